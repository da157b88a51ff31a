"""OTLP/gRPC exporters that encode a batch once per export, not once per retry.

The SDK's gRPC exporters (opentelemetry-exporter-otlp-proto-grpc 1.27 to 1.45) call
`_translate_data(batch)` inside their retry loop, so every retry of a retryable answer
(`UNAVAILABLE`, `RESOURCE_EXHAUSTED`, ...) encodes the whole batch again, in Python, under the GIL
the host's threads need (docs/guarantees.md). No setting of the SDK changes this.

`encode_once(cls)` is `cls` with `_translate_data` returning the request it already built for the
same batch object during the same `_export` call. The request is dropped when the call returns, so
no batch is kept between exports. Two threads exporting at once (the shutdown's flush beside the
batch worker) stay correct: a batch that is not the one kept is encoded as usual.
"""

from __future__ import annotations

from typing import Any


def encode_once(exporter_class: type) -> type:
    """A subclass of the SDK's OTLP/gRPC `exporter_class` that encodes each batch once per export."""

    class EncodeOnce(exporter_class):
        _stallwatch_encoded: tuple[Any, Any] | None = None  # (batch, request) of the export under way

        def _translate_data(self, data: Any) -> Any:
            encoded = self._stallwatch_encoded
            if encoded is not None and encoded[0] is data:
                return encoded[1]
            request = super()._translate_data(data)
            self._stallwatch_encoded = (data, request)
            return request

        def _export(self, data: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._export(data, *args, **kwargs)
            finally:
                self._stallwatch_encoded = None

    EncodeOnce.__name__ = EncodeOnce.__qualname__ = exporter_class.__name__
    EncodeOnce.__module__ = __name__
    return EncodeOnce
