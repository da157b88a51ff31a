"""Exporters stallwatch adds to the OpenTelemetry SDK."""
