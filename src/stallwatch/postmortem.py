"""`stallwatch postmortem`: an incident timeline from the telemetry stallwatch left behind.

Inputs (docs/postmortem.md): the `file` exporter's OTLP/JSON-lines files (`--dir`), OTLP/JSON
documents exported from a trace backend (`--file`: one document, JSON lines of them, or Tempo's
`{"batches": [...]}`), and the crash-safe journal (`--journal`, read without replaying it: what dead
processes left open, their unconfirmed creates and the watchdog's freeze records).

The timeline orders what an on-call engineer looks for: freezes, the spawns around them, SSH tunnel
failures, Nebius calls and the resource ledger (creates with no recorded outcome are leak
candidates), executor wedges, timeouts and async-exception interventions. `--format text|json|html`;
the HTML report is one self-contained file with an SVG timeline, written with the standard library
alone, and viewable offline.
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import journal
from ._private import opener

NOTABLE_BLOCKED_SECONDS = 0.05
HEADLINE_KINDS = ("freeze", "freeze_detected", "wedge")
LANES = ("freeze", "spawn", "ssh", "nebius", "cloud", "executor", "timeout", "stallwatch")


class InputError(Exception):
    """A postmortem input is missing or unreadable; the message says which and what to do."""


@dataclass
class Event:
    """One line of the timeline."""

    start_ns: int
    lane: str
    kind: str
    summary: str
    end_ns: int | None = None
    severity: str = "info"  # info | warning | error
    attributes: dict[str, Any] = field(default_factory=dict)
    trace_id: str = ""
    span_id: str = ""
    links: list[str] = field(default_factory=list)  # trace ids the event's span links to (a freeze: the host's)
    process: str = ""  # a key of `Timeline.processes`; "" for what the journal holds

    @property
    def start(self) -> str:
        return _iso(self.start_ns)


@dataclass
class Process:
    """One process's telemetry (one resource): a host, or a watchdog attached to the host it watches."""

    key: str
    service: str
    role: str  # host | watchdog
    pid: int | None  # the host's pid (a watchdog: the pid it watches), when the telemetry tells it
    first_ns: int
    last_ns: int
    group: str = ""  # the key of the host whose group this process is in

    @property
    def label(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "pid unknown"
        who = f"watchdog of {pid}" if self.role == "watchdog" else f"host {pid}"
        return f"{who}, service {self.service}, instance {self.key}"


@dataclass
class Timeline:
    """The events in a window, the leak candidates, and what could not be read.

    `headline` holds the freezes and wedges (each also in `events`); `traces` the span tree of every
    trace involved in a freeze, wedge or leak; `counters` the latest totals per process key.
    """

    events: list[Event]
    leak_candidates: list[dict[str, Any]]
    counters: dict[str, dict[str, float]]
    sources: list[str]
    skipped_lines: int = 0
    processes: dict[str, Process] = field(default_factory=dict)
    others: list[Process] = field(default_factory=list)  # processes sharing the inputs, left out
    traces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def headline(self) -> list[Event]:
        return [e for e in self.events if e.kind in HEADLINE_KINDS]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "skipped_lines": self.skipped_lines,
            "processes": [asdict(p) | {"label": p.label} for p in self.processes.values()],
            "other_processes": [asdict(p) | {"label": p.label} for p in self.others],
            "headline": [_event_dict(e) for e in self.headline],
            "events": [_event_dict(e) for e in self.events],
            "traces": self.traces,
            "leak_candidates": self.leak_candidates,
            "counters": self.counters,
        }


def _event_dict(event: Event) -> dict[str, Any]:
    return asdict(event) | {"start": event.start}


# ---- reading OTLP/JSON ---------------------------------------------------------------------------


def _documents(path: Path, counts: list[int]) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
    stripped = text.strip()
    if not stripped:
        return
    try:
        whole = json.loads(stripped)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        yield whole
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            counts[0] += 1  # a torn last line of a killed process, or not OTLP/JSON at all
            continue
        if isinstance(document, dict):
            yield document


def _value(any_value: dict[str, Any]) -> Any:
    for key, item in any_value.items():
        if key == "intValue":
            return int(item)
        if key == "arrayValue":
            return [_value(v) for v in item.get("values", [])]
        return item
    return None


def _attributes(item: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in item.get("attributes", []) if "key" in a}


def _items(documents: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], ...]:
    """Spans, log records and metrics, each with its resource's attributes under `_resource`."""
    spans: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    for document in documents:
        for resource in document.get("resourceSpans", []) + document.get("batches", []):
            attributes = _attributes(resource.get("resource", {}))
            for scope in resource.get("scopeSpans", []) + resource.get("instrumentationLibrarySpans", []):
                spans.extend(span | {"_resource": attributes} for span in scope.get("spans", []))
        for resource in document.get("resourceLogs", []):
            attributes = _attributes(resource.get("resource", {}))
            for scope in resource.get("scopeLogs", []):
                logs.extend(record | {"_resource": attributes} for record in scope.get("logRecords", []))
        for resource in document.get("resourceMetrics", []):
            attributes = _attributes(resource.get("resource", {}))
            for scope in resource.get("scopeMetrics", []):
                metrics.extend(metric | {"_resource": attributes} for metric in scope.get("metrics", []))
    return spans, logs, metrics


