"""`stallwatch demo`: both incidents, replayed safely on this machine, then the postmortem.

The stages (docs/postmortem.md):

1. spawns on a small asyncio server (on uvloop when installed, as uvicorn's `loop="auto"` picks)
   whose host builds stock-style OpenTelemetry providers after `import stallwatch`, as dstack does;
   a worker forked with `os.fork()` lives on and reports a span;
2. a freeze, caught live: a child host's uvloop spawn held before exec by a library's fork handler;
3. a Nebius create in flight when its host is killed: the ledger's intent makes it a leak candidate;
4. the executor wedge: a stale async SystemExit refused by the guard, then, with the guard off, the
   worker's death detected and the stranded request healed;
5. `stallwatch postmortem` over everything, with an HTML report.

Stages 2-4 run in child processes (`demo_incidents`) writing to the same directory; everything is
local files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import _logs, metrics, trace

from . import postmortem, setup, shutdown
from .checkup import probe_fork_handlers
from .demo_incidents import UnansweredCloud, command
from .export.file import FileLogExporter, FileMetricExporter, FileSpanExporter
from .forksafe import guard
from .forksafe.loop import loop_kind
from .instrument.subprocess import SubprocessInstrumentor


@dataclass
class DemoResult:
    """What the demo recorded; printed as text or JSON."""

    loop: str
    probes_answered: int
    spawns: int
    grpc_calls_during_spawns: int
    crashed_children: int
    spawn_blocked_ms_p50: float
    spawn_blocked_ms_max: float
    forks: dict[str, int]
    handlers_skipped: int
    stock_thread_starts_per_child: int
    stallwatch_thread_starts_per_child: int
    forked_worker_span_exported: bool
    files: dict[str, str]
    freeze_seconds: float = 0.0
    freeze_detected_while_frozen: bool = False
    freeze_cause: str = ""
    create_killed_leak_candidates: int = 0
    wedge_guarded: str = ""
    wedge_unguarded_healed: str = ""
    wedge_heal_seconds: float = 0.0
    postmortem_events: int = 0
    report: str = ""
    skipped: list[str] = field(default_factory=list)


def _build_host_providers(out: Path) -> list[Any]:
    """What a host like dstack does after startup: stock SDK classes, its own exporters."""
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": "stallwatch-demo"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(out)))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(FileMetricExporter(out), export_interval_millis=60_000)
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics.set_meter_provider(meter_provider)
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(FileLogExporter(out)))
    _logs.set_logger_provider(logger_provider)
    with warnings.catch_warnings():  # SDK 1.45 deprecates its handler; not the demo's user's to act on
        warnings.simplefilter("ignore", DeprecationWarning)
        handler = LoggingHandler(logger_provider=logger_provider)
    logging.getLogger("stallwatch.demo").addHandler(handler)
    return [tracer_provider, meter_provider, logger_provider]


class _BusyGrpc:
    """A grpc.aio client calling a local gRPC server in a loop, as the Nebius SDK keeps gRPC busy.

    gRPC's own fork handlers would restart its threads in every uvloop child (incident 000); with
    stallwatch imported first they do not. None of it runs when grpcio is not installed.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._stop = threading.Event()
        self._server: Any = None
        self._client: threading.Thread | None = None

    def __enter__(self) -> _BusyGrpc:
        import importlib.util

        if importlib.util.find_spec("grpc") is None:
            return self
        from concurrent.futures import ThreadPoolExecutor

        # optional: the grpc extra
        import grpc

        handler = grpc.method_handlers_generic_handler(
            "demo.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
        )
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        ready = threading.Event()

        async def client() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                echo: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/demo.Echo/Echo")
                while not self._stop.is_set():
                    await echo(b"x", timeout=10)
                    self.calls += 1
                    ready.set()

        self._client = threading.Thread(target=asyncio.run, args=(client(),), name="demo-grpc-client", daemon=True)
        self._client.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.join(10)  # its call in flight ends before the server goes (else: UNAVAILABLE)
        if self._server is not None:
            self._server.stop(0)


