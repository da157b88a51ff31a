"""Executor overhead benchmark: what stallwatch adds to each `ThreadPoolExecutor` work item, inside and
outside a trace, against what a user would pick instead.

Run from the repository root (a full run takes about six minutes)::

    .venvs/main/bin/python tests/bench/bench_executor.py
    .venvs/main/bin/python tests/bench/bench_executor.py --quick    # smoke test, under a minute, writes to a temp dir

The peers are measured in the same run when installed, and left out with one line saying so when not::

    .venvs/main/bin/pip install sentry-sdk ddtrace
    # its releases lag the SDK's and pin an older opentelemetry-instrumentation: without its dependencies
    .venvs/main/bin/pip install --no-deps opentelemetry-instrumentation-threading

Options: ``--items N`` work items per repeat (default 2000), ``--repeats K`` timed repeats per run
(default 5, after one warm-up of min(N, 500) items), ``--rounds R`` (default 5), ``--quick`` (500
items, 3 repeats, 1 round, 4 pairs in 1 process), ``--no-pin`` (see below), ``--out DIR`` (default
``tests/bench/results``; with ``--quick``, a fresh temporary directory). Writes ``raw/executor.json``
(raw numbers and machine info) and ``executor.md`` (the tables) to the output directory.

The cost measured is the wall time of submit + completion, divided by the number of items, of a
no-op function (``noop()`` returns None), so the figure is the executor's own cost plus whatever
the instrumentation adds to it. Workloads:

- ``submit``: ``pool.submit(noop).result()`` one at a time on a ThreadPoolExecutor(max_workers=1):
  the latency of one item, thread hand-off both ways included.
- ``batch``: submit 1000 no-ops, then wait for all of them (``concurrent.futures.wait``), on a
  ThreadPoolExecutor(max_workers=4): the throughput cost of an item.
- ``to_thread``: ``await asyncio.to_thread(noop)`` one at a time on the standard asyncio loop (its
  default executor, which every arm below instruments like any other).

Arms, each set up in a fresh interpreter, outside a trace (configuration ``ARM``) and with every
submission inside a request (``ARM_traced``: the arm's own root span, around each item):

- ``bare``: nothing imported outside a trace; traced, the stock SDK set-up: TracerProvider +
  BatchSpanProcessor to an OTLP/JSON-lines file exporter using stallwatch's own encoder, like its
  ``FileSpanExporter``, loaded from its file, so that every OpenTelemetry arm encodes alike; the
  request is ``tracer.start_as_current_span("request")``. The baseline of every other arm: ``bare``
  outside a trace, ``bare_traced`` inside.
- ``stallwatch``: ``import stallwatch`` first, then ``stallwatch.setup(traces_exporter="none",
  metrics_exporter="none", logs_exporter="none")``: its providers exist (the metric instruments
  record into a MeterProvider without readers), nothing is exported. No span is active, so the
  instrumentation creates none: the cost is the accounting queue, the `_WorkItem.run` and
  `_worker` wrappers, the interruption scope and the metric calls. ``stallwatch_traced``: the same
  with ``traces_exporter="file"`` (to a temporary directory), so the instrumentation also starts and
  ends one span per item, exported in the background in the same process, as in a server.
- ``sdk_span``: the stock SDK set-up and a span per item as a user would write it: a wrapt wrapper
  of ``ThreadPoolExecutor.submit`` that runs the callable, with the submitter's context attached, in
  ``tracer.start_as_current_span("work_item")`` (outside a trace, a root span per item).
- ``otel_threading``: the stock SDK set-up and opentelemetry-instrumentation-threading's
  ``ThreadingInstrumentor``, which attaches the submitter's context around each item (no span).
- ``sentry``: ``sentry_sdk.init(traces_sample_rate=1.0)`` with its default integrations
  (ThreadingIntegration forks the submitter's scopes into each item; no span), a transport that
  drops what it is given, ``auto_enabling_integrations=False`` (they instrument web frameworks and
  clients, none of which runs here); the request is a transaction.
- ``ddtrace``: ``ddtrace.patch(futures=True)``, which propagates the trace context into each item
  (no span); the request is ``tracer.trace("request")``. It sends to an agent stand-in run by the
  benchmark on loopback (``_machine.LoopbackReceiver``), which answers as the agent does, so ddtrace neither
  retries nor logs; telemetry and remote configuration off.

Each traced run ends with a probe outside the timed repeats: one item, inside a request, that reads
the trace it runs in, which tells whether the arm carries the trace into the item. The spans each
arm recorded are counted (the OpenTelemetry arms': those that reached the exporter; sentry's:
transactions and their spans handed to its transport; ddtrace's: finished spans, counted by a trace
processor) and compared with what it should record, so a span dropped on a full queue shows.

Pinned: every worker process is pinned to one CPU (the highest-numbered one this process may use)
before it starts any thread, unless ``--no-pin``: a one-at-a-time hand-off between two threads on
two CPUs of a VM costs 25 to 200 µs depending on where the scheduler puts the threads and how deep
the idle CPU sleeps, noise that buries a 2 µs difference; on one CPU the hand-off is a plain context
switch and every µs of CPU work the instrumentation adds (including its background threads: the
wedge detector, the span exporter) shows up in the wall time. The stallwatch configurations start
timing once the freeze watchdog (another process, pinned to the same CPU) has finished starting:
before, its one-time start-up fell into the timed repeats (wall time far above CPU time). These
figures compare whole arms across interpreters: a peer's ``_traced`` figure against
``bare_traced`` includes what its own request costs (a sentry transaction is serialized when it
ends) besides its executor integration.

Paired, unpinned (``--pairs P``, default 20, ``--processes K``, default 3; see ``_paired.py``): the
figure that decides. For each arm but ``bare``, K fresh interpreters set up as that arm alternate P
pairs of blocks of 200 items of the ``submit`` and ``to_thread`` workloads with the arm's executor
integration switched on and off (each block on pools made after the switch, so that they are
instrumented exactly when it is on), free to run on every CPU as a server's threads are. There the
awaiting thread is woken on another CPU and may wait for the GIL while the worker finishes: what a
pinned run cannot show. The ``_traced`` series run every block inside one request of the arm's own,
opened after the switch, so that both halves carry the same trace and the figure is the
integration's alone. Switched: stallwatch's ``ExecutorInstrumentor``, the hand-made wrapper, the
``ThreadingInstrumentor`` (``instrument()`` / ``uninstrument()``), sentry's patched
``ThreadPoolExecutor.submit`` and ``Thread.start`` (put back and restored), ddtrace's ``futures``
patch (its ``unpatch()`` / ``patch()``); each interpreter checks first that an item sees the
submitter's trace with the integration on and not with it off. Series: ``WORKLOAD[_traced]``
for stallwatch, ``WORKLOAD[_traced]_ARM`` for the others. Reported: the median per-pair ratio with
its 95 % bootstrap interval and the median µs added per item. A last stallwatch series,
``submit_floor``, measures a floor for this design the same way: a bare pool whose queue stamps
and logs each put and whose items read the clock at start and end, mark the running item and keep
their two durations (``_FloorQueue``, ``_FloorItem``), i.e. the queue accounting and timings
without context propagation, interruption scope, spans or fault handling.

Reported: µs per item, the median of all timed repeats pooled across rounds; per workload, each
arm's added µs against ``bare`` or ``bare_traced``; for stallwatch, the added µs (target ≤ 2 µs)
and the ratio ``stallwatch_traced`` / ``bare_traced`` (target ≤ 1.5x). Also per repeat: the
process CPU time (all threads) per item and, in the OpenTelemetry arms, the CPU time the batch span
processor's thread spent in the exporter's ``export`` per item (the "ratio without export"
subtracts it). The runs are interleaved: every round runs all (configuration, workload) pairs, in
an order rotated by one each round, so background noise on a shared machine hits all of them
alike; the per-round differences are listed to show the noise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import hashlib
import importlib.util
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import thread as cf_thread
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _machine import LoopbackReceiver, clean_env, command_line, machine_info, raw_path, rotated, worker_result
from _paired import run_blocks, run_processes, switch_for

ARMS = ("bare", "stallwatch", "sdk_span", "otel_threading", "sentry", "ddtrace")
# arm: (the module it needs, how to install it); the others need only the test environment
PEER_PACKAGES = {
    "otel_threading": (
        "opentelemetry.instrumentation.threading",
        "pip install --no-deps opentelemetry-instrumentation-threading",
    ),
    "sentry": ("sentry_sdk", "pip install sentry-sdk"),
    "ddtrace": ("ddtrace", "pip install ddtrace"),
}
ARM_TITLES = {
    "bare": "nothing outside a trace; the stock SDK set-up and a request span inside",
    "stallwatch": "`stallwatch.setup()`",
    "sdk_span": "the stock SDK set-up, a hand-made span per item (wrapt wrapper of `submit`)",
    "otel_threading": "the stock SDK set-up, opentelemetry-instrumentation-threading",
    "sentry": "sentry-sdk, default integrations (ThreadingIntegration), transactions",
    "ddtrace": "ddtrace, `patch(futures=True)`",
}
# What else an arm gives per item, by its design (the spans and the trace are measured)
ARM_GIVES = {
    "bare": "-",
    "stallwatch": "queue-wait and run-time histograms, pending, running and oldest-pending gauges, worker deaths "
    "and orphaned items, the item's interruption scope",
    "sdk_span": "-",
    "otel_threading": "the context also in the threads it starts",
    "sentry": "the submitter's scopes (tags, breadcrumbs) forked into the item",
    "ddtrace": "a profiler link when its profiler runs",
}
WORKLOADS = ("submit", "batch", "to_thread")
# What each configuration should record per item (the request's span included): the spans that reach
# the exporter, sentry's transactions and their spans, ddtrace's finished spans. `bare` records nothing.
EXPECTED_SPANS = {
    "bare_traced": 1,
    "stallwatch": 0,
    "stallwatch_traced": 2,
    "sdk_span": 1,
    "sdk_span_traced": 2,
    "otel_threading": 0,
    "otel_threading_traced": 1,
    "sentry": 0,
    "sentry_traced": 1,
    "ddtrace": 0,
    "ddtrace_traced": 1,
}
MAX_WORKERS = {"submit": 1, "batch": 4}
BATCH = 1000
WARMUP_ITEMS = 500
TARGET_ADDED_US = 2.0
TARGET_TRACED_RATIO = 1.5
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SOURCE = Path(__file__).resolve().parents[2] / "src" / "stallwatch"
VERSIONED = ("opentelemetry-api", "opentelemetry-sdk", "wrapt", "stallwatch", "opentelemetry-instrumentation-threading",
             "sentry-sdk", "ddtrace")  # fmt: skip


def configs_of(arm: str) -> tuple[str, str]:
    """The configurations of `arm`: outside a trace, and with every submission inside a request."""
    return arm, f"{arm}_traced"


def arm_of(config: str) -> tuple[str, bool]:
    """(arm, traced) of a configuration name."""
    return config.removesuffix("_traced"), config.endswith("_traced")


# ---- worker: one configuration and workload in a fresh interpreter -----------------------------


def noop() -> None:
    return None


def make_file_exporter(directory: Path) -> Any:
    """A span exporter doing what stallwatch's `FileSpanExporter` does, without importing stallwatch:
    the same OTLP/JSON encoder (`stallwatch/export/span_json.py` and the span field readers of
    `stallwatch/sdk_compat.py`, each loaded from its file, which imports nothing of stallwatch), one
    `os.writev` per batch."""
    import importlib.util

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    package = Path(__file__).resolve().parents[2] / "src" / "stallwatch"
    loaded = []
    for name, source in (
        ("bench_span_json", package / "export" / "span_json.py"),
        ("bench_sdk_compat", package / "sdk_compat.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded.append(module)
    span_json, sdk_compat = loaded

    class OtlpJsonFileExporter(SpanExporter):
        def __init__(self) -> None:
            self._fd = os.open(directory / "traces.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            line = span_json.encode_spans_json(spans, sdk_compat.readable_fields, sdk_compat.span_origin)
            os.writev(self._fd, (line.encode(), b"\n"))
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            os.close(self._fd)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return OtlpJsonFileExporter()


class ExportTap:
    """Counts the spans the global TracerProvider's batch processors hand to their exporters, and the
    CPU time (of the exporting thread) spent in `export`: what exporting costs this process."""

    def __init__(self) -> None:
        self.spans = 0
        self.cpu = 0.0

    def attach(self, provider: Any) -> None:
        for processor in provider._active_span_processor._span_processors:
            # the SDK's BatchSpanProcessor, or stallwatch's on its shared export thread (`export.batching`)
            lane = getattr(processor, "lane", None)
            exporter = processor.span_exporter if lane is None else lane.exporter
            lazy = getattr(getattr(exporter, "inner", None), "built", None)
            if lazy is not None:  # stallwatch builds its OTLP exporter at its first export: not an export's cost
                lazy()
            exporter.export = self._tap(exporter.export)

    def _tap(self, export: Any) -> Any:
        def tapped(spans: Sequence[Any]) -> Any:
            start = time.thread_time()
            try:
                return export(spans)
            finally:
                self.cpu += time.thread_time() - start  # of the thread that exports
                self.spans += len(spans)

        return tapped


Request = Callable[[], AbstractContextManager[Any]]


def run_submit(pool: concurrent.futures.ThreadPoolExecutor, items: int, request: Request | None) -> None:
    """`items` one-at-a-time submit + result(), each inside a `request()` when given."""
    if request is None:
        for _ in range(items):
            pool.submit(noop).result()
        return
    for _ in range(items):
        with request():
            pool.submit(noop).result()


def run_batch(pool: concurrent.futures.ThreadPoolExecutor, items: int, request: Request | None) -> None:
    """`items` submissions in batches of BATCH, each batch waited for as a whole."""
    remaining = items
    while remaining > 0:
        size = min(BATCH, remaining)
        remaining -= size
        if request is None:
            futures = [pool.submit(noop) for _ in range(size)]
        else:
            futures = []
            for _ in range(size):
                with request():
                    futures.append(pool.submit(noop))
        concurrent.futures.wait(futures)


async def run_to_thread(items: int, request: Request | None) -> None:
    """`items` one-at-a-time `await asyncio.to_thread(noop)`."""
    if request is None:
        for _ in range(items):
            await asyncio.to_thread(noop)
        return
    for _ in range(items):
        with request():
            await asyncio.to_thread(noop)


class Clock:
    """Wall time, process CPU time (all threads) and export CPU time of one timed repeat."""

    def __init__(self, tap: ExportTap | None) -> None:
        self.tap = tap
        self.samples: list[tuple[float, float, float]] = []

    def start(self) -> None:
        self._export = self.tap.cpu if self.tap else 0.0
        self._cpu = time.process_time()
        self._wall = time.perf_counter()

    def stop(self) -> None:
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        self.samples.append((wall, cpu, (self.tap.cpu if self.tap else 0.0) - self._export))


def measure(workload: str, items: int, repeats: int, traced: Arm | None, tap: ExportTap | None) -> dict[str, Any]:
    """One warm-up, then `repeats` timed repeats of `items` items, each inside a request of `traced`
    when given (then one probe follows); µs per item of each repeat."""
    warmup = min(items, WARMUP_ITEMS)
    request = traced.request if traced is not None else None
    clock = Clock(tap)
    if workload == "to_thread":

        async def series() -> bool | None:
            await run_to_thread(warmup, request)
            for _ in range(repeats):
                clock.start()
                await run_to_thread(items, request)
                clock.stop()
            if traced is None:
                return None
            with traced.request():
                return traced.reaches(await asyncio.to_thread(traced.trace_id))

        propagated = asyncio.run(series())
    else:
        run = run_submit if workload == "submit" else run_batch
        with concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS[workload]) as pool:
            run(pool, warmup, request)
            for _ in range(repeats):
                clock.start()
                run(pool, items, request)
                clock.stop()
            propagated = None
            if traced is not None:
                with traced.request():
                    propagated = traced.reaches(pool.submit(traced.trace_id).result())
    per_item = [[seconds / items * 1e6 for seconds in sample] for sample in clock.samples]
    return {
        "us_per_item": [wall for wall, _, _ in per_item],
        "cpu_us_per_item": [cpu for _, cpu, _ in per_item],
        "export_cpu_us_per_item": [export for _, _, export in per_item],
        "items_run": warmup + items * repeats + (traced is not None),
        "propagated": propagated,
    }


def settle(session: Any) -> None:
    """Wait (at most 10 s) until the freeze watchdog has started: a process of its own on the same
    pinned CPU, whose start-up (an interpreter importing stallwatch, about 0.3 s of CPU) is paid once
    per host, but would otherwise fall into the timed repeats, and not into this process's CPU time."""
    pid = session.watchdog_pid
    if pid is None:
        return
    stable, last, deadline = 0, -1, time.monotonic() + 10
    while stable < 3 and time.monotonic() < deadline:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return
        ticks = int(fields[11]) + int(fields[12])
        stable = stable + 1 if ticks == last else 0
        last = ticks
        time.sleep(0.1)


