"""The direct log encoder writes what the SDK's OTLP encoder + protobuf's JSON printer write."""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.sdk.resources import Resource

from stallwatch.export import log_json
from stallwatch.export.log_json import encode_logs_json
from stallwatch.export.otlp_json import to_otlp_json
from support.sample_logs import SCHEMA, Bridge, log_batch

pytestmark = pytest.mark.matrix  # the protobuf route and the batch items differ across SDK versions


def _reference(batch: Sequence[Any]) -> Any:
    return json.loads(to_otlp_json(encode_logs(batch)))


def _spy_fallback(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of each batch sent down the protobuf route."""
    calls: list[int] = []
    route: Callable[[Sequence[Any]], str] = log_json._protobuf_route

    def spy(batch: Sequence[Any]) -> str:
        calls.append(len(batch))
        return route(batch)

    monkeypatch.setattr(log_json, "_protobuf_route", spy)
    return calls


def _count(document: dict[str, Any]) -> int:
    return sum(len(s["logRecords"]) for r in document["resourceLogs"] for s in r["scopeLogs"])


def test_the_direct_encoder_matches_the_protobuf_route(monkeypatch):
    fallbacks = _spy_fallback(monkeypatch)
    batch = log_batch()
    line = encode_logs_json(batch)
    ours = json.loads(line)
    assert ours == _reference(batch)
    assert line == to_otlp_json(encode_logs(batch))  # byte for byte, too
    assert fallbacks == []
    assert _count(ours) == len(batch) == 28
    # SDK 1.27's handler logs every record under one scope, its own module's name.
    assert len(ours["resourceLogs"]) == 3 and len(ours["resourceLogs"][0]["scopeLogs"]) >= 2
    assert encode_logs_json([]) == to_otlp_json(encode_logs([])) == "{}"


def test_scope_attributes_schema_urls_and_event_names_match(monkeypatch):
    """Written directly from SDK 1.39 on; older SDKs' encoders differ, and those batches take the protobuf route."""
    fallbacks = _spy_fallback(monkeypatch)
    bridge = Bridge()
    provider = bridge.provider("a", Resource.create({"service.name": "svc"}))
    scoped = provider.get_logger("lib", "2.0", SCHEMA, {"scope.a": 1, "scope.l": ["x"]})
    bridge.emit("a", scoped, "scoped", event_name="lib.event")
    bridge.logger("a", "app").info("unscoped")
    batch = bridge.batch()
    assert json.loads(encode_logs_json(batch)) == _reference(batch)
    assert fallbacks == ([] if log_json._RESOURCE_ON_ITEM else [2])


def _odd_batch(case: str) -> list[Any]:
    """Two records, the second one with something this encoder leaves to the protobuf route."""
    bridge = Bridge()
    bridge.provider("a", Resource.create({"service.name": "svc"}))
    bridge.logger("a", "app").info("fine", extra={"k": 1})
    bridge.logger("a", "app").info("odd")
    batch = bridge.batch()
    odd = batch[-1]
    if case == "surrogate":  # protobuf refuses it: the SDK's encoder drops the attribute
        odd.log_record.attributes = BoundedAttributes(attributes={"path": "/tmp/\udcff", "k": 2})
    elif case == "int64 overflow":  # likewise
        odd.log_record.attributes = BoundedAttributes(attributes={"n": 2**64, "k": 2})
    else:  # what the SDK's encoder reads, on an object of no SDK class
        batch[-1] = types.SimpleNamespace(
            log_record=odd.log_record,
            resource=getattr(odd, "resource", None),
            instrumentation_scope=odd.instrumentation_scope,
            dropped_attributes=0,
        )
    return batch


@pytest.mark.parametrize("case", ["surrogate", "int64 overflow", "unknown item"])
def test_what_the_encoder_does_not_know_takes_the_protobuf_route(monkeypatch, case):
    batch = _odd_batch(case)
    fallbacks = _spy_fallback(monkeypatch)
    ours = json.loads(encode_logs_json(batch))
    assert fallbacks == [2]
    assert ours == _reference(batch)
    assert _count(ours) == 2


def _outcome(encode: Callable[[Sequence[Any]], str], batch: Sequence[Any]) -> Any:
    try:
        return json.loads(encode(batch))
    except Exception as error:
        return type(error)


@pytest.mark.parametrize("body", [None, [1, None], {"k": None}, {1, 2}])
def test_none_and_unknown_values_end_as_the_protobuf_route_ends(body):
    """The SDK's encoders write None differently in each version (1.27 refuses it), and refuse sets.

    SDKs 1.33 to 1.39 also turn a list of mixed types in an attribute into None.
    """
    bridge = Bridge()
    bridge.provider("a", Resource.create({"service.name": "svc"}))
    bridge.logger("a", "app").info("fine")
    bridge.logger("a", "app").info("odd", extra={"none": None, "mixed": [1, "a"]})
    batch = bridge.batch()
    batch[-1].log_record.body = body
    assert _outcome(encode_logs_json, batch) == _outcome(lambda b: to_otlp_json(encode_logs(b)), batch)


def test_cached_attribute_and_body_texts_stay_bounded_and_match_the_protobuf_route(monkeypatch):
    fallbacks = _spy_fallback(monkeypatch)
    monkeypatch.setattr(log_json, "_CACHE_LIMIT", 4)
    monkeypatch.setattr(log_json, "_pairs", {})
    monkeypatch.setattr(log_json, "_bodies", {})
    batch = log_batch()
    for _ in range(2):  # the second time from what the first left in the caches
        assert encode_logs_json(batch) == to_otlp_json(encode_logs(batch))
        assert 0 < len(log_json._pairs) <= 4 and 0 < len(log_json._bodies) <= 4
    assert fallbacks == []
    monkeypatch.setattr(log_json, "_CACHE_LIMIT", 1024)
    encode_logs_json(batch)
    long_values = [v for k, v in log_json._pairs if len(v) > log_json._CACHED_VALUE_CHARS]
    assert log_json._pairs and not long_values
