"""Bad input and settings: a bad value costs only its own setting, as in OpenTelemetry. It falls back
to its default with one log line naming the variable or keyword, the value (secrets redacted), what it
accepts and what is used instead, and everything else (fork guard, watchdog, exporters) keeps working,
unless the user asked for strictness."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from conftest import clean_env, otlp_items, read_jsonl, run_python
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
    "STALLWATCH_FAST_PATHS": ("sometimes",),
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
    "STALLWATCH_PROMETHEUS_TARGETS_DIR": ("   ",),
    "STALLWATCH_FREEZE_THRESHOLD": ("0", "-1", "soon"),
    "STALLWATCH_FAULTHANDLER": ("stacks",),
    "STALLWATCH_WATCHDOG_PROMETHEUS_PORT": ("99999", "http"),
    "STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT": ("-1", "inf", "a while"),
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


_DOCUMENTED = {option.env for option in config.OPTIONS}


def test_every_parsed_variable_has_bad_values_to_refuse():
    parsed = {option.env for option in config.OPTIONS if option.keyword is not None}
    assert parsed <= set(BAD_VALUES), f"add bad values for {sorted(parsed - set(BAD_VALUES))}"


@pytest.mark.parametrize(("variable", "value"), _bad_settings())
def test_a_bad_variable_falls_back_to_its_default_with_one_problem_naming_it(variable, value):
    settings = Settings.load(environ={variable: value})

    assert settings == Settings.load(environ={})  # every setting at its default, this one included
    (problem,) = settings.problems
    # The on-call engineer reads which variable, what it held, what it accepts and what is used instead.
    assert problem.setting == variable
    assert str(problem).startswith(f"{variable}={value!r} is invalid: expected ")
    assert problem.fallback.startswith("using the default " if variable in _DOCUMENTED else "using the ")
    assert set(_SETTING_NAME.findall(str(problem))) == {variable}


@pytest.mark.parametrize(("keyword", "value"), BAD_KEYWORDS, ids=lambda v: str(v)[:20])
def test_a_bad_keyword_override_falls_back_with_one_problem_naming_the_keyword(keyword, value):
    settings = Settings.load(environ={}, **{keyword: value})

    assert settings == Settings.load(environ={})
    (problem,) = settings.problems
    assert problem.setting.startswith(keyword) and str(problem).startswith(keyword), problem
    assert not _SETTING_NAME.findall(str(problem)), f"a keyword mistake must not blame a variable: {problem}"


def test_a_bad_keyword_override_falls_back_to_its_variable():
    settings = Settings.load(environ={"STALLWATCH_SHUTDOWN_TIMEOUT": "3"}, shutdown_timeout="abc")

    assert settings.shutdown_timeout == 3.0
    assert [str(problem) for problem in settings.problems] == [
        "shutdown_timeout='abc' is invalid: expected a positive, finite number of seconds; "
        "using STALLWATCH_SHUTDOWN_TIMEOUT instead"
    ]


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


def test_an_unknown_keyword_is_reported_with_the_closest_setting_and_ignored():
    settings = Settings.load(environ={}, shutdown_timout=2, traces_exporter="console")

    assert settings.traces_exporter == ("console",) and settings.shutdown_timeout == 1.0
    assert [str(problem) for problem in settings.problems] == [
        "setup() keyword 'shutdown_timout' is not a setting (did you mean shutdown_timeout?); ignored"
    ]
    (unlike_any,) = Settings.load(environ={}, colour="blue").problems
    for accepted in ("shutdown_timeout", "traces_exporter", "file_dir", "strict"):
        assert accepted in unlike_any.error
    with pytest.raises(ConfigError, match="shutdown_timout"):
        Settings.load(environ={}, shutdown_timout=2, strict=True)


_BOOLEAN_OPTIONS = [
    option for option in config.OPTIONS if option.keyword and type(getattr(Settings(), option.keyword)) is bool
]


def test_a_boolean_accepts_exactly_the_words_its_error_lists_in_any_case_and_spacing(monkeypatch):
    (problem,) = Settings.load(environ={"STALLWATCH_WATCHDOG": "maybe"}).problems
    listed = re.fullmatch(r".* is invalid: expected (?P<true>.+?) or (?P<false>.+) \(any case\)", problem.error)
    assert listed, problem.error
    words = {word: meaning for meaning in (True, False) for word in listed[str(meaning).lower()].split(", ")}
    assert len(words) == 8

    for option in _BOOLEAN_OPTIONS:
        for word, meaning in words.items():
            for spelled in (word, word.upper(), word.title(), f"  {word}\t"):
                settings = Settings.load(environ={option.env: spelled})
                assert (getattr(settings, option.keyword), settings.problems) == (meaning, ()), (option.env, spelled)
        for unlisted in ("y", "n", "t", "enabled", "2", "tru", "on!", "  "):
            settings = Settings.load(environ={option.env: unlisted})
            assert [problem.setting for problem in settings.problems] == [option.env], (option.env, unlisted)
    for word, meaning in words.items():  # the flags read at `import stallwatch`, too
        monkeypatch.setenv("STALLWATCH_FORK_GUARD", f" {word.upper()} ")
        assert config.env_flag("STALLWATCH_FORK_GUARD", not meaning) is meaning


@pytest.mark.parametrize(
    ("keywords", "variables"), [({"strict": True}, {}), ({"strict": "on"}, {}), ({}, {"STALLWATCH_STRICT": " TRUE "})]
)
def test_strict_raises_naming_every_bad_setting_not_only_the_first(keywords, variables):
    bad_values = {
        "OTEL_TRACES_EXPORTER": "zipkin",
        "STALLWATCH_WATCHDOG": "maybe",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "http",
    }

    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={**bad_values, **variables}, **keywords)

    bad = ["OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_PROMETHEUS_PORT", "STALLWATCH_WATCHDOG"]
    assert [problem.setting for problem in caught.value.problems] == bad
    assert str(caught.value) == "; ".join(problem.error for problem in caught.value.problems)
    assert "using the default" not in str(caught.value)  # nothing is used instead: it raises


def test_a_bad_strict_counts_as_false_and_is_reported():
    settings = Settings.load(environ={"STALLWATCH_STRICT": "perhaps", "STALLWATCH_WATCHDOG": "maybe"})

    assert settings.strict is False
    assert [str(problem) for problem in settings.problems] == [
        "STALLWATCH_STRICT='perhaps' is invalid: expected 1, true, yes, on or 0, false, no, off (any case); "
        "using the default false",
        "STALLWATCH_WATCHDOG='maybe' is invalid: expected 1, true, yes, on or 0, false, no, off (any case); "
        "using the default true",
    ]


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

# A host that sets up stallwatch, makes a span and reports what runs. `keyword`: the setting whose
# effective value is compared with its default.
_HOST = """
    import json, os
    import stallwatch
    from opentelemetry import trace
    from stallwatch.config import Settings
    from stallwatch.forksafe import guard

    keyword = {keyword!r}
    session = stallwatch.setup()
    with trace.get_tracer("shop").start_as_current_span("charge-card"):
        pass
    watchdog = session.watchdog_pid
    effective = getattr(session.settings, keyword) if keyword else None
    if keyword == "resource_attributes":  # with the service.instance.id setup() made, none being set
        effective = {{k: v for k, v in effective.items() if k != "service.instance.id"}}
    print(json.dumps({{
        "effective": repr(effective) if keyword else None,
        "default": repr(getattr(Settings.load(environ={{}}), keyword)) if keyword else None,
        "problems": [problem.setting for problem in session.config_problems],
        "watchdog_running": watchdog is not None and os.waitpid(watchdog, os.WNOHANG) == (0, 0),
        "fork_guard": guard.installed() and stallwatch.FORK_SAFETY.guard_enabled,
        "grpc_fork_support": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
        "telemetry_enabled": session.telemetry_enabled,
        "files": {{signal: str(path) for signal, path in session.files.items()}},
        "shutdown": stallwatch.shutdown(10),
    }}))