@dataclass
class Arm:
    """An arm set up in this interpreter, its executor integration on (see `set_up`)."""

    request: Request  # a request of the arm's own (a root span; sentry: a transaction)
    trace_id: Callable[[], Any]  # the trace the calling thread is in; None outside one
    switch: Callable[[bool], None]  # the executor integration on or off
    recorded: Callable[[], int]  # spans recorded so far (see EXPECTED_SPANS), once flushed
    tap: ExportTap | None = None  # the OpenTelemetry arms' exporter
    close: Callable[[], None] = noop

    def reaches(self, inside: Any) -> bool:
        """Whether `inside`, what `trace_id` read in an item, is the trace the caller is in."""
        outside = self.trace_id()
        return outside is not None and inside == outside


def stock_sdk(directory: Path) -> ExportTap:
    """The stock SDK set-up, global: TracerProvider + BatchSpanProcessor to the OTLP/JSON file
    exporter; returns the tap on its exporter."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(make_file_exporter(directory)))
    trace.set_tracer_provider(provider)
    tap = ExportTap()
    tap.attach(provider)
    return tap


def otel_arm(tap: ExportTap, switch: Callable[[bool], None], close: Callable[[], None] = noop) -> Arm:
    """An arm on the global OpenTelemetry TracerProvider; its request is a root span."""
    from opentelemetry import trace

    tracer = trace.get_tracer("bench_executor")

    def trace_id() -> Any:
        span_context = trace.get_current_span().get_span_context()
        return span_context.trace_id if span_context.is_valid else None

    def recorded() -> int:
        trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
        return tap.spans

    switch(True)
    return Arm(functools.partial(tracer.start_as_current_span, "request"), trace_id, switch, recorded, tap, close)


def handmade_sdk_span() -> Callable[[bool], None]:
    """`switch` of a span per work item as a user would write it: a wrapt wrapper of
    `ThreadPoolExecutor.submit` that runs the callable, with the submitter's context attached, in
    `tracer.start_as_current_span(...)`."""
    import wrapt
    from opentelemetry import context, trace
    from opentelemetry.instrumentation.utils import unwrap

    tracer = trace.get_tracer("bench.handmade")

    def submit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn, *rest = args
        parent = context.get_current()

        def in_span(*fn_args: Any, **fn_kwargs: Any) -> Any:
            token = context.attach(parent)
            try:
                with tracer.start_as_current_span("work_item"):
                    return fn(*fn_args, **fn_kwargs)
            finally:
                context.detach(token)

        return wrapped(in_span, *rest, **kwargs)

    state = {"on": False}

    def switch(on: bool) -> None:
        if on == state["on"]:
            return
        state["on"] = on
        if on:
            wrapt.wrap_function_wrapper(concurrent.futures.ThreadPoolExecutor, "submit", submit)
        else:
            unwrap(concurrent.futures.ThreadPoolExecutor, "submit")

    return switch


def stallwatch_arm(traced: bool, directory: Path, watchdog: bool) -> Arm:
    import stallwatch  # first, as a server's first import

    exporter = {"traces_exporter": "file", "file_dir": directory} if traced else {"traces_exporter": "none"}
    session = stallwatch.setup(**exporter, metrics_exporter="none", logs_exporter="none", watchdog=watchdog)
    if watchdog:
        settle(session)
    from opentelemetry import trace

    from stallwatch.instrument.executor import ExecutorInstrumentor

    tap = ExportTap()
    tap.attach(trace.get_tracer_provider())
    return otel_arm(tap, switch_for(ExecutorInstrumentor()), lambda: stallwatch.shutdown(10))


def sentry_arm() -> Arm:
    """sentry-sdk with its default integrations; its ThreadingIntegration patches
    `ThreadPoolExecutor.submit` and `Thread.start`, which `switch` puts back and restores."""
    import sentry_sdk
    from sentry_sdk.transport import Transport

    recorded = [0]

    class Discard(Transport):
        def capture_envelope(self, envelope: Any) -> None:
            event = envelope.get_transaction_event()
            if event is not None:
                recorded[0] += 1 + len(event.get("spans") or ())

    owners = (concurrent.futures.ThreadPoolExecutor, threading.Thread)
    before = [dict(vars(owner)) for owner in owners]
    sentry_sdk.init(dsn="http://public@127.0.0.1:9/1", traces_sample_rate=1.0, transport=Discard,
                    auto_enabling_integrations=False)  # fmt: skip
    patched = [
        (owner, name, old.get(name), value)
        for owner, old in zip(owners, before, strict=True)
        for name, value in vars(owner).items()
        if old.get(name) is not value
    ]
    if not patched or any(off is None for _, _, off, _ in patched):
        raise RuntimeError(f"sentry-sdk's ThreadingIntegration patched {patched}, expected submit and start")

    def switch(on: bool) -> None:
        for owner, name, off, patch in patched:
            setattr(owner, name, patch if on else off)

    def trace_id() -> Any:
        return getattr(sentry_sdk.get_current_span(), "trace_id", None)

    request = functools.partial(sentry_sdk.start_transaction, name="request", op="request")
    return Arm(request, trace_id, switch, lambda: recorded[0])


def ddtrace_arm(agent: str) -> Arm:
    """ddtrace with its `futures` integration, sending to the agent stand-in at `agent`."""
    os.environ.update(
        DD_TRACE_AGENT_URL=agent,
        DD_INSTRUMENTATION_TELEMETRY_ENABLED="false",
        DD_REMOTE_CONFIGURATION_ENABLED="false",
    )
    import ddtrace
    import ddtrace.contrib.internal.futures.patch as futures
    from ddtrace.trace import TraceFilter, tracer

    recorded = [0]

    class Count(TraceFilter):
        def process_trace(self, trace: list[Any]) -> list[Any]:
            recorded[0] += len(trace)
            return trace

    ddtrace.patch(futures=True)
    tracer.configure(trace_processors=[Count()])

    def switch(on: bool) -> None:
        futures.patch() if on else futures.unpatch()

    def trace_id() -> Any:
        context = tracer.current_trace_context()
        return None if context is None else context.trace_id

    return Arm(functools.partial(tracer.trace, "request"), trace_id, switch, lambda: recorded[0], close=tracer.flush)


def set_up(arm: str, traced: bool, directory: Path, agent: str, watchdog: bool) -> Arm | None:
    """Set `arm` up in this (fresh) interpreter, its executor integration on; None for `bare` outside
    a trace (nothing imported). `traced` only matters to `bare` and stallwatch (which exports spans
    only then); `watchdog`: stallwatch's, waited for (see `settle`)."""
    if arm == "stallwatch":
        return stallwatch_arm(traced, directory, watchdog)
    if arm == "sentry":
        return sentry_arm()
    if arm == "ddtrace":
        return ddtrace_arm(agent)
    if arm == "bare" and not traced:
        return None
    tap = stock_sdk(directory)
    if arm == "sdk_span":
        return otel_arm(tap, handmade_sdk_span())
    if arm == "otel_threading":
        from opentelemetry.instrumentation.threading import ThreadingInstrumentor

        return otel_arm(tap, switch_for(ThreadingInstrumentor()))
    return otel_arm(tap, lambda on: None)


