"""Exporters and processors stallwatch adds to the OpenTelemetry SDK."""
