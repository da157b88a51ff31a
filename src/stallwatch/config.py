"""One settings object: every `STALLWATCH_*` and `OTEL_*` variable stallwatch reads, parsed here.

`Settings.load(**overrides)` reads the environment, applies keyword overrides (keyword names are
the field names below) and validates everything; a bad value raises `ConfigError` whose message
names the variable or keyword and what it accepts. `OPTIONS` documents each knob; the README's
configuration table is checked against it by a test.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TRACE_EXPORTERS = ("otlp", "console", "file", "none")
METRIC_EXPORTERS = ("otlp", "console", "file", "prometheus", "none")
LOG_EXPORTERS = ("otlp", "console", "file", "none")
PROTOCOLS = ("http/protobuf", "grpc")
PROVIDER_OWNERS = ("stallwatch", "host")
UVLOOP_SPAWN_METHODS = ("fork", "vfork")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# Variables the OpenTelemetry SDK reads itself and, for some bad values, fails on by raising instead
# of logging and using its default: in `setup()` (the limits, the batch processors' sizes, the OTLP
# timeouts with gRPC, the exemplar filter), and at import (`OTEL_PROPAGATORS`,
# `OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`). stallwatch checks them like its own settings (see
# `_check_sdk_variables` and `load_opentelemetry`), so that a bad value is reported naming it.
SDK_LIMITS = (
    "OTEL_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT",
    "OTEL_SPAN_LINK_COUNT_LIMIT",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_LOGRECORD_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_LOGRECORD_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)
SDK_BATCH_PREFIXES = ("OTEL_BSP", "OTEL_BLRP")  # span and log record batch processors
_SDK_BATCH_DEFAULTS = {"MAX_QUEUE_SIZE": 2048, "SCHEDULE_DELAY": 5000, "MAX_EXPORT_BATCH_SIZE": 512}
EXEMPLAR_FILTERS = ("trace_based", "always_on", "always_off")
OTLP_TIMEOUTS = tuple(f"OTEL_EXPORTER_OTLP_{signal}TIMEOUT" for signal in ("", "TRACES_", "METRICS_", "LOGS_"))
SDK_VARIABLES = (
    *SDK_LIMITS,
    *(f"{prefix}_{name}" for prefix in SDK_BATCH_PREFIXES for name in _SDK_BATCH_DEFAULTS),
    *OTLP_TIMEOUTS,
    "OTEL_METRICS_EXEMPLAR_FILTER",
    "OTEL_PROPAGATORS",
)
# The OpenTelemetry modules that read some of those when imported, and the variables each may read.
_READ_AT_IMPORT = (("opentelemetry.propagate", ("OTEL_PROPAGATORS",)), ("opentelemetry.sdk.trace", SDK_LIMITS))
# Variables `load_opentelemetry` removed from the environment, with the error that `Settings.load` reports.
IMPORT_ERRORS: dict[str, str] = {}
_log = logging.getLogger("stallwatch")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting has a value stallwatch cannot use; the message names the setting."""


@dataclass(frozen=True)
class Option:
    """Documentation of one setting: environment variable, keyword, default and meaning."""

    env: str
    keyword: str | None
    default: str
    description: str


