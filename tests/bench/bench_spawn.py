"""Spawn-freeze benchmark: how long one subprocess spawn blocks the calling thread.

Run from the repository root, in the bench environment (tests/bench/README.md: the peers are
installed there)::

    .venvs/bench/bin/python tests/bench/bench_spawn.py --load incident   # against the peers, ~6 min
    .venvs/bench/bin/python tests/bench/bench_spawn.py --load roundtrip  # spawn + wait, the peers, ~2 min
    .venvs/bench/bin/python tests/bench/bench_spawn.py                   # one spawn at a time, 1 GiB too
    .venvs/bench/bin/python tests/bench/bench_spawn.py --quick           # smoke test, < 30 s, temp dir

``--load incident`` is the freeze incident's load: in one uvloop process, 4 coroutines spawn
``/bin/true`` (and wait for it) in a loop while 4 coroutines call a gRPC echo server (another
process, started by the runner) through ``grpc.aio``, for ``--seconds`` (default 20) per run. It
reports the p50 of the time each ``create_subprocess_exec`` call blocks the loop, and its ratio to
``no_otel``, for these configurations (each in a fresh interpreter, interleaved, ``--rounds``
rounds, default 3; exporters send OTLP/HTTP or Sentry envelopes to a loopback receiver that
answers 200):

- ``no_otel``: uvloop, no telemetry at all (the baseline).
- ``stallwatch``: ``import stallwatch.auto`` first, its default set-up (OTLP/HTTP for the three
  signals) (vfork spawning under uvloop, the default).
- ``stock_otel``: the stock SDK with OTLP/HTTP for the three signals, opentelemetry-instrumentation-grpc's
  ``grpc.aio`` client instrumentor, and a span around each spawn.
- ``sentry``: ``sentry_sdk.init(traces_sample_rate=1.0)`` with its default integrations (the
  subprocess one included), each spawn inside a transaction.
- ``ddtrace``: ``import ddtrace.auto`` (grpc and subprocess patched), each spawn inside a span.
- ``asyncio``: the standard asyncio loop, no telemetry.

Results go to ``spawn-incident.md`` (committed) and ``raw/spawn-incident.json``.

``--load roundtrip`` is the round trip of one spawn on uvloop, against the peers: ``await
asyncio.create_subprocess_exec("/bin/true", ...DEVNULL)`` + ``await proc.wait()``, one at a time,
timed from entering the arm's own wrapper (its span or transaction) to leaving it, and the call
alone; the ticker below records the loop's longest stall. ``--spawns`` (default 200, 30 with
``--quick``) per run after 10 warm-ups, ``--rounds`` (default 5, 2 with ``--quick``) interleaved
rounds, each arm in a fresh interpreter:

- ``no_otel``: bare uvloop (the baseline).
- ``stallwatch``: ``import stallwatch`` first, ``setup(file_dir=<tmp>, watchdog=False)``: its default
  vfork spawn and its span per spawn, counted (with their ``stallwatch.spawn.method``) from the
  traces file after ``shutdown()``.
- ``stallwatch_fork``: the same with ``STALLWATCH_UVLOOP_SPAWN=fork``.
- ``stock_otel``: the stock SDK (OTLP/HTTP for the three signals to a loopback receiver that answers
  200) and a hand-made span around each create + wait, as a user would write.
- ``sentry``: ``sentry_sdk.init(traces_sample_rate=1.0)``, default integrations, a transport that
  counts the subprocess spans of each transaction and drops it; a transaction per spawn.
- ``ddtrace``: ``import ddtrace.auto`` with ``DD_APPSEC_ENABLED=true`` (its subprocess integration
  makes no span without it), a trace filter counting its ``command_execution`` spans; a span per
  spawn.

uvloop spawns with its own fork and exec, not through ``subprocess.Popen``, so the peers'
subprocess integrations see nothing of it; each peer worker therefore ends with a control, one
``subprocess.run`` inside its wrapper, to show that its counter does see Popen's spans. This is a
mode of this script rather than a section of ``bench_subprocess.py``: it needs the bench
environment's peers and the per-interpreter arms this script has; on uvloop a peer's cost lies in
what its SDK does at uvloop's fork (at-fork handlers, a bigger process), which only separate
interpreters can compare, not ``bench_subprocess``'s on/off switch of a Popen wrapper in one
interpreter. Results go to ``spawn-roundtrip.md`` (committed) and ``raw/spawn-roundtrip.json``.

Options: ``--spawns N`` measured spawns per run (default 200, after 10 warm-ups), ``--rounds R``
(default 3), ``--quick`` (20 spawns, 1 round, ``rss0`` only), ``--out DIR`` (default
``tests/bench/results``; with ``--quick``, a fresh temporary directory). Writes ``raw/spawn.json``
(raw numbers and machine info) and ``spawn.md`` (the table) to the output directory.

"Frozen time" is the wall time of ``await asyncio.create_subprocess_exec("/bin/true", ...)`` with
stdin/stdout/stderr on DEVNULL: the call itself, not the wait for exit. uvloop forks there and
holds the GIL until the child execs (incident 000), so a ticker thread that sleeps 1 ms in a
loop also records its largest gap. Configurations, each run in its own fresh interpreter:

- ``no_otel``: uvloop, no OpenTelemetry.
- ``stock_otel``: uvloop; the host builds a stock SDK pipeline (TracerProvider + BatchSpanProcessor,
  MeterProvider + PeriodicExportingMetricReader, LoggerProvider + BatchLogRecordProcessor, console
  exporters writing to os.devnull), installs it globally and opens a span around each spawn.
- ``stallwatch``: as ``stock_otel``, but ``import stallwatch`` comes first (the worker imports only
  the standard library before it; OpenTelemetry and uvloop come after), which makes the host's
  pipeline fork-aware; after the host installs its providers it calls
  ``stallwatch.setup(providers="host", file_dir=<tmp>)``. We chose ``providers="host"`` so that the
  exporters, processors and span are identical to ``stock_otel``: the only difference is stallwatch,
  at its default uvloop spawn (``STALLWATCH_UVLOOP_SPAWN=vfork``: no fork of the host).
- ``stallwatch_fork``: as ``stallwatch``, with ``STALLWATCH_UVLOOP_SPAWN=fork``: uvloop's own fork,
  with stallwatch's fork-aware pipeline around it.
- ``otel_no_fork_hooks``: as ``stock_otel``, but the SDK registers no at-fork handler at all
  (``os.register_at_fork`` is a no-op while the host builds its pipeline): the floor any fork-aware
  OpenTelemetry setup can reach, since a loaded SDK alone makes the process bigger to fork.
- ``asyncio``: the standard asyncio loop (vfork, no at-fork handlers) with the ``stock_otel``
  pipeline: the baseline of what spawning without fork costs.

Each in two memory variants: ``rss0`` and ``rss1g`` (1 GiB allocated and one byte written per
4096-byte page, so it is resident; fork cost grows with RSS). The runs are interleaved: every
round runs all configurations, in an order rotated by one each round, and samples are pooled per
configuration across rounds, so background noise on a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _machine import (
    LoopbackReceiver,
    clean_env,
    command_line,
    install_stock_otlp,
    machine_info,
    p99,
    raw_path,
    read_spans,
    rotated,
    worker_result,
)

CONFIGS = ("no_otel", "otel_no_fork_hooks", "stock_otel", "stallwatch", "stallwatch_fork", "asyncio")
CONFIG_ENV = {"stallwatch_fork": {"STALLWATCH_UVLOOP_SPAWN": "fork"}}
RSS_BYTES = {"rss0": 0, "rss1g": 1 << 30}
PAGE = 4096
WARMUPS = 10
BASELINE = "no_otel"
FLOOR = "otel_no_fork_hooks"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("uvloop", "grpcio", "opentelemetry-api", "opentelemetry-sdk", "stallwatch")


# ---- worker: one configuration in a fresh interpreter ----------------------------------------


class Ticker(threading.Thread):
    """Sleeps 1 ms in a loop and keeps the largest gap between wake-ups (GIL held = big gap)."""

    def __init__(self) -> None:
        super().__init__(name="ticker", daemon=True)
        self.max_gap = 0.0

    def run(self) -> None:
        last = time.perf_counter()
        while True:
            time.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now


def build_host_pipeline() -> Any:
    """The stock SDK pipeline a host builds itself; returns a tracer from it."""
    from opentelemetry import _logs, metrics, trace
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs import export as log_export
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the providers
    # Named ConsoleLogRecordExporter since SDK 1.39, ConsoleLogExporter before.
    log_exporter = getattr(log_export, "ConsoleLogRecordExporter", None) or log_export.ConsoleLogExporter
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=devnull)))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=devnull))
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(log_export.BatchLogRecordProcessor(log_exporter(out=devnull)))
    _logs.set_logger_provider(logger_provider)
    return trace.get_tracer("bench_spawn")


def touch_memory(size: int) -> bytearray:
    """Allocate `size` bytes and write one byte per page so every page is resident."""
    ballast = bytearray(size)
    ballast[::PAGE] = b"\x01" * len(range(0, size, PAGE))
    return ballast


async def spawn_once(tracer: Any) -> float:
    """One spawn (inside a span when `tracer` is set); returns the seconds the call blocked."""
    with tracer.start_as_current_span("spawn") if tracer else contextlib.nullcontext():
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "/bin/true", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        elapsed = time.perf_counter() - start
        returncode = await proc.wait()
    if returncode != 0:
        raise RuntimeError(f"/bin/true exited with {returncode}")
    return elapsed


async def spawn_series(tracer: Any, spawns: int, ticker: Ticker) -> dict[str, Any]:
    for _ in range(WARMUPS):
        await spawn_once(tracer)
    ticker.max_gap = 0.0
    times = [await spawn_once(tracer) for _ in range(spawns)]
    return {
        "loop": type(asyncio.get_running_loop()).__module__,
        "spawn_ms": [t * 1000 for t in times],
        "ticker_max_gap_ms": ticker.max_gap * 1000,
    }


def vm_rss_mb() -> float:
    """Resident set size of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(config: str, rss: str, spawns: int) -> dict[str, Any]:
    """Run one configuration in this (fresh) interpreter and return its raw numbers."""
    if config.startswith("stallwatch"):
        import stallwatch  # before OpenTelemetry and uvloop, as a server's first import
    if config == FLOOR:
        register_at_fork = os.register_at_fork
        os.register_at_fork = lambda **handlers: None  # type: ignore[assignment]
        try:
            tracer = build_host_pipeline()
        finally:
            os.register_at_fork = register_at_fork
    else:
        tracer = None if config == BASELINE else build_host_pipeline()
    if config.startswith("stallwatch"):
        stallwatch.setup(providers="host", file_dir=tempfile.mkdtemp(prefix="bench_spawn_"))
    ballast = touch_memory(RSS_BYTES[rss])
    resident_mb = vm_rss_mb()
    ticker = Ticker()
    ticker.start()
    coroutine = spawn_series(tracer, spawns, ticker)
    if config == "asyncio":
        result = asyncio.run(coroutine)
    else:
        import uvloop

        result = uvloop.run(coroutine)
    return {"config": config, "rss": rss, "ballast_bytes": len(ballast), "vm_rss_mb": resident_mb, **result}


