"""One settings object: every `STALLWATCH_*` and `OTEL_*` variable stallwatch reads, parsed here.

`Settings.load(**overrides)` reads the environment, applies keyword overrides (keyword names are
the field names below) and validates everything. As OpenTelemetry does, a bad value costs only its
own setting: it falls back to that setting's default (for a bad keyword: to its environment
variable), and a `Problem` naming the variable or keyword, the value (secrets redacted), what it
accepts and what is used instead is recorded in `Settings.problems`; `setup()` logs each once
(`report`). With `strict` on, `ConfigError` names every problem instead. `OPTIONS` documents each
knob; docs/configuration.md is generated from it (`python -m stallwatch._docs`) and a test
keeps the two equal.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import stat
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ._private import make_directories
from ._record import Record
from .core.scrub import compile_patterns, scrub_text

# Whether an OpenTelemetry SDK module was loaded before stallwatch's first module (this one, which
# loads none): SDK objects built before `import stallwatch` keep the stock fork handlers (`forksafe`).
SDK_LOADED_BEFORE_STALLWATCH = any(name.startswith("opentelemetry.sdk") for name in sys.modules)

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
_SDK_SCHEDULE_DELAYS = {"OTEL_BSP": 5000, "OTEL_BLRP": 1000}  # the SDK's defaults differ from the check's
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
OTLP_SIGNAL_ENDPOINTS = tuple(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT" for signal in ("TRACES", "METRICS", "LOGS"))
# Refused variables that the SDK would also read itself, where stallwatch cannot hand it the default instead.
_WITHHELD_FROM_SDK = frozenset(
    {
        *SDK_VARIABLES,
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        *OTLP_SIGNAL_ENDPOINTS,
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
    }
)
_log = logging.getLogger("stallwatch")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOLEANS = f"{', '.join(_TRUE)} or {', '.join(_FALSE)} (any case)"


class Problem(Record):
    """A setting stallwatch could not use, and what it does instead.

    `setting` is the variable or keyword; `error` says what it held (secrets redacted) and what it
    accepts; `fallback` what is used in its place: the default, another setting, or a part turned off.
    """

    __slots__ = ("error", "fallback", "setting")
    setting: str
    error: str
    fallback: str

    def __init__(self, setting: str, error: str, fallback: str) -> None:
        self._set(setting=setting, error=error, fallback=fallback)

    def __str__(self) -> str:
        return f"{self.error}; {self.fallback}"


class ConfigError(ValueError):
    """Settings stallwatch cannot use under `strict`; the message names each one (`problems`)."""

    def __init__(self, message: str, problems: Iterable[Problem] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


# Problems found when `import stallwatch` read its variables (`load_opentelemetry`, `env_flag`), by variable;
# `Settings.load()` of the process environment lists them too.
IMPORT_PROBLEMS: dict[str, Problem] = {}
_reported: set[Problem] = set()


def report(problems: Iterable[Problem]) -> None:
    """Log each problem once per process: one WARNING line on the `stallwatch` logger."""
    for problem in problems:
        if problem not in _reported:
            _reported.add(problem)
            _log.warning("stallwatch: %s.", problem)


def withhold_from_sdk(problems: Iterable[Problem]) -> None:
    """Remove from `os.environ` each refused variable the OpenTelemetry SDK also reads itself (the limits,
    batch sizes, timeouts, exemplar filter, OTLP endpoints, service name and resource attributes), so that
    the SDK too uses its default instead of failing on the value or using it. The environment is the one
    way to reach every place the SDK reads them (at import, in each log record, in the exporters); the
    process's children then inherit the environment without them. `setup()` calls this."""
    for problem in problems:
        if problem.setting in _WITHHELD_FROM_SDK:
            os.environ.pop(problem.setting, None)


