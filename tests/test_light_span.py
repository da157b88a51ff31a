"""`core.light_span`: what the processors receive is what the SDK's own span would have given
them, decision for decision (real SDK TracerProvider, samplers and processors)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import sampling as sdk_sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stallwatch import sdk_compat
from stallwatch.core import light_span
from support.fast_paths import fast_paths_on  # noqa: F401  # a fixture

pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("fast_paths_on")]  # the fast path against the SDK

ATTRIBUTES = {"stallwatch.executor.name": "pool"}


def provider(sampler: sdk_sampling.Sampler | None = None, limits: SpanLimits | None = None):
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler, span_limits=limits)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer_provider, exporter


def both_ways(tracer_provider: TracerProvider, exporter: InMemorySpanExporter, work: Any) -> tuple[Any, Any]:
    """Run `work(span)` on a light span and on the SDK's span with the same parent; their exports."""
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        context = trace.set_span_in_context(parent)
        light = light_span.start(tracer, "pool work item", context, dict(ATTRIBUTES))
        assert isinstance(light, light_span.LightSpan)
        work(light)
        light.end()
        stock = tracer.start_span("pool work item", context=context, attributes=dict(ATTRIBUTES))
        work(stock)
        stock.end()
    finished = [s for s in exporter.get_finished_spans() if s.name == "pool work item"]
    assert len(finished) == 2
    return finished[0], finished[1]


def same(light: Any, stock: Any) -> None:
    assert light.name == stock.name
    assert light.parent == stock.parent
    assert light.context.trace_id == stock.context.trace_id
    assert light.context.trace_flags == stock.context.trace_flags
    assert light.context.trace_state == stock.context.trace_state
    assert light.kind == stock.kind
    assert dict(light.attributes) == dict(stock.attributes)
    assert light.dropped_attributes == stock.dropped_attributes
    assert (light.dropped_events, light.dropped_links) == (stock.dropped_events, stock.dropped_links)
    assert [(e.name, dict(e.attributes)) for e in light.events] == [(e.name, dict(e.attributes)) for e in stock.events]
    assert [(link.context, dict(link.attributes)) for link in light.links] == [
        (link.context, dict(link.attributes)) for link in stock.links
    ]
    assert (light.status.status_code, light.status.description) == (stock.status.status_code, stock.status.description)
    assert light.resource is stock.resource
    assert light.instrumentation_scope == stock.instrumentation_scope
    assert light.start_time <= light.end_time


def test_a_plain_work_item_span_is_exported_as_the_sdk_would():
    light, stock = both_ways(*provider(), lambda span: None)
    same(light, stock)
    assert light.context.span_id != stock.context.span_id
    # The processors get the light span itself, a ReadableSpan like the SDK's copy of its span.
    assert type(light) is light_span.LightSpan and isinstance(light, ReadableSpan)
    as_json = [json.loads(span.to_json()) for span in (light, stock)]
    for document in as_json:
        for varying in ("context", "start_time", "end_time"):
            del document[varying]
    assert as_json[0] == as_json[1]


@pytest.mark.parametrize("trace_state", [None, TraceState([("vendor", "value")])], ids=["no_state", "state"])
@pytest.mark.parametrize(
    "ids",
    [(1, 1), (2**128 - 1, 2**64 - 1), (0, 5), (5, 0), (2**128, 5), (5, 2**64), (0xABC, 0xDEF)],
    ids=["smallest", "largest", "no_trace", "no_span", "trace_too_big", "span_too_big", "plain"],
)
@pytest.mark.parametrize("flags", [0, 1, 2, 3, 255])
def test_its_span_context_is_the_one_the_api_builds(ids, flags, trace_state):
    built = sdk_compat.new_span_context(ids[0], ids[1], flags, trace_state)
    stock = SpanContext(ids[0], ids[1], False, TraceFlags(flags), trace_state)
    assert type(built) is SpanContext
    assert tuple(built) == tuple(stock)
    # The layout light_span, executor, guarded and span_json unpack, on this SDK.
    fields = (stock.trace_id, stock.span_id, stock.is_remote, stock.trace_flags, stock.trace_state, stock.is_valid)
    assert tuple(stock) == fields
    assert [type(field) for field in built] == [type(field) for field in stock]
    assert (built.is_valid, built.trace_flags, built.trace_state) == (
        stock.is_valid,
        stock.trace_flags,
        stock.trace_state,
    )


