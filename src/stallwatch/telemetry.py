"""The telemetry contract: every metric, attribute and resource attribute stallwatch emits.

This module is the single source of names. Instrumentation imports its names from here, and the
README's telemetry reference is generated from `reference_markdown()` (a test checks that they
match). Names follow the OpenTelemetry semantic conventions where one exists (`process.*`,
`error.type`) and use the `stallwatch.` prefix otherwise. Durations are histograms in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

InstrumentKind = Literal["counter", "updowncounter", "histogram", "observable_counter", "observable_gauge"]


@dataclass(frozen=True)
class Attribute:
    """One attribute key with the values it may take and what it means."""

    name: str
    description: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Metric:
    """One metric instrument: its name, kind, UCUM unit, meaning and attribute keys."""

    name: str
    kind: InstrumentKind
    unit: str
    description: str
    attributes: tuple[Attribute, ...] = field(default_factory=tuple)

    @property
    def prometheus_name(self) -> str:
        """The series name Prometheus stores (OTel → Prometheus: `.`→`_`, unit suffix, `_total`)."""
        base = self.name.replace(".", "_").replace("-", "_")
        unit_suffix = {"s": "_seconds", "By": "_bytes"}.get(self.unit, "")
        if unit_suffix and not base.endswith(unit_suffix):
            base += unit_suffix
        if self.kind in ("counter", "observable_counter"):
            base += "_total"
        return base


# ---- attributes -------------------------------------------------------------------------------

FORK_KIND = Attribute(
    "stallwatch.fork.kind",
    "Why the process forked: `exec_bound` (a child created only to exec, e.g. a uvloop subprocess "
    "spawn or `Popen(preexec_fn=...)`) or `fork` (a child that lives on, e.g. `os.fork()`).",
    ("exec_bound", "fork"),
)
GRPC_ACTIVE = Attribute(
    "stallwatch.grpc.active",
    "gRPC core threads (`event_engine`, `lifeguard`, `grpc_global_tim`) were running at fork time "
    "(read from `/proc/self/task`, at most once a second).",
    ("true", "false"),
)
SPAWN_LOOP = Attribute(
    "stallwatch.spawn.loop",
    "Event loop running in the forking thread: `uvloop`, `asyncio` or `none`.",
    ("uvloop", "asyncio", "none"),
)

# ---- resource attributes ----------------------------------------------------------------------

RESOURCE_VERSION = Attribute("stallwatch.version", "Version of stallwatch in the process.")
RESOURCE_UVLOOP_VERSION = Attribute(
    "stallwatch.uvloop.version", "Installed uvloop version (absent when uvloop is not installed)."
)
RESOURCE_GRPC_FORK_SUPPORT = Attribute(
    "stallwatch.grpc.fork_support",
    "Value of `GRPC_ENABLE_FORK_SUPPORT` the process runs with (`unset` when not set).",
)

RESOURCE_ATTRIBUTES: tuple[Attribute, ...] = (RESOURCE_VERSION, RESOURCE_UVLOOP_VERSION, RESOURCE_GRPC_FORK_SUPPORT)

# ---- metrics ----------------------------------------------------------------------------------

FORK_COUNT = Metric(
    "stallwatch.fork.count",
    "observable_counter",
    "{fork}",
    "Real fork() calls made by the process (not vfork/posix_spawn), by kind, gRPC activity and loop.",
    (FORK_KIND, GRPC_ACTIVE, SPAWN_LOOP),
)
FORK_HANDLERS_SKIPPED = Metric(
    "stallwatch.fork.handlers_skipped",
    "observable_counter",
    "{handler}",
    "Python at-fork handlers skipped because the child was created only to exec.",
)
FORK_WORKERS_DEFERRED = Metric(
    "stallwatch.fork.workers_deferred",
    "observable_counter",
    "{worker}",
    "OpenTelemetry background workers whose restart was moved out of an after-fork handler "
    "to first use in a child that lives on.",
)

METRICS: tuple[Metric, ...] = (FORK_COUNT, FORK_HANDLERS_SKIPPED, FORK_WORKERS_DEFERRED)

INSTRUMENTATION_SCOPE = "stallwatch"


def reference_markdown() -> str:
    """Render the telemetry reference that the README embeds."""
    lines = [
        "| Metric (OTel name) | Prometheus series | Kind | Unit | Attributes | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for metric in METRICS:
        attrs = ", ".join(f"`{a.name}`" for a in metric.attributes) or "-"
        lines.append(
            f"| `{metric.name}` | `{metric.prometheus_name}` | {metric.kind} | `{metric.unit}` "
            f"| {attrs} | {metric.description} |"
        )
    attributes = {a.name: a for m in METRICS for a in m.attributes}
    lines += ["", "| Attribute | Values | Meaning |", "|---|---|---|"]
    for attr in [*attributes.values(), *RESOURCE_ATTRIBUTES]:
        values = ", ".join(f"`{v}`" for v in attr.values) or "string"
        kind = " (resource)" if attr in RESOURCE_ATTRIBUTES else ""
        lines.append(f"| `{attr.name}`{kind} | {values} | {attr.description} |")
    return "\n".join(lines) + "\n"
