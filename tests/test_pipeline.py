"""Exporters: telemetry reaches files, a real OTLP/HTTP receiver, stdout or a Prometheus scrape;
grpc is imported only when the user chose it; and shutdown never holds the host up."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conftest import SCENARIOS, clean_env, read_jsonl, run_python, span_names
from otlp_receiver import Receiver, serving
from support.fast_paths import FAST_PATHS
from support.loopback import HeldPort

sys.path.insert(0, str(SCENARIOS))
from reliability_collectors import serve

pytestmark = pytest.mark.matrix  # what each SDK builds for each exporter

# A host doing one unit of work: a span, a WARNING through `logging`, a counter measurement.
_CHARGE_CARD = """
    import stallwatch  # first thing, as a server does

    import logging
    from opentelemetry import metrics, trace

    def charge_card():
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            logging.getLogger("shop").warning("card declined")
            metrics.get_meter("shop").create_counter("shop.orders").add(3)
"""

# A child that lives on after os.fork() and leaves without running atexit handlers.
_FORK_AND_EXIT = """
    import os

    def fork_a_child():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
"""


def run_host(body: str, **env: str) -> dict:
    """Run a host script in a fresh interpreter; return the JSON object on its last stdout line."""
    script = "".join(textwrap.dedent(part) for part in (_CHARGE_CARD, _FORK_AND_EXIT, body))
    proc = run_python(script, env=clean_env(NO_PROXY="127.0.0.1", **env), timeout=60)
    assert proc.returncode == 0, f"host failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.splitlines()[-1])
    report["stdout"], report["stderr"] = proc.stdout, proc.stderr
    return report


def _attributes(attributes: list[dict]) -> dict[str, object]:
    return {a["key"]: next(iter(a["value"].values())) for a in attributes}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- file exporter (the default) ----------------------------------------------------------------


def test_file_exporter_writes_otlp_json_for_every_signal(telemetry_dir: Path):
    report = run_host(
        f"""
        import json
        import stallwatch

        session = stallwatch.setup(file_dir={str(telemetry_dir)!r})
        charge_card()
        fork_a_child()
        print(json.dumps({{"shutdown": stallwatch.shutdown(), "version": stallwatch.__version__}}))
        """,
        OTEL_SERVICE_NAME="checkout",
    )

    assert report["shutdown"] is True
    traces, logs, metrics = (telemetry_dir / name for name in ("traces.jsonl", "logs.jsonl", "metrics.jsonl"))
    for path in (traces, logs, metrics):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert telemetry_dir.stat().st_mode & 0o777 == 0o700

    assert span_names(traces) == ["charge-card"]
    span_request = read_jsonl(traces)[0]
    resource_spans = span_request["resourceSpans"][0]
    span = resource_spans["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and int(span["traceId"], 16)
    assert len(span["spanId"]) == 16 and int(span["spanId"], 16)
    resource = _attributes(resource_spans["resource"]["attributes"])
    assert resource["service.name"] == "checkout"
    assert resource["stallwatch.version"] == report["version"]

    records = [
        record
        for request in read_jsonl(logs)
        for resource_logs in request["resourceLogs"]
        for scope_logs in resource_logs["scopeLogs"]
        for record in scope_logs["logRecords"]
    ]
    assert [r["body"]["stringValue"] for r in records] == ["card declined"]
    assert records[0]["severityNumber"] == 13  # SEVERITY_NUMBER_WARN: logging.WARNING
    assert records[0]["traceId"] == span["traceId"]  # the log joins its span

    points = {}
    for request in read_jsonl(metrics):
        for resource_metrics in request["resourceMetrics"]:
            for scope_metrics in resource_metrics["scopeMetrics"]:
                for metric in scope_metrics["metrics"]:  # the sums; duration histograms start at zero too
                    for point in metric.get("sum", {}).get("dataPoints", []):
                        points.setdefault(metric["name"], []).append(point)
    assert [int(p["asInt"]) for p in points["shop.orders"]] == [3]
    forks_by_kind: dict[str, int] = {}
    for point in points["stallwatch.fork.count"]:  # every kind, gRPC state and loop, at 0 until its first fork
        kind = _attributes(point["attributes"])["stallwatch.fork.kind"]
        forks_by_kind[kind] = forks_by_kind.get(kind, 0) + int(point["asInt"])
    assert forks_by_kind == {"fork": 1, "exec_bound": 0}


# ---- OTLP over HTTP/protobuf to a real receiver -------------------------------------------------


def _otlp_span_names(bodies: list[bytes]) -> list[str]:
    names = []
    for body in bodies:
        request = ExportTraceServiceRequest.FromString(body)
        names += [span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    return names


_SETUP_CHARGE_SHUTDOWN = """
    import json
    import stallwatch

    stallwatch.setup()
    charge_card()
    fork_a_child()
    print(json.dumps({"shutdown": stallwatch.shutdown()}))