class Option(Record):
    """Documentation of one setting: environment variable, keyword, default and meaning."""

    __slots__ = ("default", "description", "env", "keyword")
    env: str
    keyword: str | None
    default: str
    description: str

    def __init__(self, env: str, keyword: str | None, default: str, description: str) -> None:
        self._set(env=env, keyword=keyword, default=default, description=description)


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
        "Port of the Prometheus scrape endpoint (0 picks a free port). A worker that finds it taken by another "
        "process of its server (its supervisor, a fellow worker) serves on a free port instead; anything else on "
        "it is an error that turns telemetry off.",
    ),
    Option(
        "STALLWATCH_PROMETHEUS_TARGETS_DIR",
        "prometheus_targets_dir",
        "`$XDG_STATE_HOME/stallwatch/prometheus` (`~/.local/state/stallwatch/prometheus`)",
        "Where each Prometheus endpoint (`prometheus` metrics exporter), the host's and the watchdog's, writes "
        "its target file for Prometheus's `file_sd_configs` while it serves: `host-*.json`, `watchdog-*.json`. "
        "Prometheus must be able to read it.",
    ),
    Option(
        "STALLWATCH_SHED_SPANS",
        "shed_spans",
        "`true`",
        "While every span queue is full or the backend is down, sampled spans that start are not recorded "
        "(ids and sampled flag kept; counted as dropped). `false` records them, to be dropped at their end.",
    ),
    Option(
        "STALLWATCH_FAST_PATHS",
        "fast_paths",
        "`true`",
        "Take stallwatch's fast paths around the OpenTelemetry SDK (its own spans for hot paths, OTLP "
        "encoders, span shedding, the context set directly, the current span noted for freeze reports at "
        "each attach and detach), each the same telemetry, cheaper, through the SDK's private parts "
        "(`sdk_compat`). `false` uses only public SDK objects: more CPU per work item and child process, "
        "`STALLWATCH_SHED_SPANS` has no effect, and a freeze report's current span is the last span "
        "started on the main thread and not yet ended there.",
    ),
    Option(
        "STALLWATCH_SLOW_EXPORT_SECONDS",
        "slow_export_seconds",
        "`1.0`",
        "A span or log export that succeeds but takes longer than this (leaving out the exporter's build "
        "at its first export) takes the backend to be overloaded: it is backed off from as from a failing "
        "one (new items dropped at once, counted as `backend_slow`, then a small probe). `0` turns this "
        "off: a slow backend then gets every batch, at the cost of recording them on the host's threads.",
    ),
    Option(
        "STALLWATCH_PROVIDERS",
        "providers",
        "`stallwatch`",
        "`stallwatch` builds and installs the tracer/meter/logger providers; `host` leaves that to "
        "the host (stallwatch reports through whatever the host installs; the host's providers "
        "are still made fork-aware, and flushed at a SIGTERM stop). The freeze watchdog, a process of its "
        "own, keeps stallwatch's.",
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
        "Seconds `shutdown()`, interpreter exit, a SIGTERM at its default action and the flush after a uvicorn "
        "server's stop may spend flushing telemetry, not counting the building of OTLP/HTTP exporters that had not "
        "exported yet (local work, up to 5 s more).",
    ),
    Option(
        "STALLWATCH_STRICT",
        "strict",
        "`false`",
        "`true` makes `setup()` (and so `import stallwatch.auto`) raise `ConfigError` naming every bad "
        "setting, instead of logging each and using its default.",
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
        "`vfork`",
        "Read at `import stallwatch` (and by `setup()`). `vfork` keeps uvloop as the loop but spawns its "
        "subprocesses through the standard library's vfork/posix_spawn path: no fork handler runs in the child "
        "and the loop never waits on a forked copy of the host. Calls it cannot honour (e.g. `preexec_fn`) use "
        "uvloop's own fork, recorded on the span. `fork` keeps uvloop's own spawn for every call.",
    ),
    Option(
        "STALLWATCH_INSTRUMENT_SSH",
        "instrument_ssh",
        "`true`",
        "Spans and metrics for SSH tunnel open/close (dstack's `SSHTunnel`, instrumented when it is imported; "
        "other classes through `stallwatch.instrument_tunnel`) and for paramiko connections, remote commands and "
        "SFTP sessions (instrumented when `paramiko` is imported).",
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
        "loop starts. With the `prometheus` exporter the child then serves its own series, and its watchdog "
        "its own, each on a free port (`STALLWATCH_PROMETHEUS_TARGETS_DIR`); with this off, such a child's "
        "series are served nowhere (the parent's endpoint serves the parent's).",
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
        "it answers while the host, frozen, cannot. A worker's watchdog that finds it taken by the watchdog of "
        "another process of its server serves on a free port instead.",
    ),
    Option(
        "STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT",
        "watchdog_last_scrape_timeout",
        "`35`",
        "Seconds the watchdog of a host that died frozen keeps its Prometheus endpoint up, waiting for one "
        "scrape that carries the death (`stallwatch_freeze_host_killed_seconds`), before it exits; the "
        "default covers two scrapes at a 15 s interval. `0` exits at once.",
    ),
    Option(
        "STALLWATCH_FAULTHANDLER",
        "faulthandler",
        "`false`",
        "Write a freeze's Python stacks and attach them to the watchdog's report: for a held GIL by "
        "`faulthandler.dump_traceback_later` (a C timer, re-armed by stallwatch's heartbeat thread), for a "
        "blocked event loop by that thread under the GIL. Replaces any faulthandler timer of the host's. "
        "See docs/freezes.md.",
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


def _default_prometheus_targets_dir() -> Path:
    return _state_dir("prometheus")


@dataclass(frozen=True, init=False, repr=False, eq=False)
class Settings:
    """Validated settings of one stallwatch session. Build with `Settings.load()`.

    `problems` lists the settings that were refused and what is used instead (not a keyword of `load`).
    A frozen dataclass (`dataclasses.fields` and `replace` work on it) whose keyword-only `__init__`,
    `__repr__`, `__eq__` and `__hash__` are written once below over its fields, not compiled from source
    by `dataclass` when the class is made, at every start; they behave as the generated ones did (`problems`
    takes no part in equality and hashing).
    """

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
    prometheus_targets_dir: Path = field(default_factory=_default_prometheus_targets_dir)
    shed_spans: bool = True
    fast_paths: bool = True
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
    uvloop_spawn: str = "vfork"
    instrument_ssh: bool = True
    instrument_nebius: bool = True
    journal: bool = True
    journal_dir: Path = field(default_factory=_default_journal_dir)
    watchdog: bool = True
    watchdog_forked_workers: bool = True
    freeze_threshold: float = 1.0
    faulthandler: bool = False
    watchdog_prometheus_port: int = 9465
    watchdog_last_scrape_timeout: float = 35.0
    problems: tuple[Problem, ...] = field(default=(), compare=False)

    def __init__(self, **values: Any) -> None:
        for each in fields(self):
            if each.name in values:
                value = values.pop(each.name)
            elif each.default_factory is not MISSING:
                value = each.default_factory()
            else:
                value = each.default
            object.__setattr__(self, each.name, value)
        if values:
            raise TypeError(f"Settings() got an unexpected keyword argument {next(iter(values))!r}")

    def __repr__(self) -> str:
        shown = ", ".join(f"{each.name}={getattr(self, each.name)!r}" for each in fields(self))
        return f"{type(self).__qualname__}({shown})"

    def _compared(self) -> tuple[Any, ...]:
        return tuple(getattr(self, each.name) for each in fields(self) if each.compare)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Settings)
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read settings from `environ` (default `os.environ`, with the problems `import stallwatch` found)
        and apply keyword overrides.

        A bad value costs only its own setting (see the module docstring) and is recorded in
        `problems`; an unknown keyword is recorded and ignored. Directories are checked without being
        created (`prepare_directories` creates them). Nothing is logged or changed here. With `strict`
        on (a bad `strict` counts as false), raises `ConfigError` naming every problem instead.
        """
        env = os.environ if environ is None else environ
        problems: list[Problem] = list(IMPORT_PROBLEMS.values()) if environ is None else []
        defaults = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(cls)}
        for keyword in sorted(set(overrides) - set(KEYWORDS)):
            problems.append(Problem(keyword, _unknown_keyword(keyword), "ignored"))
        values: dict[str, Any] = {}

        def take(keyword: str, variable: str, parse: Callable[[str, str], Any], default: str | None = None) -> None:
            """The keyword's value, else the variable's, else `default` (parsed) or the field's default."""
            refused: list[tuple[str, str]] = []
            from_variable = False
            if keyword in overrides:
                try:
                    values[keyword] = _parse_keyword(overrides[keyword], keyword, parse)
                    return
                except ConfigError as exc:
                    refused.append((keyword, str(exc)))
            if (text := env.get(variable)) not in (None, ""):
                try:
                    values[keyword] = parse(text, variable)
                    from_variable = True
                except ConfigError as exc:
                    refused.append((variable, str(exc)))
            if keyword not in values and default is not None:
                values[keyword] = parse(default, variable)
            fallback = (
                f"using {variable} instead"
                if from_variable
                else f"using the default {_described(keyword, values.get(keyword, defaults[keyword]))}"
            )
            problems.extend(Problem(name, error, fallback) for name, error in refused)

        take("strict", "STALLWATCH_STRICT", _bool)
        take("disabled", "OTEL_SDK_DISABLED", _bool)
        take("service_name", "OTEL_SERVICE_NAME", _nonempty)
        take("resource_attributes", "OTEL_RESOURCE_ATTRIBUTES", _resource_attributes)
        take("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _url)
        endpoint_set = "otlp_endpoint" in values
        for variable in OTLP_SIGNAL_ENDPOINTS:
            if text := env.get(variable):
                try:
                    _url(text, variable)
                    endpoint_set = True
                except ConfigError as exc:
                    instead = "the general endpoint" if "otlp_endpoint" in values else "the default endpoint"
                    problems.append(Problem(variable, str(exc), f"using {instead}"))
        default_exporter = "otlp" if endpoint_set else "file"
        take("traces_exporter", "OTEL_TRACES_EXPORTER", _choices(TRACE_EXPORTERS), default_exporter)
        take("metrics_exporter", "OTEL_METRICS_EXPORTER", _choices(METRIC_EXPORTERS), default_exporter)
        take("logs_exporter", "OTEL_LOGS_EXPORTER", _choices(LOG_EXPORTERS), default_exporter)
        take("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", _one_of(PROTOCOLS))
        values["signal_protocols"] = _signal_protocols(
            overrides.get("signal_protocols", {}), env, values.get("otlp_protocol", defaults["otlp_protocol"]), problems
        )
        take("sampler", "OTEL_TRACES_SAMPLER", _one_of(SAMPLERS))
        take("sampler_arg", "OTEL_TRACES_SAMPLER_ARG", _ratio)
        take("metric_export_interval_ms", "OTEL_METRIC_EXPORT_INTERVAL", _positive_int)
        take("prometheus_host", "OTEL_EXPORTER_PROMETHEUS_HOST", _nonempty)
        take("prometheus_port", "OTEL_EXPORTER_PROMETHEUS_PORT", _port)
        take("prometheus_targets_dir", "STALLWATCH_PROMETHEUS_TARGETS_DIR", _path)
        take("shed_spans", "STALLWATCH_SHED_SPANS", _bool)
        take("fast_paths", "STALLWATCH_FAST_PATHS", _bool)
        take("slow_export_seconds", "STALLWATCH_SLOW_EXPORT_SECONDS", _seconds_or_zero)
        take("providers", "STALLWATCH_PROVIDERS", _one_of(PROVIDER_OWNERS))
        take("file_dir", "STALLWATCH_FILE_DIR", _path)
        take("log_level", "STALLWATCH_LOG_LEVEL", _log_level)
        take("shutdown_timeout", "STALLWATCH_SHUTDOWN_TIMEOUT", _positive_float)
        take("instrument_executor", "STALLWATCH_INSTRUMENT_EXECUTOR", _bool)
        take("executor_heal", "STALLWATCH_EXECUTOR_HEAL", _bool)
        take("guard_async_exc", "STALLWATCH_GUARD_ASYNC_EXC", _bool)
        take("wedge_check_interval", "STALLWATCH_WEDGE_CHECK_INTERVAL", _positive_float)
        take("queue_stall_seconds", "STALLWATCH_QUEUE_STALL_SECONDS", _positive_float)
        take("instrument_subprocess", "STALLWATCH_INSTRUMENT_SUBPROCESS", _bool)
        take("record_args", "STALLWATCH_RECORD_ARGS", _bool)
        take("scrub_patterns", "STALLWATCH_SCRUB_PATTERNS", _patterns)
        take("propagate_to_children", "STALLWATCH_PROPAGATE_TO_CHILDREN", _bool)
        take("uvloop_spawn", "STALLWATCH_UVLOOP_SPAWN", _one_of(UVLOOP_SPAWN_METHODS))
        take("instrument_ssh", "STALLWATCH_INSTRUMENT_SSH", _bool)
        take("instrument_nebius", "STALLWATCH_INSTRUMENT_NEBIUS", _bool)
        take("journal", "STALLWATCH_JOURNAL", _bool)
        take("journal_dir", "STALLWATCH_JOURNAL_DIR", _path)
        take("watchdog", "STALLWATCH_WATCHDOG", _bool)
        take("watchdog_forked_workers", "STALLWATCH_WATCHDOG_FORKED_WORKERS", _bool)
        take("freeze_threshold", "STALLWATCH_FREEZE_THRESHOLD", _positive_float)
        take("faulthandler", "STALLWATCH_FAULTHANDLER", _bool)
        take("watchdog_prometheus_port", "STALLWATCH_WATCHDOG_PROMETHEUS_PORT", _port)
        take("watchdog_last_scrape_timeout", "STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT", _seconds_or_zero)
        problems += _check_sdk_variables(env)
        settings = _check_directories(cls(**values, problems=tuple(problems)), overrides, create=False)
        _raise_if_strict(settings, settings.problems)
        return settings

    def protocol_for(self, signal: str) -> str:
        """OTLP protocol of one signal (`traces`, `metrics`, `logs`)."""
        return self.signal_protocols.get(signal, self.otlp_protocol)


KEYWORDS: tuple[str, ...] = tuple(f.name for f in fields(Settings) if f.name != "problems")


def prepare_directories(settings: Settings, keywords: Collection[str] = ()) -> Settings:
    """Create the file exporter's and the journal's directories (0700) for `setup()`. One that cannot be
    made costs only its part: the file exporter or the journal is off, and a problem names the keyword
    (when in `keywords`, the ones `setup()` was given) or the variable, with the reason. Raises
    `ConfigError` naming those instead when `strict` is on."""
    checked = _check_directories(settings, keywords, create=True)
    _raise_if_strict(checked, checked.problems[len(settings.problems) :])
    return checked


def _check_directories(settings: Settings, keywords: Collection[str], create: bool) -> Settings:
    problems: list[Problem] = []
    changes: dict[str, Any] = {}
    exporters = ("traces_exporter", "metrics_exporter", "logs_exporter")
    parts = (
        ("file_dir", "STALLWATCH_FILE_DIR", any("file" in getattr(settings, name) for name in exporters),
         "the file exporter is off (choose a writable directory, or another exporter)"),
        ("journal_dir", "STALLWATCH_JOURNAL_DIR", settings.journal,
         "the journal is off (choose a writable directory, or set STALLWATCH_JOURNAL=false)"),
    )  # fmt: skip
    for keyword, variable, used, fallback in parts:
        directory = getattr(settings, keyword)
        reason = _unusable(directory, create) if used else None
        if reason is not None:
            name = keyword if keyword in keywords else variable
            problems.append(Problem(name, f"{name}={_shown(str(directory))} is unusable: {reason}", fallback))
            if keyword == "file_dir":
                changes.update({kind: tuple(e for e in getattr(settings, kind) if e != "file") for kind in exporters})
            else:
                changes["journal"] = False
    if not problems:
        return settings
    return replace(settings, **changes, problems=settings.problems + tuple(problems))


def _unusable(directory: Path, create: bool) -> str | None:
    """Why stallwatch cannot keep files in `directory`, or None. With `create`, it is made (with its
    parents, 0700) and must then be a directory this process can write in; without, nothing is
    touched and its nearest existing ancestor must be one."""
    if create:
        try:
            make_directories(directory)
        except OSError as exc:
            return f"cannot create {scrub_text(str(exc.filename or directory))} ({exc.strerror or exc})"
    for candidate in (directory, *directory.parents):
        try:
            mode = candidate.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            return f"cannot read {scrub_text(str(candidate))} ({exc.strerror or exc})"
        if not stat.S_ISDIR(mode):
            return f"{scrub_text(str(candidate))} is not a directory"
        if not os.access(candidate, os.W_OK | os.X_OK):
            return f"{scrub_text(str(candidate))} is not writable by this process"
        return None
    return f"no parent of {scrub_text(str(directory))} exists"


def _raise_if_strict(settings: Settings, problems: Collection[Problem]) -> None:
    if settings.strict and problems:
        raise ConfigError("; ".join(problem.error for problem in problems), problems)


def _unknown_keyword(keyword: str) -> str:
    import difflib  # footprint: only for a keyword that is misspelt

    close = difflib.get_close_matches(keyword, KEYWORDS, n=1)
    hint = f"did you mean {close[0]}?" if close else "the keywords are: " + ", ".join(KEYWORDS)
    return f"setup() keyword {keyword!r} is not a setting ({hint})"


def _described(keyword: str, value: Any) -> str:
    """A setting's value as a log line shows the value used instead of a refused one."""
    if keyword in _SHOWN_DEFAULTS:  # these fall back to nothing but their default
        return _SHOWN_DEFAULTS[keyword]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return str(value)


# Defaults whose value says less than their effect.
_SHOWN_DEFAULTS = {
    "service_name": "unknown_service",
    "resource_attributes": "none",
    "otlp_endpoint": "none (OTLP exporters then send to localhost)",
    "log_level": "WARNING",
    "scrub_patterns": "none (the built-in patterns only)",
}


def _signal_protocols(given: object, env: Mapping[str, str], general: str, problems: list[Problem]) -> dict[str, str]:
    """The per-signal OTLP protocols: the `signal_protocols` keyword's, else the variables'; a bad one
    falls back to the variable, then to the general protocol."""
    signals = ("traces", "metrics", "logs")
    if not isinstance(given, Mapping) or not set(given) <= set(signals):
        expected = "a mapping of traces/metrics/logs to " + " or ".join(PROTOCOLS)
        problems.append(Problem("signal_protocols", str(_fail("signal_protocols", given, expected)), "ignored"))
        given = {}
    fallback = f"using the general protocol, {general}"
    protocols: dict[str, str] = {}
    for signal in signals:
        variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
        refused: list[tuple[str, str]] = []
        if signal in given:
            name = f"signal_protocols[{signal!r}]"
            try:
                protocols[signal] = _parse_keyword(given[signal], name, _one_of(PROTOCOLS))
            except ConfigError as exc:
                refused.append((name, str(exc)))
        if signal not in protocols and (text := env.get(variable)):
            try:
                protocols[signal] = _one_of(PROTOCOLS)(text, variable)
            except ConfigError as exc:
                refused.append((variable, str(exc)))
        instead = f"using {variable} instead" if signal in protocols else fallback
        problems.extend(Problem(name, error, instead) for name, error in refused)
    return protocols


def _strict_in_environment() -> bool:
    """`STALLWATCH_STRICT` read leniently (a bad value is false), for `import stallwatch`."""
    return os.environ.get("STALLWATCH_STRICT", "").strip().lower() in _TRUE


def load_opentelemetry() -> None:
    """Import the OpenTelemetry modules that read a variable when they are imported, those of them
    whose variables are set.

    They raise on a bad value (an unknown name in `OTEL_PROPAGATORS`, a negative
    `OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`), which would fail `import stallwatch` and with it the host.
    Which values fail depends on the installed version, so this imports them and, when one raises,
    removes the variable it read from `os.environ` (the only way to give OpenTelemetry its default
    there; children then inherit the environment without it), reports it (`report`), keeps it in
    `IMPORT_PROBLEMS` for `setup()`, and imports again. With `STALLWATCH_STRICT=true` it raises
    `ConfigError` instead and changes nothing. Called first thing by `import stallwatch`.

    `OTEL_RESOURCE_ATTRIBUTES` is checked before: the SDK reads it when imported too (1.45 builds a
    resource in `opentelemetry.sdk._logs`), logging a second line of its own about a bad one.
    """
    text = os.environ.get("OTEL_RESOURCE_ATTRIBUTES")
    if text and not _strict_in_environment():  # strict: setup() raises naming it
        try:
            _resource_attributes(text, "OTEL_RESOURCE_ATTRIBUTES")
        except ConfigError as exc:
            _remove_at_import([Problem("OTEL_RESOURCE_ATTRIBUTES", str(exc), _REMOVED_AT_IMPORT + " (none)")])
    for module, variables in _READ_AT_IMPORT:
        if not any(variable in os.environ for variable in variables):
            continue  # footprint: nothing it could refuse; it loads when the host or setup() first needs it
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
                problems = [
                    Problem(
                        variable,
                        f"{variable}={_shown(os.environ[variable])} is invalid: expected "
                        f"{_accepted_at_import(variable)} (OpenTelemetry fails to import with it: {_scrubbed(exc)})",
                        _REMOVED_AT_IMPORT + (" (tracecontext,baggage)" if variable == "OTEL_PROPAGATORS" else ""),
                    )
                    for variable in named
                ]
                if _strict_in_environment():
                    raise ConfigError("; ".join(problem.error for problem in problems), problems) from exc
                _remove_at_import(problems)


_REMOVED_AT_IMPORT = "removed from this process's environment, so OpenTelemetry uses its default"


def _remove_at_import(problems: list[Problem]) -> None:
    for problem in problems:
        del os.environ[problem.setting]
        IMPORT_PROBLEMS[problem.setting] = problem
    report(problems)


def _accepted_at_import(variable: str) -> str:
    if variable in SDK_LIMITS:
        return _LIMIT
    from importlib.metadata import entry_points

    names = sorted({entry.name for entry in entry_points(group="opentelemetry_propagator")})
    return "comma-separated names of installed propagators: " + ", ".join(names)


def _scrubbed(exc: Exception) -> str:
    return str(scrub_text(str(exc)))


def _valid_at_import(variable: str) -> bool:
    """Whether a variable OpenTelemetry reads at import passes stallwatch's own check (a limit's);
    `OTEL_PROPAGATORS` has none, as only OpenTelemetry knows the installed propagators."""
    return variable in SDK_LIMITS and not _check_sdk_variables({variable: os.environ[variable]})


def uvloop_spawn_at_import() -> str:
    """`STALLWATCH_UVLOOP_SPAWN` as `import stallwatch` reads it: `fork` only when it says so, else
    `vfork` (the default; a bad value is reported once, by `setup()`, which reads it again)."""
    text = os.environ.get("STALLWATCH_UVLOOP_SPAWN", "")
    return "fork" if text.strip().lower() == "fork" else "vfork"


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean `STALLWATCH_*` import-time flag. A bad value gives `default`, reported once
    (`report`) and kept in `IMPORT_PROBLEMS` for `setup()`."""
    text = os.environ.get(name)
    if text in (None, ""):
        return default
    try:
        return _bool(text, name)
    except ConfigError as exc:
        problem = Problem(name, str(exc), f"using the default {_described(name, default)}")
        IMPORT_PROBLEMS[name] = problem
        report([problem])
        return default


# ---- parsers: each takes (raw text, setting name) and raises ConfigError naming the setting ----

_LIMIT = "a non-negative integer, or empty for no limit"


def _check_sdk_variables(env: Mapping[str, str]) -> list[Problem]:
    """The problems of the SDK-read variables (`SDK_VARIABLES`) that `setup()` would otherwise fail on,
    as the SDK parses them: a limit is an integer ≥ 0, or empty for no limit; a batch processor's
    queue size, delay and batch size are positive integers, the batch no larger than the queue (an
    empty one means the default; text that is not an integer, which the SDK replaces by its default
    with a traceback in the log, is refused too); an OTLP timeout is a number, even if empty; the
    exemplar filter is one of `EXEMPLAR_FILTERS`, exactly. Each refused one falls back to
    OpenTelemetry's default (`withhold_from_sdk` makes the SDK use it too)."""
    problems: list[Problem] = []

    def refuse(name: str, text: str, expected: str, fallback: str) -> None:
        problems.append(Problem(name, str(_fail(name, text, expected)), fallback))

    for variable in SDK_LIMITS:
        if (text := env.get(variable)) is not None and text.strip() and _sdk_int(text, 0) is None:
            refuse(variable, text, _LIMIT, "using OpenTelemetry's default")
    for prefix in SDK_BATCH_PREFIXES:
        chosen: dict[str, int] = {}  # the values set and valid
        for name, default in _SDK_BATCH_DEFAULTS.items():
            variable, text = f"{prefix}_{name}", env.get(f"{prefix}_{name}") or ""
            value = _sdk_int(text, 1) if text else default
            if value is None:
                refuse(variable, text, "a positive integer", f"using the default {default}")
            elif text:
                chosen[name] = value
        queue = chosen.get("MAX_QUEUE_SIZE", _SDK_BATCH_DEFAULTS["MAX_QUEUE_SIZE"])
        batch = chosen.get("MAX_EXPORT_BATCH_SIZE", _SDK_BATCH_DEFAULTS["MAX_EXPORT_BATCH_SIZE"])
        batch_variable, queue_variable = f"{prefix}_MAX_EXPORT_BATCH_SIZE", f"{prefix}_MAX_QUEUE_SIZE"
        if batch > queue and "MAX_EXPORT_BATCH_SIZE" in chosen:
            batch = _SDK_BATCH_DEFAULTS["MAX_EXPORT_BATCH_SIZE"]
            refuse(batch_variable, env[batch_variable], f"at most {queue_variable} ({queue})",
                   f"using the default {batch}")  # fmt: skip
        if batch > queue:  # the queue size was set, smaller than the default batch
            refuse(queue_variable, env[queue_variable], f"at least {batch_variable} ({batch}, its default)",
                   f"using the default {_SDK_BATCH_DEFAULTS['MAX_QUEUE_SIZE']}")  # fmt: skip
    timeouts = {variable: env[variable] for variable in OTLP_TIMEOUTS if variable in env}
    whole_seconds = bool(timeouts) and _otlp_timeouts_are_whole_seconds()  # a version looked up only if needed
    for variable, text in timeouts.items():  # the exporters raise on one they cannot read (empty too)
        try:
            int(text) if whole_seconds else float(text)
        except ValueError:
            general = variable == "OTEL_EXPORTER_OTLP_TIMEOUT"
            expected = "a whole number of seconds" if whole_seconds else "a number of seconds"
            refuse(variable, text, f"{expected} (what the installed Python OTLP exporters read)",
                   "using the default, 10 seconds" if general else "using OTEL_EXPORTER_OTLP_TIMEOUT or its "
                   "default, 10 seconds")  # fmt: skip
    text = env.get("OTEL_METRICS_EXEMPLAR_FILTER")
    if text is not None and text not in EXEMPLAR_FILTERS:
        refuse("OTEL_METRICS_EXEMPLAR_FILTER", text, "one of " + ", ".join(EXEMPLAR_FILTERS) + " (exactly)",
               "using the default trace_based")  # fmt: skip
    return problems


def _otlp_timeouts_are_whole_seconds() -> bool:
    """The OTLP exporters before 1.34 read their timeout variables with `int()`, later ones with `float()`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("opentelemetry-exporter-otlp-proto-http").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (1, 34)


class Batching(Record):
    """How a batch processor queues and exports, as the SDK's reads it from `OTEL_BSP_*` (spans) or
    `OTEL_BLRP_*` (log records)."""

    __slots__ = ("batch", "delay_seconds", "queue")
    queue: int  # most items queued; one more is dropped
    batch: int  # most items per export; a queue this long is exported at once
    delay_seconds: float  # what is queued is exported at least this often

    def __init__(self, queue: int, batch: int, delay_seconds: float) -> None:
        self._set(queue=queue, batch=batch, delay_seconds=delay_seconds)


def sdk_batching(prefix: str, env: Mapping[str, str] | None = None) -> Batching:
    """The batching `prefix` (`OTEL_BSP` or `OTEL_BLRP`) asks for in `env` (the process's environment),
    OpenTelemetry's default for a value that is unset or refused (`_check_sdk_variables`)."""
    env = os.environ if env is None else env
    defaults = _SDK_BATCH_DEFAULTS | {"SCHEDULE_DELAY": _SDK_SCHEDULE_DELAYS[prefix]}
    values = {name: _sdk_int(env.get(f"{prefix}_{name}") or "", 1) or default for name, default in defaults.items()}
    if values["MAX_EXPORT_BATCH_SIZE"] > values["MAX_QUEUE_SIZE"]:
        values["MAX_EXPORT_BATCH_SIZE"] = min(defaults["MAX_EXPORT_BATCH_SIZE"], values["MAX_QUEUE_SIZE"])
    return Batching(values["MAX_QUEUE_SIZE"], values["MAX_EXPORT_BATCH_SIZE"], values["SCHEDULE_DELAY"] / 1000)


def _sdk_int(text: str, least: int) -> int | None:
    """An integer as the SDK reads it (`int(text)`), at least `least`; None when it is not."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= least else None


def _fail(name: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"{name}={_shown(value)} is invalid: expected {expected}")


def _shown(value: object) -> str:
    """A bad value as its error shows it: its repr, with secrets (a password in an endpoint URL, a token in
    the resource attributes) redacted and a long value cut, since the error goes to the host's log.
    Never raises, whatever the object's `__repr__` does."""
    if isinstance(value, str):
        return repr(scrub_text(value))
    try:
        return scrub_text(repr(value))
    except Exception:
        return f"<{type(value).__name__} object>"


def _parse_keyword(value: Any, name: str, parse: Callable[[str, str], Any]) -> Any:
    """A keyword override: text through the parser, a value of the field's own type by round-tripping it."""
    if isinstance(value, str):
        return parse(value, name)
    expected = f"a value like the environment variable takes, not {type(value).__name__}"
    try:
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
    except ConfigError:
        raise
    except Exception as exc:  # a host object whose conversion raises
        raise _fail(name, value, expected) from exc
    raise _fail(name, value, expected)


def _patterns(text: str, name: str) -> tuple[re.Pattern[str], ...]:
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
    raise _fail(name, text, _BOOLEANS)


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
    """Render the settings table of docs/configuration.md."""
    lines = ["| Variable | `setup()` keyword | Default | Meaning |", "|---|---|---|---|"]
    for option in OPTIONS:
        keyword = f"`{option.keyword}`" if option.keyword else "(environment only)"
        lines.append(f"| `{option.env}` | {keyword} | {option.default} | {option.description} |")
    return "\n".join(lines) + "\n"
