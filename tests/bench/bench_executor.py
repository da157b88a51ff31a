"""Executor overhead benchmark: what stallwatch adds to each `ThreadPoolExecutor` work item.

Run from the repository root (a full run takes about two minutes)::

    .venvs/main/bin/python tests/bench/bench_executor.py
    .venvs/main/bin/python tests/bench/bench_executor.py --quick    # smoke test, < 20 s, writes to a temp dir

Options: ``--items N`` work items per repeat (default 2000), ``--repeats K`` timed repeats per run
(default 5, after one warm-up of min(N, 500) items), ``--rounds R`` (default 5), ``--quick`` (500
items, 3 repeats, 1 round), ``--no-pin`` (see below), ``--out DIR`` (default
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
  default executor, which stallwatch instruments like any other).

Configurations, each run (per workload) in its own fresh interpreter:

- ``bare``: no stallwatch and no OpenTelemetry imported.
- ``stallwatch``: ``import stallwatch`` first, then ``stallwatch.setup(traces_exporter="none",
  metrics_exporter="none", logs_exporter="none")``: stallwatch's providers exist (the metric
  instruments record into a MeterProvider without readers), nothing is exported. No span is active,
  so the instrumentation creates no span: the cost is the accounting queue, the `_WorkItem.run`
  and `_worker` wrappers, the interruption scope and the metric calls.
- ``bare_traced``: no stallwatch; the OpenTelemetry SDK set up by hand (TracerProvider +
  BatchSpanProcessor to an OTLP/JSON-lines file exporter using stallwatch's own encoder, like its
  ``FileSpanExporter``, loaded from its file, so both traced configurations encode alike), and every
  submission happens inside ``tracer.start_as_current_span("request")``.
- ``stallwatch_traced``: as ``stallwatch``, but with ``traces_exporter="file"`` (to a temporary
  directory) and the same request span around every submission, so the instrumentation also starts
  and ends one span per item (and the batch processor exports it, in the background, in the same
  process: that cost is in the figure, as it would be in a server).

Every worker process is pinned to one CPU (the highest-numbered one this process may use) before
it starts any thread, unless ``--no-pin``: a one-at-a-time hand-off between two threads on two
CPUs of a VM costs 25 to 200 µs depending on where the scheduler puts the threads and how deep the
idle CPU sleeps, noise that buries a 2 µs difference; on one CPU the hand-off is a plain context
switch and every µs of CPU work the instrumentation adds (including its background threads: the
wedge detector, the span exporter) shows up in the wall time. The stallwatch configurations start
timing once the freeze watchdog (another process, pinned to the same CPU) has finished starting:
before, its one-time start-up fell into the timed repeats (wall time far above CPU time).

Paired, unpinned (``--pairs P``, default 20, ``--processes K``, default 3; see ``_paired.py``):
K fresh interpreters set up as ``stallwatch`` alternate P pairs of blocks of 200 items of the
``submit`` and ``to_thread`` workloads with the executor instrumentor switched on and off (each
block on pools made after the switch, so that they are instrumented exactly when it is on), free to
run on every CPU as a server's threads are. There the awaiting thread is woken on another CPU
and may wait for the GIL while the worker finishes: what a pinned run cannot show. Reported: the
median per-pair ratio with its 95 % bootstrap interval and the median µs added per item. A third
series, ``submit_floor``, measures a floor for this design the same way: a bare pool whose queue
stamps and logs each put and whose items read the clock at start and end, mark the running item
and keep their two durations (``_FloorQueue``, ``_FloorItem``), i.e. the queue accounting and
timings issue 4 asks for without context propagation, interruption scope, spans or fault handling.

Reported: µs per item, the median of all timed repeats pooled across rounds; per workload, the
added µs per item (``stallwatch`` minus ``bare``, target ≤ 2 µs) and the ratio
``stallwatch_traced`` / ``bare_traced`` (target ≤ 1.5x). Also per repeat: the process CPU time
(all threads) per item and, in the traced configurations, the CPU time the batch span processor's
thread spent in the exporter's ``export`` per item (the "ratio without export" subtracts it) and
the number of spans that reached the exporter, so a span dropped on a full queue shows instead of
silently making a configuration look cheaper. The runs are interleaved: every round runs all
(configuration, workload) pairs, in an order rotated by one each round, so background noise on a
shared machine hits all of them alike; the per-round differences are listed to show the noise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import hashlib
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
from collections.abc import Iterator, Sequence
from concurrent.futures import thread as cf_thread
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _machine import clean_env, command_line, machine_info, raw_path, rotated, worker_result
from _paired import run_blocks, run_processes, switch_for, table

CONFIGS = ("bare", "stallwatch", "bare_traced", "stallwatch_traced")
WORKLOADS = ("submit", "batch", "to_thread")
BASELINES = {"stallwatch": "bare", "stallwatch_traced": "bare_traced"}
TRACED = ("bare_traced", "stallwatch_traced")
MAX_WORKERS = {"submit": 1, "batch": 4}
BATCH = 1000
WARMUP_ITEMS = 500
TARGET_ADDED_US = 2.0
TARGET_TRACED_RATIO = 1.5
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SOURCE = Path(__file__).resolve().parents[2] / "src" / "stallwatch"
VERSIONED = ("opentelemetry-api", "opentelemetry-sdk", "wrapt", "stallwatch")


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


def run_submit(pool: concurrent.futures.ThreadPoolExecutor, items: int, tracer: Any) -> None:
    """`items` one-at-a-time submit + result()."""
    if tracer is None:
        for _ in range(items):
            pool.submit(noop).result()
        return
    for _ in range(items):
        with tracer.start_as_current_span("request"):
            pool.submit(noop).result()


def run_batch(pool: concurrent.futures.ThreadPoolExecutor, items: int, tracer: Any) -> None:
    """`items` submissions in batches of BATCH, each batch waited for as a whole."""
    remaining = items
    while remaining > 0:
        size = min(BATCH, remaining)
        remaining -= size
        if tracer is None:
            futures = [pool.submit(noop) for _ in range(size)]
        else:
            futures = []
            for _ in range(size):
                with tracer.start_as_current_span("request"):
                    futures.append(pool.submit(noop))
        concurrent.futures.wait(futures)


async def run_to_thread(items: int, tracer: Any) -> None:
    """`items` one-at-a-time `await asyncio.to_thread(noop)`."""
    if tracer is None:
        for _ in range(items):
            await asyncio.to_thread(noop)
        return
    for _ in range(items):
        with tracer.start_as_current_span("request"):
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


def measure(workload: str, items: int, repeats: int, tracer: Any, tap: ExportTap | None) -> dict[str, list[float]]:
    """One warm-up, then `repeats` timed repeats of `items` items; µs per item of each repeat."""
    warmup = min(items, WARMUP_ITEMS)
    clock = Clock(tap)
    if workload == "to_thread":

        async def series() -> None:
            await run_to_thread(warmup, tracer)
            for _ in range(repeats):
                clock.start()
                await run_to_thread(items, tracer)
                clock.stop()

        asyncio.run(series())
    else:
        run = run_submit if workload == "submit" else run_batch
        with concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS[workload]) as pool:
            run(pool, warmup, tracer)
            for _ in range(repeats):
                clock.start()
                run(pool, items, tracer)
                clock.stop()
    per_item = [[seconds / items * 1e6 for seconds in sample] for sample in clock.samples]
    return {
        "us_per_item": [wall for wall, _, _ in per_item],
        "cpu_us_per_item": [cpu for _, cpu, _ in per_item],
        "export_cpu_us_per_item": [export for _, _, export in per_item],
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


def worker(config: str, workload: str, items: int, repeats: int, cpu: int) -> dict[str, Any]:
    """Run one configuration and workload in this (fresh) interpreter and return its raw numbers."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})  # before any thread starts: they all inherit it
    if config.startswith("stallwatch"):
        import stallwatch  # first, as a server's first import
    directory = Path(tempfile.mkdtemp(prefix="bench_executor_"))
    try:
        if config == "stallwatch":
            settle(stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none"))
        elif config == "stallwatch_traced":
            settle(stallwatch.setup(traces_exporter="file", file_dir=directory, metrics_exporter="none",
                                    logs_exporter="none"))  # fmt: skip
        elif config == "bare_traced":
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(make_file_exporter(directory)))
            trace.set_tracer_provider(provider)
        tracer = tap = None
        if config in TRACED:
            from opentelemetry import trace

            tap = ExportTap()
            tap.attach(trace.get_tracer_provider())
            tracer = trace.get_tracer("bench_executor")
        result: dict[str, Any] = {"config": config, "workload": workload, "cpu": cpu}
        result.update(measure(workload, items, repeats, tracer, tap))
        if tap is not None:
            from opentelemetry import trace

            trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
            spans_per_item = 2 if config == "stallwatch_traced" else 1  # request (+ stallwatch's work item)
            result["spans_expected"] = (min(items, WARMUP_ITEMS) + items * repeats) * spans_per_item
            result["spans_exported"] = tap.spans
        if config.startswith("stallwatch"):
            stallwatch.shutdown()
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- runner: interleaved rounds of workers, aggregation, report -------------------------------