# ---- runner: interleaved rounds of workers, aggregation, report -------------------------------


def run_worker(config: str, rss: str, spawns: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, rss, str(spawns)]
    env = clean_env() | CONFIG_ENV.get(config, {})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    return worker_result(proc, f"worker {config} {rss}")


def schedule(rss_variants: list[str], rounds: int) -> Iterator[tuple[int, str, str]]:
    """(round, config, rss) in run order: every round runs all pairs, rotated by one per round."""
    pairs = [(config, rss) for rss in rss_variants for config in CONFIGS]
    for number, (config, rss) in rotated(pairs, rounds):
        yield number, config, rss


@dataclass
class Row:
    config: str
    rss: str
    p50_ms: float
    p99_ms: float
    mean_ms: float
    ticker_max_gap_ms: float
    round_p50_ms: list[float]
    p50_ratio: float = float("nan")
    p99_ratio: float = float("nan")
    p50_floor_ratio: float = float("nan")


def summarize(runs: list[dict[str, Any]], rss_variants: list[str]) -> list[Row]:
    """Pool the samples of every (config, rss) across rounds; ratios against no_otel, same rss."""
    rows = []
    for rss in rss_variants:
        for config in CONFIGS:
            mine = [run for run in runs if run["config"] == config and run["rss"] == rss]
            samples = [ms for run in mine for ms in run["spawn_ms"]]
            rows.append(
                Row(
                    config,
                    rss,
                    statistics.median(samples),
                    p99(samples),
                    statistics.fmean(samples),
                    max(run["ticker_max_gap_ms"] for run in mine),
                    [statistics.median(run["spawn_ms"]) for run in mine],
                )
            )
    baselines = {row.rss: row for row in rows if row.config == BASELINE}
    floors = {row.rss: row for row in rows if row.config == FLOOR}
    for row in rows:
        row.p50_ratio = row.p50_ms / baselines[row.rss].p50_ms
        row.p99_ratio = row.p99_ms / baselines[row.rss].p99_ms
        row.p50_floor_ratio = row.p50_ms / floors[row.rss].p50_ms
    return rows


