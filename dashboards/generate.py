"""Generate stallwatch's Grafana dashboards, Prometheus alert rules and their promtool tests.

Run `python dashboards/generate.py` after changing this file or `stallwatch.telemetry`; it rewrites
`dashboards/json/*.json`, `dashboards/alerts.yaml`, `dashboards/tests/alerts_test.yaml` and the
tables in `dashboards/README.md`, and `tests/test_dashboards.py` fails while the committed files
differ from what it generates. Every metric and label name comes from `stallwatch.telemetry`;
dashboards are built with the official grafana-foundation-sdk (Grafana 11.6 flavour).
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import logs, loki, prometheus, statetimeline, table, tempo, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as gm
from grafana_foundation_sdk.models import tempo as tempo_models

from stallwatch import telemetry as t
from stallwatch.journal.ledger import LOGGER_NAME as LEDGER_LOGGER


def label(attribute: t.Attribute) -> str:
    """The Prometheus label an attribute becomes (`.` and `-` → `_`)."""
    return attribute.name.replace(".", "_").replace("-", "_")


HERE = Path(__file__).resolve().parent
PROMETHEUS, TEMPO, LOKI = "prometheus", "tempo", "loki"
DS = {kind: gm.DataSourceRef(type_val=kind, uid=f"${{{kind}}}") for kind in (PROMETHEUS, TEMPO, LOKI)}
SERVICE_NAME, INSTANCE_ID = label(t.SERVICE_NAME), label(t.SERVICE_INSTANCE_ID)  # on every series (see pipeline)
# The template variables every dashboard selector carries: a host and its freeze watchdog share both labels.
SCOPE_MATCHERS = f'{SERVICE_NAME}=~"$service", {INSTANCE_ID}=~"$instance"'
SCOPE = f"{{{SCOPE_MATCHERS}}}"
RATE = "$__rate_interval"
# How long an event alert fires after its event, and how long a state alert holds its last seen state
# through a scrape gap (a frozen host answers no scrape; its series go stale).
ALERT_WINDOW = "10m"
# How far before its window an event alert looks for a counter's earlier value (a longer gap makes the
# series look new again).
ALERT_MEMORY = "1h"
# How long FrozenHostKilled fires after a host died frozen, whether it came back or not (HostDown fires
# while it stays down): past the event alerts' window, so it is still firing when someone looks.
KILLED_WINDOW = "30m"
HOST_JOB = "stallwatch"  # the host's own scrape job in provisioning/prometheus/prometheus.yml
ALERT_KEEP = ("job", "instance", SERVICE_NAME, INSTANCE_ID)  # an alert leads to the host and its watchdog
HOST = f"{{{{ $labels.{SERVICE_NAME} }}}} {{{{ $labels.{INSTANCE_ID} }}}}"  # who an alert is about, in its text
GRID_WIDTH, PANEL_HEIGHT = 24, 8
SPAWN_BLOCKED_HIGH = 0.1  # seconds: one spawn blocked longer fires SpawnBlockedHigh; drawn on its panel
QUEUE_WAIT_SECONDS = 30  # ExecutorQueueWaitHigh's oldest pending age, drawn on its panel

# The watchdog's freeze span and the executor's work-item span ("<executor name> work item"), from the contract.
FREEZE_SPAN = t.FREEZE_SPAN.name
WORK_ITEM_SPAN_SUFFIX = t.WORK_ITEM_SPAN.name.removeprefix("{" + t.EXECUTOR_NAME.name + "}")
WORK_ITEM_QUEUE_SECONDS = t.WORK_ITEM_QUEUE_SECONDS.name
WORK_ITEM_RUN_SECONDS = t.WORK_ITEM_RUN_SECONDS.name
WATCHDOG_LOGGER = "stallwatch.watchdog"
FREEZE_LOG_MESSAGE = "stallwatch: freeze detected"


# ---- PromQL building blocks ---------------------------------------------------------------------


def series(metric: t.Metric, suffix: str = "", matchers: Iterable[tuple[t.Attribute, str, str]] = ()) -> str:
    """A selector of `metric` (plus `_bucket`/`_sum`/`_count` for histograms) scoped by $service and $instance."""
    parts = []
    for attribute, op, value in matchers:
        if attribute not in metric.attributes:
            raise ValueError(f"{metric.name} has no attribute {attribute.name}")
        parts.append(f'{label(attribute)}{op}"{value}"')
    if suffix and metric.kind != "histogram":
        raise ValueError(f"{metric.name} is a {metric.kind}, not a histogram")
    extra = "".join(f", {part}" for part in parts)
    return f"{metric.prometheus_name}{suffix}{{{SCOPE_MATCHERS}{extra}}}"


def by(metric: t.Metric, *attributes: t.Attribute, extra: tuple[str, ...] = ()) -> str:
    """The `by (...)` label list: `extra` labels, then the labels of `metric`'s own `attributes`."""
    for attribute in attributes:
        if attribute not in metric.attributes:
            raise ValueError(f"{metric.name} has no attribute {attribute.name}")
    return ", ".join([*extra, *(label(a) for a in attributes)])


def rate(metric: t.Metric, *group: t.Attribute, suffix: str = "", matchers: tuple = (), window: str = RATE) -> str:
    """Per-second rate of a counter (or a histogram's `_count`), summed by `group`."""
    return f"sum by ({by(metric, *group)}) (rate({series(metric, suffix, matchers)}[{window}]))"


def quantile(q: float, metric: t.Metric, *group: t.Attribute, window: str = RATE, keep: tuple[str, ...] = ()) -> str:
    """Quantile `q` of a histogram over `window`, by `group` (and the `keep` labels, e.g. job, instance)."""
    return (
        f"histogram_quantile({q}, sum by ({by(metric, *group, extra=('le', *keep))}) "
        f"(rate({series(metric, '_bucket')}[{window}])))"
    )


def gauge(metric: t.Metric, *group: t.Attribute, agg: str = "sum", keep: tuple[str, ...] = ()) -> str:
    """A gauge (or up-down counter) aggregated with `agg` by `group` (and the `keep` labels)."""
    return f"{agg} by ({by(metric, *group, extra=keep)}) ({series(metric)})"


def events(
    metric: t.Metric,
    *group: t.Attribute,
    suffix: str = "",
    matchers: tuple = (),
    window: str = RATE,
    keep: tuple[str, ...] = (),
) -> str:
    """Counter increments in `window` by `group` (and the `keep` labels), the first one included; no zeros.

    A counter series appears with its first increment, and Prometheus's `increase()` cannot see the
    step from "no series" to 1 (a worker that dies once would show as 0 and never alert): the right-hand
    side adds the whole value of series that did not exist `window` ago, where the left finds no increase.
    """
    keys = by(metric, *group, extra=keep)
    selector = series(metric, suffix, matchers)
    return (
        f"sum by ({keys}) (increase({selector}[{window}])) > 0 "
        f"or sum by ({keys}) ({selector} > 0 unless {selector} offset {window})"
    )


def recent_events(metric: t.Metric, *group: t.Attribute, matchers: tuple = ()) -> str:
    """Counter increments in the last `ALERT_WINDOW` by `group` (and job, instance), for an alert that
    fires for that window after each event, whatever scrape gaps there were.

    `increase()` over the window sees an event as long as the window holds a sample from before it
    and one from after, gaps or not. It misses a series born with its first event (Prometheus has
    nothing to compare with), and one whose last sample before a gap longer than the window is
    older than the window: the second clause compares the last value in the window with the last
    value in the `ALERT_MEMORY` before it (absent: 0). A gap alone never changes either value, so no
    alert fires, clears or fires again because of it. A series that restarts with its first event
    under labels seen within the memory (a restarted host with a fixed service.instance.id) is seen
    by `increase()` alone, as a reset and growth, where stallwatch makes that series at zero from the
    start (the series it can name in advance).
    """
    keys = by(metric, *group, extra=ALERT_KEEP)
    selector = series(metric, matchers=matchers)
    latest = f"last_over_time({selector}[{ALERT_WINDOW}])"
    before = f"last_over_time({selector}[{ALERT_MEMORY}] offset {ALERT_WINDOW})"
    return (
        f"sum by ({keys}) (increase({selector}[{ALERT_WINDOW}])) > 0 "
        f"or sum by ({keys}) ({latest} > ({before} or {latest} * 0))"
    )


def recent_over(metric: t.Metric, bound: float, *group: t.Attribute) -> str:
    """Observations of histogram `metric` over `bound` (a bucket bound) in the last `ALERT_WINDOW` by
    `group` (and job, instance): `recent_events()` of each series' `_count` minus its `le` bucket,
    which counts exactly those, with the same two clauses, so a single observation fires for the
    window after it, through scrape gaps, and a gap alone never fires, clears or fires it again."""
    if bound not in (metric.buckets or t.DURATION_BUCKETS):
        raise ValueError(f"{bound} is not a bucket bound of {metric.name}")
    keys = by(metric, *group, extra=ALERT_KEEP)
    count = series(metric, "_count")
    bucket = series(metric, "_bucket").removesuffix("}") + f', le="{bound}"}}'

    def over(function: str, span: str) -> str:
        return f"({function}({count}{span}) - ignoring(le) {function}({bucket}{span}))"

    latest = over("last_over_time", f"[{ALERT_WINDOW}]")
    before = over("last_over_time", f"[{ALERT_MEMORY}] offset {ALERT_WINDOW}")
    return (
        f"sum by ({keys}) {over('increase', f'[{ALERT_WINDOW}]')} > 0 "
        f"or sum by ({keys}) ({latest} > ({before} or {latest} * 0))"
    )


