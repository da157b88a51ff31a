"""Exporters and processors stallwatch adds to the OpenTelemetry SDK."""

from ..core.light_span import LightSpan
from .span_json import FIELD_READABLE

# The encoders read a light span's fields as a finished SDK span's. Registered here, as the package
# loads: span_json.py imports nothing of stallwatch, so that the benchmarks can load it alone.
FIELD_READABLE.add(LightSpan)
