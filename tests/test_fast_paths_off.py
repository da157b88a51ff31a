"""With STALLWATCH_FAST_PATHS=false the key end-to-end paths hold through public SDK objects only: in one
host, a spawn, an executor item, a log record and a freeze report naming the span the loop froze in.

The main run takes the fast paths (half the matrix environments do not): this module runs the host
with them off whatever the environment says."""

from __future__ import annotations

import os

import pytest

from conftest import attrs, clean_env, otlp_items, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)")

HOST = """
import asyncio, json, logging, sys, time
from pathlib import Path

import stallwatch

out = sys.argv[1] if len(sys.argv) > 1 else {out!r}
session = stallwatch.setup(file_dir=out, freeze_threshold=1.0)
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"

from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider

from stallwatch import sdk_compat
from stallwatch.detect import heartbeat


async def until(predicate, what):
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {{what}}"
        await asyncio.sleep(0.01)


def freeze_spans():
    traces = Path(out) / "traces.jsonl"
    return traces.read_bytes().count(b'"stallwatch.freeze"') if traces.exists() else 0


async def main():
    began = time.monotonic_ns()

    def beating():
        state = heartbeat.read(heartbeat.AREA.path)
        return state is not None and state["loop_tracked"] and state["loop_ns"] > began

    await until(beating, "the loop heartbeat beats")
    tracer = trace.get_tracer("app")
    with tracer.start_as_current_span("request") as span:
        # first the freeze: once the task awaits, the loop's heartbeat clears the current span (a task
        # that resumes inside a span attaches nothing)
        time.sleep(2)  # sync code on the loop thread: the loop stalls
        child = await asyncio.create_subprocess_exec("/bin/true")
        await child.wait()
        item = asyncio.get_running_loop().run_in_executor(None, lambda: type(trace.get_current_span()).__name__)
        item_span_type = await item
        logging.getLogger("app").warning("fast paths off: the host's record")
    await until(lambda: freeze_spans() > 0, "the watchdog exported the freeze at its thaw")
    ids = span.get_span_context()
    return {{
        "fast_paths": sdk_compat.fast_paths(),
        "provider": type(trace.get_tracer_provider()) is TracerProvider,
        "attach": context.attach.__module__,
        "span_type": type(span).__name__,
        "item_span_type": item_span_type,
        "trace_id": format(ids.trace_id, "032x"),
        "span_id": format(ids.span_id, "016x"),
    }}


print(json.dumps(asyncio.run(main())))
"""


def test_a_spawn_an_executor_item_a_log_record_and_a_freeze_report_with_the_fast_paths_off(telemetry_dir):
    proc = run_python(HOST.format(out=str(telemetry_dir)), env=clean_env(STALLWATCH_FAST_PATHS="false"))
    assert proc.returncode == 0, proc.stderr
    result = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    # only public SDK objects: the SDK's provider and spans, the API's attach/detach
    assert result["fast_paths"] is False
    assert result["provider"] is True
    assert result["attach"] == "opentelemetry.context"
    assert result["span_type"] == result["item_span_type"] == "_Span"
    spans = otlp_items(telemetry_dir / "traces.jsonl", "spans")
    in_request = [s for s in spans if s["traceId"] == result["trace_id"] and s["name"] != "request"]
    children = [s for s in in_request if "process.pid" in attrs(s)]
    items = [s for s in in_request if "stallwatch.executor.name" in attrs(s)]
    assert len(children) == 1 and children[0]["parentSpanId"] == result["span_id"]
    assert len(items) == 1 and items[0]["parentSpanId"] == result["span_id"]
    records = otlp_items(telemetry_dir / "logs.jsonl", "logs")
    (host_record,) = [r for r in records if r["body"].get("stringValue") == "fast paths off: the host's record"]
    assert host_record["traceId"] == result["trace_id"]
    detected = [r for r in records if "freeze detected" in r["body"].get("stringValue", "")]
    assert [attrs(r)["stallwatch.freeze.kind"] for r in detected] == ["loop_blocked"]
    assert (detected[0]["traceId"], detected[0]["spanId"]) == (result["trace_id"], result["span_id"])
    (freeze,) = [s for s in spans if s["name"] == "stallwatch.freeze"]
    assert freeze["links"][0]["spanId"] == result["span_id"]