def held(metric: t.Metric, *group: t.Attribute, agg: str = "max") -> str:
    """A gauge's last value within `ALERT_WINDOW` by `group` (and job, instance): the state as last
    seen, held through a scrape gap that short, and over as soon as a sample says so."""
    return f"{agg} by ({by(metric, *group, extra=ALERT_KEEP)}) (last_over_time({series(metric)}[{ALERT_WINDOW}]))"


def killed(*group: t.Attribute, window: str = KILLED_WINDOW, keep: tuple[str, ...] = ()) -> str:
    """Seconds a host had been frozen when it died, within `window` by `group` (and the `keep` labels).

    The watchdog reports it in the last scrape before it exits, after which its series go stale: the
    maximum over the window keeps that one sample for the whole window, whatever comes after it."""
    keys = by(t.FREEZE_HOST_KILLED, *group, extra=keep)
    return f"max by ({keys}) (max_over_time({series(t.FREEZE_HOST_KILLED)}[{window}])) > 0"


# ---- panels -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class State:
    """One value a state panel shows, by name and colour."""

    value: int
    text: str
    color: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "statetimeline", "table", "logs"] = "timeseries"
    source: Literal["prometheus", "tempo", "loki"] = PROMETHEUS
    width: int = 12
    states: tuple[State, ...] = ()  # a state panel's values, lowest first (its colours and thresholds follow)
    alert_at: float | None = None  # where the alert on this panel fires: drawn as a red threshold line


# What a gauge scraped every interval can show of a freeze, for the panel and the alert that read it.
FREEZE_VISIBILITY = (
    "Seen only if a scrape of the watchdog lands inside the freeze: always for a freeze at least one scrape "
    "interval long (15 s as shipped), by chance (its length over the interval) for a shorter one, which "
    "otherwise shows only after it ends, in the freeze count and duration panels and the watchdog's records."
)
FROZEN_STATES = (State(0, "No", "green"), State(1, "Yes", "red"))
UP_STATES = (State(0, "Down", "red"), State(1, "Up", "green"))


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    tags: tuple[str, ...] = field(default=("stallwatch",))


def p50_p99(metric: t.Metric, *group: t.Attribute, what: str = "") -> tuple[Query, ...]:
    legend = " ".join("{{" + label(a) + "}}" for a in group)
    prefix = f"{what} " if what else ""
    return (
        Query(quantile(0.5, metric, *group), f"{prefix}p50 {legend}".strip()),
        Query(quantile(0.99, metric, *group), f"{prefix}p99 {legend}".strip()),
    )


def legend_of(*attributes: t.Attribute) -> str:
    return " ".join("{{" + label(a) + "}}" for a in attributes)


SERVICE_MATCH = 'resource.service.name =~ "${service:regex}"'
SPAWN_QUERY = (
    f'{{ {SERVICE_MATCH} && (span.{t.SPAWN_BLOCKED.name} > 0.1 || name = "{FREEZE_SPAN}") }} '
    f"| select(span.{t.SPAWN_BLOCKED.name}, span.{t.FREEZE_KIND.name}, span.{t.FREEZE_CAUSE.name}, "
    f"span.{t.PROCESS_EXECUTABLE_NAME.name}, span.{t.EXIT_SIGNAL.name})"
)
WORK_ITEM_QUERY = (
    f'{{ {SERVICE_MATCH} && name =~ ".+{WORK_ITEM_SPAN_SUFFIX}" && span.{WORK_ITEM_QUEUE_SECONDS} > 0.1 }} '
    f"| select(span.{WORK_ITEM_QUEUE_SECONDS}, span.{WORK_ITEM_RUN_SECONDS}, span.{t.EXECUTOR_NAME.name})"
)
NEBIUS_QUERY = (
    f'{{ {SERVICE_MATCH} && span.{t.RPC_SYSTEM.name} = "grpc" && span.{t.NEBIUS_ATTEMPTS.name} > 0 '
    f"&& (duration > 1s || status = error) }} "
    f"| select(span.{t.RPC_GRPC_STATUS_CODE.name}, span.{t.NEBIUS_ATTEMPTS.name}, span.{t.CLOUD_RESOURCE_ID.name})"
)
# `up` has no labels but the target's: its service labels come from the target's last target_info
# (kept an hour, so a host that went down keeps its Down), multiplied by up's 0 or 1.
UP_BY_IDENTITY = (
    f"max by (job, instance, {SERVICE_NAME}, {INSTANCE_ID}) (last_over_time(target_info{SCOPE}[1h])) "
    "* on (job, instance) group_left () up"
)
WATCHDOG_LOGS = f'{{service_name=~"${{service:regex}}"}} | scope_name = "{WATCHDOG_LOGGER}"'
for _span, _attributes in (
    (t.SUBPROCESS_SPAN, (t.SPAWN_BLOCKED, t.PROCESS_EXECUTABLE_NAME, t.EXIT_SIGNAL)),
    (t.NEBIUS_SPAN, (t.RPC_SYSTEM, t.NEBIUS_ATTEMPTS, t.CLOUD_RESOURCE_ID, t.RPC_GRPC_STATUS_CODE)),
):
    if not set(_attributes) <= set(_span.attributes):
        raise ValueError(f"span {_span.name} lacks an attribute a TraceQL query selects")

