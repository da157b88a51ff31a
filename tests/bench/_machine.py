"""What the benchmarks share: the machine description written next to every result, a clean environment
for the fresh interpreters they start, the interleaved order they run them in and how they read their
results, the spans a worker reads back from a traces file, the loopback receiver their exporters send to
and the stock OpenTelemetry set-up they compare with."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:  # the benchmarks share the tests' `support` package (the fake Nebius server)
    sys.path.append(str(TESTS))


def raw_path(out: Path, name: str) -> Path:
    """Where a benchmark writes its raw numbers: `raw/NAME` under its output directory.

    Only the Markdown summaries are committed; git ignores `tests/bench/results/raw/`."""
    (out / "raw").mkdir(parents=True, exist_ok=True)
    return out / "raw" / name


def clean_env() -> dict[str, str]:
    """This environment without OTEL_/STALLWATCH_/GRPC_ variables, so every worker starts alike; the
    tests' `support` package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STALLWATCH_", "GRPC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def rotated(items: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, item) in run order: every round runs all `items`, in an order rotated by one per round, so
    that background noise on a shared machine hits each of them alike."""
    for number in range(rounds):
        shift = number % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield number, item


def worker_result(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    """The JSON object a finished worker (a fresh interpreter) printed last; RuntimeError naming `what`, with
    the end of its stderr, if it failed."""
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def p99(samples: list[float]) -> float:
    """The 99th percentile of `samples` (the inclusive method: it stays within their range)."""
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command that runs `script` with `argv` in this interpreter, for a summary to name what made it:
    the interpreter and the script relative to the repository when they are in it (a virtual environment's
    `python` as its own path, not the one it links to), without `--out`."""

    def shown(path: str) -> str:
        try:
            return Path(path).absolute().relative_to(TESTS.parent).as_posix()
        except ValueError:
            return path

    kept: list[str] = []
    skip = False
    for arg in argv:  # where the summary is written is not part of what made it
        if skip or arg == "--out" or arg.startswith("--out="):
            skip = arg == "--out"
            continue
        kept.append(arg)
    return shlex.join([shown(sys.executable), shown(script), *kept])


def machine_info(versioned: tuple[str, ...]) -> dict[str, Any]:
    """Where and with what a benchmark ran: for the results file."""
    versions = {}
    for name in versioned:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "kernel": platform.release(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=HERE,
        ).stdout.strip(),
        "git_dirty": bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", ":/src"],
                capture_output=True,
                text=True,
                check=False,
                cwd=HERE,
            ).stdout.strip()
        ),
        "versions": versions,
    }


def attribute_value(value: dict[str, Any]) -> Any:
    """The Python value of an OTLP/JSON AnyValue ({"doubleValue": 0.1}, {"intValue": "3"}, ...)."""
    for key, item in value.items():
        return int(item) if key == "intValue" else item
    return None


def read_spans(path: Path, name: str) -> list[dict[str, Any]]:
    """Spans called `name` in an OTLP/JSON-lines traces file, sorted by start time, as
    {"start": ns, **attributes}."""
    spans = []
    if not path.exists():
        return spans
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        for resource_spans in json.loads(line).get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    if span.get("name") != name:
                        continue
                    attributes = {a["key"]: attribute_value(a.get("value", {})) for a in span.get("attributes", [])}
                    spans.append({"start": int(span.get("startTimeUnixNano", 0)), **attributes})
    return sorted(spans, key=lambda span: span["start"])


class _Answer200(BaseHTTPRequestHandler):
    """Reads any POST or PUT (OTLP/HTTP exports, Sentry envelopes, ddtrace payloads) and answers 200: empty,
    or to a ddtrace payload (`/v0.N/traces`) the JSON its agent answers, without which ddtrace logs an error
    and drops the payload. Counts the ddtrace payloads in the server's `payloads`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body, kind = b"", "application/x-protobuf"
        if self.path.endswith("/traces") and self.path.startswith("/v0."):
            self.server.payloads += 1  # type: ignore[attr-defined]
            body, kind = b'{"rate_by_service": {}}', "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_POST

    def log_message(self, format: str, *args: object) -> None:
        return


class LoopbackReceiver(ThreadingHTTPServer):
    """A receiver on 127.0.0.1 that answers 200 to everything sent to it, served by a thread of this process
    from construction until `close()`."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer200)
        self.payloads = 0  # ddtrace payloads
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """Where to send (OTEL_EXPORTER_OTLP_ENDPOINT, a Sentry DSN's host, DD_TRACE_AGENT_URL)."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def install_stock_otlp(logging_handler: bool = False) -> None:
    """The set-up a user writes without stallwatch, installed globally: TracerProvider + BatchSpanProcessor,
    MeterProvider + PeriodicExportingMetricReader and LoggerProvider + BatchLogRecordProcessor, each with the
    OTLP/HTTP exporter (configured by the OTEL_EXPORTER_OTLP_* environment); with `logging_handler`, an
    OpenTelemetry LoggingHandler on the root logger too. Imports OpenTelemetry when called."""
    import logging

    from opentelemetry import _logs, metrics, trace
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())]))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
    _logs.set_logger_provider(logger_provider)
    if logging_handler:
        logging.getLogger().addHandler(LoggingHandler(logger_provider=logger_provider))