async def _probe_server(probes: int, blocked: list[float], crashed: list[int]) -> int:
    """Serve `probes` health checks; each one spawns a child like an SSH tunnel open/close."""
    tracer = trace.get_tracer("stallwatch.demo")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        with tracer.start_as_current_span("probe /healthcheck"):
            started = time.perf_counter()
            child = await asyncio.create_subprocess_exec("/bin/true")
            blocked.append(time.perf_counter() - started)
            returncode = await child.wait()
            if returncode < 0:  # killed by a signal, e.g. SIGSEGV in gRPC's fork handler
                crashed.append(returncode)
        writer.write(b"ok\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    answered = 0
    async with server:
        for _ in range(probes):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthcheck\n")
            await writer.drain()
            answered += (await reader.readline()) == b"ok\n"
            writer.close()
    return answered


def _forked_worker() -> int:
    """A child that lives on (gunicorn style): its first span restarts the exporters lazily."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with trace.get_tracer("stallwatch.demo").start_as_current_span("forked worker") as span:
                span.set_attribute("demo.worker.pid", os.getpid())
            trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
        except Exception:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        # optional: the uvloop extra
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _environment(out: Path) -> dict[str, str]:
    """The demo's hosts journal under `out`: never into the user's real journal directory."""
    return {**os.environ, "STALLWATCH_JOURNAL_DIR": str(out / "journal")}


def _role(out: Path, *args: str, timeout: float = 60) -> dict[str, Any]:
    proc = subprocess.run(
        command(args[0], str(out), *args[1:]), capture_output=True, text=True, timeout=timeout, env=_environment(out)
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"demo stage {args[0]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return dict(json.loads(lines[-1]))


def _freeze_stage(out: Path, result: DemoResult) -> None:
    freeze = _role(out, "freeze", "2.5")
    result.freeze_seconds = round((int(freeze["frozen_until_ns"]) - int(freeze["frozen_from_ns"])) / 1e9, 2)

    _, logs, _, _, _ = postmortem.load(None, [out / "logs.jsonl"])
    for record in logs:
        if "freeze detected" in str(record.get("body", "")):
            detected = int(record["timeUnixNano"])
            result.freeze_detected_while_frozen = detected < int(freeze["frozen_until_ns"])
            for attribute in record.get("attributes", []):
                if attribute["key"] == "stallwatch.freeze.cause":
                    result.freeze_cause = attribute["value"]["stringValue"]


def _create_stage(out: Path) -> None:
    with UnansweredCloud() as cloud:  # the cloud takes its time
        host = subprocess.Popen(
            command("create", str(out), cloud.address),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_environment(out),
        )  # fmt: skip
        try:
            if host.stdout is None or '"creating"' not in host.stdout.readline():
                raise RuntimeError("demo stage create did not start its call")
            time.sleep(1.0)  # the create is in flight, its intent durable in the journal
            host.send_signal(signal.SIGKILL)  # the load balancer's health check
        finally:
            host.wait(10)
    _role(out, "restart")  # the next start replays the journal: an interrupted span and a leak candidate


def run(out: Path, probes: int = 20, progress: Callable[[str], None] | None = None) -> DemoResult:
    """Run every stage, writing telemetry under `out`; return what was recorded."""
    say = progress or (lambda message: None)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("traces.jsonl", "metrics.jsonl", "logs.jsonl"):  # this run's files only
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "journal", ignore_errors=True)

    say(f"[1/5] health probes spawning children on a uvloop-style server ({probes} probes) ...")

    setup(providers="host", file_dir=str(out), journal_dir=out / "journal")
    providers = _build_host_providers(out)
    loop = _new_loop()
    blocked: list[float] = []
    crashed: list[int] = []
    try:
        with _BusyGrpc() as busy:
            answered = loop.run_until_complete(_probe_server(probes, blocked, crashed))
        kind = loop_kind(loop)
    finally:
        loop.close()
    worker_status = _forked_worker()
    stock = probe_fork_handlers(stock=True)["handlers"]
    guarded = probe_fork_handlers()["handlers"]
    forks: dict[str, int] = {}
    for (fork_kind, _grpc, _loop), count in guard.fork_counts():
        forks[fork_kind] = forks.get(fork_kind, 0) + count
    logging.getLogger("stallwatch.demo").warning("demo finished: %d probes answered", answered)
    shutdown()  # builds the child spans still waiting, before the providers below stop
    SubprocessInstrumentor().uninstrument()  # the stages below spawn their own hosts: not this host's children
    for provider in providers:
        provider.shutdown()
    traces = out / "traces.jsonl"
    result = DemoResult(
        loop=kind,
        probes_answered=answered,
        spawns=len(blocked),
        grpc_calls_during_spawns=busy.calls,
        crashed_children=len(crashed),
        spawn_blocked_ms_p50=round(statistics.median(blocked) * 1e3, 3) if blocked else 0.0,
        spawn_blocked_ms_max=round(max(blocked) * 1e3, 3) if blocked else 0.0,
        forks=forks,
        handlers_skipped=guard.STATE.handlers_skipped,
        stock_thread_starts_per_child=sum(h["thread_starts"] for h in stock),
        stallwatch_thread_starts_per_child=sum(h["thread_starts"] for h in guarded),
        forked_worker_span_exported=worker_status == 0 and "forked worker" in traces.read_text(),
        files={signal: str(out / f"{signal}.jsonl") for signal in ("traces", "metrics", "logs")},
    )
    _incident_stages(out, result, say)
    return result


def _incident_stages(out: Path, result: DemoResult, say: Callable[[str], None]) -> None:
    import importlib.util

    if importlib.util.find_spec("uvloop") is None:
        result.skipped.append("freeze: needs uvloop (pip install 'stallwatch[demo]')")
    else:
        say("[2/5] a spawn held before exec freezes a child host; the watchdog reports it live ...")
        _freeze_stage(out, result)
    if importlib.util.find_spec("nebius") is None:
        result.skipped.append("cloud: needs nebius (pip install 'stallwatch[demo]')")
    else:
        say("[3/5] a Nebius create in flight when the host is killed with SIGKILL; the next start replays ...")
        _create_stage(out)
    say("[4/5] a stale async SystemExit aimed at an executor worker, with and without the guard ...")
    result.wedge_guarded = str(_role(out, "wedge", "guard", "noheal")["B"])
    unguarded = _role(out, "wedge", "noguard", "heal")
    result.wedge_unguarded_healed = str(unguarded["B"]).partition(":")[0]
    result.wedge_heal_seconds = float(unguarded["B_seconds"])
    say("[5/5] stallwatch postmortem over all of it ...")

    timeline = postmortem.timeline(out, every_process=True)  # every stage is a host of its own
    result.postmortem_events = len(timeline.events)
    result.create_killed_leak_candidates = len(timeline.leak_candidates)
    report = out / "postmortem.html"
    postmortem.write_report(report, postmortem.format_html(timeline))
    postmortem.write_report(out / "postmortem.txt", postmortem.format_text(timeline))
    result.report = str(report)


def format_text(result: DemoResult) -> str:
    """Human summary of a demo run."""
    live = "while still frozen" if result.freeze_detected_while_frozen else "NO"
    return "\n".join(
        [
            "stallwatch demo: health probes that spawn children, as in incident 000",
            f"  event loop                        {result.loop}",
            f"  probes answered                   {result.probes_answered}",
            f"  spawns (blocked in spawn call)    {result.spawns} (p50 {result.spawn_blocked_ms_p50} ms, "
            f"max {result.spawn_blocked_ms_max} ms)",
            f"  gRPC calls during the spawns      {result.grpc_calls_during_spawns} (a busy grpc.aio client)",
            f"  children killed by a signal       {result.crashed_children}",
            f"  forks recorded                    {result.forks or 'none (no fork: vfork/posix_spawn)'}",
            f"  at-fork handlers skipped          {result.handlers_skipped} (in children that only exec)",
            f"  thread starts in a fork child     stock OpenTelemetry: {result.stock_thread_starts_per_child}, "
            f"with stallwatch: {result.stallwatch_thread_starts_per_child}",
            f"  forked worker's span exported     {'yes' if result.forked_worker_span_exported else 'NO'}",
            "",
            "incident 000, the freeze (a child held before exec):",
            f"  host frozen for                   {result.freeze_seconds} s",
            f"  watchdog reported it              {live} (cause {result.freeze_cause or '?'})",
            "incident 000, the leaked instance (host killed during a create):",
            f"  leak candidates found             {result.create_killed_leak_candidates}",
            "incident 002, the wedge (stale SystemExit into an idle worker):",
            f"  with the guard (default)          next request: {result.wedge_guarded}",
            f"  without the guard, heal on        next request: {result.wedge_unguarded_healed} after "
            f"{result.wedge_heal_seconds} s (instead of hanging)",
            *[f"  skipped: {reason}" for reason in result.skipped],
            "",
            f"postmortem: {result.postmortem_events} events; report {result.report}",
            f"  text timeline: {Path(result.report).with_suffix('.txt') if result.report else '-'}",
            "  telemetry files (OTLP/JSON lines):",
            *[f"    {path}" for path in result.files.values()],
        ]
    )


def healthy(result: DemoResult, probes: int) -> bool:
    """Whether every stage showed what it is there to show (the demo's own check)."""
    return (
        result.probes_answered == probes
        and result.crashed_children == 0
        and result.stallwatch_thread_starts_per_child == 0
        and result.forked_worker_span_exported
        and (result.freeze_detected_while_frozen or any(s.startswith("freeze") for s in result.skipped))
        and (result.create_killed_leak_candidates == 1 or any(s.startswith("cloud") for s in result.skipped))
        and result.wedge_guarded == "B done"
        and result.wedge_unguarded_healed == "WorkerDied"
        and bool(result.report)
    )


def to_json(result: DemoResult) -> str:
    return json.dumps(asdict(result), indent=2)