OPTIONS: tuple[Option, ...] = (
    Option(
        "OTEL_SDK_DISABLED",
        "disabled",
        "false",
        "`true` turns all telemetry off; the fork guard still protects the process.",
    ),
    Option("OTEL_SERVICE_NAME", "service_name", "`unknown_service`", "`service.name` resource attribute."),
    Option(
        "OTEL_RESOURCE_ATTRIBUTES",
        "resource_attributes",
        "(none)",
        "Extra resource attributes, `key=value,key2=value2`.",
    ),
    Option(
        "OTEL_TRACES_EXPORTER",
        "traces_exporter",
        "`file`, or `otlp` when an OTLP endpoint is set",
        "Where spans go: `otlp`, `console`, `file`, `none` (comma-separated for several).",
    ),
    Option(
        "OTEL_METRICS_EXPORTER",
        "metrics_exporter",
        "`file`, or `otlp` when an OTLP endpoint is set",
        "Where metrics go: `otlp`, `console`, `file`, `prometheus`, `none`.",
    ),
    Option(
        "OTEL_LOGS_EXPORTER",
        "logs_exporter",
        "`file`, or `otlp` when an OTLP endpoint is set",
        "Where log records go: `otlp`, `console`, `file`, `none`.",
    ),
    Option(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "otlp_endpoint",
        "`http://localhost:4318` (HTTP)",
        "OTLP base URL; per-signal `OTEL_EXPORTER_OTLP_{TRACES,METRICS,LOGS}_ENDPOINT` override it.",
    ),
    Option(
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "otlp_protocol",
        "`http/protobuf`",
        "`http/protobuf` or `grpc` (needs the `grpc` extra; only then is grpc imported). "
        "Per-signal `OTEL_EXPORTER_OTLP_{TRACES,METRICS,LOGS}_PROTOCOL` override it.",
    ),
    Option("OTEL_TRACES_SAMPLER", "sampler", "`parentbased_always_on`", "Sampler name (OTel spec values)."),
    Option("OTEL_TRACES_SAMPLER_ARG", "sampler_arg", "`1.0`", "Ratio for the `traceidratio` samplers, 0..1."),
    Option(
        "OTEL_METRIC_EXPORT_INTERVAL",
        "metric_export_interval_ms",
        "`60000`",
        "Milliseconds between metric exports (positive).",
    ),
    Option(
        "OTEL_EXPORTER_PROMETHEUS_HOST",
        "prometheus_host",
        "`localhost`",
        "Bind address of the Prometheus scrape endpoint (`prometheus` metrics exporter).",
    ),
    Option(
        "OTEL_EXPORTER_PROMETHEUS_PORT",
        "prometheus_port",
        "`9464`",
        "Port of the Prometheus scrape endpoint (0 picks a free port).",
    ),
    Option(
        "STALLWATCH_SHED_SPANS",
        "shed_spans",
        "`true`",
        "While every span queue is full or the backend is down, sampled spans that start are not recorded "
        "(ids and sampled flag kept; counted as dropped). `false` records them, to be dropped at their end.",
    ),
    Option(
        "STALLWATCH_SLOW_EXPORT_SECONDS",
        "slow_export_seconds",
        "`1.0`",
        "A span or log export that succeeds but takes longer than this takes the backend to be "
        "overloaded: it is backed off from as from a failing one (new items dropped at once, counted "
        "as `backend_slow`, then a small probe). `0` turns this off: a slow backend then gets every "
        "batch, at the cost of recording them on the host's threads.",
    ),
    Option(
        "STALLWATCH_PROVIDERS",
        "providers",
        "`stallwatch`",
        "`stallwatch` builds and installs the tracer/meter/logger providers; `host` leaves that to "
        "the host (stallwatch reports through whatever the host installs; the host's providers "
        "are still made fork-aware).",
    ),
    Option(
        "STALLWATCH_FILE_DIR",
        "file_dir",
        "`$XDG_STATE_HOME/stallwatch/telemetry` (`~/.local/state/stallwatch/telemetry`)",
        "Directory of the `file` exporter: `traces.jsonl`, `metrics.jsonl`, `logs.jsonl` in OTLP/JSON.",
    ),
    Option(
        "STALLWATCH_LOG_LEVEL",
        "log_level",
        "`WARNING`",
        "Lowest level of Python log records exported as OpenTelemetry logs (`stallwatch` providers only).",
    ),
    Option(
        "STALLWATCH_SHUTDOWN_TIMEOUT",
        "shutdown_timeout",
        "`1.0`",
        "Seconds `shutdown()` and interpreter exit may spend flushing telemetry.",
    ),
    Option(
        "STALLWATCH_STRICT",
        "strict",
        "`false`",
        "`true` makes `setup()` raise `ConfigError` on a bad setting instead of logging it and "
        "running with telemetry off.",
    ),
    Option(
        "STALLWATCH_INSTRUMENT_EXECUTOR",
        "instrument_executor",
        "`true`",
        "Instrument every ThreadPoolExecutor (including asyncio's default): queue/run times, workers, "
        "worker deaths, orphaned items, wedge detection.",
    ),
    Option(
        "STALLWATCH_EXECUTOR_HEAL",
        "executor_heal",
        "`false`",
        "Fail orphaned executor items with `stallwatch.WorkerDied` so their awaiters wake, and replace "
        "dead workers (changes the host's behaviour, hence opt-in).",
    ),
    Option(
        "STALLWATCH_GUARD_ASYNC_EXC",
        "guard_async_exc",
        "`true`",
        "Scope raw `ctypes.pythonapi.PyThreadState_SetAsyncExc` calls aimed at executor workers: never "
        "delivered to an idle worker, never left pending across work items. `false` passes them through.",
    ),
    Option(
        "STALLWATCH_WEDGE_CHECK_INTERVAL",
        "wedge_check_interval",
        "`0.5`",
        "Seconds between wedge checks; detection takes at most two intervals.",
    ),
    Option(
        "STALLWATCH_QUEUE_STALL_SECONDS",
        "queue_stall_seconds",
        "`5.0`",
        "An executor whose items wait this long while none of its workers is alive is reported stalled.",
    ),
    Option(
        "STALLWATCH_INSTRUMENT_SUBPROCESS",
        "instrument_subprocess",
        "`true`",
        "A span and metrics per child process: `subprocess.Popen` (`run`, `call`, `check_output`), a loop's "
        "`subprocess_exec`/`subprocess_shell` (asyncio and uvloop), `os.posix_spawn`/`posix_spawnp`.",
    ),
    Option(
        "STALLWATCH_RECORD_ARGS",
        "record_args",
        "`false`",
        "Record child command lines (`process.command_args`) after scrubbing secrets; by default only the "
        "executable name and the argument count are recorded. Environment values are never recorded.",
    ),
    Option(
        "STALLWATCH_SCRUB_PATTERNS",
        "scrub_patterns",
        "empty",
        "Extra comma-separated regular expressions for option/`KEY=` names whose values are secret "
        "(matched case-insensitively), on top of password/token/secret/key/credential/auth/....",
    ),
    Option(
        "STALLWATCH_PROPAGATE_TO_CHILDREN",
        "propagate_to_children",
        "`false`",
        "Put `TRACEPARENT`/`TRACESTATE` of the child's span into the child's environment (the host's "
        "`os.environ` is never changed).",
    ),
    Option(
        "STALLWATCH_UVLOOP_SPAWN",
        "uvloop_spawn",
        "`fork`",
        "`vfork` keeps uvloop as the loop but spawns its subprocesses through the standard library's "
        "vfork/posix_spawn path: no fork handler runs in the child and the loop never waits on a forked "
        "copy of the host. Calls it cannot honour (e.g. `preexec_fn`) use uvloop's own fork, recorded on the span.",
    ),
    Option(
        "STALLWATCH_INSTRUMENT_SSH",
        "instrument_ssh",
        "`true`",
        "Spans and metrics for SSH tunnel open/close (dstack's `SSHTunnel`, instrumented when it is imported; "
        "other classes through `stallwatch.instrument_tunnel`).",
    ),
    Option(
        "STALLWATCH_INSTRUMENT_NEBIUS",
        "instrument_nebius",
        "`true`",
        "A span per Nebius API call (auth and retries included) with status, attempts, request/operation/"
        "resource ids, and the cloud resource ledger for create/delete; installed when `nebius.aio.request` "
        "is imported.",
    ),
    Option(
        "STALLWATCH_JOURNAL",
        "journal",
        "`true`",
        "Keep the crash-safe journal of operations in flight (cloud intents and outcomes durable, tunnel and "
        "Nebius spans buffered) and replay the journals of dead processes at `setup()`: interrupted operations "
        "become spans, unconfirmed cloud creates become leak candidates.",
    ),
    Option(
        "STALLWATCH_JOURNAL_DIR",
        "journal_dir",
        "`$XDG_STATE_HOME/stallwatch/journal` (`~/.local/state/stallwatch/journal`)",
        "Directory of the journal (0700, one file per process, 0600).",
    ),
    Option(
        "STALLWATCH_WATCHDOG",
        "watchdog",
        "`true`",
        "Start the freeze watchdog, a second process that reads the host's heartbeats and /proc and "
        "exports freezes while they last.",
    ),
    Option(
        "STALLWATCH_WATCHDOG_FORKED_WORKERS",
        "watchdog_forked_workers",
        "`true`",
        "Also watch each fork child that lives on and starts an event loop (workers forked after "
        "`setup()`, as gunicorn's with a preloaded app): it gets a watchdog of its own when its first "
        "loop starts. Its Prometheus endpoint, if any, takes a free port.",
    ),
    Option(
        "STALLWATCH_FREEZE_THRESHOLD",
        "freeze_threshold",
        "`1.0`",
        "Seconds without a heartbeat after which the watchdog reports a freeze.",
    ),
    Option(
        "STALLWATCH_WATCHDOG_PROMETHEUS_PORT",
        "watchdog_prometheus_port",
        "`9465`",
        "Port of the watchdog's own Prometheus scrape endpoint (with the `prometheus` metrics exporter): "
        "it answers while the host, frozen, cannot.",
    ),
    Option(
        "STALLWATCH_FAULTHANDLER",
        "faulthandler",
        "`false`",
        "Arm `faulthandler.dump_traceback_later` from the loop heartbeat so that a freeze's Python stacks "
        "are written (by a C timer, without the GIL) and attached to the watchdog's report. Replaces any "
        "faulthandler timer of the host's.",
    ),
    Option(
        "STALLWATCH_FORK_GUARD",
        None,
        "`true`",
        "Read at `import stallwatch`. `false` turns off the at-fork handler guard and the "
        "OpenTelemetry fork patches (for debugging stallwatch only: children then start threads).",
    ),
    Option(
        "STALLWATCH_GRPC_FORK_GUARD",
        None,
        "`true`",
        "Read at `import stallwatch`. `true` sets `GRPC_ENABLE_FORK_SUPPORT=false` when it is unset "
        "and grpc is not loaded yet, so gRPC starts no threads in fork children.",
    ),
)