def worker(config: str, workload: str, items: int, repeats: int, cpu: int, agent: str) -> dict[str, Any]:
    """Run one configuration and workload in this (fresh) interpreter and return its raw numbers."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})  # before any thread starts: they all inherit it
    name, traced = arm_of(config)
    directory = Path(tempfile.mkdtemp(prefix="bench_executor_"))
    try:
        arm = set_up(name, traced, directory, agent, watchdog=True)
        result: dict[str, Any] = {"config": config, "workload": workload, "cpu": cpu}
        result.update(measure(workload, items, repeats, arm if traced else None, arm.tap if arm else None))
        if arm is not None:
            result["spans_expected"] = result["items_run"] * EXPECTED_SPANS[config]
            result["spans_exported"] = arm.recorded()
            arm.close()
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- runner: interleaved rounds of workers, aggregation, report -------------------------------


def available_arms() -> tuple[list[str], dict[str, str]]:
    """The arms whose packages are installed, and, for each left out, the command that installs it."""
    arms, left_out = [], {}
    for arm in ARMS:
        module, install = PEER_PACKAGES.get(arm, (None, ""))
        if module is not None and importlib.util.find_spec(module) is None:
            left_out[arm] = install
            print(f"{arm}: left out, {module} is not installed ({install})", file=sys.stderr)
        else:
            arms.append(arm)
    return arms, left_out


def run_worker(config: str, workload: str, items: int, repeats: int, cpu: int, agent: str) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, workload]
    command += [str(items), str(repeats), str(cpu), agent]
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=900, check=False)
    result = worker_result(proc, f"worker {config} {workload}")
    result["stderr"] = proc.stderr.strip()
    return result


def schedule(arms: Sequence[str], rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, config, workload) in run order: every round runs all pairs, rotated by one per round."""
    pairs = [(config, workload) for workload in WORKLOADS for arm in arms for config in configs_of(arm)]
    for number, (config, workload) in rotated(pairs, rounds):
        yield number, config, workload