FREEZES = Dashboard(
    uid="stallwatch-freezes",
    title="stallwatch / Freezes",
    description="Is the server frozen (the whole process stopped), since when, why, and which spawn or fork did it.",
    panels=(
        Panel(
            "Frozen now",
            "1 while the freeze watchdog (a separate process, scraped on its own endpoint) sees the host frozen, "
            "by kind (gil_held: no Python thread ran; loop_blocked: only the event loop stalled) and cause "
            "(what /proc showed the host waiting on). A gil_held/child_before_exec or child_core_dump freeze is "
            "incident 000: a forked child that did not exec. " + FREEZE_VISIBILITY,
            "bool_yes_no",
            (
                Query(
                    gauge(t.FREEZE_ACTIVE, t.FREEZE_KIND, t.FREEZE_CAUSE, agg="max", keep=(SERVICE_NAME, INSTANCE_ID)),
                    f"{{{{{SERVICE_NAME}}}}} {{{{{INSTANCE_ID}}}}} {legend_of(t.FREEZE_KIND, t.FREEZE_CAUSE)}",
                ),
            ),
            kind="statetimeline",
            states=FROZEN_STATES,
        ),
        Panel(
            "Scrapes answered (up)",
            "Whether each scrape of the host's endpoint and of its freeze watchdog's was answered (Up) or not "
            "(Down). The host cannot answer while its GIL is held, so the host Down with its watchdog Up is a "
            "freeze seen from outside; both Down means the host is gone. A target shows here for an hour after "
            "its last answered scrape (its identity comes from its last target_info).",
            "none",
            (Query(UP_BY_IDENTITY, "{{job}} {{" + INSTANCE_ID + "}}"),),
            kind="statetimeline",
            states=UP_STATES,
        ),
        Panel(
            "Freezes by kind and cause",
            "Freezes that ended in the interval (the watchdog records each one when the host thaws or dies).",
            "short",
            (
                Query(
                    events(t.FREEZE_DURATION, t.FREEZE_KIND, t.FREEZE_CAUSE, suffix="_count"),
                    legend_of(t.FREEZE_KIND, t.FREEZE_CAUSE),
                ),
            ),
        ),
        Panel(
            "Hosts killed while frozen",
            "How long a host had been frozen when it died (killed by a health check, the OOM killer, an operator), "
            "by kind and cause: its watchdog's last word, scraped once after the death. The freeze's span "
            "(outcome host_killed) and the watchdog's records hold the rest.",
            "s",
            (Query(killed(t.FREEZE_KIND, t.FREEZE_CAUSE, window=RATE), legend_of(t.FREEZE_KIND, t.FREEZE_CAUSE)),),
        ),
        Panel(
            "Freeze duration p50/p99 by kind and cause",
            "How long freezes lasted, from the last fresh heartbeat to the thaw. Seconds here are seconds every "
            "request in the process waited.",
            "s",
            p50_p99(t.FREEZE_DURATION, t.FREEZE_KIND, t.FREEZE_CAUSE),
        ),
        Panel(
            "Event-loop lag p50/p99",
            "How long the main event loop took to run a heartbeat callback handed to it every 100 ms. Sustained lag "
            "is blocking code on the loop thread; a spike to seconds is a freeze in progress.",
            "s",
            p50_p99(t.LOOP_LAG, t.LOOP),
        ),
        Panel(
            "Spawn blocked time p50/p99 by loop and method",
            "How long the spawning thread was blocked inside the spawn call. Under uvloop (method fork) that is the "
            "whole loop holding the GIL; vfork/posix_spawn should stay in milliseconds. The red line is where "
            "SpawnBlockedHigh fires (any one spawn over it).",
            "s",
            p50_p99(t.SUBPROCESS_SPAWN_DURATION, t.SPAWN_LOOP, t.SPAWN_METHOD),
            alert_at=SPAWN_BLOCKED_HIGH,
        ),
        Panel(
            "Forks by kind and gRPC activity",
            "Real fork() calls. exec_bound forks with gRPC active are the incident-000 pattern (a gRPC client busy "
            "while uvloop forks); prefer vfork spawns (stallwatch.uvicorn_loop() or STALLWATCH_UVLOOP_SPAWN).",
            "ops",
            (
                Query(
                    rate(t.FORK_COUNT, t.FORK_KIND, t.GRPC_ACTIVE, t.SPAWN_LOOP),
                    legend_of(t.FORK_KIND, t.GRPC_ACTIVE, t.SPAWN_LOOP),
                ),
            ),
        ),
        Panel(
            "Child deaths by signal",
            "Children reaped after a signal killed them. Whether one died before exec (incident 000) or crashed in its "
            "own program, and whether the server signalled it itself, is on its spawn span "
            "(stallwatch.subprocess.exec, stallwatch.subprocess.signalled_by_host).",
            "short",
            (
                Query(
                    events(
                        t.SUBPROCESS_EXITS,
                        t.PROCESS_EXECUTABLE_NAME,
                        t.EXIT_SIGNAL,
                        matchers=((t.EXIT_KIND, "=", "signal"),),
                    ),
                    legend_of(t.PROCESS_EXECUTABLE_NAME, t.EXIT_SIGNAL),
                ),
            ),
        ),
        Panel(
            "SSH tunnel open/close latency p50/p99",
            "Time to open and to close an SSH tunnel, successful or not. Close latency in seconds with failures "
            "next to it is the dstack symptom 'Failed to close SSH tunnel'.",
            "s",
            (*p50_p99(t.SSH_TUNNEL_OPEN_DURATION, what="open"), *p50_p99(t.SSH_TUNNEL_CLOSE_DURATION, what="close")),
        ),
        Panel(
            "SSH tunnel failures by phase and exit signal",
            "Tunnel opens or closes that raised or whose ssh child failed; a signal here (SIGSEGV, SIGABRT) is a "
            "crashed ssh child, an empty signal a non-zero exit.",
            "short",
            (
                Query(
                    events(t.SSH_TUNNEL_FAILURES, t.SSH_PHASE, t.EXIT_SIGNAL, t.ERROR_TYPE),
                    legend_of(t.SSH_PHASE, t.EXIT_SIGNAL, t.ERROR_TYPE),
                ),
            ),
        ),
        Panel(
            "Active SSH tunnels",
            "SSH tunnels opened and not closed yet, per process. A number that only grows is leaked tunnels.",
            "short",
            (Query(f"sum by ({INSTANCE_ID}) ({series(t.SSH_TUNNEL_ACTIVE)})", "{{" + INSTANCE_ID + "}}"),),
        ),
        Panel(
            "Telemetry dropped by signal and reason",
            "Spans, log records and metric exports stallwatch dropped rather than hold the host up: backend_down "
            "(the last export failed), backend_slow (it took longer than STALLWATCH_SLOW_EXPORT_SECONDS), "
            "queue_full (the exporter fell behind), export_failed, shutdown_timeout. Traces and logs of those "
            "moments are missing from the other panels' backends.",
            "ops",
            (
                Query(
                    rate(t.TELEMETRY_DROPPED, t.TELEMETRY_SIGNAL, t.DROP_REASON),
                    legend_of(t.TELEMETRY_SIGNAL, t.DROP_REASON),
                ),
            ),
        ),
        Panel(
            "Long spawns and freezes (traces)",
            "Spawn spans that blocked their thread over 100 ms and the watchdog's freeze spans, newest first. "
            "A freeze span links to the span that was running when the host froze.",
            "s",
            (Query(SPAWN_QUERY),),
            kind="table",
            source=TEMPO,
        ),
        Panel(
            "Watchdog records",
            f"Log records of the {WATCHDOG_LOGGER} logger ('{FREEZE_LOG_MESSAGE}: ...' with the main thread's "
            "syscall, the child's pid and state, and stacks when faulthandler is on), sent while the host is "
            "still frozen.",
            "none",
            (Query(WATCHDOG_LOGS),),
            kind="logs",
            source=LOKI,
            width=GRID_WIDTH,
        ),
    ),
)

WEDGES = Dashboard(
    uid="stallwatch-wedges",
    title="stallwatch / Wedges",
    description="Is a request or an executor stuck while the process looks healthy: dead workers, orphaned work "
    "items, stale async exceptions and timed-out work still running.",
    panels=(
        Panel(
            "Executor pending, running and workers vs max",
            "Per executor: items waiting, items running, live worker threads and max_workers. Pending > 0 with "
            "workers below max and nothing running is a stalled queue; dead workers still count against max.",
            "short",
            tuple(
                Query(gauge(metric, t.EXECUTOR_NAME), f"{{{{{label(t.EXECUTOR_NAME)}}}}} {what}")
                for metric, what in (
                    (t.EXECUTOR_PENDING, "pending"),
                    (t.EXECUTOR_RUNNING, "running"),
                    (t.EXECUTOR_WORKERS, "workers"),
                    (t.EXECUTOR_MAX_WORKERS, "max"),
                )
            ),
        ),
        Panel(
            "Oldest pending age",
            "How long the oldest item still waiting in each executor's queue has waited. It grows by one second "
            "per second when the queue is wedged. The red line is where ExecutorQueueWaitHigh fires (over it for "
            "a minute).",
            "s",
            (Query(gauge(t.EXECUTOR_OLDEST_PENDING, t.EXECUTOR_NAME, agg="max"), legend_of(t.EXECUTOR_NAME)),),
            alert_at=QUEUE_WAIT_SECONDS,
        ),
        Panel(
            "Queue wait and run time p99",
            "Per executor: p99 of the time items waited before a worker started them, and of the time they ran.",
            "s",
            (
                Query(quantile(0.99, t.EXECUTOR_QUEUE_DURATION, t.EXECUTOR_NAME), f"wait {legend_of(t.EXECUTOR_NAME)}"),
                Query(quantile(0.99, t.EXECUTOR_RUN_DURATION, t.EXECUTOR_NAME), f"run {legend_of(t.EXECUTOR_NAME)}"),
            ),
        ),
        Panel(
            "Worker deaths and orphaned items",
            "Executor threads that died of an exception (error.type: SystemExit is a stale async exception, "
            "incident 002) and the work items they held, whose futures never complete unless healed; "
            "'outstanding' is how many of those futures are still not done now (requests still waiting).",
            "short",
            (
                Query(
                    events(t.EXECUTOR_WORKER_DEATHS, t.EXECUTOR_NAME, t.ERROR_TYPE),
                    f"died {legend_of(t.EXECUTOR_NAME, t.ERROR_TYPE)}",
                ),
                Query(events(t.EXECUTOR_ORPHANED, t.EXECUTOR_NAME), f"orphaned {legend_of(t.EXECUTOR_NAME)}"),
                Query(
                    gauge(t.EXECUTOR_ORPHANED_OUTSTANDING, t.EXECUTOR_NAME),
                    f"outstanding {legend_of(t.EXECUTOR_NAME)}",
                ),
            ),
        ),
        Panel(
            "Healed items",
            "Orphaned items whose futures stallwatch failed with WorkerDied (STALLWATCH_EXECUTOR_HEAL=true), so "
            "their callers got an error instead of waiting forever.",
            "short",
            (Query(events(t.EXECUTOR_HEALED, t.EXECUTOR_NAME), legend_of(t.EXECUTOR_NAME)),),
        ),
        Panel(
            "Async exceptions: injected, delivered, revoked, refused",
            "Async exceptions aimed at executor work: injected (scheduled into a running item), delivered (landed in "
            "it), revoked (cleared because the item ended first: it would have killed the next item's worker), "
            "refused (the worker was idle).",
            "short",
            tuple(
                Query(events(metric, t.EXECUTOR_NAME), f"{what} {legend_of(t.EXECUTOR_NAME)}")
                for metric, what in (
                    (t.ASYNC_EXC_INJECTED, "injected"),
                    (t.ASYNC_EXC_DELIVERED, "delivered"),
                    (t.ASYNC_EXC_REVOKED, "revoked"),
                    (t.ASYNC_EXC_REFUSED, "refused"),
                )
            ),
        ),
        Panel(
            "Execution timeouts",
            "stallwatch.execution_timeout scopes that expired, by name.",
            "short",
            (Query(events(t.EXECUTION_TIMEOUTS, t.EXECUTION_NAME), legend_of(t.EXECUTION_NAME)),),
        ),
        Panel(
            "Overrun past the deadline p50/p99",
            "How long executor work kept running after its execution_timeout expired (a timeout cannot stop a "
            "thread): long overruns hold workers and whatever state the request shared.",
            "s",
            p50_p99(t.EXECUTION_OVERRUN_DURATION, t.EXECUTION_NAME),
        ),
        Panel(
            "Overdue work now",
            "Guarded executor work still running past its deadline, by execution name.",
            "short",
            (Query(gauge(t.EXECUTION_OVERDUE, t.EXECUTION_NAME), legend_of(t.EXECUTION_NAME)),),
        ),
        Panel(
            "Wedges detected by kind",
            "Wedges the detector found: worker_died, orphaned_item, queue_stalled (items waiting, no worker alive), "
            "execution_overdue.",
            "short",
            (Query(events(t.WEDGE_DETECTED, t.WEDGE_KIND, t.EXECUTOR_NAME), legend_of(t.WEDGE_KIND, t.EXECUTOR_NAME)),),
        ),
        Panel(
            "Submissions that waited longest (traces)",
            "Executor work-item spans that waited over 100 ms in the queue, with their run time. Each is a child "
            "of the request that submitted it.",
            "s",
            (Query(WORK_ITEM_QUERY),),
            kind="table",
            source=TEMPO,
            width=GRID_WIDTH,
        ),
    ),
)

