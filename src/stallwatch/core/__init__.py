"""Shared mechanics every layer above uses: fault containment, scrubbing, the light span path,
stallwatch's own histograms and its background worker. Imports only the contract (`telemetry`,
`_version`, `_private`) and the optional Sentry integration."""