def _state_dir(name: str) -> Path:
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "stallwatch" / name


def _default_file_dir() -> Path:
    return _state_dir("telemetry")


def _default_journal_dir() -> Path:
    return _state_dir("journal")


@dataclass(frozen=True)
class Settings:
    """Validated settings of one stallwatch session. Build with `Settings.load()`."""

    disabled: bool = False
    service_name: str | None = None
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    traces_exporter: tuple[str, ...] = ("file",)
    metrics_exporter: tuple[str, ...] = ("file",)
    logs_exporter: tuple[str, ...] = ("file",)
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    signal_protocols: Mapping[str, str] = field(default_factory=dict)
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    metric_export_interval_ms: int = 60000
    prometheus_host: str = "localhost"
    prometheus_port: int = 9464
    shed_spans: bool = True
    providers: str = "stallwatch"
    file_dir: Path = field(default_factory=_default_file_dir)
    log_level: int = logging.WARNING
    shutdown_timeout: float = 1.0
    slow_export_seconds: float = 1.0
    strict: bool = False
    instrument_executor: bool = True
    executor_heal: bool = False
    guard_async_exc: bool = True
    wedge_check_interval: float = 0.5
    queue_stall_seconds: float = 5.0
    instrument_subprocess: bool = True
    record_args: bool = False
    scrub_patterns: tuple[re.Pattern[str], ...] = ()
    propagate_to_children: bool = False
    uvloop_spawn: str = "fork"
    instrument_ssh: bool = True
    instrument_nebius: bool = True
    journal: bool = True
    journal_dir: Path = field(default_factory=_default_journal_dir)
    watchdog: bool = True
    watchdog_forked_workers: bool = True
    freeze_threshold: float = 1.0
    faulthandler: bool = False
    watchdog_prometheus_port: int = 9465

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read settings from `environ` (default `os.environ`) and apply keyword overrides."""
        env = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; accepted keywords: {', '.join(sorted(known))}")
        endpoint_set = bool(
            overrides.get("otlp_endpoint")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or any(env.get(f"OTEL_EXPORTER_OTLP_{s}_ENDPOINT") for s in ("TRACES", "METRICS", "LOGS"))
        )
        default_exporter = "otlp" if endpoint_set else "file"
        values: dict[str, Any] = {}

        def take(keyword: str, variable: str, parse: Callable[[str, str], Any], default: str | None) -> None:
            if keyword in overrides:
                raw = overrides[keyword]
                values[keyword] = parse(raw, keyword) if isinstance(raw, str) else _check_type(raw, keyword, parse)
            elif (text := env.get(variable)) not in (None, ""):
                values[keyword] = parse(text, variable)
            elif default is not None:
                values[keyword] = parse(default, variable)

        take("disabled", "OTEL_SDK_DISABLED", _bool, None)
        take("service_name", "OTEL_SERVICE_NAME", _nonempty, None)
        take("resource_attributes", "OTEL_RESOURCE_ATTRIBUTES", _resource_attributes, None)
        take("traces_exporter", "OTEL_TRACES_EXPORTER", _choices(TRACE_EXPORTERS), default_exporter)
        take("metrics_exporter", "OTEL_METRICS_EXPORTER", _choices(METRIC_EXPORTERS), default_exporter)
        take("logs_exporter", "OTEL_LOGS_EXPORTER", _choices(LOG_EXPORTERS), default_exporter)
        take("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _url, None)
        for signal in ("TRACES", "METRICS", "LOGS"):
            if text := env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
                _url(text, f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        take("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", _one_of(PROTOCOLS), None)
        given = overrides.get("signal_protocols") or {}
        if not isinstance(given, Mapping) or set(given) - {"traces", "metrics", "logs"}:
            raise _fail("signal_protocols", given, "a mapping of traces/metrics/logs to " + " or ".join(PROTOCOLS))
        protocols: dict[str, str] = {}
        for signal in ("traces", "metrics", "logs"):
            variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
            if signal in given:
                protocols[signal] = _one_of(PROTOCOLS)(str(given[signal]), f"signal_protocols[{signal!r}]")
            elif text := env.get(variable):
                protocols[signal] = _one_of(PROTOCOLS)(text, variable)
        values["signal_protocols"] = protocols
        take("sampler", "OTEL_TRACES_SAMPLER", _one_of(SAMPLERS), None)
        take("sampler_arg", "OTEL_TRACES_SAMPLER_ARG", _ratio, None)
        take("metric_export_interval_ms", "OTEL_METRIC_EXPORT_INTERVAL", _positive_int, None)
        take("prometheus_host", "OTEL_EXPORTER_PROMETHEUS_HOST", _nonempty, None)
        take("prometheus_port", "OTEL_EXPORTER_PROMETHEUS_PORT", _port, None)
        take("shed_spans", "STALLWATCH_SHED_SPANS", _bool, None)
        take("slow_export_seconds", "STALLWATCH_SLOW_EXPORT_SECONDS", _seconds_or_zero, None)
        take("providers", "STALLWATCH_PROVIDERS", _one_of(PROVIDER_OWNERS), None)
        take("file_dir", "STALLWATCH_FILE_DIR", _path, None)
        take("log_level", "STALLWATCH_LOG_LEVEL", _log_level, None)
        take("shutdown_timeout", "STALLWATCH_SHUTDOWN_TIMEOUT", _positive_float, None)
        take("strict", "STALLWATCH_STRICT", _bool, None)
        take("instrument_executor", "STALLWATCH_INSTRUMENT_EXECUTOR", _bool, None)
        take("executor_heal", "STALLWATCH_EXECUTOR_HEAL", _bool, None)
        take("guard_async_exc", "STALLWATCH_GUARD_ASYNC_EXC", _bool, None)
        take("wedge_check_interval", "STALLWATCH_WEDGE_CHECK_INTERVAL", _positive_float, None)
        take("queue_stall_seconds", "STALLWATCH_QUEUE_STALL_SECONDS", _positive_float, None)
        take("instrument_subprocess", "STALLWATCH_INSTRUMENT_SUBPROCESS", _bool, None)
        take("record_args", "STALLWATCH_RECORD_ARGS", _bool, None)
        take("scrub_patterns", "STALLWATCH_SCRUB_PATTERNS", _patterns, None)
        take("propagate_to_children", "STALLWATCH_PROPAGATE_TO_CHILDREN", _bool, None)
        take("uvloop_spawn", "STALLWATCH_UVLOOP_SPAWN", _one_of(UVLOOP_SPAWN_METHODS), None)
        take("instrument_ssh", "STALLWATCH_INSTRUMENT_SSH", _bool, None)
        take("instrument_nebius", "STALLWATCH_INSTRUMENT_NEBIUS", _bool, None)
        take("journal", "STALLWATCH_JOURNAL", _bool, None)
        take("journal_dir", "STALLWATCH_JOURNAL_DIR", _path, None)
        take("watchdog", "STALLWATCH_WATCHDOG", _bool, None)
        take("watchdog_forked_workers", "STALLWATCH_WATCHDOG_FORKED_WORKERS", _bool, None)
        take("freeze_threshold", "STALLWATCH_FREEZE_THRESHOLD", _positive_float, None)
        take("faulthandler", "STALLWATCH_FAULTHANDLER", _bool, None)
        take("watchdog_prometheus_port", "STALLWATCH_WATCHDOG_PROMETHEUS_PORT", _port, None)
        _check_sdk_variables(env)
        if environ is None and IMPORT_ERRORS:
            raise ConfigError(next(iter(IMPORT_ERRORS.values())))
        return cls(**values)

    def protocol_for(self, signal: str) -> str:
        """OTLP protocol of one signal (`traces`, `metrics`, `logs`)."""
        return self.signal_protocols.get(signal, self.otlp_protocol)


def strict_requested(overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether `strict` is on, read leniently: used when the settings themselves failed to parse."""
    env = os.environ if environ is None else environ
    value = overrides["strict"] if "strict" in overrides else env.get("STALLWATCH_STRICT", "")
    if not isinstance(value, str):
        return bool(value)
    return value.strip().lower() in _TRUE


