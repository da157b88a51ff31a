"""Bad input and settings: every invalid value gives one clear error naming what to fix, and a bad
setting never takes the host (or its fork guard) down unless the user asked for strictness."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from conftest import clean_env, read_jsonl, run_python
from stallwatch import config
from stallwatch.config import ConfigError, Settings

# One or more values each setting must refuse. Keys are the variables `Settings.load()` reads.
BAD_VALUES: dict[str, tuple[str, ...]] = {
    "OTEL_SDK_DISABLED": ("maybe",),
    "OTEL_SERVICE_NAME": ("   ",),
    "OTEL_RESOURCE_ATTRIBUTES": ("novalue", "=orphan"),
    "OTEL_TRACES_EXPORTER": ("zipkin", "otlp,none"),
    "OTEL_METRICS_EXPORTER": ("otlp,none", "jaeger"),
    "OTEL_LOGS_EXPORTER": ("prometheus",),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("localhost:4318", "ftp://x", "http://host:99999", "http://"),
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ("localhost:4318", "ftp://x", "http://host:99999"),
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ("localhost:4318", "ftp://x", "http://host:99999"),
    "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": ("localhost:4318", "ftp://x", "http://host:99999"),
    "OTEL_EXPORTER_OTLP_PROTOCOL": ("http/json",),
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": ("http/json",),
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": ("http/json",),
    "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": ("http/json",),
    "OTEL_TRACES_SAMPLER": ("sometimes",),
    "OTEL_TRACES_SAMPLER_ARG": ("1.5", "abc", "-0.1"),
    "OTEL_METRIC_EXPORT_INTERVAL": ("-5", "0", "1.5s"),
    "OTEL_EXPORTER_PROMETHEUS_HOST": ("   ",),
    "OTEL_EXPORTER_PROMETHEUS_PORT": ("70000", "-1", "http"),
    "STALLWATCH_SHED_SPANS": ("sometimes",),
    "STALLWATCH_PROVIDERS": ("both",),
    "STALLWATCH_FILE_DIR": ("   ",),
    "STALLWATCH_LOG_LEVEL": ("LOUD",),
    "STALLWATCH_SHUTDOWN_TIMEOUT": ("-1", "0", "inf", "nan", "abc"),
    "STALLWATCH_SLOW_EXPORT_SECONDS": ("-1", "-0.5", "inf", "nan", "1e10", "abc"),
    "STALLWATCH_STRICT": ("perhaps",),
    "STALLWATCH_INSTRUMENT_EXECUTOR": ("sometimes",),
    "STALLWATCH_EXECUTOR_HEAL": ("2",),
    "STALLWATCH_GUARD_ASYNC_EXC": ("enabled",),
    "STALLWATCH_WEDGE_CHECK_INTERVAL": ("0", "-0.5", "fast"),
    "STALLWATCH_QUEUE_STALL_SECONDS": ("nan", "inf"),
    "STALLWATCH_WATCHDOG": ("maybe",),
    "STALLWATCH_WATCHDOG_FORKED_WORKERS": ("workers",),
    "STALLWATCH_INSTRUMENT_SUBPROCESS": ("perhaps",),
    "STALLWATCH_RECORD_ARGS": ("all",),
    "STALLWATCH_SCRUB_PATTERNS": ("pass(word", "ok,[unclosed"),
    "STALLWATCH_PROPAGATE_TO_CHILDREN": ("2",),
    "STALLWATCH_UVLOOP_SPAWN": ("posix_spawn", "VFORK!"),
    "STALLWATCH_INSTRUMENT_SSH": ("sshh",),
    "STALLWATCH_INSTRUMENT_NEBIUS": ("cloud",),
    "STALLWATCH_JOURNAL": ("durable",),
    "STALLWATCH_JOURNAL_DIR": ("   ",),
    "STALLWATCH_FREEZE_THRESHOLD": ("0", "-1", "soon"),
    "STALLWATCH_FAULTHANDLER": ("stacks",),
    "STALLWATCH_WATCHDOG_PROMETHEUS_PORT": ("99999", "http"),
}


class _NotASetting:
    def __repr__(self) -> str:
        return "<not a setting>"


# The same mistakes made through `setup(**overrides)` / `Settings.load(**overrides)`.
BAD_KEYWORDS: list[tuple[str, object]] = [
    ("disabled", "maybe"),
    ("service_name", "   "),
    ("resource_attributes", "novalue"),
    ("traces_exporter", "zipkin"),
    ("traces_exporter", ["otlp", "zipkin"]),
    ("metrics_exporter", "otlp,none"),
    ("logs_exporter", "prometheus"),
    ("otlp_endpoint", "localhost:4318"),
    ("otlp_protocol", "http/json"),
    ("signal_protocols", {"traces": "http/json"}),
    ("signal_protocols", "grpc"),
    ("sampler", "sometimes"),
    ("sampler_arg", 1.5),
    ("metric_export_interval_ms", 0),
    ("prometheus_host", "   "),
    ("prometheus_port", 70000),
    ("providers", "both"),
    ("file_dir", "   "),
    ("log_level", "LOUD"),
    ("shutdown_timeout", -1),
    ("shutdown_timeout", float("inf")),
    ("shutdown_timeout", _NotASetting()),
    ("strict", "perhaps"),
]

_SETTING_NAME = re.compile(r"\b(?:OTEL|STALLWATCH)_[A-Z_]+\b")


def _log_bodies(path: Path) -> list[str]:
    return [
        record["body"]["stringValue"]
        for request in read_jsonl(path)
        for resource_logs in request["resourceLogs"]
        for scope_logs in resource_logs["scopeLogs"]
        for record in scope_logs["logRecords"]
    ]


def _bad_settings() -> list[tuple[str, str]]:
    return [(variable, value) for variable, values in BAD_VALUES.items() for value in values]


def test_every_parsed_variable_has_bad_values_to_refuse():
    parsed = {option.env for option in config.OPTIONS if option.keyword is not None}
    assert parsed <= set(BAD_VALUES), f"add bad values for {sorted(parsed - set(BAD_VALUES))}"


@pytest.mark.parametrize(("variable", "value"), _bad_settings())
def test_bad_variable_gives_one_error_naming_it(variable, value):
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={variable: value})

    message = str(caught.value)
    # The on-call engineer reads which variable, what it held and what it accepts, and nothing else.
    assert message.startswith(f"{variable}={value!r} is invalid: expected ")
    assert set(_SETTING_NAME.findall(message)) == {variable}


@pytest.mark.parametrize(("keyword", "value"), BAD_KEYWORDS, ids=lambda v: str(v)[:20])
def test_bad_keyword_override_names_the_keyword(keyword, value):
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={}, **{keyword: value})

    message = str(caught.value)
    assert message.startswith(keyword), message
    assert not _SETTING_NAME.findall(message), f"a keyword mistake must not blame a variable: {message}"


@pytest.mark.parametrize(
    ("keyword", "value", "expected"),
    [
        ("log_level", logging.DEBUG, logging.DEBUG),
        ("log_level", "info", logging.INFO),
        ("file_dir", Path("/var/lib/app/telemetry"), Path("/var/lib/app/telemetry")),
        ("resource_attributes", {"deployment.environment": "prod"}, {"deployment.environment": "prod"}),
        ("traces_exporter", ("console", "file"), ("console", "file")),
        ("metrics_exporter", "none", ()),
        ("shutdown_timeout", 2, 2.0),
        ("disabled", True, True),
        ("prometheus_port", 0, 0),
        ("sampler_arg", 0.25, 0.25),
    ],
    ids=lambda v: str(v)[:20],
)
def test_keyword_override_accepts_the_fields_own_type(keyword, value, expected):
    assert getattr(Settings.load(environ={}, **{keyword: value}), keyword) == expected


def test_unknown_keyword_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={}, shutdown_timout=2)

    message = str(caught.value)
    assert "shutdown_timout" in message
    for accepted in ("shutdown_timeout", "traces_exporter", "file_dir", "strict"):
        assert accepted in message


def test_exporters_default_to_file_without_an_endpoint():
    settings = Settings.load(environ={})

    assert (settings.traces_exporter, settings.metrics_exporter, settings.logs_exporter) == (("file",),) * 3


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector:4318/v1/traces"},
    ],
)
def test_exporters_default_to_otlp_when_an_endpoint_is_set(environ):
    settings = Settings.load(environ=environ)

    assert (settings.traces_exporter, settings.metrics_exporter, settings.logs_exporter) == (("otlp",),) * 3


def test_explicit_exporter_wins_over_the_endpoint_default():
    settings = Settings.load(
        environ={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_LOGS_EXPORTER": "none",
        },
        metrics_exporter="prometheus",
    )

    assert settings.traces_exporter == ("console",)
    assert settings.metrics_exporter == ("prometheus",)
    assert settings.logs_exporter == ()


def test_keyword_override_wins_over_the_environment():
    settings = Settings.load(environ={"STALLWATCH_SHUTDOWN_TIMEOUT": "abc"}, shutdown_timeout=3)

    assert settings.shutdown_timeout == 3.0


# ---- in a fresh interpreter: what a host importing stallwatch sees ------------------------------

_REPORT_AFTER_AUTO = """
    import json, os
    import stallwatch.auto
    print("host code after the import runs")
    from stallwatch.forksafe import guard
    session = stallwatch.auto.SESSION
    print(json.dumps({
        "guard_installed": guard.installed(),
        "grpc_fork_support": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
        "telemetry_enabled": session.telemetry_enabled,
        "error": session.error,
    }))