CLOUD_CALLS = Dashboard(
    uid="stallwatch-cloud-calls",
    title="stallwatch / Cloud calls",
    description="Nebius API calls (authentication and retries included) and the cloud resources they created "
    "and deleted.",
    panels=(
        Panel(
            "Nebius call rate by method",
            "Logical Nebius API calls per second, by service and method.",
            "reqps",
            (
                Query(
                    rate(t.NEBIUS_CALL_DURATION, t.RPC_SERVICE, t.RPC_METHOD, suffix="_count"),
                    legend_of(t.RPC_SERVICE, t.RPC_METHOD),
                ),
            ),
        ),
        Panel(
            "Nebius errors by status code",
            "Calls that did not end OK, by gRPC status code (4 DEADLINE_EXCEEDED includes the caller's own "
            "timeout, 1 CANCELLED its cancellation).",
            "reqps",
            (
                Query(
                    rate(
                        t.NEBIUS_CALL_DURATION,
                        t.RPC_SERVICE,
                        t.RPC_METHOD,
                        t.RPC_GRPC_STATUS_CODE,
                        suffix="_count",
                        matchers=((t.RPC_GRPC_STATUS_CODE, "!=", "0"),),
                    ),
                    legend_of(t.RPC_GRPC_STATUS_CODE, t.RPC_SERVICE, t.RPC_METHOD),
                ),
            ),
        ),
        Panel(
            "Nebius latency p50/p99 by method",
            "Duration of logical calls, retries and authentication included.",
            "s",
            p50_p99(t.NEBIUS_CALL_DURATION, t.RPC_SERVICE, t.RPC_METHOD),
        ),
        Panel(
            "Nebius calls in flight",
            "Calls started and not finished. A level that never returns to zero is a call awaiting forever.",
            "short",
            (Query(gauge(t.NEBIUS_CALLS_ACTIVE, t.RPC_SERVICE, t.RPC_METHOD), legend_of(t.RPC_SERVICE, t.RPC_METHOD)),),
        ),
        Panel(
            "Cloud resources created and deleted",
            "Create and delete calls the cloud accepted, by resource type. Creates without matching deletes over "
            "a day are resources to account for.",
            "short",
            (
                Query(
                    events(t.CLOUD_RESOURCES_CREATED, t.CLOUD_RESOURCE_TYPE),
                    f"created {legend_of(t.CLOUD_RESOURCE_TYPE)}",
                ),
                Query(
                    events(t.CLOUD_RESOURCES_DELETED, t.CLOUD_RESOURCE_TYPE),
                    f"deleted {legend_of(t.CLOUD_RESOURCE_TYPE)}",
                ),
            ),
        ),
        Panel(
            "Unconfirmed cloud resources (leak candidates)",
            "Leak candidates not confirmed yet: creates a dead process's journal held with an intent and no "
            "outcome, so the cloud may hold resources nothing tracks (incident 000). `stallwatch leaks` on the "
            "host lists them with their ids; reconcile each against the cloud, then `stallwatch leaks --confirm`.",
            "short",
            (
                Query(
                    gauge(t.CLOUD_RESOURCES_UNCONFIRMED, t.CLOUD_RESOURCE_TYPE, agg="max"),
                    legend_of(t.CLOUD_RESOURCE_TYPE),
                ),
            ),
        ),
        Panel(
            "Slow and failed Nebius calls (traces)",
            "Nebius call spans over 1 s or with an error status, with the attempts made and the resource id.",
            "s",
            (Query(NEBIUS_QUERY),),
            kind="table",
            source=TEMPO,
        ),
    ),
)

DASHBOARDS = (FREEZES, WEDGES, CLOUD_CALLS)
ANNOTATIONS = (
    (
        "Freezes",
        "red",
        # Frozen while a scrape of the watchdog saw it, or (a freeze shorter than a scrape interval) ended.
        gauge(t.FREEZE_ACTIVE, t.FREEZE_KIND, t.FREEZE_CAUSE, agg="max", keep=ALERT_KEEP)
        + " > 0 or "
        + events(t.FREEZE_DURATION, t.FREEZE_KIND, t.FREEZE_CAUSE, suffix="_count", keep=ALERT_KEEP),
    ),
    (
        "Wedges",
        "orange",
        events(t.WEDGE_DETECTED, t.WEDGE_KIND, t.EXECUTOR_NAME, keep=ALERT_KEEP),
    ),
)