def load_opentelemetry() -> None:
    """Import the OpenTelemetry modules that read a variable when they are imported.

    They raise on a bad value (an unknown name in `OTEL_PROPAGATORS`, a negative
    `OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`), which would fail `import stallwatch` and with it the host.
    Which values fail depends on the installed version, so this imports them and, when one raises,
    removes the variable it read from `os.environ` (children then inherit the environment without
    it), logs that at ERROR naming it, keeps the error for `setup()`, which then reports it and
    keeps telemetry off like any bad setting, and imports again. With `STALLWATCH_STRICT=true` it
    raises `ConfigError` instead and changes nothing. Called first thing by `import stallwatch`.
    """
    for module, variables in _READ_AT_IMPORT:
        while True:
            try:
                importlib.import_module(module)
                break
            except ValueError as exc:
                present = [variable for variable in variables if variable in os.environ]
                # The error names the variable, or (OTEL_PROPAGATORS, and SDK 1.27, whose message fails to
                # format) not: then those of the module's variables that stallwatch's own check refuses.
                named = [variable for variable in present if variable in str(exc)]
                named = named or [variable for variable in present if not _valid_at_import(variable)]
                if not named:
                    raise
                errors = {
                    variable: f"{variable}={_shown(os.environ[variable])} is invalid: OpenTelemetry "
                    f"fails to import with it ({exc})"
                    for variable in named
                }
                if strict_requested({}):
                    raise ConfigError("; ".join(errors.values())) from exc
                for variable, error in errors.items():
                    del os.environ[variable]
                    IMPORT_ERRORS[variable] = error
                    _log.error(
                        "stallwatch: %s; removed from this process's environment so that OpenTelemetry can "
                        "be imported. setup() keeps telemetry off (STALLWATCH_STRICT=true fails the import "
                        "instead).",
                        error,
                    )