"""


def test_otlp_http_sends_each_signal_to_its_path_under_the_endpoint(receiver: Receiver):
    report = run_host(_SETUP_CHARGE_SHUTDOWN, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_SERVICE_NAME="checkout")

    assert report["shutdown"] is True
    assert _otlp_span_names(receiver.bodies("/v1/traces")) == ["charge-card"]
    trace_request = ExportTraceServiceRequest.FromString(receiver.bodies("/v1/traces")[0])
    resource = {a.key: a.value.string_value for a in trace_request.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "checkout"
    logs = [ExportLogsServiceRequest.FromString(body) for body in receiver.bodies("/v1/logs")]
    assert [
        r.body.string_value for req in logs for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records
    ] == ["card declined"]
    metrics = [ExportMetricsServiceRequest.FromString(body) for body in receiver.bodies("/v1/metrics")]
    metric_names = {
        m.name for req in metrics for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert {"shop.orders", "stallwatch.fork.count"} <= metric_names


def test_otlp_per_signal_endpoint_is_used_as_is(receiver: Receiver):
    report = run_host(
        _SETUP_CHARGE_SHUTDOWN,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"{receiver.url}/base",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.url}/custom/spans",
    )

    assert report["shutdown"] is True
    assert _otlp_span_names(receiver.bodies("/custom/spans")) == ["charge-card"]
    assert {path for path, _ in receiver.requests} == {"/custom/spans", "/base/v1/metrics", "/base/v1/logs"}


# ---- grpc stays out of the process unless the user chose it ------------------------------------

_REPORT_GRPC_MODULES = """
    import json, sys
    import stallwatch

    stallwatch.setup({overrides})
    charge_card()
    shutdown = stallwatch.shutdown()
    grpc_modules = sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc."))
    print(json.dumps({{"shutdown": shutdown, "grpc_modules": grpc_modules}}))