def run_worker(config: str, workload: str, items: int, repeats: int, cpu: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, workload]
    command += [str(items), str(repeats), str(cpu)]
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=900, check=False)
    result = worker_result(proc, f"worker {config} {workload}")
    result["stderr"] = proc.stderr.strip()
    return result


def schedule(rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, config, workload) in run order: every round runs all pairs, rotated by one per round."""
    pairs = [(config, workload) for workload in WORKLOADS for config in CONFIGS]
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
    spans_expected: int | None = None
    spans_exported: int | None = None


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


def summarize(runs: list[dict[str, Any]]) -> tuple[list[Row], list[Comparison]]:
    """Pool the repeats of every (config, workload) across rounds; compare medians per workload."""
    rows = {}
    for workload in WORKLOADS:
        for config in CONFIGS:
            mine = sorted(
                (run for run in runs if run["config"] == config and run["workload"] == workload),
                key=lambda run: run["round"],
            )
            wall = [us for run in mine for us in run["us_per_item"]]
            traced = config in TRACED
            rows[config, workload] = Row(
                config,
                workload,
                statistics.median(wall),
                min(wall),
                max(wall),
                statistics.median(us for run in mine for us in run["cpu_us_per_item"]),
                statistics.median(us for run in mine for us in run["export_cpu_us_per_item"]),
                [statistics.median(run["us_per_item"]) for run in mine],
                sum(run["spans_expected"] for run in mine) if traced else None,
                sum(run["spans_exported"] for run in mine) if traced else None,
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
    return list(rows.values()), comparisons


def source_digest() -> str:
    """Digest of stallwatch's sources (editable install: every worker imports them afresh)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE.rglob("*.py")):
        digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