@dataclass
class Row:
    """One configuration on one workload: µs per item over all timed repeats of all rounds."""

    config: str
    workload: str
    median_us: float
    min_us: float
    max_us: float
    cpu_median_us: float
    export_cpu_median_us: float
    round_median_us: list[float]
    items_run: int
    spans_expected: int | None = None
    spans_exported: int | None = None
    propagated: list[bool] = field(default_factory=list)  # per round, traced configurations only


@dataclass
class Comparison:
    """One workload: stallwatch against bare, stallwatch_traced against bare_traced (medians)."""

    workload: str
    added_us: float
    ratio: float
    added_cpu_us: float
    traced_added_us: float
    traced_ratio: float
    traced_ratio_without_export: float
    round_added_us: list[float]
    round_traced_ratio: list[float]
    added_met: bool
    traced_met: bool


@dataclass
class PeerFigure:
    """One arm on one workload, inside or outside a trace, against `bare` or `bare_traced` (medians)."""

    workload: str
    arm: str
    traced: bool
    median_us: float
    added_us: float
    ratio: float
    item_spans: float | None  # spans per item besides the request's (None: nothing records them)
    propagated: list[bool]


def summarize(runs: list[dict[str, Any]], arms: Sequence[str]) -> tuple[list[Row], list[Comparison], list[PeerFigure]]:
    """Pool the repeats of every (config, workload) across rounds; compare medians per workload."""
    rows = {}
    for workload in WORKLOADS:
        for config in (config for arm in arms for config in configs_of(arm)):
            mine = sorted(
                (run for run in runs if run["config"] == config and run["workload"] == workload),
                key=lambda run: run["round"],
            )
            wall = [us for run in mine for us in run["us_per_item"]]
            counted = "spans_exported" in mine[0]
            rows[config, workload] = Row(
                config,
                workload,
                statistics.median(wall),
                min(wall),
                max(wall),
                statistics.median(us for run in mine for us in run["cpu_us_per_item"]),
                statistics.median(us for run in mine for us in run["export_cpu_us_per_item"]),
                [statistics.median(run["us_per_item"]) for run in mine],
                sum(run["items_run"] for run in mine),
                sum(run["spans_expected"] for run in mine) if counted else None,
                sum(run["spans_exported"] for run in mine) if counted else None,
                [run["propagated"] for run in mine if run["propagated"] is not None],
            )
    comparisons = []
    for workload in WORKLOADS:
        bare, ours = rows["bare", workload], rows["stallwatch", workload]
        bare_t, ours_t = rows["bare_traced", workload], rows["stallwatch_traced", workload]
        added = ours.median_us - bare.median_us
        traced_ratio = ours_t.median_us / bare_t.median_us
        comparisons.append(
            Comparison(
                workload,
                added,
                ours.median_us / bare.median_us,
                ours.cpu_median_us - bare.cpu_median_us,
                ours_t.median_us - bare_t.median_us,
                traced_ratio,
                (ours_t.median_us - ours_t.export_cpu_median_us) / (bare_t.median_us - bare_t.export_cpu_median_us),
                [a - b for a, b in zip(ours.round_median_us, bare.round_median_us, strict=True)],
                [a / b for a, b in zip(ours_t.round_median_us, bare_t.round_median_us, strict=True)],
                added <= TARGET_ADDED_US,
                traced_ratio <= TARGET_TRACED_RATIO,
            )
        )
    peers = []
    for workload in WORKLOADS:
        for traced in (False, True):
            base = rows["bare_traced" if traced else "bare", workload]
            for arm in arms:
                row = rows[f"{arm}_traced" if traced else arm, workload]
                item_spans = None
                if row.spans_exported is not None:
                    item_spans = row.spans_exported / row.items_run - traced  # the request's span aside
                added, ratio = row.median_us - base.median_us, row.median_us / base.median_us
                peers.append(PeerFigure(workload, arm, traced, row.median_us, added, ratio, item_spans, row.propagated))
    return list(rows.values()), comparisons, peers