"""


@pytest.mark.parametrize("exporter", ["otlp", "file", "console"])
def test_default_exporters_never_import_grpc(exporter: str, receiver: Receiver, telemetry_dir: Path):
    overrides = f"traces_exporter={exporter!r}, metrics_exporter={exporter!r}, logs_exporter={exporter!r}"
    report = run_host(
        _REPORT_GRPC_MODULES.format(overrides=overrides),
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        STALLWATCH_FILE_DIR=str(telemetry_dir),
    )

    assert report["shutdown"] is True
    assert report["grpc_modules"] == []


def test_otlp_grpc_protocol_imports_grpc_because_the_user_chose_it():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="the grpc extra")
    closed_port = _free_port()
    report = run_host(
        _REPORT_GRPC_MODULES.format(overrides=""),
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{closed_port}",
        STALLWATCH_SHUTDOWN_TIMEOUT="0.3",
    )

    assert "grpc" in report["grpc_modules"]
    assert "grpc._cython.cygrpc" in report["grpc_modules"]


# ---- console and none ---------------------------------------------------------------------------


def test_console_exporter_prints_the_span_to_stdout():
    report = run_host(
        _SETUP_CHARGE_SHUTDOWN, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none"
    )

    assert report["shutdown"] is True
    assert '"name": "charge-card"' in report["stdout"]


def test_none_exporter_writes_nothing_and_builds_no_processor(telemetry_dir: Path):
    report = run_host(
        """
        import json, logging
        import stallwatch
        from stallwatch import sdk_compat

        session = stallwatch.setup()
        charge_card()
        pipeline = session._pipeline
        spans = sdk_compat.active_span_processor(pipeline.tracer_provider)
        print(json.dumps({
            "span_processors": len(sdk_compat.span_processors(spans)),
            "metric_readers": len(sdk_compat.metric_readers(pipeline.meter_provider)),
            "log_processors": len(pipeline.logger_provider._multi_log_record_processor._log_record_processors),
            "log_handler": repr(pipeline.log_handler),
            "root_handlers": [type(h).__name__ for h in logging.getLogger().handlers],
            "files": {k: str(v) for k, v in session.files.items()},
            "shutdown": stallwatch.shutdown(),
        }))
        """,
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        STALLWATCH_FILE_DIR=str(telemetry_dir),
    )

    assert report["stdout"].count("\n") == 1  # only the report line
    assert not telemetry_dir.exists()
    del report["stdout"], report["stderr"]
    assert report == {
        "span_processors": 0 if FAST_PATHS else 1,  # fast paths off: the heartbeat's current-span noter
        "metric_readers": 0,
        "log_processors": 0,
        "log_handler": "None",
        "root_handlers": [],
        "files": {},
        "shutdown": True,
    }


def test_each_pushed_metrics_exporter_gets_one_periodic_reader_the_sdk_door_lists(telemetry_dir: Path):
    report = run_host(
        """
        import json
        import stallwatch
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from stallwatch import sdk_compat

        session = stallwatch.setup()
        readers = sdk_compat.metric_readers(session._pipeline.meter_provider)
        print(json.dumps({
            "periodic": [isinstance(reader, PeriodicExportingMetricReader) for reader in readers],
            "shutdown": stallwatch.shutdown(),
        }))
        """,
        OTEL_METRICS_EXPORTER="file,console",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        STALLWATCH_FILE_DIR=str(telemetry_dir),
    )

    # The watchdog flushes the readers the door lists when it reports a freeze: none listed, none flushed.
    assert report["periodic"] == [True, True]
    assert report["shutdown"] is True


# ---- Prometheus scrape endpoint -----------------------------------------------------------------


def test_prometheus_endpoint_on_a_free_port_shows_forks_and_closes_at_shutdown():
    report = run_host(
        """
        import json, urllib.error, urllib.request
        import stallwatch

        session = stallwatch.setup()
        host, port = session.prometheus_address
        fork_a_child()
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        shutdown = stallwatch.shutdown()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
            after_shutdown = "still serving"
        except urllib.error.URLError as exc:
            after_shutdown = type(exc.reason).__name__
        except OSError as exc:
            after_shutdown = type(exc).__name__
        print(json.dumps({"port": port, "scrape": scrape, "shutdown": shutdown, "after_shutdown": after_shutdown}))
        """,
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT="0",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
    )

    assert report["port"] not in (0, 9464)
    fork_series = [
        line
        for line in report["scrape"].splitlines()
        if line.startswith("stallwatch_fork_count_total{")
        and 'stallwatch_fork_kind="fork"' in line
        and not line.endswith(" 0.0")
    ]
    assert len(fork_series) == 1 and fork_series[0].endswith(" 1.0"), report["scrape"]
    assert report["shutdown"] is True
    # The scrape port is released, so a restarted pipeline can bind it and scrapers fail fast.
    assert report["after_shutdown"] == "ConnectionRefusedError"


def test_prometheus_port_in_use_by_another_program_turns_telemetry_off_naming_the_port_variable():
    with HeldPort() as port:
        report = run_host(
            """
            import json
            import stallwatch

            from opentelemetry import trace

            session = stallwatch.setup()
            print(json.dumps({
                "telemetry_enabled": session.telemetry_enabled,
                "error": session.error,
                "tracer_provider": type(trace.get_tracer_provider()).__name__,
            }))
            """,
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        )

    assert report["telemetry_enabled"] is False
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" in report["error"]
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" in report["stderr"]
    # Off means off: no half-built pipeline keeps exporting spans behind the session's back.
    assert report["tracer_provider"] == "ProxyTracerProvider"


# ---- shutdown is bounded ------------------------------------------------------------------------


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An OTLP endpoint that accepts connections and never answers (tests/scenarios/reliability_collectors.py)."""
    with serve("silent") as endpoint:
        yield endpoint


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_shutdown_returns_within_the_timeout_when_the_collector_hangs(silent_endpoint: str):
    started = time.monotonic()
    report = run_host(
        """
        import json, time
        import stallwatch

        stallwatch.setup()
        charge_card()
        started = time.monotonic()
        finished = stallwatch.shutdown()
        print(json.dumps({"finished": finished, "seconds": time.monotonic() - started}))
        """,
        OTEL_EXPORTER_OTLP_ENDPOINT=silent_endpoint,
        OTEL_EXPORTER_OTLP_TIMEOUT="60",  # what an unbounded shutdown would wait: far above the bounds below
        STALLWATCH_SHUTDOWN_TIMEOUT="1",
    )
    host_seconds = time.monotonic() - started

    assert report["finished"] is False
    assert 0.9 <= report["seconds"] < 10
    assert "STALLWATCH_SHUTDOWN_TIMEOUT" in report["stderr"]
    # Interpreter exit is not held up by the export still stuck on the socket either.
    assert host_seconds < 30