# ---- paired, unpinned: the instrumentor on and off inside one interpreter ----------------------

PAIRED_SERIES = ("submit", "to_thread")
PAIRED_BLOCK = 200


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


def paired_worker(pairs: int, seed: int) -> dict[str, Any]:
    """The `stallwatch` setup, the executor instrumentor switched on and off in blocks (µs per item)."""
    import stallwatch

    stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none", watchdog=False)
    from stallwatch.instrument.executor import ExecutorInstrumentor

    toggle = switch_for(ExecutorInstrumentor())
    original_item = cf_thread._WorkItem
    pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def switch(on: bool) -> None:
        toggle(on)
        previous = list(pools.values())
        pools["submit"] = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS["submit"])
        pools["to_thread"] = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="asyncio")
        asyncio.get_running_loop().set_default_executor(pools["to_thread"])
        for pool in previous:
            pool.shutdown(wait=True)

    async def submit() -> None:
        pools["submit"].submit(noop).result()

    async def to_thread() -> None:
        await asyncio.to_thread(noop)

    def switch_floor(on: bool) -> None:
        previous = pools.get("floor")
        cf_thread._WorkItem = _FloorItem if on else original_item  # what `submit` makes (read per call)
        pools["floor"] = floor_pool() if on else concurrent.futures.ThreadPoolExecutor(MAX_WORKERS["submit"])
        if previous is not None:
            previous.shutdown(wait=True)

    async def submit_floor() -> None:
        pools["floor"].submit(noop).result()

    async def main() -> dict[str, Any]:
        switch(True)
        result: dict[str, Any] = {}
        for series, call in zip(PAIRED_SERIES, (submit, to_thread), strict=True):
            for _ in range(WARMUP_ITEMS):
                await call()
            result[series] = await run_blocks(call, switch, pairs, PAIRED_BLOCK, seed, settle=20)
        switch(False)  # the floor series runs on the stock executor, stallwatch's instrumentor off
        switch_floor(True)
        for _ in range(WARMUP_ITEMS):
            await submit_floor()
        result["submit_floor"] = await run_blocks(submit_floor, switch_floor, pairs, PAIRED_BLOCK, seed, settle=20)
        switch_floor(False)
        return result

    try:
        return asyncio.run(main())
    finally:
        stallwatch.shutdown(10)


def run_paired(pairs: int, processes: int) -> dict[str, Any]:
    me = str(Path(__file__).resolve())
    return run_processes([[sys.executable, me, "--paired-worker", str(pairs), str(n)] for n in range(processes)], 900)


