"""The OpenTelemetry variables the SDK reads itself: a value the SDK fails on never fails
`import stallwatch` or `setup()`; it is reported naming the variable like any bad setting and falls
back to OpenTelemetry's default, in the SDK too.

The SDK is the judge here: each candidate value is tried on the real SDK object that reads it (in
this process) or on the real import (in a fresh interpreter), on whatever SDK version is installed,
which is why this file runs again in the version matrix."""

from __future__ import annotations

import json

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conftest import clean_env, run_python
from otlp_receiver import otlp_spans
from stallwatch import config
from stallwatch.config import Settings

pytestmark = pytest.mark.matrix

LIMIT_VALUES = ("0", "128", " 64 ", "+7", "", "  ", "-1", "ten", "1.5", "unset")
BATCH_VALUES = ("1", "512", "2048", "4096", "", "0", "-5", "soon")
EXEMPLAR_VALUES = ("trace_based", "always_on", "always_off", "", "Always_Off", "sometimes")
# Values both the SDK and stallwatch take, on every SDK version of the matrix.
ACCEPTED = {
    **{variable: ("0", "128", " 64 ", "+7", "", "  ") for variable in config.SDK_LIMITS},  # empty: no limit
    **{f"{prefix}_MAX_QUEUE_SIZE": ("512", "2048") for prefix in ("OTEL_BSP", "OTEL_BLRP")},
    **{f"{prefix}_{name}": ("1", "512") for prefix in ("OTEL_BSP", "OTEL_BLRP") for name in ("SCHEDULE_DELAY",
                                                                                              "MAX_EXPORT_BATCH_SIZE")},
    "OTEL_METRICS_EXEMPLAR_FILTER": ("trace_based", "always_on", "always_off"),
}  # fmt: skip


def _candidates() -> list[tuple[str, str]]:
    pairs = [(variable, value) for variable in config.SDK_LIMITS for value in LIMIT_VALUES]
    batch = [variable for variable in config.SDK_VARIABLES if variable.startswith(("OTEL_BSP_", "OTEL_BLRP_"))]
    pairs += [(variable, value) for variable in batch for value in BATCH_VALUES]
    return pairs + [("OTEL_METRICS_EXEMPLAR_FILTER", value) for value in EXEMPLAR_VALUES]


def _build_what_reads(variable: str) -> None:
    """Build the SDK objects that read `variable` from the environment, and stop them."""
    if variable in config.SDK_LIMITS:
        from opentelemetry.sdk import _logs
        from opentelemetry.sdk.trace import SpanLimits

        SpanLimits()
        (getattr(_logs, "LogRecordLimits", None) or _logs.LogLimits)()  # LogLimits before SDK 1.39
    elif variable.startswith("OTEL_BSP_"):
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        BatchSpanProcessor(InMemorySpanExporter()).shutdown()
    elif variable.startswith("OTEL_BLRP_"):
        from opentelemetry.sdk._logs import export

        exporter = getattr(export, "InMemoryLogRecordExporter", None) or export.InMemoryLogExporter
        export.BatchLogRecordProcessor(exporter()).shutdown()
    else:
        from opentelemetry.sdk.metrics import MeterProvider

        MeterProvider().shutdown()