# The host's exporters are built at its shutdown, slowly: an import finder that sleeps before the first
# import of `requests` (the OTLP/HTTP exporters load it), as a cold disk or a contended CPU would make
# that build slow. A sleep, not CPU hogs: it makes the build outlast the budget on any machine, without
# loading the CPU of the tests beside it.
_SLOW_BUILD_AT_SHUTDOWN = """
    import importlib.abc, json, sys, time
    import stallwatch

    class SlowDisk(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "requests":
                time.sleep(BUILD_SECONDS)
            return None  # the import itself is left to the stock finders

    stallwatch.setup()
    charge_card()
    sys.meta_path.insert(0, SlowDisk())
    built_before = "requests" in sys.modules
    started = time.monotonic()
    finished = stallwatch.shutdown()
    print(json.dumps({"finished": finished, "seconds": time.monotonic() - started, "built_before": built_before,
                      "built": "requests" in sys.modules}))
"""
_NO_EXPORT_BEFORE_SHUTDOWN = {  # the first export is the shutdown's
    "OTEL_BSP_SCHEDULE_DELAY": "60000",
    "OTEL_BLRP_SCHEDULE_DELAY": "60000",
    "OTEL_METRIC_EXPORT_INTERVAL": "60000",
}


def test_a_host_whose_first_export_is_its_shutdown_builds_its_exporters_outside_the_budget_and_exports():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    with serving() as collector:
        report = run_host(
            _SLOW_BUILD_AT_SHUTDOWN.replace("BUILD_SECONDS", "1.5"),
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            STALLWATCH_SHUTDOWN_TIMEOUT="1",
            STALLWATCH_WATCHDOG="false",
            **_NO_EXPORT_BEFORE_SHUTDOWN,
        )
        paths = {path for path, _ in collector.requests}

    if report["built_before"]:  # SDKs without the metric exporter's preferences door, or the fast paths off
        pytest.skip("the OTLP/HTTP metric exporter is built at setup() here: no build is left for the shutdown")
    assert report["finished"] is True, report["stderr"]
    assert report["built"] is True
    assert report["seconds"] >= 1.5  # the build alone outlasted the 1 s budget
    assert "STALLWATCH_SHUTDOWN_TIMEOUT" not in report["stderr"]
    assert paths >= {"/v1/traces", "/v1/logs", "/v1/metrics"}, paths
    assert any(b"charge-card" in body for body in collector.bodies("/v1/traces"))


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_a_host_whose_first_export_is_its_shutdown_still_waits_only_the_budget_on_a_collector_that_never_answers(
    silent_endpoint: str,
):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    report = run_host(
        _SLOW_BUILD_AT_SHUTDOWN.replace("BUILD_SECONDS", "1.5"),
        OTEL_EXPORTER_OTLP_ENDPOINT=silent_endpoint,
        OTEL_EXPORTER_OTLP_TIMEOUT="60",  # what an unbounded shutdown would wait: far above the bounds below
        STALLWATCH_SHUTDOWN_TIMEOUT="1",
        STALLWATCH_WATCHDOG="false",
        **_NO_EXPORT_BEFORE_SHUTDOWN,
    )

    if report["built_before"]:  # SDKs without the metric exporter's preferences door, or the fast paths off
        pytest.skip("the OTLP/HTTP metric exporter is built at setup() here: no build is left for the shutdown")
    assert report["finished"] is False
    # The 1.5 s build, then the 1 s budget on the collector; the bound leaves room for a loaded machine
    # and stays far below the 60 s export timeout and the 1.5 + 5 s the build cap would allow.
    assert 2.4 <= report["seconds"] < 6
    assert report["built"] is True
    assert "telemetry shutdown did not finish within 1.0s" in report["stderr"]


def test_the_inline_shutdown_of_a_process_that_can_start_no_thread_leaves_the_build_out_of_its_budget():
    # Python 3.12+ at exit in a fork child: the shutdown runs on the exiting thread, cut by SIGALRM.
    from opentelemetry.sdk.trace.export import SpanExportResult

    from stallwatch.export.lazy import LazyExporter
    from stallwatch.pipeline import _bounded_inline

    def slow_build() -> object:
        time.sleep(0.6)  # the build's imports on a loaded machine: three times the budget below
        return object()

    building = LazyExporter(slow_build, SpanExportResult.FAILURE)
    assert _bounded_inline(building.built, 0.2) is True

    never_answered = threading.Event()
    stuck = LazyExporter(slow_build, SpanExportResult.FAILURE)
    assert _bounded_inline(lambda: (stuck.built(), never_answered.wait(60)), 0.2) is False
    assert stuck.built() is not None  # built once, by the shutdown cut off while it waited