def load(
    directory: Path | None, files: Iterable[Path] = ()
) -> tuple[list[dict], list[dict], list[dict], list[str], int]:
    """Spans, log records and metrics from a file-exporter directory and/or OTLP/JSON files."""
    paths = [Path(f) for f in files]
    if directory is not None:
        if not directory.is_dir():
            raise InputError(
                f"{directory} is not a directory; pass the file exporter's directory "
                "(STALLWATCH_FILE_DIR) with --dir, or OTLP/JSON files with --file"
            )
        found = [directory / name for name in ("traces.jsonl", "logs.jsonl", "metrics.jsonl")]
        found = [p for p in found if p.exists()]
        if not found:
            raise InputError(
                f"no traces.jsonl, logs.jsonl or metrics.jsonl in {directory}: is it the file exporter's "
                "directory (STALLWATCH_FILE_DIR)?"
            )
        paths = found + paths
    if not paths:
        raise InputError("nothing to read: pass --dir DIR (the file exporter's directory) or --file FILE")
    for path in paths:
        if not path.exists():
            raise InputError(f"{path} does not exist")
    counts = [0]
    documents = [doc for path in paths for doc in _documents(path, counts)]
    spans, logs, metrics = _items(documents)
    if not (spans or logs or metrics):
        raise InputError(f"no OTLP/JSON spans, logs or metrics in {', '.join(map(str, paths))}")
    return spans, logs, metrics, [str(p) for p in paths], counts[0]


# ---- building the timeline ----------------------------------------------------------------------


