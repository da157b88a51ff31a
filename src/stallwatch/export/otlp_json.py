"""The protobuf route to OTLP/JSON: protobuf's JSON printer on an SDK-encoded export request, with
the ids written as OTLP/JSON wants them (hex; protobuf prints bytes as base64). Used for what the
direct encoders (`span_json`, `log_json`) do not write themselves, and as their reference."""

from __future__ import annotations

import base64
import json
import warnings
from typing import Any

with warnings.catch_warnings():
    # protobuf 4 (what SDK 1.27-1.32 allow) on CPython 3.13 warns about its own C types when first imported
    # (here, before any other stallwatch module); under the host's `-W error` that would fail setup() and
    # the demo, and it is not the host's to act on
    warnings.filterwarnings("ignore", r"Type google\._upb\._message\.", DeprecationWarning)
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.message import Message

_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: base64.b64decode(value).hex() if key in _ID_FIELDS else _hex_ids(value) for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(item) for item in node]
    return node


def to_otlp_json(message: Message) -> str:
    """One OTLP/JSON line for an export request message."""
    as_dict = MessageToDict(message, use_integers_for_enums=True)
    return json.dumps(_hex_ids(as_dict), separators=(",", ":"))
