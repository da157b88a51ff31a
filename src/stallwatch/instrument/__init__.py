"""One OpenTelemetry BaseInstrumentor per instrumented thing."""