def render_paired(paired: dict[str, Any]) -> list[str]:
    lines = [
        "**Paired, unpinned** (interpreters x pairs of blocks of "
        f"{PAIRED_BLOCK} items, the executor instrumentor switched on and off inside each, every thread free to "
        "run on any CPU; see `_paired.py`): median per-pair ratio on / off, its 95 % bootstrap interval, and "
        "the median µs added per item. `submit_floor`: the same pairs for a floor of this design instead "
        "of stallwatch (a queue that stamps and logs each put, items that time themselves and mark "
        "themselves running; nothing else, see the module docstring).",
        "",
    ]
    lines += table(
        paired,
        lambda series: series,
        f"≤ {TARGET_ADDED_US:g} µs",
        lambda found: "met" if found["added_us"] <= TARGET_ADDED_US else "**not met**",
    )
    return [*lines, ""]


def render_markdown(
    rows: list[Row],
    comparisons: list[Comparison],
    info: dict[str, Any],
    settings: dict[str, Any],
    paired: dict[str, Any],
) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    dirty = " (with uncommitted changes in src/)" if info["git_dirty"] else ""
    changed = info["source_digest"] != info["source_digest_end"]
    pinned = f"pinned to CPU {settings['cpu']}" if settings["cpu"] >= 0 else "not pinned"
    met = {True: "met", False: "**not met**"}
    lines = [
        "# Executor overhead: µs per work item, submit + completion of a no-op",
        "",
        f"Generated by `{command_line(__file__, [])}` "
        f"(items={settings['items']} per repeat, repeats={settings['repeats']} after a warm-up of "
        f"{settings['warmup']} items, rounds={settings['rounds']}, every worker {pinned}). Each "
        "configuration and workload runs in a fresh interpreter. Runs are **interleaved**: every round "
        "runs all (configuration, workload) pairs in an order rotated by one per round, and µs/item is "
        "the median of every timed repeat pooled across rounds. `stallwatch` is compared with `bare` "
        f"(added µs, target ≤ {TARGET_ADDED_US:g} µs), `stallwatch_traced` with `bare_traced` (ratio, "
        f"target ≤ {TARGET_TRACED_RATIO:g}x).",
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
    lines += render_paired(paired)
    lines += [
        "Pinned, one interpreter per configuration:",
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
        "threads per item; export: CPU time in `export` per item; spans: exported / started (a "
        "shortfall is spans the batch processor dropped, queue full):",
        "",
        "| workload | config | median µs | min | max | CPU µs | export µs | medians per round | spans |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spans = f"{r.spans_exported}/{r.spans_expected}" if r.spans_expected is not None else ""
        export = f"{r.export_cpu_median_us:.2f}" if r.config in TRACED else ""
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
    paired = run_paired(pairs, processes)
    runs = []
    for number, config, workload in schedule(rounds):
        run = run_worker(config, workload, items, repeats, cpu)
        run["round"] = number
        runs.append(run)
        median = statistics.median(run["us_per_item"])
        print(f"round {number} {workload:<9} {config:<17} {median:7.2f} µs/item", file=sys.stderr)
        if run["stderr"]:
            print(run["stderr"], file=sys.stderr)
    info["source_digest_end"] = source_digest()
    if info["source_digest_end"] != info["source_digest"]:
        print("warning: src/stallwatch changed during the run; the results mix two versions", file=sys.stderr)
    rows, comparisons = summarize(runs)
    settings = {
        "items": items,
        "repeats": repeats,
        "warmup": min(items, WARMUP_ITEMS),
        "rounds": rounds,
        "batch": BATCH,
        "cpu": cpu,
        "pairs": pairs,
        "processes": processes,
    }
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": info,
        "settings": settings,
        "targets": {"added_us": TARGET_ADDED_US, "traced_ratio": TARGET_TRACED_RATIO},
        "paired": paired,
        "comparison": [asdict(c) for c in comparisons],
        "summary": [asdict(r) for r in rows],
        "runs": runs,
    }
    raw_path(out, "executor.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(rows, comparisons, info, settings, paired)
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
    parser.add_argument("--processes", type=int, help="paired interpreters (default 3; 1 with --quick)")
    parser.add_argument("--paired-worker", nargs=2, metavar=("PAIRS", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--worker", nargs=5, metavar=("CONFIG", "WORKLOAD", "ITEMS", "REPEATS", "CPU"), help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        config, workload, items, repeats, cpu = args.worker
        print(json.dumps(worker(config, workload, int(items), int(repeats), int(cpu))))
        return
    if args.paired_worker:
        pairs, seed = args.paired_worker
        print(json.dumps(paired_worker(int(pairs), int(seed))))
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