def _valid_at_import(variable: str) -> bool:
    """Whether a variable OpenTelemetry reads at import passes stallwatch's own check (a limit's);
    `OTEL_PROPAGATORS` has none, as only OpenTelemetry knows the installed propagators."""
    if variable not in SDK_LIMITS:
        return False
    try:
        _check_sdk_variables({variable: os.environ[variable]})
    except ConfigError:
        return False
    return True


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean `STALLWATCH_*` import-time flag; a bad value raises `ConfigError`."""
    text = os.environ.get(name)
    return default if text in (None, "") else _bool(text, name)


# ---- parsers: each takes (raw text, setting name) and raises ConfigError naming the setting ----


def _check_sdk_variables(env: Mapping[str, str]) -> None:
    """The SDK-read variables (`SDK_VARIABLES`) that `setup()` would otherwise fail on, as the SDK
    parses them: a limit is an integer ≥ 0, or empty for no limit; a batch processor's queue size,
    delay and batch size are positive integers, the batch no larger than the queue (an empty one
    means the default; text that is not an integer, which the SDK replaces by its default with a
    traceback in the log, is refused too); an OTLP timeout is a number, even if empty; the exemplar
    filter is one of `EXEMPLAR_FILTERS`, exactly."""
    for variable in SDK_LIMITS:
        if (text := env.get(variable)) is not None and text.strip():
            _sdk_int(text, variable, 0, "a non-negative integer, or empty for no limit")
    for prefix in SDK_BATCH_PREFIXES:
        chosen = {}
        for name, default in _SDK_BATCH_DEFAULTS.items():
            text = env.get(f"{prefix}_{name}") or ""
            chosen[name] = _sdk_int(text, f"{prefix}_{name}", 1, "a positive integer") if text else default
        queue, batch = chosen["MAX_QUEUE_SIZE"], chosen["MAX_EXPORT_BATCH_SIZE"]
        if batch > queue:  # named: the batch size if it was set, else the queue size
            if env.get(f"{prefix}_MAX_EXPORT_BATCH_SIZE"):
                raise _fail(f"{prefix}_MAX_EXPORT_BATCH_SIZE", env[f"{prefix}_MAX_EXPORT_BATCH_SIZE"],
                            f"at most {prefix}_MAX_QUEUE_SIZE ({queue})")  # fmt: skip
            raise _fail(f"{prefix}_MAX_QUEUE_SIZE", env[f"{prefix}_MAX_QUEUE_SIZE"],
                        f"at least {prefix}_MAX_EXPORT_BATCH_SIZE ({batch}, its default)")  # fmt: skip
    for variable in OTLP_TIMEOUTS:  # the gRPC exporters raise on one that is not a number (empty too)
        if (text := env.get(variable)) is not None:
            try:
                float(text)
            except ValueError:
                raise _fail(variable, text, "a number of seconds (what the Python OTLP exporters read)") from None
    text = env.get("OTEL_METRICS_EXEMPLAR_FILTER")
    if text is not None and text not in EXEMPLAR_FILTERS:
        raise _fail("OTEL_METRICS_EXEMPLAR_FILTER", text, "one of " + ", ".join(EXEMPLAR_FILTERS) + " (exactly)")


def _sdk_int(text: str, name: str, least: int, expected: str) -> int:
    """An integer as the SDK reads it (`int(text)`), at least `least`."""
    try:
        value = int(text)
    except ValueError:
        raise _fail(name, text, expected) from None
    if value < least:
        raise _fail(name, text, expected)
    return value


def _fail(name: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"{name}={_shown(value)} is invalid: expected {expected}")


def _shown(value: object) -> str:
    """A bad value as its error shows it: its repr, with secrets (a password in an endpoint URL, a token in
    the resource attributes) redacted and a long value cut, since the error goes to the host's log.
    Never raises, whatever the object's `__repr__` does."""
    from .instrument.scrub import scrub_text

    if isinstance(value, str):
        return repr(scrub_text(value))
    try:
        return scrub_text(repr(value))
    except Exception:
        return f"<{type(value).__name__} object>"


