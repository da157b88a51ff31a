"""Detectors: wedges in executors (freeze watchdog to come)."""
