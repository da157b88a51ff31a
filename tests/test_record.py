"""The telemetry contract's, the settings', the fork safety's and the cloud ledger's records keep what
frozen dataclasses gave them: value equality and hashing, a repr naming the fields, immutability, copying
and pickling."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

import stallwatch
from stallwatch import config, telemetry
from stallwatch.forksafe import guard, loop
from stallwatch.journal import ledger

pytestmark = pytest.mark.matrix

RECORDS = [
    telemetry.FORK_KIND,
    telemetry.FORK_COUNT,
    telemetry.SUBPROCESS_SPAN,
    telemetry.SENTRY_FREEZE,
    config.OPTIONS[0],
    config.Problem("STALLWATCH_X", "`x` is not a number", "using 1"),
    config.Batching(2048, 512, 5.0),
    stallwatch.FORK_SAFETY.grpc,
    loop.LoopReport("0.21.0", "1.48.0", "0.30.0", "uvloop", "asyncio"),
    guard.ForkListener(),
    ledger.Intent("create", "compute.instance", "svc/Create", "1" * 32, "2" * 16, number=7),
    ledger.Outcome(False, "UNAVAILABLE", request_id="req-1"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda record: type(record).__name__)
def test_a_record_is_an_immutable_value_that_copies_and_pickles_as_itself(record):
    again = pickle.loads(pickle.dumps(record))

    assert again == record and hash(again) == hash(record) and again is not record
    assert copy.deepcopy(record) == record == copy.copy(record)
    field = record.__slots__[0]
    assert f"{field}={getattr(record, field)!r}" in repr(record)
    with pytest.raises(AttributeError):
        setattr(record, field, "changed")
    with pytest.raises(AttributeError):
        delattr(record, field)


def test_records_with_one_field_apart_differ_and_records_of_two_classes_never_equal():
    problem = config.Problem("STALLWATCH_X", "bad", "using 1")

    assert problem != config.Problem("STALLWATCH_X", "bad", "using 2")
    assert telemetry.Attribute("a", "b") != telemetry.Span("a", "INTERNAL", "b")
    assert telemetry.Attribute("a", "b", type="int") == telemetry.Attribute("a", "b", (), "int")
    assert str(problem) == "bad; using 1"


def test_what_import_stallwatch_did_for_fork_safety_is_an_immutable_value_that_copies_as_itself():
    safety = stallwatch.FORK_SAFETY

    assert copy.deepcopy(safety) == safety == pickle.loads(pickle.dumps(safety))
    assert f"guard_enabled={safety.guard_enabled!r}" in repr(safety)
    with pytest.raises(AttributeError):
        safety.guard_enabled = not safety.guard_enabled  # type: ignore[misc]


def test_an_intents_and_an_outcomes_text_fields_are_clipped_and_a_missing_one_is_marked():
    intent = ledger.Intent("create", None, "x" * 500, "1" * 32, "2" * 16, resource_id=42)  # type: ignore[arg-type]
    outcome = ledger.Outcome(True, "", operation_id="op-\udc80")

    assert intent.resource_type == "?" and len(intent.rpc) == ledger.MAX_FIELD_CHARS and intent.resource_id is None
    assert intent.number != ledger.Intent("create", "disk", "rpc", "1" * 32, "2" * 16).number
    assert outcome.status == "?" and outcome.operation_id is not None and "\udc80" not in outcome.operation_id


def test_settings_compare_without_their_problems_and_replace_copy_pickle_and_show_as_a_frozen_dataclass():
    settings = config.Settings.load(environ={"STALLWATCH_FREEZE_THRESHOLD": "oops"})
    default = config.Settings.load(environ={})

    assert settings.problems and settings == default and settings != dataclasses.replace(default, strict=True)
    assert dataclasses.replace(settings, faulthandler=True).faulthandler is True
    assert copy.deepcopy(settings) == settings == pickle.loads(pickle.dumps(settings))
    assert repr(settings).startswith("Settings(disabled=False, service_name=None, ") and "problems=(" in repr(settings)
    with pytest.raises(TypeError, match="unhashable type: 'dict'"):  # its mappings are dicts
        hash(settings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.strict = True  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        config.Settings(colour="red")