@pytest.mark.parametrize("imported_first", [False, True], ids=["uvloop-not-imported", "uvloop-imported"])
def test_the_resource_carries_the_installed_uvloop_version_whether_or_not_the_host_imported_uvloop(imported_first):
    pytest.importorskip("uvloop")
    code = (
        ("import uvloop\n" if imported_first else "") + "import importlib.metadata, json, sys, stallwatch\n"
        "from opentelemetry import trace\n"
        "stallwatch.setup()\n"
        "attributes = trace.get_tracer_provider().resource.attributes\n"
        "print(json.dumps([attributes.get('stallwatch.uvloop.version'), importlib.metadata.version('uvloop'),\n"
        "                  'uvloop' in sys.modules]))\n"
    )
    proc = run_python(code, env={**clean_env(), "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                                 "OTEL_LOGS_EXPORTER": "none", "STALLWATCH_WATCHDOG": "false"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    carried, installed, loaded = json.loads(proc.stdout.splitlines()[-1])

    assert carried == installed
    assert loaded is imported_first  # the version is read without importing uvloop


def test_a_session_equals_one_with_equal_fields_is_unhashable_and_shows_its_fields_as_its_dataclass_did():
    from stallwatch import FORK_SAFETY
    from stallwatch.config import Settings
    from stallwatch.session import Session

    settings = Settings.load(environ={})
    session = Session(settings, FORK_SAFETY, error="off")

    assert session == Session(settings, FORK_SAFETY, {}, "off")
    assert session != Session(settings, FORK_SAFETY, error="other")
    assert session.files == {} and session.files is not Session(None, FORK_SAFETY).files
    assert repr(session) == (
        f"Session(settings={settings!r}, fork_safety={FORK_SAFETY!r}, files={{}}, error='off', _pipeline=None, "
        "_watchdog=None, _journal=None)"
    )
    with pytest.raises(TypeError):
        hash(session)


_RESOURCES = """
import json
import stallwatch
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource

stallwatch.setup()
ours = dict(trace.get_tracer_provider().resource.attributes)
own = {key: value for key, value in ours.items() if key.startswith("stallwatch.") or key == "service.instance.id"}
stock = dict(Resource.create(own).attributes)
print(json.dumps({"ours": ours, "stock": stock}))
"""


@pytest.mark.parametrize("fast", [True, False], ids=["fast-paths", "no-fast-paths"])
@pytest.mark.parametrize("named", [False, True], ids=["default-service-name", "OTEL_SERVICE_NAME"])
def test_the_resource_is_the_one_resource_create_makes_from_the_same_attributes(fast, named):
    env = {**clean_env(), "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "STALLWATCH_WATCHDOG": "false", "STALLWATCH_INSTRUMENT_EXECUTOR": "false",
           "STALLWATCH_FAST_PATHS": str(fast).lower(),
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,a=b"}  # fmt: skip
    if named:
        env["OTEL_SERVICE_NAME"] = "billing"
    proc = run_python(_RESOURCES, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])

    assert seen["ours"] == seen["stock"]
    # The default is "unknown_service", on newer SDKs followed by ":" and the executable's name.
    default = seen["ours"]["service.name"].startswith("unknown_service")
    assert seen["ours"]["service.name"] == "billing" if named else default
    assert seen["ours"]["a"] == "b"


def test_a_lazy_exporter_whose_first_build_fails_fails_that_batch_warns_once_and_builds_at_the_next_export(caplog):
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stallwatch.export.lazy import LazyExporter

    built = InMemorySpanExporter()
    attempts = []

    def build() -> InMemorySpanExporter:  # fails twice, as an import racing the host's may
        attempts.append(len(attempts))
        if len(attempts) <= 2:
            raise ImportError("deadlock detected by _ModuleLock('requests')")
        return built

    lazy = LazyExporter(build, SpanExportResult.FAILURE)
    spans = [ReadableSpan(name=f"s{n}") for n in range(4)]
    with caplog.at_level("WARNING", logger="stallwatch"):
        results = [lazy.export([span]) for span in spans]

    assert results == [SpanExportResult.FAILURE, SpanExportResult.FAILURE, SpanExportResult.SUCCESS,
                       SpanExportResult.SUCCESS]  # fmt: skip
    assert [span.name for span in built.get_finished_spans()] == ["s2", "s3"]
    assert len(attempts) == 3
    assert [record.getMessage() for record in caplog.records if "can be built" in record.getMessage()] == [
        "stallwatch: deadlock detected by _ModuleLock('requests'); this signal's batches fail until it can be built."
    ]