def source_digest() -> str:
    """Digest of stallwatch's sources (editable install: every worker imports them afresh)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE.rglob("*.py")):
        digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


# ---- paired, unpinned: each arm's executor integration on and off inside one interpreter -------

PAIRED_SERIES = ("submit", "to_thread")
PAIRED_BLOCK = 200


def paired_name(workload: str, traced: bool, arm: str) -> str:
    """A paired series' name: `WORKLOAD[_traced]` for stallwatch, `WORKLOAD[_traced]_ARM` for the others."""
    return workload + "_traced" * traced + ("" if arm == "stallwatch" else f"_{arm}")


class _FloorQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """The `floor` series' work queue: stamps and logs each put, nothing else."""

    log: collections.deque[Any]

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is not None:  # None: a shutdown sentinel
            item.submitted = time.monotonic()
        queue.SimpleQueue.put(self, item, block, timeout)
        self.log.append(item)


class _FloorItem(cf_thread._WorkItem):  # type: ignore[misc,name-defined]
    """The `floor` series' work item: the clock at start and end, the running item marked, two
    durations kept; no context, no interruption scope, no span, no fault handling."""

    submitted = 0.0
    running: dict[int, Any] = {}
    durations: list[float] = []

    def run(self) -> None:
        started = time.monotonic()
        ident = threading.get_ident()
        future = self.future
        if not future.set_running_or_notify_cancel():
            return
        self.running[ident] = self
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.running.pop(ident, None)
            future.set_exception(exc)
        else:
            self.running.pop(ident, None)
            durations = self.durations
            if len(durations) > 100_000:
                durations.clear()
            durations.append(started - self.submitted)
            durations.append(time.monotonic() - started)
            future.set_result(result)