# ---- alerts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One promtool unit test of an alert: input series (selector, values, one sample a minute from 0m)
    and the evaluation times at which the alert must be firing and must not be (pending counts as not)."""

    name: str
    inputs: tuple[tuple[str, str], ...]
    firing: tuple[str, ...] = ()
    quiet: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    dashboard: Dashboard
    panel: str
    duration: str = "0s"
    action: str = ""  # what to do first, before the dashboard and the postmortem
    fired_labels: dict[str, str] = field(default_factory=dict)  # what the firing alert carries in its cases
    fired_value: str = ""  # its value as `{{ $value | humanizeDuration }}` renders it in its cases
    target: dict[str, str] | None = None  # the labels of its input series' target, when not `JOB`'s
    cases: tuple[Case, ...] = ()


# The target of the promtool input series, and the host it belongs to.
JOB = {"job": HOST_JOB, "instance": "host:9464", SERVICE_NAME: "checkout", INSTANCE_ID: "checkout-1"}
UP_TARGET = {"job": HOST_JOB, "instance": "host:9464"}
KILLED_AT = {label(t.FREEZE_KIND): "gil_held", label(t.FREEZE_CAUSE): "child_before_exec"}


def input_series(metric: t.Metric, values: str, **labels: str) -> tuple[str, str]:
    """A promtool input series of `metric` (its `_bucket` series when `le` is given)."""
    attributes = {label(a): a for a in metric.attributes}
    for key in labels:
        if key not in attributes and key not in (*JOB, "le"):
            raise ValueError(f"{metric.name} has no label {key}")
    rendered = ", ".join(f'{k}="{v}"' for k, v in {**JOB, **labels}.items())
    name = metric.prometheus_name + ("_bucket" if "le" in labels else "")
    return (f"{name}{{{rendered}}}", values)


def up_series(values: str) -> tuple[str, str]:
    """A promtool input series of the host's `up` (a target's labels only: `job` and `instance`)."""
    return (f'up{{job="{UP_TARGET["job"]}", instance="{UP_TARGET["instance"]}"}}', values)


def minutes(*runs: tuple[str | float, int]) -> str:
    """promtool values, one a minute: each `(value, n)` is n samples of value; value `gap` is a target
    that answered no scrape for n minutes (a stale marker, as Prometheus writes, then nothing), `_` is
    n minutes before the series existed."""
    parts = []
    for value, count in runs:
        if value == "gap":
            parts.append("stale" + (f" _x{count - 1}" if count > 1 else ""))
        elif value == "_":
            parts.append(f"_x{count}")
        else:
            parts.append(f"{value}x{count - 1}")
    return " ".join(parts)


def at(*times: int) -> tuple[str, ...]:
    return tuple(f"{time}m" for time in times)


def event_cases(metric: t.Metric, zeroed: bool, **labels: str) -> tuple[Case, ...]:
    """The cases of an alert on `recent_events(metric)`; `zeroed`: stallwatch makes this series at zero."""
    first = (0, 10) if zeroed else ("_", 10)
    during = Case(
        "an event, then a 5-minute freeze while it fires: no clear, no second firing",
        (input_series(metric, minutes(first, (1, 3), ("gap", 5), (1, 30)), **labels),),
        firing=at(10, 12, 14, 16, 18, 19),
        quiet=at(9, 21, 25, 28, 30, 40),
    )
    old = Case(
        "an event an hour before a 5-minute freeze: quiet across the freeze and after it",
        (input_series(metric, minutes(first, (1, 70), ("gap", 5), (1, 30)), **labels),),
        firing=at(10, 19),
        quiet=at(21, 60, 80, 82, 84, 86, 90, 95, 100, 110),
    )
    if not zeroed:
        return (during, old)
    restart = Case(
        "a host that restarts (its series start again at zero), then a new event",
        (input_series(metric, minutes((0, 10), (3, 20), ("gap", 2), (0, 10), (1, 20)), **labels),),
        firing=at(10, 19, 42, 51),
        quiet=at(21, 31, 35, 41, 53),
    )
    return (during, old, restart)


def state_cases(metric: t.Metric, on: float, off: float, held_name: str, **labels: str) -> tuple[Case, ...]:
    """The cases of an alert on `held(metric)` with no `for`: `on` is a value in the alerting state,
    held from 5m to 25m with no scrape from 12m to 17m (`held_name` names that case)."""
    return (
        Case(
            held_name,
            (input_series(metric, minutes((off, 5), (on, 7), ("gap", 5), (on, 8), (off, 10)), **labels),),
            firing=at(5, 6, 10, 12, 14, 16, 20, 24),
            quiet=at(0, 4, 26, 30, 34),
        ),
        Case(
            "a 5-minute scrape gap with nothing wrong: quiet",
            (input_series(metric, minutes((off, 10), ("gap", 5), (off, 10)), **labels),),
            quiet=at(5, 10, 12, 15, 20, 24),
        ),
    )


RUNNER = {label(t.EXECUTOR_NAME): "runner"}
STALLED_AT = ((0, 5), (3, 7), ("gap", 5), (3, 8), (0, 10))  # items waiting from 5m to 25m, through a freeze
WORKERS_AT = ((1, 5), (0, 7), ("gap", 5), (0, 8), (1, 10))  # no live worker meanwhile
SPAWN_LABELS = {label(t.SPAWN_LOOP): "uvloop", label(t.SPAWN_METHOD): "fork", label(t.PROCESS_EXECUTABLE_NAME): "ssh"}


def spawns(count: str, fast: str) -> tuple[tuple[str, str], ...]:
    """promtool input series of the spawn-duration histogram: its `_count` and its bucket of spawns
    that blocked up to `SPAWN_BLOCKED_HIGH` (SpawnBlockedHigh reads no other)."""
    name = t.SUBPROCESS_SPAWN_DURATION.prometheus_name
    rendered = ", ".join(f'{k}="{v}"' for k, v in {**JOB, **SPAWN_LABELS}.items())
    return (
        (f"{name}_count{{{rendered}}}", count),
        (f'{name}_bucket{{{rendered}, le="{SPAWN_BLOCKED_HIGH}"}}', fast),
    )


ALERTS = (
    Alert(
        "FreezeActive",
        held(t.FREEZE_ACTIVE, t.FREEZE_KIND, t.FREEZE_CAUSE) + " > 0",
        "critical",
        HOST + " is frozen ({{ $labels.stallwatch_freeze_kind }}, {{ $labels.stallwatch_freeze_cause }})",
        "The freeze watchdog sees the host process frozen: no request is served. gil_held with child_before_exec "
        "or child_core_dump is a forked child that has not exec'd (incident 000). " + FREEZE_VISIBILITY,
        FREEZES,
        "Frozen now",
        fired_labels={"stallwatch_freeze_kind": "gil_held", "stallwatch_freeze_cause": "child_before_exec"},
        cases=state_cases(
            t.FREEZE_ACTIVE,
            1,
            0,
            "a 20-minute freeze during which the watchdog answers no scrape for 5 minutes: firing throughout",
            stallwatch_freeze_kind="gil_held",
            stallwatch_freeze_cause="child_before_exec",
        ),
    ),
    Alert(
        "FrozenHostKilled",
        killed(t.FREEZE_KIND, t.FREEZE_CAUSE, keep=ALERT_KEEP),
        "critical",
        HOST + " died frozen ({{ $labels.stallwatch_freeze_kind }}, {{ $labels.stallwatch_freeze_cause }}) "
        "after {{ $value | humanizeDuration }}",
        "The host process died during a freeze: killed by a health check, a load balancer, the OOM killer or "
        "an operator while it served nothing. Its freeze watchdog said so in its last scrape before it exited. "
        f"Fires for {KILLED_WINDOW[:-1]} minutes after the death whether the host came back or not; HostDown "
        "fires while it stays down.",
        FREEZES,
        "Hosts killed while frozen",
        action="The freeze's stallwatch.freeze span (outcome host_killed) and the watchdog's records say what "
        "the host waited on and which spawn held it; FreezeActive cleared at the death.",
        fired_labels=KILLED_AT,
        fired_value="42s",
        cases=(
            Case(
                "a host frozen 42 s and killed, its watchdog scraped once after the death and gone: "
                "firing 10 minutes later, quiet after its 30 minutes",
                (input_series(t.FREEZE_HOST_KILLED, minutes((0, 10), (42, 1), ("gap", 40)), **KILLED_AT),),
                firing=at(10, 11, 20, 30, 39),
                quiet=at(0, 9, 41, 45, 50),
            ),
            Case(
                "a host killed while frozen and restarted 2 minutes later (a new instance id): firing as long",
                (
                    input_series(t.FREEZE_HOST_KILLED, minutes((0, 10), (42, 1), ("gap", 40)), **KILLED_AT),
                    input_series(
                        t.FREEZE_HOST_KILLED,
                        minutes(("_", 13), (0, 37)),
                        **KILLED_AT,
                        **{INSTANCE_ID: "checkout-2"},
                    ),
                ),
                firing=at(10, 13, 20, 30, 39),
                quiet=at(9, 41, 45, 49),
            ),
            Case(
                "a host stopped cleanly, its watchdog gone with it: quiet",
                (input_series(t.FREEZE_HOST_KILLED, minutes((0, 10), ("gap", 30)), **KILLED_AT),),
                quiet=at(5, 9, 10, 11, 20, 30),
            ),
        ),
    ),
    Alert(
        "HostDown",
        f'up{{job="{HOST_JOB}"}} == 0',
        "critical",
        "{{ $labels.job }} target {{ $labels.instance }} is down",
        "Prometheus has not been able to scrape the host's own endpoint for a minute: the process is gone "
        "without withdrawing its discovered target (killed or crashed, and not restarted; FrozenHostKilled "
        "fires if it died frozen; a host that stops cleanly removes its target and leaves no alert), frozen "
        "with its GIL held (FreezeActive fires, from the watchdog's endpoint), or unreachable. Only where "
        f"Prometheus scrapes the host itself (job {HOST_JOB}); through the OpenTelemetry Collector there is "
        "no `up` for it.",
        FREEZES,
        "Scrapes answered (up)",
        duration="1m",
        action="The alert names the scrape target, not the host process: see whether it runs there and was "
        "restarted (a killed host's supervisor restarts it, and the restarted process removes the dead one's "
        "target, which ends the alert); FrozenHostKilled or FreezeActive for the same host says why it "
        "stopped answering.",
        target=UP_TARGET,
        cases=(
            Case(
                "a host killed and not restarted: firing after its for, throughout",
                (up_series(minutes((1, 10), (0, 40))),),
                firing=at(11, 12, 20, 30, 49),
                quiet=at(0, 9, 10),
            ),
            Case(
                "one failed scrape (a 30 s held GIL at a 15 s interval): quiet",
                (up_series(minutes((1, 10), (0, 1), (1, 10))),),
                quiet=at(9, 10, 11, 12, 15),
            ),
            Case(
                "a host down for 5 minutes, then restarted: firing after its for, then cleared",
                (up_series(minutes((1, 10), (0, 5), (1, 10))),),
                firing=at(11, 14),
                quiet=at(9, 10, 15, 16, 20),
            ),
        ),
    ),
    Alert(
        "SpawnBlockedHigh",
        recent_over(t.SUBPROCESS_SPAWN_DURATION, SPAWN_BLOCKED_HIGH, t.SPAWN_LOOP, t.SPAWN_METHOD),
        "warning",
        "A spawn on " + HOST + " blocked the {{ $labels.stallwatch_spawn_loop }} loop over 100 ms "
        "(method {{ $labels.stallwatch_spawn_method }})",
        "A thread was blocked inside a subprocess spawn for over 100 ms, in the last 10 minutes (one such spawn "
        "is enough; the alert fires for 10 minutes after each). With uvloop's fork spawns that is the whole "
        "event loop holding the GIL, the precursor of incident 000's freeze; a spawn that blocked for as long "
        "as a freeze is counted when it ends, so FreezeActive fires first.",
        FREEZES,
        "Spawn blocked time p50/p99 by loop and method",
        action="The Long spawns and freezes (traces) panel lists the spawn spans over 100 ms: which program, "
        "whether the child reached exec. Method fork under uvloop: unset STALLWATCH_UVLOOP_SPAWN=fork (the default "
        "spawns by vfork/posix_spawn) or run the standard loop (stallwatch.uvicorn_loop()).",
        fired_labels={"stallwatch_spawn_loop": "uvloop", "stallwatch_spawn_method": "fork"},
        cases=(
            Case(
                "one spawn blocked 30 s, then a 5-minute scrape gap while it fires: no clear, no second firing",
                spawns(minutes((0, 10), (1, 3), ("gap", 5), (1, 30)), minutes((0, 10), (0, 3), ("gap", 5), (0, 30))),
                firing=at(10, 12, 14, 16, 18, 19),
                quiet=at(9, 21, 25, 28, 30, 40),
            ),
            Case(
                "a slow spawn in a series born with it: fires",
                spawns(minutes(("_", 10), (1, 20)), minutes(("_", 10), (0, 20))),
                firing=at(10, 15, 19),
                quiet=at(9, 21, 25),
            ),
            Case(
                "fast spawns (under 100 ms) every minute: quiet",
                spawns("0+1x30", "0+1x30"),
                quiet=at(1, 5, 10, 20, 29),
            ),
            Case(
                "slow spawns an hour before a 5-minute scrape gap, none since: quiet across the gap and after it",
                spawns(minutes((0, 5), (2, 55), ("gap", 5), (2, 20)), minutes((0, 5), (1, 55), ("gap", 5), (1, 20))),
                firing=at(5, 14),
                quiet=at(16, 58, 60, 62, 66, 70, 75),
            ),
        ),
    ),
    Alert(
        "ChildKilledBySignal",
        recent_events(
            t.SUBPROCESS_EXITS,
            t.PROCESS_EXECUTABLE_NAME,
            t.EXIT_SIGNAL,
            matchers=(
                (t.EXIT_KIND, "=", "signal"),
                (t.SIGNALLED_BY_HOST, "!=", "true"),
                (t.EXIT_SIGNAL, "!~", "SIGTERM|SIGINT|SIGHUP"),
            ),
        ),
        "warning",
        "A {{ $labels.process_executable_name }} child of " + HOST + " was killed by "
        "{{ $labels.stallwatch_exit_signal }}",
        "A child process died, in the last 10 minutes, of a signal the server did not send it (signals sent from "
        "Python are recorded; SIGTERM/SIGINT/SIGHUP from elsewhere count as stop requests). Its spawn span says "
        "whether it died before exec, in a copy of the server (stallwatch.subprocess.exec=not_done: incident 000; "
        "if the server froze meanwhile, FreezeActive fired too), or crashed in its own program (done).",
        FREEZES,
        "Child deaths by signal",
        fired_labels={"process_executable_name": "ssh", "stallwatch_exit_signal": "SIGSEGV"},
        cases=(
            *event_cases(
                t.SUBPROCESS_EXITS,
                False,
                stallwatch_exit_kind="signal",
                stallwatch_exit_signal="SIGSEGV",
                process_executable_name="ssh",
            ),
            Case(
                "children the server stopped itself: quiet",
                (
                    input_series(
                        t.SUBPROCESS_EXITS,
                        minutes(("_", 3), (1, 3), (2, 10)),
                        stallwatch_exit_kind="signal",
                        stallwatch_exit_signal="SIGTERM",
                        process_executable_name="sleep",
                    ),
                ),
                quiet=at(3, 4, 7, 10),
            ),
            Case(
                "a child the server killed itself (dstack closing a foreground tunnel): quiet",
                (
                    input_series(
                        t.SUBPROCESS_EXITS,
                        minutes(("_", 3), (1, 3), (2, 10)),
                        stallwatch_exit_kind="signal",
                        stallwatch_exit_signal="SIGKILL",
                        stallwatch_subprocess_signalled_by_host="true",
                        process_executable_name="ssh",
                    ),
                ),
                quiet=at(3, 4, 7, 10),
            ),
        ),
    ),
    Alert(
        "ExecutorWorkerDied",
        recent_events(t.EXECUTOR_WORKER_DEATHS, t.EXECUTOR_NAME, t.ERROR_TYPE),
        "critical",
        "Executor {{ $labels.stallwatch_executor_name }} on " + HOST + " lost a worker ({{ $labels.error_type }})",
        "An executor worker thread ended by an exception in the last 10 minutes. SystemExit here is a stale "
        "async exception (incident 002): the item the worker held never completes unless "
        "STALLWATCH_EXECUTOR_HEAL=true (ExecutorOrphanedItem fires while it waits).",
        WEDGES,
        "Worker deaths and orphaned items",
        fired_labels={label(t.EXECUTOR_NAME): "asyncio-default", "error_type": "SystemExit"},
        cases=event_cases(
            t.EXECUTOR_WORKER_DEATHS, False, stallwatch_executor_name="asyncio-default", error_type="SystemExit"
        ),
    ),
    Alert(
        "ExecutorOrphanedItem",
        held(t.EXECUTOR_ORPHANED_OUTSTANDING, t.EXECUTOR_NAME) + " > 0",
        "critical",
        "Work items on executor {{ $labels.stallwatch_executor_name }} of " + HOST + " are orphaned",
        "Submitted items were held by a worker that died: their futures never complete and the requests "
        "awaiting them hang, with their own timeouts possibly never armed (incident 002). Fires until each "
        "future is done (healed, cancelled, or completed by the host).",
        WEDGES,
        "Worker deaths and orphaned items",
        action="Restart the process: nothing else ends the waiting requests. STALLWATCH_EXECUTOR_HEAL=true "
        "fails such items with stallwatch.WorkerDied from then on.",
        fired_labels=RUNNER,
        cases=state_cases(
            t.EXECUTOR_ORPHANED_OUTSTANDING,
            1,
            0,
            "an orphaned item waiting 20 minutes through a 5-minute freeze: firing throughout, then healed",
            **RUNNER,
        ),
    ),
    Alert(
        "ExecutorQueueStalled",
        f"{held(t.EXECUTOR_PENDING, t.EXECUTOR_NAME)} > 0 and {held(t.EXECUTOR_WORKERS, t.EXECUTOR_NAME)} == 0",
        "critical",
        "Executor {{ $labels.stallwatch_executor_name }} on " + HOST + " has work waiting and no live worker",
        "Items wait in the executor's queue and none of its worker threads is alive, for a minute: nothing "
        "will run them (dead workers still count against max_workers, so the pool starts no new ones). "
        "Fires until a worker runs again or the queue is drained.",
        WEDGES,
        "Executor pending, running and workers vs max",
        duration="1m",
        action="Restart the process; STALLWATCH_EXECUTOR_HEAL=true replaces dead workers from then on.",
        fired_labels=RUNNER,
        cases=(
            Case(
                "a stalled queue held 20 minutes through a 5-minute freeze: firing throughout after its for",
                (
                    input_series(t.EXECUTOR_PENDING, minutes(*STALLED_AT), **RUNNER),
                    input_series(t.EXECUTOR_WORKERS, minutes(*WORKERS_AT), **RUNNER),
                ),
                firing=at(6, 10, 12, 14, 16, 20, 24),
                quiet=at(0, 5, 26, 30),
            ),
            Case(
                "one scrape between a submission and its new worker's start, and a 5-minute gap: quiet",
                (
                    input_series(t.EXECUTOR_PENDING, minutes((0, 5), (1, 1), (0, 4), ("gap", 5), (0, 5)), **RUNNER),
                    input_series(t.EXECUTOR_WORKERS, minutes((0, 6), (1, 4), ("gap", 5), (1, 5)), **RUNNER),
                ),
                quiet=at(5, 6, 7, 10, 12, 16, 19),
            ),
        ),
    ),
    Alert(
        "ExecutorQueueWaitHigh",
        f"{held(t.EXECUTOR_OLDEST_PENDING, t.EXECUTOR_NAME)} > {QUEUE_WAIT_SECONDS}",
        "critical",
        "Work on executor {{ $labels.stallwatch_executor_name }} of " + HOST + " has waited over "
        f"{QUEUE_WAIT_SECONDS} s to start",
        f"For a minute, the oldest item waiting in the executor's queue has waited over {QUEUE_WAIT_SECONDS} s: "
        "its workers are all dead (ExecutorQueueStalled), stuck, or busy with long work, and the requests "
        "behind the queue wait with it. Fires until the queue moves again.",
        WEDGES,
        "Oldest pending age",
        duration="1m",
        fired_labels=RUNNER,
        cases=(
            Case(
                "a queue stuck 20 minutes through a 5-minute freeze: firing throughout after its for",
                (
                    input_series(
                        t.EXECUTOR_OLDEST_PENDING,
                        minutes((0, 5), ("60+60", 7), ("gap", 5), ("780+60", 8), (0, 10)),
                        **RUNNER,
                    ),
                ),
                firing=at(6, 10, 12, 14, 16, 20, 24),
                quiet=at(0, 5, 26, 30),
            ),
            Case(
                "items waiting under the threshold, and a 5-minute gap: quiet",
                (
                    input_series(
                        t.EXECUTOR_OLDEST_PENDING,
                        minutes((0, 5), (QUEUE_WAIT_SECONDS - 5, 10), ("gap", 5), (5, 10)),
                        **RUNNER,
                    ),
                ),
                quiet=at(5, 10, 15, 17, 20, 25),
            ),
        ),
    ),
    Alert(
        "ExecutionOverdue",
        held(t.EXECUTION_OVERDUE, t.EXECUTION_NAME) + " > 0",
        "warning",
        "Work of {{ $labels.stallwatch_execution_name }} on " + HOST + " runs past its deadline",
        "Executor work guarded by stallwatch.execution_timeout has kept running for over a minute after the "
        "timeout expired: the request gave up but its thread (and any shared state) is still busy.",
        WEDGES,
        "Overdue work now",
        duration="1m",
        fired_labels={label(t.EXECUTION_NAME): "trace"},
        cases=(
            Case(
                "work overdue 20 minutes through a 5-minute freeze: firing throughout after its for",
                (
                    input_series(
                        t.EXECUTION_OVERDUE,
                        minutes((0, 5), (1, 7), ("gap", 5), (1, 8), (0, 10)),
                        stallwatch_execution_name="trace",
                    ),
                ),
                firing=at(6, 10, 12, 14, 16, 20, 24),
                quiet=at(0, 5, 26, 30),
            ),
            Case(
                "a 5-minute scrape gap with nothing overdue: quiet",
                (
                    input_series(
                        t.EXECUTION_OVERDUE, minutes((0, 10), ("gap", 5), (0, 10)), stallwatch_execution_name="trace"
                    ),
                ),
                quiet=at(5, 10, 12, 15, 20, 24),
            ),
        ),
    ),
    Alert(
        "UnconfirmedCloudResource",
        held(t.CLOUD_RESOURCES_UNCONFIRMED, t.CLOUD_RESOURCE_TYPE) + " > 0",
        "critical",
        "Unconfirmed {{ $labels.stallwatch_cloud_resource_type }} creates on " + HOST + ": possible leak",
        "A process died after asking the cloud for a resource and before recording the answer (incident 000: "
        "instances ran untracked for days); a later start replayed its journal and found the create "
        "unconfirmed. Fires until each such create is confirmed.",
        CLOUD_CALLS,
        "Unconfirmed cloud resources (leak candidates)",
        action="On the host, `stallwatch leaks` lists the candidates; reconcile each against the cloud (adopt or "
        "delete what was created), then `stallwatch leaks --confirm KEY`.",
        fired_labels={label(t.CLOUD_RESOURCE_TYPE): "compute.instance"},
        cases=(
            Case(
                "a leak candidate held through a restart of its host, then confirmed",
                (
                    input_series(
                        t.CLOUD_RESOURCES_UNCONFIRMED,
                        minutes((1, 10), ("gap", 5), (1, 10), (0, 10)),
                        stallwatch_cloud_resource_type="compute.instance",
                    ),
                ),
                firing=at(0, 5, 10, 12, 14, 16, 20, 24),
                quiet=at(26, 30, 34),
            ),
            Case(
                "a 5-minute scrape gap with every candidate confirmed: quiet",
                (
                    input_series(
                        t.CLOUD_RESOURCES_UNCONFIRMED,
                        minutes((0, 10), ("gap", 5), (0, 10)),
                        stallwatch_cloud_resource_type="compute.instance",
                    ),
                ),
                quiet=at(5, 10, 12, 15, 20, 24),
            ),
        ),
    ),
    Alert(
        "WedgeDetected",
        recent_events(t.WEDGE_DETECTED, t.WEDGE_KIND, t.EXECUTOR_NAME),
        "critical",
        "{{ $labels.stallwatch_wedge_kind }} wedge in executor {{ $labels.stallwatch_executor_name }} on " + HOST,
        "The wedge detector found a stuck executor in the last 10 minutes: a dead worker, an orphaned item, "
        "a queue with no live worker, or guarded work running past its deadline.",
        WEDGES,
        "Wedges detected by kind",
        fired_labels={label(t.WEDGE_KIND): "queue_stalled", **RUNNER},
        cases=event_cases(t.WEDGE_DETECTED, True, stallwatch_wedge_kind="queue_stalled", **RUNNER),
    ),
)


def _runbook(alert: Alert) -> str:
    first = f"{alert.action} " if alert.action else ""
    return (
        f"{first}Grafana dashboard uid {alert.dashboard.uid} ({alert.dashboard.title}), panel '{alert.panel}', "
        "with its Instance set to the alert's service_instance_id (the host's and its freeze watchdog's "
        "series carry the same); the annotations there mark freezes and wedges. Then run "
        "`stallwatch postmortem` on the host's telemetry files (or its traces in Tempo) for the timeline of "
        "the operations that were in flight."
    )


def unscoped(expr: str) -> str:
    """A dashboard expression without its template-variable matchers, for a rule file."""
    return expr.replace(f"{{{SCOPE_MATCHERS}, ", "{").replace(SCOPE, "")


def alert_rule(alert: Alert) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": alert.name, "expr": unscoped(alert.expr)}
    if alert.duration != "0s":
        rule["for"] = alert.duration
    rule["labels"] = {"severity": alert.severity}
    rule["annotations"] = {
        "summary": alert.summary,
        "description": alert.description,
        "runbook": _runbook(alert),
        "dashboard_uid": alert.dashboard.uid,
        "panel": alert.panel,
    }
    return rule


def alert_rules() -> dict[str, Any]:
    """The Prometheus rule file."""
    return {"groups": [{"name": "stallwatch", "rules": [alert_rule(alert) for alert in ALERTS]}]}


def _expand(template: str, labels: dict[str, str], value: str) -> str:
    """Render the `{{ $labels.x }}` and `{{ $value | humanizeDuration }}` placeholders, as Prometheus does
    for a firing alert (`value` rendered already)."""
    for key, text in labels.items():
        template = template.replace(f"{{{{ $labels.{key} }}}}", text)
    return template.replace("{{ $value | humanizeDuration }}", value)


def alert_tests() -> dict[str, Any]:
    """promtool unit tests: each case of each alert, firing or quiet at each of its evaluation times."""
    tests = []
    for alert in ALERTS:
        labels = {"severity": alert.severity, **(alert.target or JOB), **alert.fired_labels}
        rule = alert_rule(alert)["annotations"]
        annotations = {key: _expand(text, labels, alert.fired_value) for key, text in rule.items()}
        firing = [{"exp_labels": labels, "exp_annotations": annotations}]
        for case in alert.cases:
            times = sorted([*case.firing, *case.quiet], key=lambda time: int(time.removesuffix("m")))
            tests.append(
                {
                    "name": f"{alert.name}: {case.name}",
                    "interval": "1m",
                    "input_series": [{"series": s, "values": v} for s, v in case.inputs],
                    "alert_rule_test": [
                        {
                            "eval_time": time,
                            "alertname": alert.name,
                            "exp_alerts": firing if time in case.firing else [],
                        }
                        for time in times
                    ],
                }
            )
    return {"rule_files": ["../alerts.yaml"], "evaluation_interval": "1m", "tests": tests}


# ---- dashboards ---------------------------------------------------------------------------------


def _datasource_variable(kind: str, label_text: str) -> gd.DatasourceVariable:
    return gd.DatasourceVariable(kind).label(label_text).type(kind)


def _query_variable(name: str, label_text: str, query: str, description: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label_text)
        .description(description)
        .datasource(DS[PROMETHEUS])
        .query(query)
        .refresh(gm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(gm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(gm.VariableOption(text="All", value="$__all", selected=True))
    )


VARIABLES = (
    _datasource_variable(PROMETHEUS, "Prometheus"),
    _datasource_variable(TEMPO, "Tempo"),
    _datasource_variable(LOKI, "Loki"),
    _query_variable(
        "service",
        "Service",
        f"label_values(target_info, {SERVICE_NAME})",
        "OpenTelemetry service.name of the instrumented server.",
    ),
    _query_variable(
        "instance",
        "Instance",
        f'label_values(target_info{{{SERVICE_NAME}=~"$service"}}, {INSTANCE_ID})',
        "OpenTelemetry service.instance.id of one server process (a UUID unless set): its own series and its "
        "freeze watchdog's carry it.",
    ),
)


def _target(panel: Panel, query: Query, ref: str) -> Any:
    if panel.source == TEMPO:
        return (
            tempo.TempoQuery()
            .ref_id(ref)
            .datasource(DS[TEMPO])
            .query_type("traceql")
            .query(query.expr)
            .table_type(tempo_models.SearchTableType.SPANS)
            .limit(20)
        )
    if panel.source == LOKI:
        return loki.Dataquery().ref_id(ref).datasource(DS[LOKI]).expr(query.expr)
    return (
        prometheus.Dataquery()
        .ref_id(ref)
        .datasource(DS[PROMETHEUS])
        .expr(query.expr)
        .legend_format(query.legend or "__auto")
        .range()
    )


def _panel(panel: Panel, panel_id: int, position: gm.GridPos) -> Any:
    builder: Any
    if panel.kind == "statetimeline":
        builder = statetimeline.Panel().show_value(common.VisibilityMode.NEVER)
    elif panel.kind == "table":
        builder = table.Panel()
    elif panel.kind == "logs":
        builder = logs.Panel().show_time(True).wrap_log_message(True).enable_log_details(True)
    else:
        builder = timeseries.Panel().legend(
            gc.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["max", "lastNotNull"])
        )
    builder = builder.id(panel_id).title(panel.title).description(panel.description).unit(panel.unit)
    builder = builder.datasource(DS[panel.source]).grid_pos(position)
    if panel.states:
        results = {str(s.value): gm.ValueMappingResult(text=s.text, color=s.color, index=n)
                   for n, s in enumerate(panel.states)}  # fmt: skip
        steps = [gm.Threshold(value=s.value, color=s.color) for s in panel.states]  # Grafana: the first is the base
        builder = (
            builder.mappings([gm.ValueMap(options=results)])
            .thresholds(gd.ThresholdsConfig().mode(gm.ThresholdsMode.ABSOLUTE).steps(steps))
            .color_scheme(gd.FieldColor().mode(gm.FieldColorModeId.THRESHOLDS))
            .min(panel.states[0].value)
            .max(panel.states[-1].value)
        )
    if panel.alert_at is not None:
        # the base step (Grafana reads the first as base whatever its value; the schema wants a number)
        steps = [gm.Threshold(value=0, color="green"), gm.Threshold(value=panel.alert_at, color="red")]
        builder = builder.thresholds(gd.ThresholdsConfig().mode(gm.ThresholdsMode.ABSOLUTE).steps(steps))
        builder = builder.thresholds_style(gc.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    for index, query in enumerate(panel.queries):
        builder = builder.with_target(_target(panel, query, chr(ord("A") + index)))
    return builder


def _annotation(name: str, color: str, expr: str) -> gd.AnnotationQuery:
    return gd.AnnotationQuery().name(name).datasource(DS[PROMETHEUS]).enable(True).icon_color(color).expr(expr)


# ---- from a freeze, wedge or cloud call to its trace ----------------------------------------------

# Loki's OTLP ingestion keeps a record's trace and span ids, scope name and attributes as structured
# metadata (`trace_id`, `scope_name`, dots made underscores); the data source's derived field
# `trace_id` (provisioning/grafana/datasources.yaml) turns the first into a link to Tempo.
TRACE_RECORDS = {
    "stallwatch-freezes": (
        "Freeze records → traces",
        f'{{service_name=~"${{service:regex}}"}} | scope_name = "{WATCHDOG_LOGGER}" | trace_id != ""',
        "The watchdog's records of freezes that happened inside a span: each carries the trace and span ids of "
        "the span current on the host's main thread when it froze (the spawn in progress, else the span last "
        "entered there since the loop last ran its heartbeat). Open a record and follow trace_id to Tempo.",
    ),
    "stallwatch-wedges": (
        "Wedge records → traces",
        f'{{service_name=~"${{service:regex}}"}} | {label(t.WEDGE_KIND)} != ""',
        "Every wedge detection's record; those about one work item carry the trace and span ids of the span "
        "that submitted it (the request left waiting). Open a record and follow trace_id to Tempo.",
    ),
    "stallwatch-cloud-calls": (
        "Cloud resource records → traces",
        f'{{service_name=~"${{service:regex}}"}} | scope_name = "{LEDGER_LOGGER}"',
        "The cloud resource ledger's records (intent, outcome), each made in the span of the API call it "
        "describes. Open a record and follow trace_id to Tempo.",
    ),
}
TRACE_LINK_PANES = {
    "trace": {
        "datasource": "${tempo}",
        "queries": [
            {
                "refId": "A",
                "datasource": {"type": TEMPO, "uid": "${tempo}"},
                "queryType": "traceql",
                "query": "${__data.fields.trace_id}",
            }
        ],
        "range": {"from": "${__from}", "to": "${__to}"},
    }
}
TRACE_LINK = "/explore?schemaVersion=1&orgId=1&panes=" + urllib.parse.quote(
    json.dumps(TRACE_LINK_PANES, separators=(",", ":")), safe="${}_.:"
)


def trace_records_panel(spec: Dashboard, model: dict[str, Any]) -> dict[str, Any] | None:
    """The Loki panel of `spec`'s log records that lead to traces, placed full width below every
    panel of `model` (the built dashboard), with a data link to the record's trace in Tempo; None
    for a dashboard without one."""
    if spec.uid not in TRACE_RECORDS:
        return None
    title, expr, description = TRACE_RECORDS[spec.uid]
    panel_id = max((p["id"] for p in model.get("panels", [])), default=0) + 1
    below = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in model.get("panels", [])), default=0)
    position = gm.GridPos(h=10, w=24, x=0, y=below)
    built = _panel(
        Panel(title, description, "none", (Query(expr),), kind="logs", source=LOKI, width=24), panel_id, position
    )
    panel: dict[str, Any] = json.loads(json.dumps(built.build(), cls=JSONEncoder))
    # A data link (title, url, targetBlank); the SDK's schema types field links as dashboard links, whose
    # other fields Grafana ignores here.
    link = {"title": "Trace in Tempo", "url": TRACE_LINK, "targetBlank": False, "type": "link", "icon": "external link",
            "tooltip": "The record's trace in Tempo", "tags": [], "asDropdown": False, "includeVars": False,
            "keepTime": False}  # fmt: skip
    panel["fieldConfig"]["defaults"]["links"] = [link]
    return panel


def build(spec: Dashboard) -> dict[str, Any]:
    """The dashboard model (Grafana JSON) of one dashboard spec."""
    builder = (
        gd.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(spec.tags))
        .editable()
        .tooltip(gm.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .variables(list(VARIABLES))
        .annotations([_annotation(*annotation) for annotation in ANNOTATIONS])
        .link(
            gd.DashboardLink("stallwatch")
            .type(gm.DashboardLinkType.DASHBOARDS)
            .tags(["stallwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    x = y = 0
    for panel_id, panel in enumerate(spec.panels, start=1):
        if x + panel.width > GRID_WIDTH:  # the next row: no panel runs past the grid
            x, y = 0, y + PANEL_HEIGHT
        builder = builder.with_panel(_panel(panel, panel_id, gm.GridPos(h=PANEL_HEIGHT, w=panel.width, x=x, y=y)))
        x += panel.width
    model: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    records = trace_records_panel(spec, model)
    if records is not None:
        model["panels"].append(records)
    return model


def _yaml(data: dict[str, Any], header: str) -> str:
    return header + yaml.safe_dump(data, sort_keys=False, width=100000, allow_unicode=True)


GENERATED = "# Generated by dashboards/generate.py from stallwatch.telemetry: edit that script, then rerun it.\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _readme(text: str) -> str:
    """README.md with its panel and alert tables filled in from the specs."""
    panels = ["| Dashboard | Panel | Data | Unit | What it tells on-call |", "|---|---|---|---|---|"]
    for spec in DASHBOARDS:
        for panel in spec.panels:
            cells = (f"`{spec.uid}`", _cell(panel.title), panel.source, f"`{panel.unit}`", _cell(panel.description))
            panels.append(f"| {' | '.join(cells)} |")
    alerts = ["| Alert | Severity | For | Means | Do first | Panel |", "|---|---|---|---|---|---|"]
    for alert in ALERTS:
        alerts.append(
            f"| {alert.name} | {alert.severity} | {alert.duration} | {_cell(alert.description)} "
            f"| {_cell(alert.action) or '-'} | `{alert.dashboard.uid}` / {_cell(alert.panel)} |"
        )
    for name, rows in (("panels", panels), ("alerts", alerts)):
        start = f"<!-- {name}: generated by generate.py -->\n"
        head, rest = text.split(start)
        text = head + start + "\n".join(rows) + "\n" + rest[rest.index(f"<!-- /{name} -->") :]
    return text


def render() -> dict[Path, str]:
    """Every generated file (path → text)."""
    files = {
        HERE / "json" / f"{spec.uid.removeprefix('stallwatch-')}.json": json.dumps(build(spec), indent=2) + "\n"
        for spec in DASHBOARDS
    }
    files[HERE / "alerts.yaml"] = _yaml(alert_rules(), GENERATED)
    files[HERE / "tests" / "alerts_test.yaml"] = _yaml(
        alert_tests(), GENERATED + "# Run: promtool test rules alerts_test.yaml\n"
    )
    files[HERE / "README.md"] = _readme((HERE / "README.md").read_text())
    return files


def main() -> int:
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path.relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