"""
# Bad values of variables that are no `Settings` field: per-signal OTLP variables, SDK variables (the SDK
# itself fails on these two), and variables read at `import stallwatch`, whose line comes before setup().
_MORE_BAD_VALUES = [
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "localhost:4318"),
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json"),
    ("OTEL_BSP_SCHEDULE_DELAY", "-5"),
    ("OTEL_METRICS_EXEMPLAR_FILTER", "sometimes"),
    ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-1"),
    ("OTEL_PROPAGATORS", "bogus"),
    ("STALLWATCH_FORK_GUARD", "sometimes"),
    ("STALLWATCH_GRPC_FORK_GUARD", "sometimes"),
]
_READ_AT_IMPORT = {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_PROPAGATORS", "OTEL_RESOURCE_ATTRIBUTES",
                   "STALLWATCH_FORK_GUARD", "STALLWATCH_GRPC_FORK_GUARD"}  # fmt: skip
_EVERY_BAD_VALUE = [
    *((option.env, BAD_VALUES[option.env][0], option.keyword) for option in config.OPTIONS if option.keyword),
    *((variable, value, None) for variable, value in _MORE_BAD_VALUES),
]


def _stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _only_line(text: str) -> str:
    lines = _stderr_lines(text)
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(("variable", "value", "keyword"), _EVERY_BAD_VALUE, ids=[v for v, _, _ in _EVERY_BAD_VALUE])
def test_a_bad_value_costs_only_its_own_setting_in_a_real_host(variable, value, keyword, tmp_path):
    # The defaults put the telemetry files and the journal under XDG_STATE_HOME: a bad directory falls back there.
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "state"), **{variable: value})
    proc = run_python(_HOST.format(keyword=keyword), env=env)

    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["effective"] == seen["default"]
    assert seen["problems"] == [variable]
    # One line, naming the variable, its value, what it accepts and what is used instead; nothing else,
    # not from the watchdog either, which gets the defaults too.
    line = _only_line(proc.stderr)
    assert line.startswith(f"stallwatch: {variable}={value!r} is invalid: expected "), proc.stderr
    assert "; using " in line or "; removed from this process's environment, so OpenTelemetry uses its default" in line
    # Everything else works: the watchdog runs, forks are guarded, spans reach the file exporter.
    assert seen["watchdog_running"] is True
    assert seen["fork_guard"] is True and seen["grpc_fork_support"] == "false"
    assert seen["telemetry_enabled"] is True and seen["shutdown"] is True
    traces, logs = Path(seen["files"]["traces"]), Path(seen["files"]["logs"])
    assert traces.parent == tmp_path / "state" / "stallwatch" / "telemetry" or variable != "STALLWATCH_FILE_DIR"
    assert "charge-card" in [span["name"] for span in otlp_items(traces, "spans")]
    if variable not in _READ_AT_IMPORT:  # logged once the pipeline runs, so exported with the host's logs
        assert line in _log_bodies(logs)


def test_a_bad_boolean_and_a_bad_port_give_one_line_each_and_telemetry_stays_on(telemetry_dir):
    proc = run_python(
        """
        import json, logging, os
        import stallwatch.auto
        from opentelemetry import trace

        session = stallwatch.auto.SESSION
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            logging.getLogger("shop").warning("card declined")
        print(json.dumps({
            "telemetry_enabled": session.telemetry_enabled,
            "problems": [str(problem) for problem in session.config_problems],
            "watchdog_running": os.waitpid(session.watchdog_pid, os.WNOHANG) == (0, 0),
            "shed_spans": session.settings.shed_spans,
            "prometheus_port": session.settings.prometheus_port,
            "shutdown": stallwatch.shutdown(10),
        }))
        """,
        env=clean_env(
            STALLWATCH_SHED_SPANS="sometimes",
            OTEL_EXPORTER_PROMETHEUS_PORT="http",
            STALLWATCH_FILE_DIR=str(telemetry_dir),
        ),
    )

    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [
        "OTEL_EXPORTER_PROMETHEUS_PORT='http' is invalid: expected a port number in 0..65535; using the default 9464",
        "STALLWATCH_SHED_SPANS='sometimes' is invalid: expected 1, true, yes, on or 0, false, no, off (any case); "
        "using the default true",
    ]
    assert seen["problems"] == expected
    assert (seen["shed_spans"], seen["prometheus_port"]) == (True, 9464)
    assert seen["telemetry_enabled"] is seen["watchdog_running"] is seen["shutdown"] is True
    assert _stderr_lines(proc.stderr) == [f"stallwatch: {problem}." for problem in expected] + ["card declined"]
    assert [span["name"] for span in otlp_items(telemetry_dir / "traces.jsonl", "spans")] == ["charge-card"]
    assert _log_bodies(telemetry_dir / "logs.jsonl") == [f"stallwatch: {problem}." for problem in expected] + [
        "card declined"
    ]


_BAD_PAIR = {"OTEL_TRACES_EXPORTER": "zipkin", "STALLWATCH_WATCHDOG": "maybe"}


@pytest.mark.parametrize("strict", [True, "true"])
def test_setup_strict_raises_config_error_naming_every_bad_setting(strict):
    proc = run_python(
        f"""
        import os, stallwatch
        try:
            stallwatch.setup(strict={strict!r})
        except stallwatch.ConfigError as exc:
            print("ConfigError:", exc)
            print([problem.setting for problem in exc.problems])
        else:
            print("setup returned")
        try:
            os.wait()
        except ChildProcessError:
            print("no watchdog was started")
        """,
        env=clean_env(**_BAD_PAIR),
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "ConfigError: OTEL_TRACES_EXPORTER='zipkin' is invalid: expected a comma-separated list of otlp, console, "
        "file, none; STALLWATCH_WATCHDOG='maybe' is invalid: expected 1, true, yes, on or 0, false, no, off (any case)",
        "['OTEL_TRACES_EXPORTER', 'STALLWATCH_WATCHDOG']",
        "no watchdog was started",
    ], proc.stdout + proc.stderr
    assert proc.stderr == ""  # raised, not also logged


def test_strict_env_makes_import_auto_fail_naming_every_bad_setting():
    proc = run_python(
        """
        import stallwatch.auto
        print("host code after the import runs")
        """,
        env=clean_env(STALLWATCH_STRICT="true", **_BAD_PAIR),
    )

    assert proc.returncode == 1
    assert "host code after the import runs" not in proc.stdout
    assert "ConfigError: OTEL_TRACES_EXPORTER='zipkin' is invalid" in proc.stderr
    assert "; STALLWATCH_WATCHDOG='maybe' is invalid" in proc.stderr


def test_a_secret_in_a_bad_setting_is_never_printed_or_exported(telemetry_dir):
    secrets = ("CfgEndpointPw-7", "CfgSignalPw-8", "CfgToken-9")
    proc = run_python(
        """
        import json, stallwatch
        session = stallwatch.setup()
        print(json.dumps([str(problem) for problem in session.config_problems]))
        stallwatch.shutdown(10)
        """,
        env=clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"ftp://collector:{secrets[0]}@otel.internal",
            OTEL_EXPORTER_OTLP_LOGS_ENDPOINT=f"https://deploy:{secrets[1]}@otel.internal:99999",
            OTEL_RESOURCE_ATTRIBUTES=f"deployment=prod,api_token:{secrets[2]}",
            STALLWATCH_FILE_DIR=str(telemetry_dir),
        ),
    )

    assert proc.returncode == 0, proc.stderr
    problems = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [problem.split("=", 1)[0] for problem in problems] == [
        "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
    ]  # fmt: skip
    assert problems[1].startswith("OTEL_EXPORTER_OTLP_ENDPOINT='ftp://[REDACTED]@otel.internal' is invalid")
    assert len(_stderr_lines(proc.stderr)) == 3, proc.stderr
    written = proc.stdout + proc.stderr + "".join(path.read_text() for path in telemetry_dir.glob("*.jsonl"))
    assert "is invalid" in (telemetry_dir / "logs.jsonl").read_text()
    assert not [secret for secret in secrets if secret in written]


@pytest.mark.parametrize("variable", ["STALLWATCH_FORK_GUARD", "STALLWATCH_GRPC_FORK_GUARD"])
def test_a_bad_fork_guard_flag_turns_its_guard_on_and_the_other_flag_keeps_its_effect(variable):
    other = {"STALLWATCH_FORK_GUARD": "STALLWATCH_GRPC_FORK_GUARD"}.get(variable, "STALLWATCH_FORK_GUARD")
    proc = run_python(
        """
        import json, os
        import stallwatch
        from stallwatch.forksafe import guard
        print(json.dumps({
            "guard_installed": guard.installed(),
            "guard_enabled": stallwatch.FORK_SAFETY.guard_enabled,
            "grpc_guard_enabled": stallwatch.FORK_SAFETY.grpc.enabled,
            "error": stallwatch.FORK_SAFETY.error,
        }))
        """,
        env=clean_env(**{variable: "sometimes", other: "false"}),
    )

    assert proc.returncode == 0, proc.stderr
    line = f"stallwatch: {variable}='sometimes' is invalid: expected 1, true, yes, on or 0, false, no, off (any case)"
    assert _stderr_lines(proc.stderr)[0] == f"{line}; using the default true."
    assert proc.stderr.count(variable) == 1
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["error"].startswith(f"{variable}=")
    fork_guard = variable == "STALLWATCH_FORK_GUARD"
    assert (report["guard_installed"], report["guard_enabled"], report["grpc_guard_enabled"]) == (
        fork_guard, fork_guard, not fork_guard,
    )  # fmt: skip


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


def _run_with_an_unusable_directory(variable: str, directory: str, tmp_path: Path) -> tuple[dict, str, str]:
    env = clean_env(
        XDG_STATE_HOME=str(tmp_path / "state"), OTEL_TRACES_EXPORTER="console,file", **{variable: directory}
    )
    proc = run_python(
        """
        import json, os, stallwatch
        from opentelemetry import trace
        session = stallwatch.setup()
        with trace.get_tracer("shop").start_as_current_span("charge-card"):
            pass
        print(json.dumps({
            "problems": [problem.setting for problem in session.config_problems],
            "watchdog_running": os.waitpid(session.watchdog_pid, os.WNOHANG) == (0, 0),
            "journal": session.settings.journal,
            "journal_open": session._journal is not None,
            "traces_exporter": session.settings.traces_exporter,
            "files": {signal: str(path) for signal, path in session.files.items()},
            "telemetry_enabled": session.telemetry_enabled,
            "error": session.error,
            "shutdown": stallwatch.shutdown(10),
        }))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout, proc.stderr


