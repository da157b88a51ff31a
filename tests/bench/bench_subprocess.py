"""Subprocess benchmark: how long a spawn blocks under stallwatch's subprocess instrumentation, with
uvloop's own fork and with ``STALLWATCH_UVLOOP_SPAWN=vfork``, and what the instrumentation adds.

Run from the repository root (a full run takes about two minutes)::

    .venvs/main/bin/python tests/bench/bench_subprocess.py
    .venvs/main/bin/python tests/bench/bench_subprocess.py --quick    # smoke test, < 40 s, writes to a temp dir

Options: ``--spawns N`` measured spawns per blocked-time run (default 200, after 10 warm-ups),
``--samples M`` measured round trips per series of an overhead run (default 300, after 10
warm-ups), ``--rounds R`` (default 10), ``--quick`` (20 spawns, 50 samples, 1 round, ``rss0``
only), ``--out DIR`` (default ``tests/bench/results``; with ``--quick``, a fresh temporary
directory). Writes ``raw/subprocess.json`` (raw numbers and machine info) and ``subprocess.md`` (the
tables) to the output directory.

Every worker runs in a fresh interpreter, imports ``stallwatch`` first (only the standard library
before it; OpenTelemetry and uvloop come after) and calls ``stallwatch.setup(file_dir=<tmp>,
watchdog=False, metric_export_interval_ms=3600000)``: the default pipeline (file exporters) with
the subprocess instrumentation on unless the configuration says otherwise.

1. Blocked time per spawn: the wall time of ``await asyncio.create_subprocess_exec("/bin/true",
   ...)`` with stdin/stdout/stderr on DEVNULL (the call, not the wait for exit), as in
   ``bench_spawn.py``, plus the largest gap of a ticker thread that sleeps 1 ms in a loop (the GIL
   held). Configurations:

   - ``uvloop_native``: a uvloop loop (``uvloop.new_event_loop()`` + ``run_until_complete``) with
     ``STALLWATCH_UVLOOP_SPAWN=fork`` in the worker's environment: uvloop forks the whole process.
     The baseline of the ratios, same rss.
   - ``uvloop_vfork``: as ``uvloop_native``, with ``STALLWATCH_UVLOOP_SPAWN=vfork`` (the default, set
     explicitly): stallwatch routes uvloop's ``subprocess_exec`` through ``subprocess.Popen`` (vfork).
   - ``asyncio``: the standard asyncio loop (vfork through ``Popen``).

   Each in two memory variants: ``rss0`` and ``rss1g`` (1 GiB allocated and one byte written per
   4096-byte page, so it is resident; fork cost grows with RSS). After the series the worker calls
   ``stallwatch.shutdown(10)`` and reads back, from ``<tmp>/traces.jsonl``, the spans named
   ``true`` after the warm-ups: their ``stallwatch.spawn.blocked_seconds`` (the instrumentation's
   own stopwatch, which sums the synchronous steps of the loop's spawn coroutine) and their
   ``stallwatch.spawn.method`` (``fork`` expected for ``uvloop_native``, ``vfork`` for the others).

2. Wrapper overhead, on the standard asyncio loop, ``rss0`` only: the time of a full round trip,
   ``create_subprocess_exec("/bin/true", ...DEVNULL)`` + ``await proc.wait()``, and, in the same
   worker after the loop has closed, of a synchronous ``subprocess.run(["/bin/true"])``.
   Configurations: ``instrumented`` (the setup above) and ``uninstrumented`` (the same setup with
   ``STALLWATCH_INSTRUMENT_SUBPROCESS=false`` in the environment). Reported: instrumented /
   uninstrumented of the p50 and of the mean (target ≤ 1.02, i.e. at most 2% added), and the
   median over rounds of the ratio of the two runs' own p50 in that round (the two run one after
   the other, so this figure shrugs off a slow stretch of the machine that hits a single run:
   on this VM, round trips now and then take ~4 ms instead of ~0.7 ms for a few seconds). Also the
   CPU time of the worker process per round trip (``time.process_time()``: all its threads, not
   the children), which scheduling noise hardly moves, and the µs of it the instrumentation adds.
   The batch span processor exports in its own thread every 5 s, so an export would land in one
   series or another by chance: the worker flushes the spans queued so far before each timed
   series (outside every figure) and once after it (inside the CPU figure only, reported apart as
   "of which export"), so the CPU figure includes exporting the series' own spans.

3. Paired overhead, the headline of part 2 (see ``_paired.py``): K fresh interpreters set up as
   ``instrumented``, so both sides of each ratio share a process and a moment; reported: the
   median per-pair ratio with its 95 % bootstrap interval. ``--pairs P`` (default 30; 4 with
   ``--quick``) and ``--processes K`` (default 4; 1 with ``--quick``). Each interpreter first
   alternates P pairs of blocks of 25 round trips (``async_roundtrip``) with the subprocess
   instrumentor switched on and off (``SubprocessInstrumentor().instrument()`` /
   ``.uninstrument()``). Then ``subprocess.run`` (called from a coroutine) runs in P groups of
   blocks of 25 calls in a shuffled order (``run_arms``): one with everything off and one per arm
   alone on, each arm's ratio taken against its group's off block, so stallwatch and the others
   are compared at the same moments (the cost a wrapper adds grows with the machine's load, and
   arms measured minutes apart would differ for that alone). The arms: the instrumentor; two
   floors (``PopenFloor``), a wrapper that only times the spawn, and one that also keeps what a
   span per child needs and builds nothing; and what a user would pick instead (``Alternative``):
   a hand-made SDK span per child (a wrapt wrapper of ``Popen`` that starts an OpenTelemetry SDK
   span at the spawn and ends it at the exit, through the same provider), sentry-sdk's
   ``StdlibIntegration`` (its spawn and wait spans, inside a transaction per block, opened when it
   is switched on and closed when it is switched off, outside the timed calls, and sent to a
   transport that drops them) and ddtrace's ``subprocess`` integration (with
   ``DD_APPSEC_ENABLED=true``, without which it makes no span; its agent on an unreachable
   loopback port). The packages are imported and installed after the round trips, each while
   every other arm is off, and are switched by swapping what they patched; their imports stay
   (ddtrace's import hook, sentry's client), so every arm's blocks, the off ones too, run with
   them loaded. Each arm first makes 10 untimed calls on. A package not installed is left out
   (``pip install sentry-sdk ddtrace``).

The runs are interleaved: every round runs all (configuration, rss) pairs of both parts, in an
order rotated by one each round, and samples are pooled per configuration across rounds, so
background noise on a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _machine import clean_env, command_line, machine_info, p99, raw_path, read_spans, rotated, worker_result
from _paired import run_arms, run_blocks, run_processes, switch_for, table, verdict
from bench_spawn import Ticker, touch_memory, vm_rss_mb

BLOCKED_CONFIGS = ("uvloop_native", "uvloop_vfork", "asyncio")
OVERHEAD_CONFIGS = ("uninstrumented", "instrumented")
SERIES = ("async_spawn_call", "async_roundtrip", "sync_run")
SERIES_TITLES = {
    "async_spawn_call": "`await create_subprocess_exec(...)` alone, timed inside the same round trips (asyncio loop)",
    "async_roundtrip": "`await create_subprocess_exec(...)` + `await proc.wait()` (asyncio loop)",
    "sync_run": '`subprocess.run(["/bin/true"])`',
    "sync_run_floor_clock": '`subprocess.run(["/bin/true"])`, floor: a wrapper that only times the spawn',
    "sync_run_floor_capture": '`subprocess.run(["/bin/true"])`, floor: a wrapper that keeps what a span needs',
    "sync_run_sdk_span": '`subprocess.run(["/bin/true"])`, instead: a hand-made OpenTelemetry SDK span per child',
    "sync_run_sentry": '`subprocess.run(["/bin/true"])`, instead: sentry-sdk `StdlibIntegration`',
    "sync_run_ddtrace": '`subprocess.run(["/bin/true"])`, instead: ddtrace `subprocess` integration (appsec on)',
}
# stallwatch.spawn.loop of each series' spans
SERIES_LOOP = {"async_spawn_call": "asyncio", "async_roundtrip": "asyncio", "sync_run": "none"}
RSS_BYTES = {"rss0": 0, "rss1g": 1 << 30}
WARMUPS = 10
BASELINE = "uvloop_native"
OVERHEAD_BASELINE = "uninstrumented"
OVERHEAD_TARGET = 1.02
EXPECTED_METHOD = {"uvloop_native": "fork", "uvloop_vfork": "vfork", "asyncio": "vfork"}
CONFIG_ENV = {
    "uvloop_native": {"STALLWATCH_UVLOOP_SPAWN": "fork"},
    "uvloop_vfork": {"STALLWATCH_UVLOOP_SPAWN": "vfork"},
    "uninstrumented": {"STALLWATCH_INSTRUMENT_SUBPROCESS": "false"},
}
SPAN_NAME = "true"
BLOCKED_KEY = "stallwatch.spawn.blocked_seconds"
METHOD_KEY = "stallwatch.spawn.method"
LOOP_KEY = "stallwatch.spawn.loop"
FALLBACK_KEY = "stallwatch.spawn.fallback"
DEVNULL = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("uvloop", "opentelemetry-api", "opentelemetry-sdk", "wrapt", "stallwatch", "sentry-sdk", "ddtrace")


# ---- worker: one configuration in a fresh interpreter ----------------------------------------


def run_loop(kind: str, coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run `coroutine` to completion on a new uvloop loop (`kind` "uvloop") or standard asyncio loop."""
    if kind == "uvloop":
        import uvloop  # after stallwatch.setup(): its import hooks patch uvloop.Loop as it loads

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coroutine)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def spawn_once() -> float:
    """One spawn; returns the seconds the call blocked (the wait for exit is not counted)."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec("/bin/true", **DEVNULL)
    elapsed = time.perf_counter() - start
    returncode = await proc.wait()
    if returncode != 0:
        raise RuntimeError(f"/bin/true exited with {returncode}")
    return elapsed


async def spawn_series(spawns: int, ticker: Ticker) -> dict[str, Any]:
    for _ in range(WARMUPS):
        await spawn_once()
    ticker.max_gap = 0.0
    times = [await spawn_once() for _ in range(spawns)]
    return {
        "loop": type(asyncio.get_running_loop()).__module__,
        "spawn_ms": [t * 1000 for t in times],
        "ticker_max_gap_ms": ticker.max_gap * 1000,
    }


async def roundtrip_once() -> tuple[float, float]:
    """One spawn and wait for exit; returns the seconds of the spawn call and of the whole round trip."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec("/bin/true", **DEVNULL)
    spawned = time.perf_counter() - start
    returncode = await proc.wait()
    elapsed = time.perf_counter() - start
    if returncode != 0:
        raise RuntimeError(f"/bin/true exited with {returncode}")
    return spawned, elapsed