"""


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318"),
        ("STALLWATCH_SHUTDOWN_TIMEOUT", "abc"),
    ],
)
def test_import_auto_with_a_bad_setting_keeps_the_host_running_and_the_fork_guard_on(variable, value, telemetry_dir):
    proc = run_python(_REPORT_AFTER_AUTO, env=clean_env(**{variable: value}, STALLWATCH_FILE_DIR=str(telemetry_dir)))

    assert proc.returncode == 0, proc.stderr
    assert "host code after the import runs" in proc.stdout
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["guard_installed"] is True
    assert report["grpc_fork_support"] == "false"
    assert report["telemetry_enabled"] is False
    assert variable in report["error"]
    # One log line naming the variable, not a traceback.
    assert proc.stderr.count(variable) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not telemetry_dir.exists()


@pytest.mark.parametrize("strict", [True, "true"])
def test_setup_strict_raises_config_error_on_a_bad_setting(strict):
    proc = run_python(
        f"""
        import stallwatch
        try:
            stallwatch.setup(strict={strict!r})
        except stallwatch.ConfigError as exc:
            print("ConfigError:", exc)
        else:
            print("setup returned")
        """,
        env=clean_env(OTEL_TRACES_EXPORTER="zipkin"),
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ConfigError: OTEL_TRACES_EXPORTER='zipkin'"), proc.stdout + proc.stderr


def test_strict_env_makes_import_auto_fail_naming_the_variable():
    proc = run_python(
        """
        import stallwatch.auto
        print("host code after the import runs")
        """,
        env=clean_env(STALLWATCH_STRICT="true", OTEL_TRACES_EXPORTER="zipkin"),
    )

    assert proc.returncode == 1
    assert "host code after the import runs" not in proc.stdout
    assert "ConfigError: OTEL_TRACES_EXPORTER='zipkin' is invalid" in proc.stderr


def test_setup_is_idempotent(telemetry_dir):
    proc = run_python(
        f"""
        import stallwatch
        first = stallwatch.setup(file_dir={str(telemetry_dir)!r})
        second = stallwatch.setup()
        third = stallwatch.setup(traces_exporter="console")
        print(first is second is third is stallwatch.session.current(), first.settings.traces_exporter)
        stallwatch.shutdown()
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "('file',)"]
    # Once setup() ran, stallwatch's own warnings travel with the host's logs.
    assert _log_bodies(telemetry_dir / "logs.jsonl") == [
        "stallwatch: setup() already ran; ignoring the new settings ['traces_exporter']"
    ]