# Under a regular file: refused without touching the disk. Under /proc as root: only creating it tells.
_UNUSABLE = {"under a file": lambda tmp_path: str(tmp_path / "file" / "stallwatch"),
             "under /proc": lambda tmp_path: "/proc/stallwatch-test/stallwatch"}  # fmt: skip


@pytest.mark.parametrize("where", sorted(_UNUSABLE))
def test_an_unusable_journal_dir_is_reported_at_setup_and_only_the_journal_is_off(where, tmp_path):
    (tmp_path / "file").write_text("")
    directory = _UNUSABLE[where](tmp_path)

    seen, _, stderr = _run_with_an_unusable_directory("STALLWATCH_JOURNAL_DIR", directory, tmp_path)

    line = _only_line(stderr)
    assert line.startswith(f"stallwatch: STALLWATCH_JOURNAL_DIR={directory!r} is unusable: "), stderr
    assert line.endswith("; the journal is off (choose a writable directory, or set STALLWATCH_JOURNAL=false).")
    assert seen["problems"] == ["STALLWATCH_JOURNAL_DIR"]
    assert seen["journal"] is seen["journal_open"] is False
    assert seen["watchdog_running"] is seen["telemetry_enabled"] is seen["shutdown"] is True
    assert "charge-card" in [span["name"] for span in otlp_items(Path(seen["files"]["traces"]), "spans")]
    assert line in _log_bodies(Path(seen["files"]["logs"]))