def flush_spans() -> float:
    """Export every span queued so far (the batch processor's own timer fires every 5 s, so without
    this an export lands in one series or another by chance); returns the process CPU ms it took."""
    from opentelemetry import trace

    cpu = time.process_time()
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush(10_000)
    return (time.process_time() - cpu) * 1000


def cpu_figures(series: str, samples: int, cpu_ms: float, flush_ms: float) -> dict[str, float]:
    """Process CPU per round trip: the series alone, and with the export of its spans."""
    return {f"{series}_cpu_ms": (cpu_ms + flush_ms) / samples, f"{series}_export_cpu_ms": flush_ms / samples}


async def roundtrip_series(samples: int) -> dict[str, Any]:
    for _ in range(WARMUPS):
        await roundtrip_once()
    flush_spans()
    cpu = time.process_time()
    pairs = [await roundtrip_once() for _ in range(samples)]
    cpu_ms = (time.process_time() - cpu) * 1000
    figures = cpu_figures("async_roundtrip", samples, cpu_ms, flush_spans())
    return {
        "async_spawn_call_ms": [spawned * 1000 for spawned, _ in pairs],
        "async_roundtrip_ms": [elapsed * 1000 for _, elapsed in pairs],
        **figures,
        # The spawn calls are part of the round trips: same CPU and spans.
        **{key.replace("async_roundtrip", "async_spawn_call"): value for key, value in figures.items()},
    }