def test_what_other_code_sets_on_it_is_kept_cleaned_and_bounded_as_the_sdk_does():
    limits = SpanLimits(max_span_attributes=3, max_events=2, max_span_attribute_length=4)

    def work(span: Any) -> None:
        span.set_attribute("text", "abcdefgh")
        span.set_attributes({"number": 7, "bad": object(), "list": [1, 2]})
        span.add_event("first", {"k": "v"})
        span.add_event("second")
        span.add_event("third")  # past max_events
        span.record_exception(ValueError("boom"))
        span.update_name("pool work item")
        span.set_status(Status(StatusCode.ERROR, "failed"))
        span.set_status(StatusCode.OK)
        span.set_status(StatusCode.ERROR, "after OK")  # OK is final
        span.add_link(SpanContext(1, 2, False, TraceFlags(1)), {"why": "test"})

    light, stock = both_ways(*provider(limits=limits), work)
    same(light, stock)
    assert light.status.status_code is StatusCode.OK


@pytest.mark.parametrize(
    "sampler",
    [
        sdk_sampling.ParentBased(sdk_sampling.ALWAYS_ON),
        sdk_sampling.ParentBased(sdk_sampling.ALWAYS_ON, local_parent_sampled=sdk_sampling.ALWAYS_OFF),
        sdk_sampling.ALWAYS_ON,
    ],
    ids=["parent_based", "children_dropped", "always_on"],
)
def test_the_providers_sampler_decides(sampler):
    tracer_provider, exporter = provider(sampler)
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        context = trace.set_span_in_context(parent)
        light = light_span.start(tracer, "item", context, dict(ATTRIBUTES))
        stock = tracer.start_span("item", context=context, attributes=dict(ATTRIBUTES))
        recording = stock.is_recording()
        assert light.is_recording() == recording
        assert light.get_span_context().trace_flags == stock.get_span_context().trace_flags
        light.end()
        stock.end()
    assert len([s for s in exporter.get_finished_spans() if s.name == "item"]) == (2 if recording else 0)


class AskingSampler(sdk_sampling.ParentBased):
    """A subclass of the default sampler type: it may decide otherwise, so the light path asks it."""

    def __init__(self) -> None:
        super().__init__(sdk_sampling.ALWAYS_ON)
        self.asked = 0

    def should_sample(self, *args: Any, **kwargs: Any) -> sdk_sampling.SamplingResult:
        self.asked += 1
        return super().should_sample(*args, **kwargs)