def render_markdown(rows: list[Row], info: dict[str, Any], settings: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    lines = [
        '# Spawn freeze: time blocked in `await asyncio.create_subprocess_exec("/bin/true")`',
        "",
        f"Generated by `{command_line(__file__, [])}` "
        f"(spawns={settings['spawns']} after {settings['warmups']} warm-ups, rounds={settings['rounds']}). "
        "Each configuration runs in a fresh interpreter. Runs are **interleaved**: every round runs "
        "all configurations in an order rotated by one per round, and samples are pooled per "
        "configuration across rounds, so background noise on this shared machine hits all of them "
        "alike. Ratios are against `no_otel` with the same rss (target: `stallwatch` ≤ 1.05x). `stallwatch` "
        "spawns by vfork (its default), `stallwatch_fork` with `STALLWATCH_UVLOOP_SPAWN=fork`.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}; {info['date']}.",
        "",
        "| config | rss | p50 ms | p99 | mean | ticker max gap ms | p50 / no_otel | p99 / no_otel "
        "| p50 / otel_no_fork_hooks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.config} | {r.rss} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.mean_ms:.2f} | "
        f"{r.ticker_max_gap_ms:.1f} | {r.p50_ratio:.2f}x | {r.p99_ratio:.2f}x | {r.p50_floor_ratio:.2f}x |"
        for r in rows
    ]
    lines += ["", "Median of each round's own p50 (ms), in round order, to show the run-to-run noise:", ""]
    lines += [f"- {r.config} {r.rss}: " + ", ".join(f"{ms:.2f}" for ms in r.round_p50_ms) for r in rows]
    return "\n".join(lines) + "\n"


def benchmark(spawns: int, rounds: int, rss_variants: list[str], out: Path) -> str:
    """Run every round, write raw/spawn.json and spawn.md into `out`, return the markdown."""
    info = machine_info(VERSIONED)
    runs = []
    for number, config, rss in schedule(rss_variants, rounds):
        run = run_worker(config, rss, spawns)
        run["round"] = number
        runs.append(run)
        print(f"round {number} {config:<10} {rss:<5} p50 {statistics.median(run['spawn_ms']):6.2f} ms", file=sys.stderr)
    rows = summarize(runs, rss_variants)
    settings = {"spawns": spawns, "warmups": WARMUPS, "rounds": rounds, "rss": rss_variants}
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "settings": settings, "summary": [asdict(r) for r in rows], "runs": runs}
    raw_path(out, "spawn.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(rows, info, settings)
    (out / "spawn.md").write_text(markdown)
    return markdown


# ---- the incident load: spawners and grpc.aio callers on one loop, against the peers ----------

INCIDENT_CONFIGS = ("no_otel", "stallwatch", "stock_otel", "sentry", "ddtrace", "asyncio")
INCIDENT_GOALS = {"stallwatch": 0.62}  # p50 per spawn at most this times no_otel's
SPAWNERS = CALLERS = 4
ECHO = "/bench.Echo/Echo"


def echo_server() -> None:
    """The gRPC server the callers call (its own process): echoes every request; prints its port."""
    from support.grpc_echo import start_echo_server

    server, port = start_echo_server("bench.Echo")
    print(port, flush=True)
    server.wait_for_termination()


def incident_setup(config: str, receiver: str) -> Any:
    """What each configuration does before grpc and the loop are imported; returns a context
    manager factory to wrap each spawn in (or None)."""
    if config == "stallwatch":
        import stallwatch.auto  # noqa: F401 - first, as a server's first import

        return None
    if config == "stock_otel":
        from opentelemetry import trace
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient

        install_stock_otlp()
        GrpcAioInstrumentorClient().instrument()
        tracer = trace.get_tracer("bench_spawn")
        return lambda: tracer.start_as_current_span("spawn")
    if config == "sentry":
        import sentry_sdk

        sentry_sdk.init(dsn=f"http://public@{receiver.removeprefix('http://')}/1", traces_sample_rate=1.0)
        return lambda: sentry_sdk.start_transaction(name="spawn", op="bench")
    if config == "ddtrace":
        import ddtrace.auto  # noqa: F401
        from ddtrace.trace import tracer

        return lambda: tracer.trace("spawn")
    return None


async def incident_load(port: int, seconds: float, wrap: Any) -> dict[str, Any]:
    import grpc

    stop_at = time.monotonic() + seconds
    blocked: list[float] = []
    calls = [0]
    failures: list[str] = []
    rpc_failures: list[str] = []

    async def spawner() -> None:
        while time.monotonic() < stop_at:
            with wrap() if wrap else contextlib.nullcontext():
                start = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    "/bin/true", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                blocked.append((time.perf_counter() - start) * 1000)
                code = await proc.wait()
            if code != 0:
                failures.append(f"exit {code}")

    async def caller(channel: Any) -> None:
        echo = channel.unary_unary(ECHO)
        while time.monotonic() < stop_at:
            try:
                await echo(b"x" * 64, timeout=30)
            except grpc.aio.AioRpcError as error:  # the incident: a call stuck behind a fork; counted, not fatal
                rpc_failures.append(error.code().name)
                continue
            calls[0] += 1

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.unary_unary(ECHO)(b"ping", timeout=30)
        await asyncio.gather(*[spawner() for _ in range(SPAWNERS)], *[caller(channel) for _ in range(CALLERS)])
    return {
        "spawn_ms": blocked,
        "rpc_calls": calls[0],
        "failures": failures[:10],
        "failed": len(failures),
        "rpc_failures": rpc_failures[:10],
        "rpc_failed": len(rpc_failures),
    }


def incident_worker(config: str, port: int, seconds: float, receiver: str) -> dict[str, Any]:
    wrap = incident_setup(config, receiver)
    import grpc  # noqa: F401 - initialised before uvloop, as in the incident

    coroutine = incident_load(port, seconds, wrap)
    if config == "asyncio":
        result = asyncio.run(coroutine)
    else:
        import uvloop

        result = uvloop.run(coroutine)
    spawn_mode = os.environ.get("STALLWATCH_UVLOOP_SPAWN") if config == "stallwatch" else None
    return {"config": config, "uvloop_spawn": spawn_mode, "vm_rss_mb": vm_rss_mb(), **result}


def run_incident(rounds: int, seconds: float, out: Path) -> str:
    info = machine_info((*VERSIONED, "sentry-sdk", "ddtrace", "opentelemetry-instrumentation-grpc"))
    receiver = LoopbackReceiver()
    endpoint = receiver.url
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--echo-server"],
                              stdout=subprocess.PIPE, text=True, env=clean_env())  # fmt: skip
    runs = []
    try:
        port = int(server.stdout.readline())
        for number, config in rotated(INCIDENT_CONFIGS, rounds):
            env = clean_env() | {
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_LOGS_EXPORTER": "otlp",
                "STALLWATCH_UVLOOP_SPAWN": "vfork",
                "DD_TRACE_AGENT_URL": endpoint,
                "DD_INSTRUMENTATION_TELEMETRY_ENABLED": "false",
                "DD_REMOTE_CONFIGURATION_ENABLED": "false",
            }
            command = [sys.executable, str(Path(__file__).resolve()), "--incident-worker", config, str(port),
                       str(seconds), endpoint]  # fmt: skip
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds + 300)
            run = worker_result(proc, f"worker {config}") | {"round": number}
            runs.append(run)
            print(f"round {number} {config:<10} p50 {statistics.median(run['spawn_ms']):6.2f} ms, "
                  f"{len(run['spawn_ms'])} spawns, {run['rpc_calls']} calls", file=sys.stderr)  # fmt: skip
    finally:
        server.kill()
        server.wait()
        receiver.close()
    info["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    rows = {}
    for config in INCIDENT_CONFIGS:
        mine = [run for run in runs if run["config"] == config]
        samples = [ms for run in mine for ms in run["spawn_ms"]]
        rows[config] = {
            "p50_ms": statistics.median(samples),
            "p99_ms": p99(samples),
            "spawns": len(samples),
            "rpc_calls": sum(run["rpc_calls"] for run in mine),
            "failed": sum(run["failed"] for run in mine),
            "rpc_failed": sum(run.get("rpc_failed", 0) for run in mine),
            "round_p50_ms": [statistics.median(run["spawn_ms"]) for run in mine],
        }
    for row in rows.values():
        row["ratio"] = row["p50_ms"] / rows[BASELINE]["p50_ms"]
    settings = {"rounds": rounds, "seconds": seconds, "spawners": SPAWNERS, "callers": CALLERS}
    markdown = render_incident(rows, info, settings)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "settings": settings, "summary": rows, "runs": runs}
    (out / "raw" / "spawn-incident.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "spawn-incident.md").write_text(markdown)
    return markdown


def render_incident(rows: dict[str, dict[str, Any]], info: dict[str, Any], settings: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    lines = [
        "# Spawns under the freeze incident's load, against the peers",
        "",
        f"Generated by `.venvs/bench/bin/python tests/bench/bench_spawn.py --load incident --rounds "
        f"{settings['rounds']} --seconds {settings['seconds']:g}`: in one process, {settings['spawners']} "
        f"coroutines spawn `/bin/true` and wait for it in a loop while {settings['callers']} call a gRPC echo "
        "server (another process) through `grpc.aio`. `p50 ms` is the time one `create_subprocess_exec` "
        "call blocks the loop, pooled over the rounds; `failed gRPC calls` the echo calls that ended in an "
        "error (each has a 30 s deadline: a call stuck behind a fork is the incident); every configuration "
        "in a fresh interpreter, interleaved (order rotated per round); ratios against `no_otel` from this "
        "run. `stallwatch` runs with `STALLWATCH_UVLOOP_SPAWN=vfork` (its default) set explicitly.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}; {info['date']}; load average "
        f"{' '.join(info['loadavg'])} before, {' '.join(info['loadavg_after'])} after.",
        "",
        "| config | p50 ms | p99 ms | spawns | gRPC calls | failed gRPC calls | failed spawns | p50 / no_otel | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config, row in rows.items():
        goal = INCIDENT_GOALS.get(config)
        verdict = "" if goal is None else f"≤ {goal}x: {'met' if row['ratio'] <= goal else '**not met**'}"
        lines.append(
            f"| {config} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['spawns']} | {row['rpc_calls']} | "
            f"{row['rpc_failed']} | {row['failed']} | {row['ratio']:.2f}x | {verdict} |"
        )
    lines += ["", "Each round's own p50 (ms), in round order:", ""]
    lines += [f"- {config}: " + ", ".join(f"{ms:.2f}" for ms in row["round_p50_ms"]) for config, row in rows.items()]
    return "\n".join(lines) + "\n"


# ---- the round trip on uvloop: one spawn and its wait at a time, against the peers -------------

ROUNDTRIP_CONFIGS = ("no_otel", "stallwatch", "stallwatch_fork", "stock_otel", "sentry", "ddtrace")
ROUNDTRIP_PEERS = ("stock_otel", "sentry", "ddtrace")
STALLWATCH_SPAN = "true"  # stallwatch names a spawn's span after the program
METHOD_KEY = "stallwatch.spawn.method"
SENTRY_SPAWN_OP = "subprocess"  # sentry-sdk's StdlibIntegration: subprocess, subprocess.wait, ...
DDTRACE_SPAWN_SPAN = "command_execution"  # ddtrace's subprocess integration
UVLOOP_FORK = "uvloop's fork"
ROUNDTRIP_GIVES = {
    "no_otel": "no",
    "stallwatch": "yes: stallwatch's own",
    "stallwatch_fork": "yes: stallwatch's own",
    "stock_otel": "yes: a hand-made SDK span",
    "sentry": "yes: the transaction per spawn",
    "ddtrace": "yes: a hand-made ddtrace span",
}


def roundtrip_env(config: str, receiver: str) -> dict[str, str]:
    """What each configuration adds to the clean environment of its worker."""
    if config == "stallwatch_fork":
        return {"STALLWATCH_UVLOOP_SPAWN": "fork"}
    if config == "stock_otel":
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver}
    if config == "ddtrace":
        return {
            "DD_TRACE_AGENT_URL": receiver,
            "DD_APPSEC_ENABLED": "true",  # without it ddtrace's subprocess integration makes no span
            "DD_INSTRUMENTATION_TELEMETRY_ENABLED": "false",
            "DD_REMOTE_CONFIGURATION_ENABLED": "false",
        }
    return {}


def roundtrip_setup(config: str) -> tuple[Any, Any]:
    """What each configuration does before uvloop is imported. Returns a context manager factory to
    wrap each spawn and its wait in (or None), and a function to call after the loop that returns
    {"records": how many spans the instrumentation itself made for the spawns, "spawn_methods": ...
    (stallwatch), "popen_records": ... (the peers' control)}, an empty dict where the host's wrapper
    is the only record."""
    if config.startswith("stallwatch"):
        import stallwatch  # first, as a server's first import: before OpenTelemetry and uvloop

        file_dir = Path(tempfile.mkdtemp(prefix="bench_spawn_"))
        stallwatch.setup(file_dir=str(file_dir), watchdog=False)

        def stallwatch_records() -> dict[str, Any]:
            stallwatch.shutdown(10)
            spans = read_spans(file_dir / "traces.jsonl", STALLWATCH_SPAN)
            shutil.rmtree(file_dir, ignore_errors=True)
            return {"records": len(spans), "spawn_methods": dict(Counter(str(s.get(METHOD_KEY)) for s in spans))}

        return None, stallwatch_records
    if config == "stock_otel":
        from opentelemetry import trace

        install_stock_otlp()
        tracer = trace.get_tracer("bench_spawn")
        return lambda: tracer.start_as_current_span("spawn"), dict
    if config == "sentry":
        import sentry_sdk
        from sentry_sdk.transport import Transport

        seen = [0]

        class CountAndDiscard(Transport):  # type: ignore[misc]
            def capture_envelope(self, envelope: Any) -> None:
                event = envelope.get_transaction_event() or {}
                spans = event.get("spans", [])
                seen[0] += sum(str(span.get("op", "")).startswith(SENTRY_SPAWN_OP) for span in spans)

        sentry_sdk.init(dsn="http://public@127.0.0.1:9/1", traces_sample_rate=1.0, transport=CountAndDiscard)

        def transaction() -> Any:
            return sentry_sdk.start_transaction(name="spawn", op="bench")

        def sentry_count() -> int:
            sentry_sdk.flush(10)
            return seen[0]

        return transaction, lambda: with_popen_control(transaction, sentry_count)
    if config == "ddtrace":
        import ddtrace.auto  # noqa: F401 - subprocess patched
        from ddtrace.trace import TraceFilter, tracer

        spawn_spans = [0]

        class Count(TraceFilter):  # type: ignore[misc]
            def process_trace(self, trace: list[Any]) -> list[Any]:
                spawn_spans[0] += sum(span.name == DDTRACE_SPAWN_SPAN for span in trace)
                return trace

        tracer.configure(trace_processors=[Count()])

        def span() -> Any:
            return tracer.trace("spawn")

        return span, lambda: with_popen_control(span, lambda: spawn_spans[0])
    return None, dict


def with_popen_control(wrap: Any, count: Any) -> dict[str, Any]:
    """The spans a peer's subprocess integration made (`count()`) for the uvloop spawns, and then for
    one `subprocess.run(["/bin/true"])` inside `wrap()`: the control that shows the count works."""
    seen = count()
    with wrap():
        subprocess.run(["/bin/true"], check=True)
    return {"records": seen, "popen_records": count() - seen}


async def roundtrip_once(wrap: Any) -> tuple[float, float, int]:
    """One spawn and its wait, inside `wrap()` when set: the seconds of the whole (the wrapper
    included), of the spawn call alone, and the exit code."""
    start = time.perf_counter()
    with wrap() if wrap else contextlib.nullcontext():
        call_start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "/bin/true", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        call = time.perf_counter() - call_start
        code = await proc.wait()
    return time.perf_counter() - start, call, code


async def roundtrip_series(wrap: Any, spawns: int, ticker: Ticker) -> dict[str, Any]:
    for _ in range(WARMUPS):
        await roundtrip_once(wrap)
    ticker.max_gap = 0.0
    samples = [await roundtrip_once(wrap) for _ in range(spawns)]
    return {
        "loop": type(asyncio.get_running_loop()).__module__,
        "roundtrip_ms": [whole * 1000 for whole, _, _ in samples],
        "call_ms": [call * 1000 for _, call, _ in samples],
        "failed": sum(code != 0 for _, _, code in samples),
        "ticker_max_gap_ms": ticker.max_gap * 1000,
    }


def roundtrip_worker(config: str, spawns: int) -> dict[str, Any]:
    wrap, records = roundtrip_setup(config)
    import uvloop

    ticker = Ticker()
    ticker.start()
    result = uvloop.run(roundtrip_series(wrap, spawns, ticker))
    return {"config": config, "spawns_total": spawns + WARMUPS, "vm_rss_mb": vm_rss_mb(), **result, **records()}


def spread(values: list[float]) -> float:
    """(largest - smallest) / median, in percent."""
    return (max(values) - min(values)) / statistics.median(values) * 100


def run_roundtrip(spawns: int, rounds: int, out: Path) -> str:
    """Run every round, write raw/spawn-roundtrip.json and spawn-roundtrip.md into `out`, return the markdown."""
    info = machine_info((*VERSIONED, "sentry-sdk", "ddtrace"))
    receiver = LoopbackReceiver()
    runs = []
    try:
        for number, config in rotated(ROUNDTRIP_CONFIGS, rounds):
            command = [sys.executable, str(Path(__file__).resolve()), "--roundtrip-worker", config, str(spawns)]
            env = clean_env() | roundtrip_env(config, receiver.url)
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
            run = worker_result(proc, f"worker {config}") | {"round": number}
            runs.append(run)
            print(f"round {number} {config:<15} p50 {statistics.median(run['roundtrip_ms']):6.2f} ms", file=sys.stderr)
    finally:
        receiver.close()
    info["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    rows = {}
    for config in ROUNDTRIP_CONFIGS:
        mine = [run for run in runs if run["config"] == config]
        samples = [ms for run in mine for ms in run["roundtrip_ms"]]
        round_p50 = [statistics.median(run["roundtrip_ms"]) for run in mine]
        methods = Counter[str]()
        for run in mine:
            methods.update(run.get("spawn_methods", {}))
        rows[config] = {
            "p50_ms": statistics.median(samples),
            "p99_ms": p99(samples),
            "mean_ms": statistics.fmean(samples),
            "call_p50_ms": statistics.median(ms for run in mine for ms in run["call_ms"]),
            "ticker_max_gap_ms": max(run["ticker_max_gap_ms"] for run in mine),
            "records": sum(run["records"] for run in mine) if "records" in mine[0] else None,
            "popen_records": sum(run.get("popen_records", 0) for run in mine),
            "popen_runs": len(mine),
            "spawns_total": sum(run["spawns_total"] for run in mine),
            "spawn_methods": dict(methods),
            "failed": sum(run["failed"] for run in mine),
            "round_p50_ms": round_p50,
            "round_spread_pct": spread(round_p50),
        }
    fastest_peer = min(rows[peer]["p50_ms"] for peer in ROUNDTRIP_PEERS)
    for row in rows.values():
        row["p50_ratio"] = row["p50_ms"] / rows[BASELINE]["p50_ms"]
        row["p99_ratio"] = row["p99_ms"] / rows[BASELINE]["p99_ms"]
        row["p50_to_fastest_peer"] = row["p50_ms"] / fastest_peer
    settings = {"spawns": spawns, "warmups": WARMUPS, "rounds": rounds}
    markdown = render_roundtrip(rows, info, settings)
    report = {"machine": info, "settings": settings, "summary": rows, "runs": runs}
    raw_path(out, "spawn-roundtrip.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "spawn-roundtrip.md").write_text(markdown)
    return markdown


def roundtrip_span_text(config: str, row: dict[str, Any]) -> str:
    """What the arm records per spawn, with the count its instrumentation itself made."""
    gives = ROUNDTRIP_GIVES[config]
    if row["records"] is None:
        return gives
    if config.startswith("stallwatch"):
        return f"{gives} ({row['records']} for {row['spawns_total']} spawns)"
    return (
        f"{gives}; its subprocess integration's spans: {row['records']} for {row['spawns_total']} spawns "
        f"(control: {row['popen_records']} for {row['popen_runs']} `subprocess.run`)"
    )


def render_roundtrip(rows: dict[str, dict[str, Any]], info: dict[str, Any], settings: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    lines = [
        "# uvloop spawn + wait against the peers: the round trip of one `/bin/true`",
        "",
        f"Generated by `.venvs/bench/bin/python tests/bench/bench_spawn.py --load roundtrip --rounds "
        f"{settings['rounds']} --spawns {settings['spawns']}` ({settings['warmups']} warm-ups per run): on a "
        "uvloop loop, one `await asyncio.create_subprocess_exec('/bin/true', ...DEVNULL)` + `await "
        "proc.wait()` at a time, timed from entering the arm's own wrapper (its span or transaction) to "
        "leaving it; `call p50` is the `create_subprocess_exec` call alone. Each arm in a fresh interpreter, "
        "interleaved (order rotated per round), samples pooled over the rounds; ratios against `no_otel` "
        "(bare uvloop) from this run. `ticker max gap` is the longest wake-up gap of a thread sleeping 1 ms "
        "(the loop's longest stall with the GIL held). Spans per spawn are counted in the worker: "
        "stallwatch's from its traces file, sentry-sdk's by its transport, ddtrace's by a trace filter "
        "(warm-ups included); for the peers, a control after the timed spawns: the spans the same counter "
        'sees for one `subprocess.run(["/bin/true"])` inside the arm\'s wrapper.',
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}; {info['date']}; load average "
        f"{' '.join(info['loadavg'])} before, {' '.join(info['loadavg_after'])} after.",
        "",
        "| arm | p50 ms | p99 ms | mean ms | call p50 ms | ticker max gap ms | p50 / no_otel | p99 / no_otel "
        "| p50 / fastest peer | span per spawn | spawn method | rounds' p50 ms (spread) | failed spawns |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, row in rows.items():
        methods = ", ".join(f"{name} {n}" for name, n in sorted(row["spawn_methods"].items())) or UVLOOP_FORK
        to_peer = f"{row['p50_to_fastest_peer']:.2f}x" if config.startswith("stallwatch") else ""
        rounds = ", ".join(f"{ms:.2f}" for ms in row["round_p50_ms"])
        lines.append(
            f"| {config} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['mean_ms']:.2f} | "
            f"{row['call_p50_ms']:.2f} | {row['ticker_max_gap_ms']:.1f} | {row['p50_ratio']:.2f}x | "
            f"{row['p99_ratio']:.2f}x | {to_peer} | {roundtrip_span_text(config, row)} | {methods} | "
            f"{rounds} ({row['round_spread_pct']:.0f} %) | {row['failed']} |"
        )
    lines += [
        "",
        "Arms: `no_otel` bare uvloop; `stallwatch` `import stallwatch` first, `setup(file_dir=<tmp>, "
        "watchdog=False)`, its default spawn and its span per spawn; `stallwatch_fork` the same with "
        "`STALLWATCH_UVLOOP_SPAWN=fork`; `stock_otel` the stock SDK (OTLP/HTTP for the three signals to a "
        "loopback receiver) and a hand-made span around each create + wait; `sentry` `sentry_sdk.init("
        "traces_sample_rate=1.0)` with its default integrations and a discarding transport, a transaction "
        "per spawn; `ddtrace` `import ddtrace.auto` with `DD_APPSEC_ENABLED=true` (its subprocess "
        'integration makes no span without it), a span per spawn. "fastest peer": the lowest p50 of '
        '`stock_otel`, `sentry` and `ddtrace` in this run. "spread": (largest - smallest) / median of the '
        "rounds' p50s.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--spawns", type=int, help="measured spawns per run (default 200; 20 with --quick, "
                        "30 with --load roundtrip --quick)")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, 5 with --load roundtrip; "
                        "1 with --quick, 2 with --load roundtrip --quick)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke test: few spawns, one round, rss0 only")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--load", choices=("sequential", "incident", "roundtrip"), default="sequential",
                        help="one spawn at a time (default), the incident's load against the peers, or one "
                             "spawn + wait at a time on uvloop against the peers")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=20.0, help="with --load incident: seconds per run")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "RSS", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--incident-worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--roundtrip-worker", nargs=2, metavar=("CONFIG", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.echo_server:
        echo_server()
        return
    if args.incident_worker:
        config, port, seconds, receiver = args.incident_worker
        print(json.dumps(incident_worker(config, int(port), float(seconds), receiver)))
        return
    if args.roundtrip_worker:
        config, spawns = args.roundtrip_worker
        print(json.dumps(roundtrip_worker(config, int(spawns))))
        return
    if args.load == "roundtrip":
        out = args.out or (Path(tempfile.mkdtemp(prefix="bench_spawn_")) if args.quick else DEFAULT_OUT)
        spawns = args.spawns or (30 if args.quick else 200)
        print(run_roundtrip(spawns, args.rounds or (2 if args.quick else 5), out))
        print(f"results: {raw_path(out, 'spawn-roundtrip.json')}, {out / 'spawn-roundtrip.md'}", file=sys.stderr)
        return
    if args.load == "incident":
        out = args.out or (Path(tempfile.mkdtemp(prefix="bench_spawn_")) if args.quick else DEFAULT_OUT)
        print(run_incident(args.rounds or (1 if args.quick else 3), 3.0 if args.quick else args.seconds, out))
        return
    if args.worker:
        config, rss, spawns = args.worker
        print(json.dumps(worker(config, rss, int(spawns))))
        return
    spawns = args.spawns or (20 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    rss_variants = ["rss0"] if args.quick else list(RSS_BYTES)
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_spawn_")) if args.quick else DEFAULT_OUT)
    print(benchmark(spawns, rounds, rss_variants, out))
    print(f"results: {raw_path(out, 'spawn.json')}, {out / 'spawn.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
