"""`stallwatch demo`: the freeze scenario of incidents/000_…, run safely on this machine.

A small asyncio server (on uvloop when installed, as uvicorn's `loop="auto"` would pick) answers
health probes; each probe spawns a child the way dstack opens and closes an SSH tunnel. The host
builds its own stock-style OpenTelemetry providers after `import stallwatch` (as dstack does),
exporting to local files. A worker child forked with `os.fork()` lives on and reports a span.
The demo prints what was recorded and measured, and where the files are. No collector needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from opentelemetry import _logs, metrics, trace

from .doctor import probe_fork_handlers
from .export.file import FileLogExporter, FileMetricExporter, FileSpanExporter
from .forksafe import guard
from .forksafe.loop import loop_kind


@dataclass
class DemoResult:
    """What the demo recorded; printed as text or JSON."""

    loop: str
    probes_answered: int
    spawns: int
    spawn_blocked_ms_p50: float
    spawn_blocked_ms_max: float
    forks: dict[str, int]
    handlers_skipped: int
    stock_thread_starts_per_child: int
    stallwatch_thread_starts_per_child: int
    forked_worker_span_exported: bool
    files: dict[str, str]


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
    logging.getLogger("stallwatch.demo").addHandler(LoggingHandler(logger_provider=logger_provider))
    return [tracer_provider, meter_provider, logger_provider]


async def _probe_server(probes: int, blocked: list[float]) -> int:
    """Serve `probes` health checks; each one spawns a child like an SSH tunnel open/close."""
    tracer = trace.get_tracer("stallwatch.demo")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        with tracer.start_as_current_span("probe /healthcheck"):
            started = time.perf_counter()
            child = await asyncio.create_subprocess_exec("/bin/true")
            blocked.append(time.perf_counter() - started)
            await child.wait()
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
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(out: Path, probes: int = 20) -> DemoResult:
    """Run the scenario, writing telemetry under `out`; return what was recorded."""
    out.mkdir(parents=True, exist_ok=True)
    from . import setup

    setup(providers="host", file_dir=str(out))
    providers = _build_host_providers(out)
    loop = _new_loop()
    blocked: list[float] = []
    try:
        answered = loop.run_until_complete(_probe_server(probes, blocked))
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
    for provider in providers:
        provider.shutdown()
    traces = out / "traces.jsonl"
    return DemoResult(
        loop=kind,
        probes_answered=answered,
        spawns=len(blocked),
        spawn_blocked_ms_p50=round(statistics.median(blocked) * 1e3, 3) if blocked else 0.0,
        spawn_blocked_ms_max=round(max(blocked) * 1e3, 3) if blocked else 0.0,
        forks=forks,
        handlers_skipped=guard.STATE.handlers_skipped,
        stock_thread_starts_per_child=sum(h["thread_starts"] for h in stock),
        stallwatch_thread_starts_per_child=sum(h["thread_starts"] for h in guarded),
        forked_worker_span_exported=worker_status == 0 and "forked worker" in traces.read_text(),
        files={signal: str(out / f"{signal}.jsonl") for signal in ("traces", "metrics", "logs")},
    )


def format_text(result: DemoResult) -> str:
    """Human summary of a demo run."""
    return "\n".join(
        [
            "stallwatch demo: health probes that spawn children, as in incidents/000",
            f"  event loop                        {result.loop}",
            f"  probes answered                   {result.probes_answered}",
            f"  spawns (blocked in spawn call)    {result.spawns} (p50 {result.spawn_blocked_ms_p50} ms, "
            f"max {result.spawn_blocked_ms_max} ms)",
            f"  forks recorded                    {result.forks or 'none (no fork: vfork/posix_spawn)'}",
            f"  at-fork handlers skipped          {result.handlers_skipped} (in children that only exec)",
            f"  thread starts in a fork child     stock OpenTelemetry: {result.stock_thread_starts_per_child}, "
            f"with stallwatch: {result.stallwatch_thread_starts_per_child}",
            f"  forked worker's span exported     {'yes' if result.forked_worker_span_exported else 'NO'}",
            "  telemetry files (OTLP/JSON lines):",
            *[f"    {path}" for path in result.files.values()],
        ]
    )


def to_json(result: DemoResult) -> str:
    return json.dumps(asdict(result), indent=2)