def run_once() -> float:
    start = time.perf_counter()
    subprocess.run(["/bin/true"], check=True)
    return time.perf_counter() - start


def run_series(samples: int) -> dict[str, Any]:
    for _ in range(WARMUPS):
        run_once()
    flush_spans()
    cpu = time.process_time()
    times = [run_once() * 1000 for _ in range(samples)]
    cpu_ms = (time.process_time() - cpu) * 1000
    return {"sync_run_ms": times, **cpu_figures("sync_run", samples, cpu_ms, flush_spans())}


def span_summary(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """What the instrumentation recorded for these spans: blocked ms, methods, loops, fallbacks."""
    return {
        "span_count": len(spans),
        "span_blocked_ms": [s[BLOCKED_KEY] * 1000 for s in spans if BLOCKED_KEY in s],
        "span_methods": dict(Counter(str(s.get(METHOD_KEY)) for s in spans)),
        "span_loops": dict(Counter(str(s.get(LOOP_KEY)) for s in spans)),
        "span_fallbacks": dict(Counter(str(s[FALLBACK_KEY]) for s in spans if FALLBACK_KEY in s)),
    }


def worker(config: str, rss: str, count: int) -> dict[str, Any]:
    """Run one configuration in this (fresh) interpreter and return its raw numbers."""
    import stallwatch  # first, as a server's first import: before OpenTelemetry and uvloop

    file_dir = Path(tempfile.mkdtemp(prefix="bench_subprocess_"))
    try:
        stallwatch.setup(file_dir=str(file_dir), watchdog=False, metric_export_interval_ms=3600000)
        ballast = touch_memory(RSS_BYTES[rss])
        result: dict[str, Any] = {"config": config, "rss": rss, "ballast_bytes": len(ballast), "vm_rss_mb": vm_rss_mb()}
        if config in BLOCKED_CONFIGS:
            ticker = Ticker()
            ticker.start()
            result |= run_loop("asyncio" if config == "asyncio" else "uvloop", spawn_series(count, ticker))
        else:
            result |= run_loop("asyncio", roundtrip_series(count))
            result |= run_series(count)
        del ballast
        stallwatch.shutdown(10)
        spans = read_spans(file_dir / "traces.jsonl", SPAN_NAME)
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)
    if config in BLOCKED_CONFIGS:
        result |= span_summary(spans[WARMUPS:])  # the warm-ups come first
    else:
        for series in SERIES:
            mine = [s for s in spans if s.get(LOOP_KEY) == SERIES_LOOP[series]]
            summary = span_summary(mine[WARMUPS:])
            result[f"{series}_spans"] = {"span_count": len(mine), "span_methods": summary["span_methods"]}
    return result


# Floors for `subprocess.run`, arms of the same groups as the instrumentor (which is off during
# their blocks): what any wrapper of Popen costs right after a spawn.
FLOOR_SERIES = ("sync_run_floor_clock", "sync_run_floor_capture")
BLOCK = 25