def _sdk_refuses(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> bool:
    with monkeypatch.context() as patched:
        patched.setenv(variable, value)
        try:
            _build_what_reads(variable)
        except ValueError:
            return True
    return False


def test_every_value_the_sdk_refuses_is_refused_by_settings_naming_the_variable(monkeypatch):
    refused_by_sdk = []
    for variable, value in _candidates():
        if _sdk_refuses(monkeypatch, variable, value):
            refused_by_sdk.append((variable, value))
            (problem,) = Settings.load(environ={variable: value}).problems
            assert problem.setting == variable
            assert str(problem).startswith(f"{variable}={value!r} is invalid: expected "), str(problem)
    # Every SDK of the matrix refuses these, so the loop above checked something.
    assert {("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-1"), ("OTEL_BSP_SCHEDULE_DELAY", "0")} <= set(refused_by_sdk)
    assert ("OTEL_BLRP_MAX_EXPORT_BATCH_SIZE", "4096") in refused_by_sdk  # larger than the default queue


@pytest.mark.parametrize("variable", sorted(ACCEPTED))
def test_values_the_sdk_takes_are_taken(monkeypatch, variable):
    for value in ACCEPTED[variable]:
        assert not _sdk_refuses(monkeypatch, variable, value), (variable, value)
        assert Settings.load(environ={variable: value}).problems == ()


@pytest.mark.parametrize(
    ("environ", "messages"),
    [
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"},
         ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE='200' is invalid: expected at most OTEL_BSP_MAX_QUEUE_SIZE (100); using "
          "the default 512",  # which the queue size is smaller than, as if the batch size had not been set:
          "OTEL_BSP_MAX_QUEUE_SIZE='100' is invalid: expected at least OTEL_BSP_MAX_EXPORT_BATCH_SIZE (512, its "
          "default); using the default 2048"]),
        ({"OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "4096"},
         ["OTEL_BLRP_MAX_EXPORT_BATCH_SIZE='4096' is invalid: expected at most OTEL_BLRP_MAX_QUEUE_SIZE (2048); "
          "using the default 512"]),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "100"},
         ["OTEL_BSP_MAX_QUEUE_SIZE='100' is invalid: expected at least OTEL_BSP_MAX_EXPORT_BATCH_SIZE (512, its "
          "default); using the default 2048"]),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "300", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"}, []),
    ],
)  # fmt: skip
def test_a_batch_larger_than_its_queue_is_refused_naming_what_was_set(environ, messages):
    assert [str(problem) for problem in Settings.load(environ=environ).problems] == messages


# ---- at import: the variables OpenTelemetry reads when its modules load ---------------------------

_PROBE = """
import json, os, subprocess, sys
import stallwatch.auto
import stallwatch

variable = {variable!r}
session = stallwatch.auto.SESSION
child = subprocess.run([sys.executable, "-c", f"import os; print(repr(os.environ.get({{variable!r}})))"],
                       capture_output=True, text=True, check=True)
from opentelemetry import propagate, trace
with trace.get_tracer("probe").start_as_current_span("request"):
    carrier = {{}}
    propagate.inject(carrier)
print(json.dumps({{"error": session.error, "problems": [str(problem) for problem in session.config_problems],
                  "kept": os.environ.get(variable), "child": child.stdout.strip(),
                  "guard": stallwatch.FORK_SAFETY.guard_enabled, "injected": sorted(carrier)}}))
"""


def _import_fails_without_stallwatch(variable: str, value: str) -> bool:
    env = {**clean_env(), variable: value}
    return run_python("import opentelemetry.propagate, opentelemetry.sdk.trace", env=env).returncode != 0


def _probe(tmp_path, variable: str, value: str, **extra: str) -> tuple[int, dict, str]:
    env = {**clean_env(), variable: value, "STALLWATCH_FILE_DIR": str(tmp_path), "STALLWATCH_WATCHDOG": "false",
           "STALLWATCH_JOURNAL": "false", **extra}  # fmt: skip
    proc = run_python(_PROBE.format(variable=variable), env=env)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if proc.returncode == 0 else {}, proc.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [("OTEL_PROPAGATORS", "tracecontext,no-such-propagator"), ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-1")],
)
def test_a_value_opentelemetry_fails_to_import_with_never_fails_the_import(tmp_path, variable, value):
    fails_alone = _import_fails_without_stallwatch(variable, value)
    code, seen, stderr = _probe(tmp_path, variable, value)
    assert code == 0, stderr
    assert seen["guard"] is True and seen["error"] is None
    (problem,) = seen["problems"]
    assert problem.startswith(f"{variable}={value!r} is invalid: expected "), seen
    assert stderr.strip() == f"stallwatch: {problem}.", stderr  # one line, at import or at setup()
    if fails_alone:  # removed at import, so that OpenTelemetry loads
        assert problem.endswith("; removed from this process's environment, so OpenTelemetry uses its default" +
                                (" (tracecontext,baggage)" if variable == "OTEL_PROPAGATORS" else ""))  # fmt: skip
    # Either way the SDK, and the children, which inherit the environment, do without it.
    assert seen["kept"] is None and seen["child"] == "None"
    assert seen["injected"] == ["traceparent"]  # by the default propagators (baggage only when there is some)
    if variable == "OTEL_PROPAGATORS":
        assert fails_alone  # on every SDK of the matrix