@pytest.mark.parametrize("remote", [False, True, None], ids=["local_parent", "remote_parent", "root"])
@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda: sdk_sampling.ParentBased(sdk_sampling.ALWAYS_ON),
        lambda: sdk_sampling.ParentBasedTraceIdRatio(0.0),
        lambda: sdk_sampling.ParentBased(sdk_sampling.ALWAYS_ON, remote_parent_sampled=sdk_sampling.ALWAYS_OFF),
        AskingSampler,
    ],
    ids=["parent_based", "parent_based_ratio_0", "remote_dropped", "subclass"],
)
def test_a_sampled_parent_gets_the_samplers_answer_whether_or_not_it_is_asked(make_sampler, remote, monkeypatch):
    sampler = make_sampler()
    asked: list[str] = []
    for cls in (sdk_sampling.ParentBased, sdk_sampling.StaticSampler):  # count the stock samplers' calls
        original = cls.should_sample
        monkeypatch.setattr(
            cls, "should_sample", lambda self, *a, _o=original, **k: asked.append("x") or _o(self, *a, **k)
        )
    tracer_provider, exporter = provider(sampler)
    tracer = tracer_provider.get_tracer("test")
    state = trace.TraceState([("vendor", "value")])
    if remote is None:  # a root span: no parent, no trace state
        context, state = otel_context.Context(), trace.TraceState()
    else:
        parent = trace.NonRecordingSpan(SpanContext(0x1234, 0x5678, remote, TraceFlags(TraceFlags.SAMPLED), state))
        context = trace.set_span_in_context(parent)
    asked.clear()
    light = light_span.start(tracer, "item", context, dict(ATTRIBUTES))
    light_asked = len(asked)
    stock = tracer.start_span("item", context=context, attributes=dict(ATTRIBUTES))
    recording = stock.is_recording()
    assert light.is_recording() == recording
    assert light.get_span_context().trace_flags == stock.get_span_context().trace_flags
    assert light.get_span_context().trace_state == stock.get_span_context().trace_state == state
    light.end()
    stock.end()
    finished = exporter.get_finished_spans()
    if recording:
        assert len(finished) == 2
        if remote is None:
            assert finished[0].parent is None and finished[1].parent is None
            assert dict(finished[0].attributes) == dict(finished[1].attributes)
            assert finished[0].context.trace_flags == finished[1].context.trace_flags
        else:
            same(*finished)
    else:
        assert not finished
    # The default sampler's answer is known for a sampled parent, and for a root span when its root
    # sampler is ALWAYS_ON: it is not asked then; any other is.
    default = type(sampler) in (sdk_sampling.ParentBased, sdk_sampling.ParentBasedTraceIdRatio) and recording
    if remote is None:
        default = type(sampler) is sdk_sampling.ParentBased
    assert (light_asked == 0) == default
    if isinstance(sampler, AskingSampler):
        assert sampler.asked == 2


