"""Exporters stallwatch adds to the OpenTelemetry SDK."""

from __future__ import annotations

from typing import Any

from opentelemetry.attributes import BoundedAttributes


def plain_attributes(attributes: Any) -> Any:
    """The dict inside an SDK `BoundedAttributes`, for the encoders to read; anything else as it is.

    A `BoundedAttributes` is a `MutableMapping` whose `items()`, iteration and `len()` go through
    Python methods and a lock: 1.95 µs against 0.33 µs to walk three attributes here. A finished
    span's or log record's attributes are immutable, so reading the dict directly is safe.
    """
    if type(attributes) is BoundedAttributes:
        return getattr(attributes, "_dict", attributes)
    return attributes