def test_strict_fails_the_import_naming_the_variable(tmp_path):
    code, _, stderr = _probe(tmp_path, "OTEL_PROPAGATORS", "bogus", STALLWATCH_STRICT="true")
    assert code != 0
    assert "ConfigError: OTEL_PROPAGATORS='bogus' is invalid: expected comma-separated names of installed " in stderr
    assert "(OpenTelemetry fails to import with it: " in stderr


def test_a_propagator_opentelemetry_knows_is_left_alone(tmp_path):
    code, seen, stderr = _probe(tmp_path, "OTEL_PROPAGATORS", "tracecontext")
    assert code == 0, stderr
    assert seen == {"error": None, "problems": [], "kept": "tracecontext", "child": "'tracecontext'", "guard": True,
                    "injected": ["traceparent"]}  # fmt: skip


@pytest.mark.parametrize(
    ("variable", "value"),
    [("OTEL_BSP_SCHEDULE_DELAY", "-5"), ("OTEL_ATTRIBUTE_COUNT_LIMIT", "-3"), ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s")],
)
def test_a_value_the_sdk_would_fail_on_falls_back_to_its_default_and_telemetry_stays_on(tmp_path, variable, value):
    env = {**clean_env(), variable: value}
    proc = run_python(
        f"""
        import json, os, stallwatch
        from opentelemetry import trace
        session = stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False, journal=False)
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            pass
        print(json.dumps({{"problems": [str(problem) for problem in session.config_problems],
                          "telemetry_enabled": session.telemetry_enabled, "kept": os.environ.get({variable!r}),
                          "shutdown": stallwatch.shutdown(10)}}))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    (problem,) = seen["problems"]
    assert problem.startswith(f"{variable}={value!r} is invalid: expected "), problem
    assert proc.stderr.strip() == f"stallwatch: {problem}."
    # The SDK, which would have failed on it, does without it: the span is exported.
    assert seen["kept"] is None and seen["telemetry_enabled"] is seen["shutdown"] is True
    assert '"name":"charge-card"' in (tmp_path / "traces.jsonl").read_text()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"])
def test_the_sdk_uses_the_fallback_of_a_refused_variable_it_reads_itself(receiver, variable):
    """The OTLP exporter reads the per-signal endpoint, the SDK's resource the service name: refused, they
    must not reach it, or spans would go to the bad URL and carry the blank name."""
    bad = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:99999/v1/traces", "OTEL_SERVICE_NAME": "   "}
    env = {**clean_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "STALLWATCH_WATCHDOG": "false", variable: bad[variable]}  # fmt: skip
    proc = run_python(
        """
        import stallwatch
        from opentelemetry import trace
        session = stallwatch.setup()
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            pass
        print([problem.setting for problem in session.config_problems], stallwatch.shutdown(10))
        """,
        env=env,
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"['{variable}']", "True"], proc.stdout + proc.stderr
    assert [span.name for span in otlp_spans(receiver)] == ["charge-card"]  # sent to the general endpoint
    (request,) = receiver.bodies("/v1/traces")
    (resource_spans,) = ExportTraceServiceRequest.FromString(request).resource_spans
    resource = {attribute.key: attribute.value.string_value for attribute in resource_spans.resource.attributes}
    assert resource["service.name"].startswith("unknown_service")


# ---- the OTLP exporters' own variables ---------------------------------------------------------------

TIMEOUT_VALUES = ("10", "0.5", "1e3", " 7 ", "", "abc", "10s")


def _grpc_exporter_refuses(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> bool:
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    with monkeypatch.context() as patched:
        patched.setenv(variable, value)
        try:
            for exporter in (OTLPSpanExporter, OTLPMetricExporter, OTLPLogExporter):
                exporter(endpoint="http://127.0.0.1:9", insecure=True).shutdown()
        except ValueError:
            return True
    return False


def test_every_timeout_the_grpc_exporters_refuse_is_refused_naming_it(monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", reason="the grpc extra")
    refused = []
    for variable in config.OTLP_TIMEOUTS:
        for value in TIMEOUT_VALUES:
            problems = Settings.load(environ={variable: value}).problems
            if _grpc_exporter_refuses(monkeypatch, variable, value):
                refused.append((variable, value))
                (problem,) = problems
                assert str(problem).startswith(f"{variable}={value!r} is invalid: expected a "), problem
                assert "number of seconds (what the installed Python OTLP exporters read)" in str(problem), problem
            else:
                assert problems == ()
    assert ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc") in refused and ("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT", "10s") in refused


def test_an_exporter_that_cannot_be_built_is_reported_naming_the_variables_set(tmp_path, monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", reason="the grpc extra")
    with monkeypatch.context() as patched:  # the judge: this SDK's gRPC exporter refuses the compression
        patched.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "bogus")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        with pytest.raises(Exception, match="OTEL_EXPORTER_OTLP_COMPRESSION"):
            OTLPSpanExporter(endpoint="http://127.0.0.1:9", insecure=True)
    env = {**clean_env(), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_COMPRESSION": "bogus",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}  # fmt: skip
    proc = run_python(
        f"""
        import json, stallwatch
        from opentelemetry import trace
        session = stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False, journal=False)
        print(json.dumps({{"error": session.error, "provider": type(trace.get_tracer_provider()).__name__}}))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["error"].startswith(
        "the OTLP traces exporter (grpc) cannot be built from the OTEL_EXPORTER_OTLP_* variables (set: "
        "OTEL_EXPORTER_OTLP_COMPRESSION, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL): "
    ), seen
    assert "OTEL_EXPORTER_OTLP_COMPRESSION" in seen["error"].split("): ", 1)[1]  # the exporter's own words
    assert seen["provider"] == "ProxyTracerProvider"  # nothing half-installed: telemetry is off
    assert f"stallwatch: {seen['error']}. Telemetry is off; the fork guard stays on." in proc.stderr


# ---- warnings as errors ---------------------------------------------------------------------------------


def test_setup_works_with_warnings_as_errors(tmp_path):
    """`-W error` (or pytest's `filterwarnings = error`) in the host: a deprecation inside the SDK that
    stallwatch uses (SDK 1.45 deprecates its LoggingHandler) must not fail setup()."""
    env = {**clean_env(), "PYTHONWARNINGS": "error", "STALLWATCH_FILE_DIR": str(tmp_path),
           "STALLWATCH_WATCHDOG": "false", "STALLWATCH_JOURNAL": "false"}  # fmt: skip
    proc = run_python(
        """
        import logging, stallwatch.auto, stallwatch
        from opentelemetry import trace
        with trace.get_tracer("probe").start_as_current_span("request"):
            logging.getLogger("host").warning("served")
        print(stallwatch.auto.SESSION.error, stallwatch.shutdown())
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "True"], proc.stdout + proc.stderr
    assert "served" in (tmp_path / "logs.jsonl").read_text()
    assert '"name":"request"' in (tmp_path / "traces.jsonl").read_text()