def floor_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A one-worker pool whose items run `_FloorItem`'s bookkeeping (see `paired_worker`)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS["submit"])
    pool._work_queue = _FloorQueue()  # type: ignore[attr-defined]  # no worker holds the old one yet
    pool._work_queue.log = collections.deque(maxlen=64)  # type: ignore[attr-defined]
    return pool


def paired_worker(name: str, pairs: int, seed: int, agent: str) -> dict[str, Any]:
    """Arm `name` set up in this interpreter, its executor integration switched on and off in blocks
    (µs per item), outside a trace, then with every block inside one request; for stallwatch, then
    the floor series."""
    directory = Path(tempfile.mkdtemp(prefix="bench_executor_"))
    arm = set_up(name, True, directory, agent, watchdog=False)
    assert arm is not None
    original_item = cf_thread._WorkItem
    pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
    requests: list[AbstractContextManager[Any]] = []  # the request open now, if any

    def switcher(traced: bool) -> Callable[[bool], None]:
        def switch(on: bool) -> None:
            if requests:
                requests.pop().__exit__(None, None, None)
            arm.switch(on)
            previous = list(pools.values())
            pools["submit"] = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS["submit"])
            pools["to_thread"] = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="asyncio")
            asyncio.get_running_loop().set_default_executor(pools["to_thread"])
            for pool in previous:
                pool.shutdown(wait=True)
            if traced:
                requests.append(arm.request())
                requests[-1].__enter__()

        return switch

    async def submit() -> None:
        pools["submit"].submit(noop).result()

    async def to_thread() -> None:
        await asyncio.to_thread(noop)

    def switch_floor(on: bool) -> None:
        previous = pools.pop("floor", None)
        cf_thread._WorkItem = _FloorItem if on else original_item  # what `submit` makes (read per call)
        pools["floor"] = floor_pool() if on else concurrent.futures.ThreadPoolExecutor(MAX_WORKERS["submit"])
        if previous is not None:
            previous.shutdown(wait=True)

    async def submit_floor() -> None:
        pools["floor"].submit(noop).result()

    async def main() -> dict[str, Any]:
        switch = switcher(traced=True)
        for on in (True, False):  # the switch works: an item sees the submitter's trace exactly when on
            switch(on)
            if arm.reaches(pools["submit"].submit(arm.trace_id).result()) != on:
                raise RuntimeError(f"{name}: switched {'on' if on else 'off'}, yet the trace does "
                                   f"{'not ' if on else ''}reach a submitted item")  # fmt: skip
        result: dict[str, Any] = {}
        for traced in (False, True):
            switch = switcher(traced)
            switch(True)
            for workload, call in zip(PAIRED_SERIES, (submit, to_thread), strict=True):
                for _ in range(WARMUP_ITEMS):
                    await call()
                blocks = await run_blocks(call, switch, pairs, PAIRED_BLOCK, seed, settle=20)
                result[paired_name(workload, traced, name)] = blocks
        switcher(traced=False)(False)  # the request closed; the floor runs with the instrumentor off
        if name == "stallwatch":
            switch_floor(True)
            for _ in range(WARMUP_ITEMS):
                await submit_floor()
            result["submit_floor"] = await run_blocks(submit_floor, switch_floor, pairs, PAIRED_BLOCK, seed, settle=20)
            switch_floor(False)
        for pool in pools.values():
            pool.shutdown(wait=True)
        return result

    try:
        return asyncio.run(main())
    finally:
        arm.close()
        shutil.rmtree(directory, ignore_errors=True)


def run_paired(pairs: int, processes: int, arms: Sequence[str], agent: str) -> dict[str, Any]:
    me = str(Path(__file__).resolve())
    commands = [[sys.executable, me, "--paired-worker", arm, str(pairs), str(number), agent]
                for number in range(processes) for arm in arms if arm != "bare"]  # fmt: skip
    return run_processes(commands, 900)


def paired_rows(arms: Sequence[str]) -> Iterator[tuple[str, str, str, bool]]:
    """(series, arm, workload, traced) of every paired series, in the report's order."""
    for arm in arms:
        if arm == "bare":
            continue
        for traced in (False, True):
            for workload in PAIRED_SERIES:
                yield paired_name(workload, traced, arm), arm, workload, traced
        if arm == "stallwatch":
            yield "submit_floor", arm, "submit", False