def _ns(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(timespec="milliseconds")


def _is_error(span: dict[str, Any]) -> bool:
    return span.get("status", {}).get("code") in (2, "STATUS_CODE_ERROR")


def _span_event(span: dict[str, Any]) -> Event | None:
    name = span.get("name", "")
    a = _attributes(span)
    start, end = _ns(span.get("startTimeUnixNano")), _ns(span.get("endTimeUnixNano"))
    error = _is_error(span)
    if a.get("stallwatch.interrupted"):
        reason = a.get("stallwatch.interrupted.reason", "unknown")
        return Event(start, _lane_of(name, a), "interrupted", f"{name} never ended: process died ({reason})", end,
                     "error", a)  # fmt: skip
    if name == "stallwatch.freeze":
        summary = (
            f"{a.get('stallwatch.freeze.kind', '?')} freeze, {(end - start) / 1e9:.1f} s, cause "
            f"{a.get('stallwatch.freeze.cause', '?')}"
        )
        if a.get("stallwatch.freeze.spawn"):
            summary += f", spawning {a['stallwatch.freeze.spawn']}"
        if a.get("stallwatch.freeze.outcome") == "host_killed":
            summary += f"; host killed ({a.get('stallwatch.freeze.host.exit_signal', 'signal unknown')})"
        return Event(start, "freeze", "freeze", summary, end, "error", a)
    if "stallwatch.spawn.method" in a:
        blocked = float(a.get("stallwatch.spawn.blocked_seconds") or 0)
        signal = a.get("stallwatch.exit.signal")
        summary = (
            f"spawn {name} ({a.get('stallwatch.spawn.loop')}/{a.get('stallwatch.spawn.method')}) "
            f"blocked {blocked * 1000:.1f} ms"
        )
        if signal:
            summary += f", killed by {signal}"
            if a.get("stallwatch.subprocess.exec") == "not_done":
                summary += " before exec"
            if a.get("stallwatch.subprocess.signalled_by_host"):
                summary += " (the host had signalled it)"
        elif a.get("error.type"):
            summary += f", failed: {a['error.type']}"
        return Event(start, "spawn", "spawn", summary, end, "error" if error else "info", a)
    if name.startswith("ssh.tunnel."):
        status = a.get("stallwatch.ssh.exit.status")
        summary = f"{name} to {a.get('server.address', '?')}" + (f" (ssh exit status {status})" if error else "")
        return Event(start, "ssh", name.rsplit(".", 1)[1], summary, end, "error" if error else "info", a)
    if name.startswith("nebius."):
        summary = f"{name} -> {a.get('rpc.response.status_code', '?')}"
        if a.get("stallwatch.cloud.resource.id"):
            summary += f" resource {a['stallwatch.cloud.resource.id']}"
        if a.get("error.type"):
            summary += f" ({a['error.type']})"
        return Event(start, "nebius", "call", summary, end, "error" if error else "info", a)
    return None


def _lane_of(name: str, attributes: dict[str, Any]) -> str:
    if "stallwatch.spawn.method" in attributes:
        return "spawn"
    if name.startswith("ssh.tunnel."):
        return "ssh"
    if name.startswith("nebius."):
        return "nebius"
    return "stallwatch"


def _log_event(record: dict[str, Any]) -> Event | None:
    body = record.get("body", {})
    text = str(_value(body) if isinstance(body, dict) else body)
    a = _attributes(record)
    at = _ns(record.get("timeUnixNano") or record.get("observedTimeUnixNano"))
    if "freeze detected" in text:
        return Event(at, "freeze", "freeze_detected", text.removeprefix("stallwatch: "), None, "warning", a)
    if "stallwatch: wedge" in text:
        return Event(at, "executor", "wedge", text.removeprefix("stallwatch: "), None, "error", a)
    if "PyThreadState_SetAsyncExc" in text:
        return Event(at, "executor", "async_exception", text.removeprefix("stallwatch: "), None, "warning", a)
    if text.startswith("cloud resource"):
        severity = "warning" if ("failed" in text or "unconfirmed" in text) else "info"
        ids = ", ".join(f"{k.rsplit('.', 2)[-2]} {v}" for k, v in a.items() if k.endswith(".id"))
        return Event(at, "cloud", "ledger", f"{text}" + (f" ({ids})" if ids else ""), None, severity, a)
    return None


def _leak_candidates(events: list[Event]) -> list[dict[str, Any]]:
    """Creates whose intent was recorded but whose outcome never was, and creates replayed as such.

    The ledger writes a create's intent and outcome inside the call's span, so they pair by span id;
    a replayed `unconfirmed` record is written in the intent's span too, so it answers the intent.
    """
    ledger = [e for e in events if e.kind == "ledger"]
    answered = {e.attributes.get("_span") for e in ledger if "requested" not in e.summary}
    candidates = [e for e in ledger if "unconfirmed" in e.summary]  # replayed from a dead host's journal
    candidates += [e for e in ledger if "create requested" in e.summary and e.attributes.get("_span") not in answered]
    return [
        {
            "time": e.start,
            "trace_id": e.attributes.get("_trace", ""),
            "process": e.process,
            **{k: v for k, v in e.attributes.items() if not k.startswith(("_", "code."))},
        }
        for e in candidates
    ]


def _process_key(resource: dict[str, Any]) -> str:
    """One key per process: a watchdog shares its host's service.instance.id, and is told apart by its role."""
    instance = resource.get("service.instance.id")
    if not instance:
        return json.dumps(resource, sort_keys=True, default=str)
    role = resource.get("stallwatch.process.role")
    return f"{instance} ({role})" if role else str(instance)


def _counters(metrics: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Latest cumulative totals, per process, of the counters an engineer checks first."""
    wanted = (
        "stallwatch.wedge.detected", "stallwatch.executor.worker.deaths", "stallwatch.executor.orphaned",
        "stallwatch.executor.healed", "stallwatch.async_exception.injected", "stallwatch.async_exception.refused",
        "stallwatch.async_exception.revoked", "stallwatch.execution.timeouts", "stallwatch.asyncio.timeouts",
        "stallwatch.subprocess.exits", "stallwatch.ssh.tunnel.failures", "stallwatch.cloud.resources.unconfirmed",
        "stallwatch.telemetry.dropped", "stallwatch.instrumentation.errors",
    )  # fmt: skip
    latest: dict[tuple[str, str, str], tuple[int, float]] = {}
    for metric in metrics:
        name = metric.get("name")
        if name not in wanted:
            continue
        process = _process_key(metric.get("_resource", {}))
        for point in (metric.get("sum") or {}).get("dataPoints", []):
            key = (process, name, json.dumps(point.get("attributes", []), sort_keys=True))
            at = _ns(point.get("timeUnixNano"))
            value = float(point.get("asDouble", point.get("asInt", 0)))
            if key not in latest or at >= latest[key][0]:
                latest[key] = (at, value)
    totals: dict[str, dict[str, float]] = {}
    for (process, name, _), (_, value) in sorted(latest.items()):
        if value:
            totals.setdefault(process, {})
            totals[process][name] = totals[process].get(name, 0.0) + value
    return totals


def _item_times(item: dict[str, Any]) -> list[int]:
    if any(k in item for k in ("sum", "gauge", "histogram")):
        points = [p for kind in ("sum", "gauge", "histogram") for p in (item.get(kind) or {}).get("dataPoints", [])]
        return [_ns(p.get(k)) for p in points for k in ("startTimeUnixNano", "timeUnixNano")]
    return [_ns(item.get(k)) for k in ("startTimeUnixNano", "endTimeUnixNano", "timeUnixNano")]


def processes(spans: list[dict], logs: list[dict], metrics: list[dict]) -> dict[str, Process]:
    """Every process in the inputs, each watchdog grouped with the host it watches.

    A watchdog joins the host its freeze spans link to; failing that, the host of its service whose
    telemetry spans the most time in common with its own (it lives as long as its host). A host's pid is the pid
    its watchdog watches, or the resource's `process.pid` (replayed journals carry one).
    """
    found: dict[str, Process] = {}
    for item in (*spans, *logs, *metrics):
        resource = item.get("_resource", {})
        key = _process_key(resource)
        times = [t for t in _item_times(item) if t] or [0]
        process = found.get(key)
        if process is None:
            watchdog = resource.get("stallwatch.process.role") == "watchdog"
            pid = resource.get("stallwatch.watched.pid" if watchdog else "process.pid")
            found[key] = Process(key, str(resource.get("service.name", "?")), "watchdog" if watchdog else "host",
                                 _ns(pid) or None, min(times), max(times))  # fmt: skip
        else:
            process.first_ns, process.last_ns = min(process.first_ns, *times), max(process.last_ns, *times)
    hosts = [p for p in found.values() if p.role == "host"]
    traces_of: dict[str, set[Any]] = {p.key: set() for p in hosts}
    for span in spans:
        key = _process_key(span.get("_resource", {}))
        if key in traces_of:
            traces_of[key].add(span.get("traceId"))
    for process in found.values():
        process.group = process.key
    for watchdog in (p for p in found.values() if p.role == "watchdog"):
        linked = {
            link.get("traceId")
            for span in spans
            if _process_key(span.get("_resource", {})) == watchdog.key
            for link in span.get("links") or []
        }
        host = next((h for h in hosts if linked & traces_of[h.key]), None)
        if host is None:
            same = [h for h in hosts if h.service == watchdog.service]
            host = max(same, key=lambda h: min(h.last_ns, watchdog.last_ns) - max(h.first_ns, watchdog.first_ns),
                       default=None)  # fmt: skip
        if host is not None:
            watchdog.group = host.key
            host.pid = host.pid or watchdog.pid
    return dict(sorted(found.items(), key=lambda item: (item[1].role != "host", item[1].first_ns)))


def choose(
    found: dict[str, Process], service: str | None = None, pid: int | None = None, every: bool = False
) -> set[str]:
    """The process keys of one group: the newest host matching `service` and `pid`, with its watchdogs."""
    if every:
        return set(found)
    groups: dict[str, list[Process]] = {}
    for process in found.values():
        groups.setdefault(process.group, []).append(process)
    matching = [
        members for members in groups.values()
        if (service is None or any(p.service == service for p in members))
        and (pid is None or any(p.pid == pid for p in members))
    ]  # fmt: skip
    if not matching:
        wanted = " and ".join(x for x in (service and f"service {service}", pid and f"pid {pid}") if x)
        known = "; ".join(p.label for p in found.values()) or "none"
        raise InputError(f"no process with {wanted} in the inputs (processes: {known})")
    newest = max(matching, key=lambda members: max(p.last_ns for p in members))
    return {p.key for p in newest}


def _collapse(events: list[Event]) -> list[Event]:
    """Healthy spawns of one process between two notable ones, as one line: count, blocked p50 and max."""
    kept: list[Event] = []
    runs: dict[tuple[str, int], list[Event]] = {}
    notable: dict[str, int] = {}
    for event in events:
        if event.kind == "spawn" and event.attributes.pop("_healthy", False):
            runs.setdefault((event.process, notable.get(event.process, 0)), []).append(event)
            continue
        if event.kind == "spawn":
            notable[event.process] = notable.get(event.process, 0) + 1
        kept.append(event)
    for run in runs.values():
        if len(run) == 1:
            kept.append(run[0])
            continue
        blocked = sorted(float(e.attributes.get("stallwatch.spawn.blocked_seconds") or 0) for e in run)
        p50, top = blocked[len(blocked) // 2] * 1000, blocked[-1] * 1000
        summary = f"{len(run)} spawns, blocked p50 {p50:.0f} ms, max {top:.0f} ms"
        traces = list(dict.fromkeys(e.trace_id for e in run if e.trace_id))
        kept.append(Event(run[0].start_ns, "spawn", "spawns", summary, max(e.end_ns or e.start_ns for e in run),
                          "info", {"count": len(run), "trace_ids": traces}, process=run[0].process))  # fmt: skip
    return sorted(kept, key=lambda e: e.start_ns)


def build(
    spans: list[dict[str, Any]],
    logs: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    since_ns: int | None = None,
    until_ns: int | None = None,
) -> list[Event]:
    """Every notable event in [since, until], in time order; runs of healthy spawns as one line."""
    events = []
    for span in spans:
        event = _span_event(span)
        if event is not None:
            event.trace_id, event.span_id = str(span.get("traceId", "")), str(span.get("spanId", ""))
            event.links = [str(link.get("traceId")) for link in span.get("links") or [] if link.get("traceId")]
            event.process = _process_key(span.get("_resource", {}))
            events.append(event)
    for record in logs:
        event = _log_event(record)
        if event is not None:
            event.attributes["_span"] = str(record.get("spanId", ""))
            event.attributes["_trace"] = str(record.get("traceId", ""))
            event.trace_id, event.span_id = event.attributes["_trace"], event.attributes["_span"]
            event.process = _process_key(record.get("_resource", {}))
            events.append(event)
    for event in events:
        blocked = float(event.attributes.get("stallwatch.spawn.blocked_seconds") or 0)
        if event.kind == "spawn" and event.severity == "info" and blocked < NOTABLE_BLOCKED_SECONDS:
            event.attributes["_healthy"] = True  # a frozen spawn is blocked for the freeze: never healthy
    return _collapse(sorted((e for e in events if _in_window(e, since_ns, until_ns)), key=lambda e: e.start_ns))


def _walk(children: dict[str, list[dict[str, Any]]], parent: str, depth: int, rows: list[dict[str, Any]]) -> None:
    for span in children.get(parent, []):
        start, end = _ns(span.get("startTimeUnixNano")), _ns(span.get("endTimeUnixNano"))
        rows.append({"span_id": span.get("spanId", ""), "name": span.get("name", ""), "depth": depth,
                     "start_ns": start, "end_ns": max(end, start), "error": _is_error(span)})  # fmt: skip
        _walk(children, span.get("spanId", ""), depth + 1, rows)


def span_trees(spans: list[dict[str, Any]], trace_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Each trace's spans in tree order (parents before children, siblings by start), with their depth."""
    wanted = {t for t in trace_ids if t and t.strip("0")}
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span.get("traceId") in wanted:
            by_trace.setdefault(span["traceId"], []).append(span)
    trees: dict[str, list[dict[str, Any]]] = {}
    for trace_id, members in by_trace.items():
        ids = {s.get("spanId") for s in members}
        children: dict[str, list[dict[str, Any]]] = {}
        for span in sorted(members, key=lambda s: _ns(s.get("startTimeUnixNano"))):
            parent = span.get("parentSpanId") if span.get("parentSpanId") in ids else ""
            children.setdefault(parent or "", []).append(span)
        rows: list[dict[str, Any]] = []
        _walk(children, "", 0, rows)
        trees[trace_id] = rows
    return trees


def _in_window(event: Event, since_ns: int | None, until_ns: int | None) -> bool:
    return (since_ns is None or event.start_ns >= since_ns) and (until_ns is None or event.start_ns <= until_ns)


def journal_events(journal_dir: Path) -> tuple[list[Event], list[dict[str, Any]]]:
    """What the journals in `journal_dir` hold that never ended, without replaying them."""
    if not journal_dir.is_dir():
        raise InputError(f"{journal_dir} is not a directory; pass the journal directory (STALLWATCH_JOURNAL_DIR)")
    events: list[Event] = []
    candidates: list[dict[str, Any]] = []
    for process in journal.scan(journal_dir):
        if process.state in ("alive", "watchdog_alive"):
            continue  # still running: what it has open is not (yet) lost
        for operation in process.interrupted():
            events.append(Event(
                operation.start_ns, _lane_of(operation.name, operation.attributes), "interrupted",
                f"{operation.name} never ended: process {operation.pid} died ({operation.reason})",
                operation.end_ns, "error", dict(operation.attributes),
            ))  # fmt: skip
        for resource in process.unconfirmed():
            candidates.append({
                "time": _iso(resource.intent_ns), "stallwatch.cloud.action": resource.action,
                "stallwatch.cloud.resource.type": resource.resource_type, "stallwatch.cloud.rpc": resource.rpc,
                "trace_id": resource.trace_id, "pid": resource.pid,
                **({"stallwatch.cloud.resource.id": resource.resource_id} if resource.resource_id else {}),
            })  # fmt: skip
        for record in process.watchdog:
            if record.get("type") == "freeze":
                events.append(Event(
                    int(record.get("started_ns", 0)), "freeze", "freeze",
                    f"{record.get('kind')} freeze of process {process.pid}, cause {record.get('cause')} (journal)",
                    None, "error", dict(record.get("attributes", {})),
                ))  # fmt: skip
    return events, candidates


def timeline(
    directory: Path | None,
    files: Iterable[Path] = (),
    since_ns: int | None = None,
    until_ns: int | None = None,
    journal_dir: Path | None = None,
    service: str | None = None,
    pid: int | None = None,
    every_process: bool = False,
) -> Timeline:
    """Read the inputs and build the timeline of one process group (raises InputError for a user mistake).

    By default the group is the newest host in the inputs with its watchdogs; `service` and `pid`
    choose among the groups, `every_process` takes them all. What the journal holds is always shown.
    """
    spans: list[dict[str, Any]]
    logs: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    sources: list[str]
    if journal_dir is not None and directory is None and not list(files):
        spans, logs, metrics, sources, skipped = [], [], [], [], 0
    else:
        spans, logs, metrics, sources, skipped = load(directory, files)
    found = processes(spans, logs, metrics)
    keep = choose(found, service, pid, every_process) if found else set()

    def mine(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in items if _process_key(item.get("_resource", {})) in keep]

    spans, logs, metrics = mine(spans), mine(logs), mine(metrics)
    events = build(spans, logs, metrics, since_ns, until_ns)
    candidates = _leak_candidates(events)
    if journal_dir is not None:
        found_events, unconfirmed = journal_events(journal_dir)
        in_window = [e for e in found_events if _in_window(e, since_ns, until_ns)]
        events = sorted(events + in_window, key=lambda e: e.start_ns)
        known = {c.get("trace_id") for c in candidates}
        candidates += [c for c in unconfirmed if c["trace_id"] not in known]
        sources = [*sources, str(journal_dir)]
    for candidate in candidates:
        owner = found.get(str(candidate.pop("process", "")))
        candidate.setdefault("pid", owner.pid if owner else None)
    involved = [t for e in events if e.kind in HEADLINE_KINDS for t in (e.trace_id, *e.links)]
    involved += [str(c.get("trace_id", "")) for c in candidates]
    chosen = {k: p for k, p in found.items() if k in keep}
    others = [p for k, p in found.items() if k not in keep]
    return Timeline(events, candidates, _counters(metrics), sources, skipped, chosen, others,
                    span_trees(spans, involved))  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------


def _trace_note(event: Event) -> str:
    if event.kind == "spawns":
        return f"traces {', '.join(event.attributes.get('trace_ids', [])) or 'none'}"
    note = f"trace {event.trace_id or 'none'}"
    return note + (f" (links to {', '.join(event.links)})" if event.links else "")


def _relative(ns: int, t0: int) -> str:
    return f"+{(ns - t0) / 1e9:.3f} s"


_LEAK_COLUMNS = (
    ("type", "stallwatch.cloud.resource.type"), ("id", "stallwatch.cloud.resource.id"),
    ("operation", "stallwatch.cloud.rpc"), ("time", "time"), ("pid", "pid"), ("trace", "trace_id"),
)  # fmt: skip


def _label(result: Timeline, key: str) -> str:
    process = result.processes.get(key)
    return process.label if process else key


def format_text(result: Timeline) -> str:
    """The report as text: the same facts as `format_json`, headline first."""
    lines = [f"stallwatch postmortem: {len(result.events)} events from {', '.join(result.sources)}"]
    for process in result.processes.values():
        lines.append(f"   process: {process.label}")
    if result.others:
        lines.append(f"   left out ({len(result.others)} other processes; choose with --service/--pid, or "
                     "--all-processes):")  # fmt: skip
        lines += [f"      {process.label}" for process in result.others]
    if result.skipped_lines:
        lines.append(f"  ({result.skipped_lines} unreadable lines skipped: a torn write or not OTLP/JSON)")
    marks = {"error": "!!", "warning": " !", "info": "  "}

    def row(event: Event, t0: int) -> str:
        duration = f" [{(event.end_ns - event.start_ns) / 1e9:.3f} s]" if event.end_ns else ""
        return (f"{marks[event.severity]} {_relative(event.start_ns, t0):>11}  {event.start}  {event.lane:<9} "
                f"{event.summary}{duration}  {_trace_note(event)}")  # fmt: skip

    t0 = min((e.start_ns for e in result.events), default=0)
    lines += ["", "What happened (freezes and wedges):"]
    lines += [row(e, t0) for e in result.headline] or ["   no freeze or wedge in this window"]
    lines += ["", f"Timeline (start {_iso(t0) if result.events else '-'}; times relative to it):"]
    lines += [row(e, t0) for e in result.events]
    if not result.events:
        lines.append("   (no freezes, failures, wedges or cloud calls in this window)")
    if result.traces:
        lines += ["", "Traces involved in a freeze, wedge or leak:"]
        for trace_id, rows in result.traces.items():
            start = min(r["start_ns"] for r in rows)
            lines.append(f"   trace {trace_id}")
            lines += [
                f"   {_relative(r['start_ns'], start):>11} {(r['end_ns'] - r['start_ns']) / 1e9:9.3f} s  "
                f"{'  ' * r['depth']}{r['name']} (span {r['span_id']}){' ERROR' if r['error'] else ''}"
                for r in rows
            ]
    lines += [
        "",
        f"Leak candidates (cloud resources asked for with no recorded outcome): {len(result.leak_candidates)}",
    ]
    if result.leak_candidates:
        lines.append("   " + " | ".join(title for title, _ in _LEAK_COLUMNS))
    for candidate in result.leak_candidates:
        lines.append("   " + " | ".join(str(candidate.get(key) or "-") for _, key in _LEAK_COLUMNS))
    if result.counters:
        lines += ["", "Totals per process (latest export of each):"]
        for key, totals in result.counters.items():
            lines.append(f"   {_label(result, key)}")
            lines += [f"      {name}: {value:g}" for name, value in totals.items()]
    return "\n".join(lines) + "\n"


def format_json(result: Timeline) -> str:
    return json.dumps(result.to_dict(), indent=2, default=str) + "\n"


_COLORS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def _tick_step(span_ns: int) -> int:
    """A round step giving about 5 to 10 ticks over `span_ns`."""
    for step_s in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600,
                   900, 1800, 3600, 7200, 21600, 43200, 86400):  # fmt: skip
        if span_ns / (step_s * 1e9) <= 10:
            return int(step_s * 1e9)
    return int(86400e9 * max(1, span_ns // int(864000e9)))


def _seconds(ns: int) -> str:
    seconds = ns / 1e9
    if seconds >= 3600:
        return f"+{seconds / 3600:g} h"
    if seconds >= 60:
        return f"+{seconds / 60:g} min"
    return f"+{seconds:g} s"


def _svg(events: list[Event]) -> str:
    width, lane_height, left, top = 1000, 30, 80, 34
    lanes = [lane for lane in LANES if any(e.lane == lane for e in events)] or ["stallwatch"]
    height = lane_height * len(lanes) + top + 6
    t0 = min((e.start_ns for e in events), default=0)
    t1 = max(max((e.end_ns or e.start_ns for e in events), default=0), t0 + 1_000_000)

    def x(ns: int) -> float:
        return left + (ns - t0) / (t1 - t0) * (width - left - 20)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
             'preserveAspectRatio="xMinYMin meet" font-family="sans-serif" font-size="12" role="img">']  # fmt: skip
    parts.append(f'<text x="4" y="12">start {html.escape(_iso(t0) if events else "-")}</text>')
    step = _tick_step(t1 - t0)
    for tick in range(0, t1 - t0 + 1, step):
        tx = x(t0 + tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 6}" x2="{tx:.1f}" y2="{height}" stroke="#eee"/>')
        parts.append(f'<text x="{tx:.1f}" y="{top - 9}" text-anchor="middle" class="tick">{_seconds(tick)}</text>')
    for event in events:  # freezes and wedges as bands across every lane
        if event.kind in ("freeze", "wedge"):
            end = event.end_ns or event.start_ns + (t1 - t0) // 200
            color = "#d62728" if event.kind == "freeze" else "#ff7f0e"
            band = max(x(end) - x(event.start_ns), 2)
            parts.append(f'<rect x="{x(event.start_ns):.1f}" y="{top}" width="{band:.1f}" height="{height - top}" '
                         f'fill="{color}" opacity="0.15"/>')  # fmt: skip
    for index, lane in enumerate(lanes):
        y = top + index * lane_height
        parts.append(f'<text x="4" y="{y + 19}">{html.escape(lane)}</text>')
        parts.append(f'<line x1="{left}" y1="{y + lane_height}" x2="{width - 20}" y2="{y + lane_height}" '
                     'stroke="#ddd"/>')  # fmt: skip
        for event in (e for e in events if e.lane == lane):
            start = x(event.start_ns)
            span_width = max((x(event.end_ns) - start) if event.end_ns else 3, 3)
            title = html.escape(f"{event.start} {event.summary} {_trace_note(event)}")
            parts.append(
                f'<rect x="{start:.1f}" y="{y + 7}" width="{span_width:.1f}" height="{lane_height - 12}" '
                f'fill="{_COLORS[event.severity]}"><title>{title}</title></rect>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _html_traces(event: Event) -> str:
    if event.kind != "spawns":
        return html.escape(_trace_note(event))
    ids = event.attributes.get("trace_ids", [])
    return f"<details><summary>{len(ids)} traces</summary>{html.escape(', '.join(ids))}</details>"


def _html_rows(events: list[Event], t0: int, kind: str) -> str:
    rows = []
    for event in events:
        duration = f" [{(event.end_ns - event.start_ns) / 1e9:.3f} s]" if event.end_ns else ""
        rows.append(
            f'<tr class="{event.severity} {kind}" data-kind="{html.escape(event.kind)}">'
            f"<td>{_relative(event.start_ns, t0)}<br><small>{html.escape(event.start)}</small></td>"
            f"<td>{html.escape(event.lane)}</td><td>{html.escape(event.summary + duration)}</td>"
            f'<td class="id">{_html_traces(event)}</td></tr>'
        )
    return "".join(rows)


def _waterfall(trace_id: str, rows: list[dict[str, Any]]) -> str:
    start = min(r["start_ns"] for r in rows)
    total = max(max(r["end_ns"] for r in rows) - start, 1)
    bars = []
    for r in rows:
        left = (r["start_ns"] - start) / total * 100
        width = max((r["end_ns"] - r["start_ns"]) / total * 100, 0.5)
        color = _COLORS["error" if r["error"] else "info"]
        bars.append(
            f'<div class="wf"><div class="wn" style="padding-left:{r["depth"]}em">{html.escape(r["name"])} '
            f"<small>{(r['end_ns'] - r['start_ns']) / 1e9:.3f} s, span {html.escape(r['span_id'])}</small></div>"
            f'<div class="wt"><div style="margin-left:{left:.2f}%;width:{min(width, 100 - left):.2f}%;'
            f'background:{color}">&nbsp;</div></div></div>'
        )
    return f'<h3 class="id">trace {html.escape(trace_id)}</h3>{"".join(bars)}'


def format_html(result: Timeline) -> str:
    """One self-contained page, readable from 800 px wide up: headline first, then the timeline."""
    events = result.events
    t0 = min((e.start_ns for e in events), default=0)
    header = "<tr><th>time</th><th>lane</th><th>what</th><th>trace</th></tr>"
    processes = "".join(f"<li>{html.escape(p.label)}</li>" for p in result.processes.values())
    others = "".join(f"<li>{html.escape(p.label)}</li>" for p in result.others)
    leaks = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c.get(key) or '-'))}</td>" for _, key in _LEAK_COLUMNS) + "</tr>"
        for c in result.leak_candidates
    )
    leak_header = "<tr>" + "".join(f"<th>{title}</th>" for title, _ in _LEAK_COLUMNS) + "</tr>"
    counters = "".join(
        f"<h3>{html.escape(_label(result, key))}</h3><ul>"
        + "".join(f"<li>{html.escape(k)}: {v:g}</li>" for k, v in totals.items())
        + "</ul>"
        for key, totals in result.counters.items()
    )
    left_out = (
        "<p>Left out: other processes in the inputs (choose with --service/--pid, or --all-processes)</p>"
        f"<ul>{others}</ul>"
        if others
        else ""
    )
    traces = "".join(_waterfall(trace_id, rows) for trace_id, rows in result.traces.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>stallwatch postmortem</title>
<style>body{{font-family:sans-serif;margin:16px;max-width:1400px}} table{{border-collapse:collapse;width:100%;
table-layout:fixed}} td,th{{padding:2px 6px;border-bottom:1px solid #eee;text-align:left;vertical-align:top;
overflow-wrap:anywhere}} tr.error td{{color:#a00}} tr.warning td{{color:#a60}} .id{{font-family:monospace;
font-size:11px;overflow-wrap:anywhere}} col.t{{width:10em}} col.l{{width:5em}} col.i{{width:30%}}
.wf{{display:flex;font-size:12px}} .wn{{flex:0 0 40%;overflow-wrap:anywhere}} .wt{{flex:1 1 auto;
background:#f4f4f4}} svg{{display:block;max-width:100%}}</style>
</head><body>
<h1>stallwatch postmortem</h1>
<p>{len(events)} events from {html.escape(", ".join(result.sources))}.</p>
<ul>{processes}</ul>
{left_out}
<h2>What happened</h2>
<table id="headline"><colgroup><col class="t"><col class="l"><col><col class="i"></colgroup>{header}
{_html_rows(result.headline, t0, "headline") or '<tr><td colspan="4">no freeze or wedge</td></tr>'}</table>
<h2>Timeline</h2>
<p>Start {html.escape(_iso(t0) if events else "-")}; times relative to it. Red bands: freezes; orange: wedges.</p>
{_svg(events)}
<table id="timeline"><colgroup><col class="t"><col class="l"><col><col class="i"></colgroup>{header}
{_html_rows(events, t0, "event")}</table>
<h2>Traces involved in a freeze, wedge or leak</h2>{traces or "<p>none</p>"}
<h2>Leak candidates ({len(result.leak_candidates)})</h2>
{f'<table id="leaks">{leak_header}{leaks}</table>' if leaks else "<p>none</p>"}
<h2>Totals per process (latest export of each)</h2>{counters or "<p>none</p>"}
</body></html>
"""


def write_report(path: Path, text: str) -> None:
    """Write a report 0600, like every file stallwatch writes: it names hosts, pids, trace and resource ids."""
    with open(path, "w", encoding="utf-8", opener=opener) as out:
        out.write(text)


def parse_time(text: str, now_ns: int) -> int:
    """`2026-12-02T10:00:00Z`-style ISO times, or a duration back from now: `90s`, `15m`, `2h`, `1d`."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    stripped = text.strip()
    if stripped[-1:] in units and stripped[:-1].replace(".", "", 1).isdigit():
        return now_ns - int(float(stripped[:-1]) * units[stripped[-1]] * 1e9)
    try:
        moment = datetime.datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        raise InputError(
            f"cannot read the time {text!r}: use an ISO time (2026-12-02T10:00:00Z) or 90s/15m/2h/1d"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp() * 1e9)