@pytest.mark.parametrize("where", sorted(_UNUSABLE))
def test_an_unusable_file_dir_is_reported_at_setup_and_only_the_file_exporter_is_off(where, tmp_path):
    (tmp_path / "file").write_text("")
    directory = _UNUSABLE[where](tmp_path)

    seen, stdout, stderr = _run_with_an_unusable_directory("STALLWATCH_FILE_DIR", directory, tmp_path)

    line = _only_line(stderr)
    assert line.startswith(f"stallwatch: STALLWATCH_FILE_DIR={directory!r} is unusable: "), stderr
    assert line.endswith("; the file exporter is off (choose a writable directory, or another exporter).")
    assert seen["problems"] == ["STALLWATCH_FILE_DIR"]
    assert seen["traces_exporter"] == ["console"] and seen["files"] == {}
    assert seen["error"] is None and seen["journal"] is seen["journal_open"] is True
    assert seen["watchdog_running"] is seen["telemetry_enabled"] is seen["shutdown"] is True
    assert '"name": "charge-card"' in stdout  # the console exporter still gets the spans


def test_an_unusable_file_dir_names_the_keyword_it_came_from(tmp_path):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "telemetry"

    settings = Settings.load(environ={}, file_dir=directory, traces_exporter="file,console")

    assert [str(problem) for problem in settings.problems] == [
        f"file_dir={str(directory)!r} is unusable: {tmp_path / 'file'} is not a directory; the file exporter is "
        "off (choose a writable directory, or another exporter)"
    ]
    assert (settings.traces_exporter, settings.metrics_exporter) == (("console",), ())