def render_paired(paired: dict[str, Any], arms: Sequence[str]) -> list[str]:
    peers = [arm for arm in arms if arm != "bare"]
    lines = [
        "## Paired, unpinned: what each executor integration adds per item (the figure that decides)",
        "",
        "Interpreters x pairs of blocks of "
        f"{PAIRED_BLOCK} items, each arm's executor integration switched on and off inside its own "
        "interpreter (set up as that arm), every thread free to run on any CPU; see `_paired.py` and the "
        "module docstring. Inside a trace: every block runs inside one request of the arm's own (an "
        "OpenTelemetry span, a sentry transaction, a ddtrace span), in both halves. Each cell: the median "
        "µs added per item, the median per-pair ratio on / off and its 95 % bootstrap interval.",
        "",
        "| workload | trace | " + " | ".join(peers) + " |",
        "|---|---|" + "---|" * len(peers),
    ]
    for traced in (False, True):
        for workload in PAIRED_SERIES:
            cells = []
            for arm in peers:
                found = paired.get(paired_name(workload, traced, arm))
                if found is None:
                    cells.append("-")
                    continue
                low, high = found["ratio_ci95"]
                cells.append(f"{found['added_us']:+.1f} µs ({found['ratio']:.3f}x, {low:.3f} to {high:.3f})")
            lines.append(f"| {workload} | {'inside' if traced else 'outside'} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every series: `submit_floor` is the same pairs for a floor of this design instead of stallwatch "
        "(a queue that stamps and logs each put, items that time themselves and mark themselves running; "
        f"nothing else). Target ≤ {TARGET_ADDED_US:g} µs for stallwatch outside a trace.",
        "",
        "| arm | series | pairs | off p50 µs | on p50 µs | ratio | 95 % interval | added µs "
        f"| ≤ {TARGET_ADDED_US:g} µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for series, arm, _, traced in paired_rows(arms):
        found = paired.get(series)
        if found is None:
            continue
        low, high = found["ratio_ci95"]
        judged = ""
        if arm == "stallwatch" and not traced:
            judged = "met" if found["added_us"] <= TARGET_ADDED_US else "**not met**"
        lines.append(
            f"| {arm} | {series} | {found['pairs']} | {found['off_p50_us']:.1f} | {found['on_p50_us']:.1f} "
            f"| {found['ratio']:.3f}x | {low:.3f} to {high:.3f} | {found['added_us']:+.1f} | {judged} |"
        )
    return [*lines, ""]


def yes_no(propagated: list[bool]) -> str:
    if not propagated:
        return "-"
    if all(propagated):
        return "yes"
    return "no" if not any(propagated) else f"{sum(propagated)} of {len(propagated)} rounds"


def render_peers(peers: list[PeerFigure], arms: Sequence[str], left_out: dict[str, str]) -> list[str]:
    figure = {(p.workload, p.arm, p.traced): p for p in peers}
    lines = [
        "## Pinned: each arm in its own interpreters, against bare (µs per item, added µs)",
        "",
        "Medians of the interleaved pinned runs of this run. Outside a trace each arm is compared with "
        "`bare` (nothing installed), inside with `bare_traced` (the stock SDK set-up and a request span "
        "per item). These compare whole arms across interpreters: a peer's figure inside a trace also "
        "holds what its own request costs (a sentry transaction is serialized when it ends, a ddtrace "
        "span is encoded for its agent) besides its executor integration, which the paired figures "
        "above isolate.",
        "",
        "| workload | trace | " + " | ".join(f"{arm} µs" for arm in arms) + " |",
        "|---|---|" + "---|" * len(arms),
    ]
    for workload in WORKLOADS:
        for traced in (False, True):
            cells = []
            for arm in arms:
                found = figure[workload, arm, traced]
                added = "" if arm == "bare" else f" ({found.added_us:+.2f})"
                cells.append(f"{found.median_us:.2f}{added}")
            lines.append(f"| {workload} | {'inside' if traced else 'outside'} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "What each arm gives the user, as recorded in the same runs: the spans it records per item besides "
        "the request's own (outside a trace: per item), and whether the submitter's trace reaches the item "
        "(a probe item inside a request, after the timed repeats of each traced run):",
        "",
        "| arm | set-up | spans per item outside a trace | spans per item inside a trace "
        "| trace reaches the item: submit / batch / to_thread | besides |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        spans = []
        for traced in (False, True):
            counts = [figure[workload, arm, traced].item_spans for workload in WORKLOADS]
            known = [count for count in counts if count is not None]
            spans.append(f"{statistics.median(known):.2f}" if len(known) == len(counts) else "-")
        reached = " / ".join(yes_no(figure[workload, arm, True].propagated) for workload in WORKLOADS)
        lines.append(f"| {arm} | {ARM_TITLES[arm]} | {spans[0]} | {spans[1]} | {reached} | {ARM_GIVES[arm]} |")
    lines += [
        "",
        '`stallwatch` outside a trace exports no span (`traces_exporter="none"`), so its count there is the '
        "set-up's; it starts a span only inside a sampled trace. `bare`'s `to_thread` carries the trace "
        "because `asyncio.to_thread` runs the item in a copy of the caller's context variables.",
    ]
    if left_out:
        lines += ["", *(f"- `{arm}` left out: not installed (`{install}`)." for arm, install in left_out.items())]
    return [*lines, ""]


def render_markdown(
    rows: list[Row],
    comparisons: list[Comparison],
    peers: list[PeerFigure],
    info: dict[str, Any],
    settings: dict[str, Any],
    paired: dict[str, Any],
) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    dirty = " (with uncommitted changes in src/)" if info["git_dirty"] else ""
    changed = info["source_digest"] != info["source_digest_end"]
    pinned = f"pinned to CPU {settings['cpu']}" if settings["cpu"] >= 0 else "not pinned"
    arms = settings["arms"]
    met = {True: "met", False: "**not met**"}
    lines = [
        "# Executor overhead: µs per work item, submit + completion of a no-op, against the peers",
        "",
        f"Generated by `{command_line(__file__, [])}` "
        f"(items={settings['items']} per repeat, repeats={settings['repeats']} after a warm-up of "
        f"{settings['warmup']} items, rounds={settings['rounds']}, every worker {pinned}; paired: "
        f"{settings['processes']} interpreters per arm x {settings['pairs']} pairs). Arms: "
        + ", ".join(f"`{arm}`" for arm in arms)
        + ", each outside a trace and, `ARM_traced`, with every submission inside a request of its own "
        "(see the module docstring and the set-ups below). Each configuration and workload runs in a fresh "
        "interpreter. Runs are **interleaved**: every round runs all (configuration, workload) pairs in an "
        "order rotated by one per round, and µs/item is the median of every timed repeat pooled across "
        "rounds."
        + (f" ddtrace sent {settings['agent_payloads']} payloads to the agent stand-in." if "ddtrace" in arms else ""),
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}{dirty}, sources {info['source_digest']}; load {' '.join(info['loadavg'])}; "
        f"{info['date']}.",
        "",
    ]
    if changed:
        lines += [
            f"**Warning: src/stallwatch changed during the run (sources {info['source_digest']} at the start, "
            f"{info['source_digest_end']} at the end): the runs mix two versions of stallwatch.**",
            "",
        ]
    lines += render_paired(paired, arms)
    lines += render_peers(peers, arms, settings["left_out"])
    lines += [
        "## Pinned: stallwatch against its targets",
        "",
        f"`stallwatch` against `bare` (added µs, target ≤ {TARGET_ADDED_US:g} µs), `stallwatch_traced` "
        f"against `bare_traced` (ratio, target ≤ {TARGET_TRACED_RATIO:g}x):",
        "",
        "| workload | bare µs | stallwatch µs | added µs | ratio | ≤ 2 µs "
        "| bare_traced µs | stallwatch_traced µs | added µs | ratio | ≤ 1.5x | ratio without export |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r.config, r.workload): r for r in rows}
    for c in comparisons:
        lines.append(
            f"| {c.workload} | {by_key['bare', c.workload].median_us:.2f} | "
            f"{by_key['stallwatch', c.workload].median_us:.2f} | {c.added_us:+.2f} | {c.ratio:.2f}x | "
            f"{met[c.added_met]} | {by_key['bare_traced', c.workload].median_us:.2f} | "
            f"{by_key['stallwatch_traced', c.workload].median_us:.2f} | {c.traced_added_us:+.2f} | "
            f"{c.traced_ratio:.2f}x | {met[c.traced_met]} | {c.traced_ratio_without_export:.2f}x |"
        )
    lines += [
        "",
        '"ratio without export": both traced medians minus the CPU time their batch processor spent in '
        "the exporter's `export` (same OTLP/JSON file exporter in both), i.e. the ratio if exporting "
        "were free.",
        "",
        "All configurations. µs per item over all timed repeats (wall); CPU: process CPU time of all "
        "threads per item; export: CPU time in `export` per item (OpenTelemetry arms); spans: recorded / "
        "expected over every item run, warm-ups and probes included (a shortfall is spans the batch "
        "processor dropped, queue full):",
        "",
        "| workload | config | median µs | min | max | CPU µs | export µs | medians per round | spans |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spans = f"{r.spans_exported}/{r.spans_expected}" if r.spans_expected is not None else ""
        export = f"{r.export_cpu_median_us:.2f}" if r.export_cpu_median_us else ""
        per_round = ", ".join(f"{us:.2f}" for us in r.round_median_us)
        lines.append(
            f"| {r.workload} | {r.config} | {r.median_us:.2f} | {r.min_us:.2f} | {r.max_us:.2f} | "
            f"{r.cpu_median_us:.2f} | {export} | {per_round} | {spans} |"
        )
    lines += ["", "Per round, in round order, to show the run-to-run noise:", ""]
    for c in comparisons:
        lines.append(f"- {c.workload}: added µs " + ", ".join(f"{us:+.2f}" for us in c.round_added_us))
        lines.append(f"- {c.workload}: traced ratio " + ", ".join(f"{x:.2f}x" for x in c.round_traced_ratio))
    return "\n".join(lines) + "\n"


def benchmark(items: int, repeats: int, rounds: int, cpu: int, out: Path, pairs: int, processes: int) -> str:
    """Run every round, write raw/executor.json and executor.md into `out`, return the markdown."""
    info = {**machine_info(VERSIONED), "source_digest": source_digest()}
    arms, left_out = available_arms()
    agent = LoopbackReceiver()
    try:
        paired = run_paired(pairs, processes, arms, agent.url)
        runs = []
        for number, config, workload in schedule(arms, rounds):
            run = run_worker(config, workload, items, repeats, cpu, agent.url)
            run["round"] = number
            runs.append(run)
            median = statistics.median(run["us_per_item"])
            print(f"round {number} {workload:<9} {config:<21} {median:7.2f} µs/item", file=sys.stderr)
            if run["stderr"]:
                print(run["stderr"], file=sys.stderr)
    finally:
        agent.close()
    info["source_digest_end"] = source_digest()
    if info["source_digest_end"] != info["source_digest"]:
        print("warning: src/stallwatch changed during the run; the results mix two versions", file=sys.stderr)
    rows, comparisons, peers = summarize(runs, arms)
    settings = {
        "items": items,
        "repeats": repeats,
        "warmup": min(items, WARMUP_ITEMS),
        "rounds": rounds,
        "batch": BATCH,
        "cpu": cpu,
        "pairs": pairs,
        "processes": processes,
        "arms": arms,
        "left_out": left_out,
        "agent_payloads": agent.payloads,
    }
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": info,
        "settings": settings,
        "targets": {"added_us": TARGET_ADDED_US, "traced_ratio": TARGET_TRACED_RATIO},
        "paired": paired,
        "comparison": [asdict(c) for c in comparisons],
        "peers": [asdict(p) for p in peers],
        "summary": [asdict(r) for r in rows],
        "runs": runs,
    }
    raw_path(out, "executor.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(rows, comparisons, peers, info, settings, paired)
    (out / "executor.md").write_text(markdown)
    return markdown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, help="work items per timed repeat (default 2000; 500 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed repeats per run (default 5; 3 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: fewer items and repeats, one round")
    parser.add_argument("--no-pin", action="store_true", help="do not pin each worker to one CPU")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--pairs", type=int, help="on/off block pairs per paired process (default 20; 4 with --quick)")
    parser.add_argument("--processes", type=int, help="paired interpreters per arm (default 3; 1 with --quick)")
    parser.add_argument("--paired-worker", nargs=4, metavar=("ARM", "PAIRS", "SEED", "AGENT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--worker",
        nargs=6,
        metavar=("CONFIG", "WORKLOAD", "ITEMS", "REPEATS", "CPU", "AGENT"),
        help=argparse.SUPPRESS,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        config, workload, items, repeats, cpu, agent = args.worker
        print(json.dumps(worker(config, workload, int(items), int(repeats), int(cpu), agent)))
        return
    if args.paired_worker:
        arm, pairs, seed, agent = args.paired_worker
        print(json.dumps(paired_worker(arm, int(pairs), int(seed), agent)))
        return
    items = args.items or (500 if args.quick else 2000)
    repeats = args.repeats or (3 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 5)
    cpu = -1 if args.no_pin else max(os.sched_getaffinity(0))
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_executor_")) if args.quick else DEFAULT_OUT)
    pairs = args.pairs or (4 if args.quick else 20)
    processes = args.processes or (1 if args.quick else 3)
    print(benchmark(items, repeats, rounds, cpu, out, pairs, processes))
    print(f"results: {raw_path(out, 'executor.json')}, {out / 'executor.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