class PopenFloor:
    """Wrappers of `Popen.__init__` and `Popen._handle_exitstatus` (wrapt, as stallwatch's) that do
    only the least a span per child needs, for the paired floor series.

    `clock`: two clock reads around the spawn kept on the Popen, and the exit's time and code
    appended to a deque. `capture`: also what stallwatch's calling thread must keep for the span it
    builds elsewhere: the caller's OpenTelemetry context, the running loop, the arguments, the
    start's wall time, the pid, a context variable set during the spawn (how stallwatch tells a
    Popen's own posix_spawn apart); the record goes to a deque at the spawn and again at the exit.
    Nothing is built from the records.
    """

    def __init__(self, capture: bool) -> None:
        import contextvars
        from collections import deque

        self.capture = capture
        self.records: deque[Any] = deque(maxlen=64)  # about what stallwatch's builder holds between its runs
        self.inside: contextvars.ContextVar[Any] = contextvars.ContextVar("floor_inside", default=None)
        self.on = False

    def _init(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.capture:
            start = time.perf_counter()
            wrapped(*args, **kwargs)
            instance._floor = (start, time.perf_counter())
            return
        from asyncio.events import _get_running_loop

        from opentelemetry import context

        record = [args, kwargs, context.get_current(), _get_running_loop(), time.time_ns(), 0.0, 0.0, None]
        token = self.inside.set(record)
        start = time.perf_counter()
        wrapped(*args, **kwargs)
        record[6] = time.perf_counter() - start
        self.inside.reset(token)
        record[5], record[7] = start, instance.pid
        instance._floor = record
        self.records.append(record)

    def _reaped(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        if instance.returncode is not None:
            record = getattr(instance, "_floor", None)
            if record is not None:
                instance._floor = None
                self.records.append((record, instance.returncode, time.time_ns(), time.perf_counter()))
        return result

    def switch(self, on: bool) -> None:
        import wrapt
        from opentelemetry.instrumentation.utils import unwrap

        if on == self.on:
            return
        self.on = on
        if on:
            wrapt.wrap_function_wrapper(subprocess.Popen, "__init__", self._init)
            wrapt.wrap_function_wrapper(subprocess.Popen, "_handle_exitstatus", self._reaped)
        else:
            unwrap(subprocess.Popen, "__init__")
            unwrap(subprocess.Popen, "_handle_exitstatus")


class Alternative:
    """Another package's subprocess instrumentation, installed once by `install()` (none of them can
    be taken off again), then switched on and off by swapping the attributes the installation
    changed on `subprocess.Popen` and `os`. `enter()`/`leave()` run when it is switched on/off,
    outside the timed calls (sentry-sdk's transaction per block)."""

    OWNERS = (subprocess.Popen, os)

    def __init__(self, install: Any, enter: Any = None, leave: Any = None) -> None:
        before = self._snapshot()
        install()
        after = self._snapshot()
        self.changes = [(key, before.get(key), value) for key, value in after.items() if before.get(key) is not value]
        self.enter, self.leave = enter, leave
        self.on = False
        self._apply(on=False)

    def _snapshot(self) -> dict[tuple[int, str], Any]:
        owners = enumerate(self.OWNERS)
        return {(number, name): value for number, owner in owners for name, value in vars(owner).items()}

    def _apply(self, on: bool) -> None:
        for (number, name), off_value, on_value in self.changes:
            value = on_value if on else off_value
            if value is None:
                delattr(self.OWNERS[number], name)
            else:
                setattr(self.OWNERS[number], name, value)

    def switch(self, on: bool) -> None:
        if on == self.on:
            return
        self.on = on
        if not on and self.leave is not None:
            self.leave()
        self._apply(on)
        if on and self.enter is not None:
            self.enter()


def handmade_sdk_span() -> Alternative:
    """A span per child as a user would write it: the SDK's `start_span` at the spawn, `end()` at the exit."""
    import wrapt
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    tracer = trace.get_tracer("bench.handmade")

    def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        argv = args[0] if args else kwargs["args"]
        name = os.path.basename(str(argv[0]))
        span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes={"process.executable.name": name,
                                                                          "process.args_count": len(argv)})  # fmt: skip
        try:
            wrapped(*args, **kwargs)
        except BaseException:
            span.end()
            raise
        span.set_attribute("process.pid", instance.pid)
        instance._bench_span = span

    def reaped(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        span = getattr(instance, "_bench_span", None)
        if span is not None and instance.returncode is not None:
            instance._bench_span = None
            span.set_attribute("process.exit.code", instance.returncode)
            span.end()
        return result

    def install() -> None:
        wrapt.wrap_function_wrapper(subprocess.Popen, "__init__", init)
        wrapt.wrap_function_wrapper(subprocess.Popen, "_handle_exitstatus", reaped)

    return Alternative(install)


def sentry() -> Alternative | None:
    try:
        import sentry_sdk
        from sentry_sdk.integrations.stdlib import StdlibIntegration
        from sentry_sdk.transport import Transport
    except ImportError:
        return None

    class Discard(Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            return

    def install() -> None:
        sentry_sdk.init(dsn="http://public@127.0.0.1:9/1", traces_sample_rate=1.0, transport=Discard,
                        default_integrations=False, auto_enabling_integrations=False,
                        integrations=[StdlibIntegration()])  # fmt: skip

    transactions: list[Any] = []

    def enter() -> None:
        transactions.append(sentry_sdk.start_transaction(name="bench", op="bench").__enter__())

    def leave() -> None:
        transactions.pop().__exit__(None, None, None)

    return Alternative(install, enter, leave)


def ddtrace() -> Alternative | None:
    os.environ.update({"DD_APPSEC_ENABLED": "true", "DD_TRACE_AGENT_URL": "http://127.0.0.1:9"})
    try:
        from ddtrace import patch
    except ImportError:
        return None
    return Alternative(lambda: patch(subprocess=True))


ALTERNATIVES = {"sync_run_sdk_span": handmade_sdk_span, "sync_run_sentry": sentry, "sync_run_ddtrace": ddtrace}


def sync_run_arms(stallwatch_switch: Callable[[bool], None]) -> dict[str, Callable[[bool], None]]:
    """The arms of the `subprocess.run` groups, all off: stallwatch's instrumentor, the floors, and
    each alternative whose package is installed. Each alternative installs while all the others are
    off, so the changes it swaps are its own alone (and ddtrace does not patch a `Popen.__init__`
    that is already wrapped)."""
    stallwatch_switch(False)
    arms = {"sync_run": stallwatch_switch}
    for series, floor in zip(FLOOR_SERIES, (PopenFloor(capture=False), PopenFloor(capture=True)), strict=True):
        arms[series] = floor.switch
    for series, make in ALTERNATIVES.items():
        alternative = make()
        if alternative is not None:
            arms[series] = alternative.switch
    return arms


def paired_worker(pairs: int, seed: int) -> dict[str, Any]:
    """The `instrumented` setup: round trips with the subprocess instrumentor switched on and off in
    pairs of blocks, then `subprocess.run` in groups of blocks, one with everything off and one per arm
    on (`run_arms`: the instrumentor, the floors, the alternatives); µs per call."""
    import stallwatch

    file_dir = tempfile.mkdtemp(prefix="bench_subprocess_")
    stallwatch.setup(file_dir=file_dir, watchdog=False, metric_export_interval_ms=3600000)
    from stallwatch.instrument.subprocess import SubprocessInstrumentor

    switch = switch_for(SubprocessInstrumentor())

    async def roundtrip() -> None:
        await roundtrip_once()

    async def run() -> None:  # subprocess.run from a coroutine, as a server's blocking helper would
        run_once()

    async def warm_up(call: Callable[[], Coroutine[Any, Any, None]], arms: list[Callable[[bool], None]]) -> None:
        """`WARMUPS` untimed calls with each arm on in turn, so that what an arm does only once (a lazy
        import, a first transaction) lands in no block."""
        for arm in arms:
            arm(True)
            for _ in range(WARMUPS):
                await call()
            arm(False)

    async def main() -> dict[str, Any]:
        await warm_up(roundtrip, [switch])
        result = {"async_roundtrip": await run_blocks(roundtrip, switch, pairs, BLOCK, seed)}
        # Installed only now, so nothing of theirs ran during the round trips.
        arms = sync_run_arms(switch)
        await warm_up(run, list(arms.values()))
        result |= await run_arms(run, arms, pairs, BLOCK, seed)
        for arm in arms.values():
            arm(False)
        return result

    try:
        return run_loop("asyncio", main())
    finally:
        stallwatch.shutdown(10)
        shutil.rmtree(file_dir, ignore_errors=True)


def run_paired(pairs: int, processes: int) -> dict[str, Any]:
    me = str(Path(__file__).resolve())
    return run_processes([[sys.executable, me, "--paired-worker", str(pairs), str(n)] for n in range(processes)], 900)


# ---- runner: interleaved rounds of workers, aggregation, report -------------------------------


def run_worker(config: str, rss: str, count: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, rss, str(count)]
    env = clean_env() | CONFIG_ENV.get(config, {})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    return worker_result(proc, f"worker {config} {rss}")


def schedule(rss_variants: list[str], rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, config, rss) in run order: every round runs all pairs, rotated by one per round."""
    pairs = [(config, rss) for rss in rss_variants for config in BLOCKED_CONFIGS]
    pairs += [(config, "rss0") for config in OVERHEAD_CONFIGS]
    for number, (config, rss) in rotated(pairs, rounds):
        yield number, config, rss


@dataclass
class BlockedRow:
    config: str
    rss: str
    p50_ms: float
    p99_ms: float
    mean_ms: float
    ticker_max_gap_ms: float
    round_p50_ms: list[float]
    span_count: int
    span_p50_ms: float
    span_methods: dict[str, int]
    span_fallbacks: dict[str, int]
    p50_ratio: float = float("nan")
    p99_ratio: float = float("nan")
    span_to_stopwatch: float = float("nan")


@dataclass
class OverheadRow:
    series: str
    config: str
    p50_ms: float
    p99_ms: float
    mean_ms: float
    round_p50_ms: list[float]
    cpu_ms: float
    export_cpu_ms: float
    span_count: int
    span_methods: dict[str, int] = field(default_factory=dict)
    p50_ratio: float = float("nan")
    mean_ratio: float = float("nan")
    cpu_ratio: float = float("nan")
    cpu_added_us: float = float("nan")
    round_p50_ratios: list[float] = field(default_factory=list)
    round_p50_ratio_median: float = float("nan")


def merge_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)


def summarize_blocked(runs: list[dict[str, Any]], rss_variants: list[str]) -> list[BlockedRow]:
    """Pool the samples of every (config, rss) across rounds; ratios against uvloop_native, same rss."""
    rows = []
    for rss in rss_variants:
        for config in BLOCKED_CONFIGS:
            mine = [run for run in runs if run["config"] == config and run["rss"] == rss]
            samples = [ms for run in mine for ms in run["spawn_ms"]]
            span_samples = [ms for run in mine for ms in run["span_blocked_ms"]]
            rows.append(
                BlockedRow(
                    config,
                    rss,
                    statistics.median(samples),
                    p99(samples),
                    statistics.fmean(samples),
                    max(run["ticker_max_gap_ms"] for run in mine),
                    [statistics.median(run["spawn_ms"]) for run in mine],
                    sum(run["span_count"] for run in mine),
                    statistics.median(span_samples) if span_samples else float("nan"),
                    merge_counts([run["span_methods"] for run in mine]),
                    merge_counts([run["span_fallbacks"] for run in mine]),
                )
            )
    baselines = {row.rss: row for row in rows if row.config == BASELINE}
    for row in rows:
        row.p50_ratio = row.p50_ms / baselines[row.rss].p50_ms
        row.p99_ratio = row.p99_ms / baselines[row.rss].p99_ms
        row.span_to_stopwatch = row.span_p50_ms / row.p50_ms
    return rows


def summarize_overhead(runs: list[dict[str, Any]]) -> list[OverheadRow]:
    """Pool every (series, config) across rounds; ratios instrumented / uninstrumented."""
    rows = []
    for series in SERIES:
        for config in OVERHEAD_CONFIGS:
            mine = [run for run in runs if run["config"] == config]
            samples = [ms for run in mine for ms in run[f"{series}_ms"]]
            rows.append(
                OverheadRow(
                    series,
                    config,
                    statistics.median(samples),
                    p99(samples),
                    statistics.fmean(samples),
                    [statistics.median(run[f"{series}_ms"]) for run in mine],
                    statistics.median(run[f"{series}_cpu_ms"] for run in mine),
                    statistics.median(run[f"{series}_export_cpu_ms"] for run in mine),
                    sum(run[f"{series}_spans"]["span_count"] for run in mine),
                    merge_counts([run[f"{series}_spans"]["span_methods"] for run in mine]),
                )
            )
    baselines = {row.series: row for row in rows if row.config == OVERHEAD_BASELINE}
    for row in rows:
        row.p50_ratio = row.p50_ms / baselines[row.series].p50_ms
        row.mean_ratio = row.mean_ms / baselines[row.series].mean_ms
        row.cpu_ratio = row.cpu_ms / baselines[row.series].cpu_ms
        row.cpu_added_us = (row.cpu_ms - baselines[row.series].cpu_ms) * 1000
        pairs = zip(row.round_p50_ms, baselines[row.series].round_p50_ms, strict=True)
        row.round_p50_ratios = [mine / base for mine, base in pairs]
        row.round_p50_ratio_median = statistics.median(row.round_p50_ratios)
    return rows


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "-"


def method_checks(rows: list[BlockedRow], overhead: list[OverheadRow]) -> list[str]:
    """Sentences for whatever the spans show that the configuration did not mean to do."""
    problems = []
    for row in rows:
        expected = EXPECTED_METHOD[row.config]
        if not row.span_count:
            problems.append(f"`{row.config}` {row.rss}: no `true` span was recorded.")
        elif set(row.span_methods) != {expected}:
            problems.append(
                f"`{row.config}` {row.rss}: `stallwatch.spawn.method` is {counts_text(row.span_methods)}, "
                f"expected only `{expected}`."
            )
        if row.span_fallbacks:
            problems.append(f"`{row.config}` {row.rss}: fallbacks to uvloop's fork: {counts_text(row.span_fallbacks)}.")
    for row in overhead:
        if row.config == "uninstrumented" and row.span_count:
            problems.append(f"`uninstrumented` {row.series}: {row.span_count} spans recorded (expected none).")
        if row.config == "instrumented" and not row.span_count:
            problems.append(f"`instrumented` {row.series}: no span recorded.")
    return problems


def render_markdown(
    rows: list[BlockedRow],
    overhead: list[OverheadRow],
    paired: dict[str, Any],
    info: dict[str, Any],
    settings: dict[str, Any],
) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    ratio = {(r.config, r.rss): r for r in rows}
    lines = [
        "# Subprocess spawns under stallwatch: blocked time per spawn, and the wrapper's overhead",
        "",
        f"Generated by `{command_line(__file__, [])}` "
        f"(spawns={settings['spawns']}, samples={settings['samples']}, each after {settings['warmups']} "
        f"warm-ups, rounds={settings['rounds']}). Each configuration runs in a fresh interpreter that "
        "imports `stallwatch` first and calls `stallwatch.setup(file_dir=<tmp>, watchdog=False, "
        "metric_export_interval_ms=3600000)`. Runs are **interleaved**: every round runs all "
        "configurations of both parts in an order rotated by one per round, and samples are pooled "
        "per configuration across rounds, so background noise on this shared machine hits all of "
        "them alike.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}{' (src modified)' if info['git_dirty'] else ''}; {info['date']}.",
        "",
        '## 1. Blocked time of `await asyncio.create_subprocess_exec("/bin/true", ...DEVNULL)`',
        "",
        "The call, not the wait for exit. `uvloop_native`: uvloop's own fork (`STALLWATCH_UVLOOP_SPAWN=fork`, "
        "the baseline of the ratios, same rss); `uvloop_vfork`: uvloop with `STALLWATCH_UVLOOP_SPAWN=vfork` (spawns go "
        'through `subprocess.Popen`, vfork); `asyncio`: the standard loop. "span p50" is the median '
        "`stallwatch.spawn.blocked_seconds` the instrumentation itself recorded on the same spawns "
        '(read back from `traces.jsonl`), and "span / stopwatch" its ratio to the outside '
        "stopwatch's p50. Target: `uvloop_vfork` far below `uvloop_native`, and flat in rss.",
        "",
        "| config | rss | p50 ms | p99 | mean | ticker max gap ms | p50 / uvloop_native "
        "| p99 / uvloop_native | span p50 ms | span / stopwatch | spans | spawn.method |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.config} | {r.rss} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.mean_ms:.2f} | {r.ticker_max_gap_ms:.1f} "
        f"| {r.p50_ratio:.2f}x | {r.p99_ratio:.2f}x | {r.span_p50_ms:.2f} | {r.span_to_stopwatch:.2f}x "
        f"| {r.span_count} | {counts_text(r.span_methods)} |"
        for r in rows
    ]
    lines += ["", "Key ratios (p50 / p99):", ""]
    for rss in settings["rss"]:
        for config in BLOCKED_CONFIGS:
            if config == BASELINE:
                continue
            r = ratio[(config, rss)]
            lines.append(
                f"- `{config}` vs `{BASELINE}`, {rss}: p50 {r.p50_ratio:.2f}x, p99 {r.p99_ratio:.2f}x "
                f"({r.p50_ms:.2f} vs {ratio[(BASELINE, rss)].p50_ms:.2f} ms p50)."
            )
    lines += ["", "Median of each round's own p50 (ms), in round order, to show the run-to-run noise:", ""]
    lines += [f"- {r.config} {r.rss}: " + ", ".join(f"{ms:.2f}" for ms in r.round_p50_ms) for r in rows]
    lines += [
        "",
        "## 2. Wrapper overhead: instrumented / uninstrumented (rss0)",
        "",
        f"**Paired** ({settings['processes']} interpreters x {settings['pairs']} pairs of blocks of "
        f"{BLOCK} round trips, the subprocess instrumentor switched on and off inside each; see "
        "`_paired.py`): median per-pair ratio on / off, its 95 % bootstrap interval, and the median "
        f"added per round trip. The `subprocess.run` rows run in {settings['pairs']} groups of blocks "
        "in the same interpreters, one block with everything off and one per row with it alone on, "
        "shuffled per group, each row's ratio against its group's off block: the rows are measured "
        "at the same moments.",
        "",
    ]
    lines += table(
        paired, SERIES_TITLES.__getitem__, f"≤ {OVERHEAD_TARGET:.2f}", lambda found: verdict(found, OVERHEAD_TARGET)
    )
    lines += [
        "",
        "The two floor rows switch a bare-minimum wrapper of `Popen` on instead of the "
        "instrumentor (which is off in their blocks): `clock` only times the spawn, `capture` also keeps "
        "what stallwatch's calling thread must keep for a span per child (the caller's context, loop, "
        "arguments, start time, pid, return code) and builds nothing (`PopenFloor`). A floor at or "
        "above the target means no wrapper of this kind can meet it on this machine. The `instead` "
        "rows switch on what a user would pick instead of stallwatch (`Alternative`): a hand-made "
        "SDK span per child, sentry-sdk and ddtrace (see the module docstring); stallwatch's "
        "`subprocess.run` row above is to be read against them.",
    ]
    lines += [
        "",
        "Per configuration, each in its own interpreter:",
        "",
        "`instrumented`: the setup above; `uninstrumented`: the same setup with "
        "`STALLWATCH_INSTRUMENT_SUBPROCESS=false`. Both series run in the same worker (the async one "
        "first, on a standard asyncio loop). Target: ratio of p50 and of mean ≤ "
        f"{OVERHEAD_TARGET:.2f} (at most {round((OVERHEAD_TARGET - 1) * 100)}% added).",
        "",
        "| series | config | p50 ms | p99 | mean | p50 ratio | mean ratio | median of round p50 ratios "
        "| within target | CPU ms | of which export | CPU ratio | CPU added µs | spans |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in overhead:
        within = "yes" if max(r.p50_ratio, r.mean_ratio) <= OVERHEAD_TARGET else "**no**"
        if r.config == OVERHEAD_BASELINE:
            within = ""
        lines.append(
            f"| {SERIES_TITLES[r.series]} | {r.config} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | {r.mean_ms:.3f} "
            f"| {r.p50_ratio:.3f}x | {r.mean_ratio:.3f}x | {r.round_p50_ratio_median:.3f}x | {within} "
            f"| {r.cpu_ms:.3f} | {r.export_cpu_ms:.3f} | {r.cpu_ratio:.2f}x | {r.cpu_added_us:.0f} | {r.span_count} |"
        )
    lines += ["", f"Key ratios, instrumented / uninstrumented (target ≤ {OVERHEAD_TARGET:.2f}):", ""]
    lines += [
        f"- {SERIES_TITLES[r.series]}: p50 {r.p50_ratio:.3f}x, mean {r.mean_ratio:.3f}x, median of round "
        f"p50 ratios {r.round_p50_ratio_median:.3f}x, process CPU {r.cpu_ratio:.2f}x (+{r.cpu_added_us:.0f} µs "
        f"per round trip): target {'met' if max(r.p50_ratio, r.mean_ratio) <= OVERHEAD_TARGET else 'NOT met'}."
        for r in overhead
        if r.config != OVERHEAD_BASELINE
    ]
    lines += [
        "",
        '"within target": both the pooled p50 ratio and the pooled mean ratio ≤ '
        f'{OVERHEAD_TARGET:.2f}. "CPU ms": CPU time of the whole worker process (all its threads, '
        "not the children's) per round trip, the median over the runs, including the export of the "
        "series' spans (queued spans are flushed before each series, outside the figure, and once "
        'after it, inside; "of which export" is that last flush). CPU time is '
        "far less sensitive than wall time to the scheduling noise of a shared machine. Median of "
        "each round's own p50 (ms), in round order, and the instrumented / uninstrumented ratio of "
        "each round:",
        "",
    ]
    lines += [f"- {r.series} {r.config}: " + ", ".join(f"{ms:.3f}" for ms in r.round_p50_ms) for r in overhead]
    lines += [
        f"- {r.series} ratio per round: " + ", ".join(f"{x:.3f}x" for x in r.round_p50_ratios)
        for r in overhead
        if r.config != OVERHEAD_BASELINE
    ]
    problems = method_checks(rows, overhead)
    lines += ["", "Checks on the recorded spans: " + (" ".join(problems) if problems else "all as expected "
              "(`stallwatch.spawn.method` is `fork` for `uvloop_native` and `vfork` for the others, no "
              "fallback, no span when uninstrumented).")]  # fmt: skip
    return "\n".join(lines) + "\n"


def benchmark(
    spawns: int, samples: int, rounds: int, rss_variants: list[str], pairs: int, processes: int, out: Path
) -> str:
    """Run every round, write raw/subprocess.json and subprocess.md into `out`, return the markdown."""
    info = machine_info(VERSIONED)
    runs = []
    for number, config, rss in schedule(rss_variants, rounds):
        run = run_worker(config, rss, spawns if config in BLOCKED_CONFIGS else samples)
        run["round"] = number
        runs.append(run)
        if config in BLOCKED_CONFIGS:
            detail = f"p50 {statistics.median(run['spawn_ms']):6.2f} ms, span p50 " + (
                f"{statistics.median(run['span_blocked_ms']):6.2f} ms" if run["span_blocked_ms"] else "-"
            )
        else:
            detail = ", ".join(f"{series} p50 {statistics.median(run[f'{series}_ms']):.3f} ms" for series in SERIES)
        print(f"round {number} {config:<14} {rss:<5} {detail}", file=sys.stderr)
    paired = run_paired(pairs, processes)
    blocked_runs = [run for run in runs if run["config"] in BLOCKED_CONFIGS]
    overhead_runs = [run for run in runs if run["config"] in OVERHEAD_CONFIGS]
    rows = summarize_blocked(blocked_runs, rss_variants)
    overhead = summarize_overhead(overhead_runs)
    settings = {"spawns": spawns, "samples": samples, "warmups": WARMUPS, "rounds": rounds, "rss": rss_variants,
                "pairs": pairs, "processes": processes}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": info,
        "settings": settings,
        "blocked": [asdict(r) for r in rows],
        "overhead": [asdict(r) for r in overhead],
        "paired": paired,
        "checks": method_checks(rows, overhead),
        "runs": runs,
    }
    raw_path(out, "subprocess.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(rows, overhead, paired, info, settings)
    (out / "subprocess.md").write_text(markdown)
    return markdown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--spawns", type=int, help="spawns per blocked-time run (default 200; 20 with --quick)")
    parser.add_argument("--samples", type=int, help="round trips per overhead series (default 300; 50 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 10; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: few spawns, one round, rss0 only")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--pairs", type=int, help="on/off block pairs per paired process (default 30; 4 with --quick)")
    parser.add_argument("--processes", type=int, help="paired interpreters (default 4; 1 with --quick)")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "RSS", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--paired-worker", nargs=2, metavar=("PAIRS", "SEED"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        config, rss, count = args.worker
        print(json.dumps(worker(config, rss, int(count))))
        return
    if args.paired_worker:
        pairs, seed = args.paired_worker
        print(json.dumps(paired_worker(int(pairs), int(seed))))
        return
    spawns = args.spawns or (20 if args.quick else 200)
    samples = args.samples or (50 if args.quick else 300)
    rounds = args.rounds or (1 if args.quick else 10)
    rss_variants = ["rss0"] if args.quick else list(RSS_BYTES)
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_subprocess_")) if args.quick else DEFAULT_OUT)
    pairs = args.pairs or (4 if args.quick else 30)
    processes = args.processes or (1 if args.quick else 4)
    print(benchmark(spawns, samples, rounds, rss_variants, pairs, processes, out))
    print(f"results: {raw_path(out, 'subprocess.json')}, {out / 'subprocess.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
