"""The telemetry contract's and the settings' records keep what frozen dataclasses gave them: value
equality and hashing, a repr naming the fields, immutability, copying and pickling."""

from __future__ import annotations

import copy
import pickle

import pytest

from stallwatch import config, telemetry

pytestmark = pytest.mark.matrix

RECORDS = [
    telemetry.FORK_KIND,
    telemetry.FORK_COUNT,
    telemetry.SUBPROCESS_SPAN,
    telemetry.SENTRY_FREEZE,
    config.OPTIONS[0],
    config.Problem("STALLWATCH_X", "`x` is not a number", "using 1"),
    config.Batching(2048, 512, 5.0),
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