def _check_type(value: Any, name: str, parse: Callable[[str, str], Any]) -> Any:
    """Validate a non-string keyword override by round-tripping it through the parser."""
    if isinstance(value, bool) and parse is _bool:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return parse(",".join(value), name)
    if isinstance(value, Mapping) and parse is _resource_attributes:
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, Path) and parse is _path:
        return value
    if isinstance(value, (tuple, list)) and parse is _patterns and all(isinstance(v, re.Pattern) for v in value):
        return tuple(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return parse(str(value), name)
    raise _fail(name, value, f"a value like the environment variable takes, not {type(value).__name__}")


def _patterns(text: str, name: str) -> tuple[re.Pattern[str], ...]:
    from .instrument.scrub import compile_patterns

    try:
        return compile_patterns(text, name)
    except ValueError as exc:
        reason = str(exc).removeprefix(f"{name}: ")
        raise _fail(name, text, f"comma-separated regular expressions, but {reason}") from None


def _bool(text: str, name: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _fail(name, text, "true or false")


def _nonempty(text: str, name: str) -> str:
    if not text.strip():
        raise _fail(name, text, "a non-empty string")
    return text.strip()


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(text: str, name: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise _fail(name, text, "one of " + ", ".join(allowed))
        return value

    return parse


def _choices(allowed: tuple[str, ...]) -> Callable[[str, str], tuple[str, ...]]:
    def parse(text: str, name: str) -> tuple[str, ...]:
        chosen = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
        if not chosen or any(c not in allowed for c in chosen):
            raise _fail(name, text, "a comma-separated list of " + ", ".join(allowed))
        if "none" in chosen and len(chosen) > 1:
            raise _fail(name, text, "`none` alone, or a list without `none`")
        return () if chosen == ("none",) else chosen

    return parse


def _url(text: str, name: str) -> str:
    try:
        parts = urlsplit(text.strip())
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise _fail(name, text, "an http:// or https:// URL with a host, e.g. http://localhost:4318") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(name, text, "an http:// or https:// URL with a host, e.g. http://localhost:4318")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise _fail(name, text, "a URL whose port is a number in 0..65535") from None
    return text.strip()


def _number(
    cast: Callable[[str], float], low: float, high: float, expected: str, *, open_low: bool = False
) -> Callable[[str, str], Any]:
    """A parser for a number in [low, high] (or (low, high] with `open_low`)."""

    def parse(text: str, name: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise _fail(name, text, expected) from None
        if not (low < value if open_low else low <= value) or not value <= high:
            raise _fail(name, text, expected)
        return value

    return parse


_ratio = _number(float, 0.0, 1.0, "a number between 0 and 1")
_positive_int = _number(int, 0, float("inf"), "a positive whole number", open_low=True)
_positive_float = _number(float, 0.0, 1e9, "a positive, finite number of seconds", open_low=True)
_port = _number(int, 0, 65535, "a port number in 0..65535")
_seconds_or_zero = _number(float, 0.0, 1e9, "a finite number of seconds, 0 or more")


def _path(text: str, name: str) -> Path:
    if "\x00" in text or not text.strip():
        raise _fail(name, text, "a directory path")
    try:
        return Path(text).expanduser()
    except RuntimeError:  # `~someone` who has no home directory here
        raise _fail(name, text, "a directory path (a `~user` prefix must name a user with a home)") from None


def _log_level(text: str, name: str) -> int:
    if text.strip().isdecimal() and len(text.strip()) < 10:  # `int()` refuses other digits (`²`) and huge ones
        return int(text)
    level = logging.getLevelName(text.strip().upper())
    if not isinstance(level, int):
        raise _fail(name, text, "a logging level name: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _resource_attributes(text: str, name: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise _fail(name, text, "comma-separated key=value pairs")
        result[key.strip()] = value.strip()
    return result


def reference_markdown() -> str:
    """Render the configuration table that the README embeds."""
    lines = ["| Variable | `setup()` keyword | Default | Meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        keyword = f"`{option.keyword}`" if option.keyword else "(environment only)"
        lines.append(f"| `{option.env}` | {keyword} | {option.default} | {option.description} |")
    return "\n".join(lines) + "\n"