def test_sdk_disabled_gives_a_session_with_telemetry_off_and_no_files(telemetry_dir):
    proc = run_python(
        """
        import json, logging, os
        import stallwatch
        from opentelemetry import metrics, trace
        from stallwatch.forksafe import guard

        session = stallwatch.setup()
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            logging.getLogger("shop").warning("card declined")
            metrics.get_meter("shop").create_counter("orders").add(1)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({
            "telemetry_enabled": session.telemetry_enabled,
            "files": {k: str(v) for k, v in session.files.items()},
            "shutdown": stallwatch.shutdown(),
            "guard_installed": guard.installed(),
        }))
        """,
        env=clean_env(OTEL_SDK_DISABLED="true", STALLWATCH_FILE_DIR=str(telemetry_dir)),
    )

    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {"telemetry_enabled": False, "files": {}, "shutdown": True, "guard_installed": True}
    assert not telemetry_dir.exists()


@pytest.mark.parametrize("variable", ["STALLWATCH_FORK_GUARD", "STALLWATCH_GRPC_FORK_GUARD"])
def test_bad_fork_guard_flag_is_logged_and_the_guards_stay_on(variable):
    proc = run_python(
        """
        import json, os
        import stallwatch
        from stallwatch.forksafe import guard
        print(json.dumps({
            "guard_installed": guard.installed(),
            "guard_enabled": stallwatch.FORK_SAFETY.guard_enabled,
            "grpc_guard_enabled": stallwatch.FORK_SAFETY.grpc.enabled,
            "grpc_fork_support": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
            "error": stallwatch.FORK_SAFETY.error,
        }))
        """,
        env=clean_env(**{variable: "sometimes"}),
    )

    assert proc.returncode == 0, proc.stderr
    assert f"{variable}='sometimes' is invalid" in proc.stderr
    assert "fork guards stay on" in proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["error"].startswith(f"{variable}=")
    assert report["guard_installed"] is report["guard_enabled"] is report["grpc_guard_enabled"] is True
    assert report["grpc_fork_support"] == "false"


def test_an_unusable_file_dir_is_reported_naming_it_and_the_started_watchdog_is_stopped(tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    proc = run_python(
        f"""
        import json, os, stallwatch
        session = stallwatch.setup(file_dir={str(not_a_directory / "telemetry")!r}, journal=False)
        try:
            left = os.waitpid(-1, os.WNOHANG)  # (0, 0) while a child (the watchdog) still runs
        except ChildProcessError:
            left = None
        print(json.dumps({{"error": session.error, "watchdog_pid": session.watchdog_pid, "child": left}}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["error"] == (
        f"STALLWATCH_FILE_DIR={str(not_a_directory / 'telemetry')!r} is unusable for the `file` exporter "
        "(Not a directory): choose a writable directory, or another exporter"
    )
    assert seen["watchdog_pid"] is None and seen["child"] is None  # started before the pipeline, then reaped
    assert "Traceback" not in proc.stderr