class StartingProcessor(SpanProcessor):
    """A processor that does something when a span starts: the light path must not skip it."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started.append(span.name)


def test_a_processor_with_its_own_on_start_gets_the_sdks_span():
    tracer_provider, _ = provider()
    starting = StartingProcessor()
    tracer_provider.add_span_processor(starting)
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        span = light_span.start(tracer, "item", trace.set_span_in_context(parent), {})
        span.end()
    assert not isinstance(span, light_span.LightSpan)
    assert starting.started == ["request", "item"]


@pytest.mark.parametrize("remote", [False, True], ids=["local_parent", "remote_parent"])
@pytest.mark.parametrize(
    "sampler",
    [None, sdk_sampling.ParentBased(sdk_sampling.ALWAYS_ON, local_parent_sampled=sdk_sampling.ALWAYS_OFF)],
    ids=["default_sampler", "local_children_dropped"],
)
def test_a_child_of_a_parent_looked_up_already_is_the_span_the_sdk_starts(remote, sampler):
    """`start` given the sampled parent (the executor's path) decides as the SDK does, whatever the parent
    and sampler: the usual case, a local parent under the default sampler, without asking the sampler."""
    tracer_provider, exporter = provider(sampler)
    tracer = tracer_provider.get_tracer("test")
    parent = SpanContext(0xABC, 0xDEF, remote, TraceFlags(TraceFlags.SAMPLED), TraceState([("vendor", "value")]))
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    found = sdk_compat.sampled_parent(context)
    assert found == parent
    light = light_span.start(tracer, "pool work item", context, dict(ATTRIBUTES), parent=found, shed=True)
    stock = tracer.start_span("pool work item", context=context, attributes=dict(ATTRIBUTES))
    recorded = sampler is None or remote  # the sampler given drops local children only
    assert type(light) is (light_span.LightSpan if recorded else trace.NonRecordingSpan)
    assert light.is_recording() == stock.is_recording() == recorded
    assert light.get_span_context().trace_flags == stock.get_span_context().trace_flags
    light.end()
    stock.end()
    assert len(exporter.get_finished_spans()) == 2 * recorded
    if recorded:
        exported_light, exported_stock = exporter.get_finished_spans()
        same(exported_light, exported_stock)
        assert exported_light.parent == parent


@pytest.mark.parametrize(
    "current",
    [
        trace.NonRecordingSpan(SpanContext(1, 2, False, TraceFlags(TraceFlags.DEFAULT))),
        trace.INVALID_SPAN,
        "not a span",
    ],
    ids=["unsampled", "invalid", "not_a_span"],
)
@pytest.mark.parametrize("fast", [True, False], ids=["fast_paths", "public_api"])
def test_no_sampled_parent_is_found_where_the_api_sees_none(current, fast):
    sdk_compat.use_fast_paths(fast)  # the fixture puts it back
    context = otel_context.set_value(sdk_compat.SPAN_KEY, current)
    assert sdk_compat.sampled_parent(context) is None
    assert sdk_compat.sampled_parent(otel_context.Context()) is None
    sampled = SpanContext(1, 2, False, TraceFlags(TraceFlags.SAMPLED))
    assert sdk_compat.sampled_parent(trace.set_span_in_context(trace.NonRecordingSpan(sampled))) == sampled


def test_end_own_sets_stallwatchs_attributes_and_ends_once():
    tracer_provider, exporter = provider()
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        span = light_span.start(tracer, "item", trace.set_span_in_context(parent), dict(ATTRIBUTES))
        span.end_own({"queue": 0.5})
        span.end_own({"late": 1.0})
        span.end()
        ended_first = light_span.start(tracer, "ended", trace.set_span_in_context(parent), dict(ATTRIBUTES))
        ended_first.end()
        ended_first.end_own({"late": 1.0})
    item, ended = [s for s in exporter.get_finished_spans() if s.name in ("item", "ended")]
    assert dict(item.attributes) == {**ATTRIBUTES, "queue": 0.5}
    assert dict(ended.attributes) == ATTRIBUTES
    assert not span.is_recording() and not ended_first.is_recording()


def test_an_ended_light_span_ignores_changes_and_a_second_end():
    tracer_provider, exporter = provider()
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        span = light_span.start(tracer, "item", trace.set_span_in_context(parent), {})
        span.end()
        span.set_attribute("late", 1)
        span.add_event("late")
        span.end()
    (item,) = [s for s in exporter.get_finished_spans() if s.name == "item"]
    assert "late" not in item.attributes and not item.events
    assert not span.is_recording()


def test_a_root_client_span_with_its_own_start_time_matches_the_sdks():
    """The subprocess spans: built after the child ended, often outside any trace."""
    tracer_provider, exporter = provider()
    tracer = tracer_provider.get_tracer("test")
    empty = otel_context.Context()
    light = light_span.start(tracer, "true", empty, {}, SpanKind.CLIENT, 1_000)
    assert isinstance(light, light_span.LightSpan)
    light.set_own_attributes({"process.pid": 42})
    light.end(end_time=2_000)
    stock = tracer.start_span("true", context=empty, kind=SpanKind.CLIENT, start_time=1_000)
    stock.set_attributes({"process.pid": 42})
    stock.end(end_time=2_000)
    light_out, stock_out = exporter.get_finished_spans()
    assert light_out.parent is None and stock_out.parent is None
    assert light_out.context.trace_id != stock_out.context.trace_id  # each a new trace
    assert light_out.context.trace_flags == stock_out.context.trace_flags
    assert (light_out.kind, light_out.start_time, light_out.end_time) == (SpanKind.CLIENT, 1_000, 2_000)
    assert dict(light_out.attributes) == dict(stock_out.attributes)


class TaggingSampler(sdk_sampling.Sampler):
    """Samples every span and adds an attribute of its own, which the span's own attributes follow."""

    def should_sample(self, *args: Any, **kwargs: Any) -> sdk_sampling.SamplingResult:
        attributes = {"sampler.tag": "t", "process.pid": 0}
        return sdk_sampling.SamplingResult(sdk_sampling.Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "TaggingSampler"


@pytest.mark.parametrize("parented", [False, True], ids=["root", "in_a_trace"])
@pytest.mark.parametrize("sampler", [None, TaggingSampler(), sdk_sampling.ALWAYS_OFF], ids=["default", "tags", "off"])
@pytest.mark.parametrize("status", [None, Status(StatusCode.ERROR, "exit code 3")], ids=["unset", "error"])
def test_a_finished_span_is_what_the_sdks_span_started_set_and_ended_gives(parented, sampler, status):
    """The subprocess spans of children with no event: built ended at once (`finish`)."""
    tracer_provider, exporter = provider(sampler)
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        context = trace.set_span_in_context(parent) if parented else otel_context.Context()
        light_span.finish(tracer, "true", context, SpanKind.CLIENT, 1_000, 2_000, {"process.pid": 42}, status)
        stock = tracer.start_span("true", context=context, kind=SpanKind.CLIENT, start_time=1_000)
        stock.set_attributes({"process.pid": 42})
        if status is not None:
            stock.set_status(status)
        stock.end(end_time=2_000)
    finished = [s for s in exporter.get_finished_spans() if s.name == "true"]
    if sampler is sdk_sampling.ALWAYS_OFF:
        assert not finished
        return
    light, stock_out = finished
    if parented:
        same(light, stock_out)
    else:  # each a new trace: all else the same
        assert light.parent is None and stock_out.parent is None
        assert light.context.trace_id != stock_out.context.trace_id
        assert light.context.trace_flags == stock_out.context.trace_flags
        assert (light.name, light.kind, dict(light.attributes)) == (
            stock_out.name,
            stock_out.kind,
            dict(stock_out.attributes),
        )
        assert light.status.status_code == stock_out.status.status_code
        assert light.status.description == stock_out.status.description
        assert light.resource is stock_out.resource and not light.events
    assert type(light) is light_span.LightSpan
    assert list(light.attributes) == list(stock_out.attributes)  # the sampler's first, then the span's own
    assert (light.start_time, light.end_time) == (stock_out.start_time, stock_out.end_time) == (1_000, 2_000)


def test_a_live_light_span_reads_like_the_sdks_span():
    """The journal records a live span's name, kind, parent, start, attributes, status and end."""
    tracer_provider, _ = provider()
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as parent:
        context = trace.set_span_in_context(parent)
        light = light_span.start(tracer, "svc/Create", context, dict(ATTRIBUTES), SpanKind.CLIENT, 5)
        stock = tracer.start_span(
            "svc/Create", context=context, kind=SpanKind.CLIENT, attributes=ATTRIBUTES, start_time=5
        )
        for span in (light, stock):
            span.set_status(Status(StatusCode.ERROR, "NOT_FOUND"))
        read = ("name", "kind", "parent", "start_time", "end_time")
        assert [getattr(light, field) for field in read] == [getattr(stock, field) for field in read]
        assert dict(light.attributes) == dict(stock.attributes)
        assert (light.status.status_code, light.status.description) == (
            stock.status.status_code,
            stock.status.description,
        )
        light.end(end_time=9)
        stock.end(end_time=9)
        assert light.end_time == stock.end_time == 9


def test_a_provider_without_processors_gets_light_spans_from_the_first_call():
    """The processors tuple is then the interpreter's one empty tuple: the verdict cached for it
    must be computed, not taken from the cache's initial state (a fresh interpreter, so no other
    test has filled the cache)."""
    script = (
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from stallwatch import sdk_compat\n"
        "from stallwatch.core import light_span\n"
        "sdk_compat.use_fast_paths(True)\n"
        "tracer = TracerProvider().get_tracer('test')\n"
        "span = light_span.start(tracer, 'item', None, {'k': 'v'})\n"
        "span.end()\n"
        "print(type(span).__name__, span.get_span_context().trace_flags.sampled)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["LightSpan", "True"]
