"""`stallwatch postmortem`: an incident timeline from the telemetry stallwatch left behind.

Inputs are OTLP/JSON, either the `file` exporter's JSON-lines files (`traces.jsonl`, `logs.jsonl`,
`metrics.jsonl` in `--dir`) or OTLP/JSON documents exported from a trace backend (`--file`: one
`{"resourceSpans": ...}` / `{"resourceLogs": ...}` document, JSON lines of them, or Tempo's
`{"batches": [...]}`), and the crash-safe journal (`--journal`, read without replaying it: what
dead processes left open, their unconfirmed creates and the watchdog's freeze records). Spans
replayed from a journal (`stallwatch.interrupted`) arrive through the exported files once a
`setup()` has replayed it.

The timeline orders what an on-call engineer looks for: freezes (kind, cause, the child, the
frozen spawn, outcome), spawns around them (blocked time, loop, method, exit signals), SSH tunnel
failures, Nebius calls and the resource ledger (creates with no recorded outcome are leak
candidates), executor wedges, timeouts and async-exception interventions. `--format text|json|html`;
the HTML report is one self-contained file with an SVG timeline (a lane per component, freezes and
wedges as bands), viewable offline. Plain SVG is written here instead of a plotting library, so
the report needs nothing beyond the standard library.
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NOTABLE_BLOCKED_SECONDS = 0.05
AROUND_FREEZE_NS = 5_000_000_000
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

    @property
    def start(self) -> str:
        return _iso(self.start_ns)


@dataclass
class Timeline:
    """The events in a window, the leak candidates, and what could not be read."""

    events: list[Event]
    leak_candidates: list[dict[str, Any]]
    counters: dict[str, float]
    sources: list[str]
    skipped_lines: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "skipped_lines": self.skipped_lines,
            "events": [asdict(e) | {"start": e.start} for e in self.events],
            "leak_candidates": self.leak_candidates,
            "counters": self.counters,
        }


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
    spans: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    metrics: list[dict[str, Any]] = []
    for document in documents:
        for resource in document.get("resourceSpans", []) + document.get("batches", []):
            for scope in resource.get("scopeSpans", []) + resource.get("instrumentationLibrarySpans", []):
                spans.extend(scope.get("spans", []))
        for resource in document.get("resourceLogs", []):
            for scope in resource.get("scopeLogs", []):
                logs.extend(scope.get("logRecords", []))
        for resource in document.get("resourceMetrics", []):
            for scope in resource.get("scopeMetrics", []):
                metrics.extend(scope.get("metrics", []))
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
            **{k: v for k, v in e.attributes.items() if not k.startswith(("_", "code."))},
        }
        for e in candidates
    ]


def _counters(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Latest cumulative totals of the counters an engineer checks first."""
    wanted = (
        "stallwatch.wedge.detected", "stallwatch.executor.worker.deaths", "stallwatch.executor.orphaned",
        "stallwatch.executor.healed", "stallwatch.async_exception.injected", "stallwatch.async_exception.refused",
        "stallwatch.async_exception.revoked", "stallwatch.execution.timeouts", "stallwatch.asyncio.timeouts",
        "stallwatch.subprocess.exits", "stallwatch.ssh.tunnel.failures", "stallwatch.cloud.resources.unconfirmed",
        "stallwatch.telemetry.dropped", "stallwatch.instrumentation.errors",
    )  # fmt: skip
    latest: dict[tuple[str, str], tuple[int, float]] = {}
    for metric in metrics:
        name = metric.get("name")
        if name not in wanted:
            continue
        for point in (metric.get("sum") or {}).get("dataPoints", []):
            key = (name, json.dumps(point.get("attributes", []), sort_keys=True))
            at = _ns(point.get("timeUnixNano"))
            value = float(point.get("asDouble", point.get("asInt", 0)))
            if key not in latest or at >= latest[key][0]:
                latest[key] = (at, value)
    totals: dict[str, float] = {}
    for (name, _), (_, value) in latest.items():
        totals[name] = totals.get(name, 0.0) + value
    return {name: value for name, value in sorted(totals.items()) if value}


def build(
    spans: list[dict[str, Any]],
    logs: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    since_ns: int | None = None,
    until_ns: int | None = None,
) -> list[Event]:
    """Every notable event in [since, until], in time order."""
    events = [e for e in map(_span_event, spans) if e is not None]
    for record in logs:
        event = _log_event(record)
        if event is not None:
            event.attributes["_span"] = str(record.get("spanId", ""))
            event.attributes["_trace"] = str(record.get("traceId", ""))
            events.append(event)
    freezes = [(e.start_ns, e.end_ns or e.start_ns) for e in events if e.kind == "freeze"]

    def notable(event: Event) -> bool:
        if event.kind != "spawn" or event.severity != "info":
            return True
        if float(event.attributes.get("stallwatch.spawn.blocked_seconds") or 0) >= NOTABLE_BLOCKED_SECONDS:
            return True
        return any(start - AROUND_FREEZE_NS <= event.start_ns <= end + AROUND_FREEZE_NS for start, end in freezes)

    selected = [
        e for e in events
        if notable(e) and (since_ns is None or e.start_ns >= since_ns) and (until_ns is None or e.start_ns <= until_ns)
    ]  # fmt: skip
    return sorted(selected, key=lambda e: e.start_ns)


def _in_window(event: Event, since_ns: int | None, until_ns: int | None) -> bool:
    return (since_ns is None or event.start_ns >= since_ns) and (until_ns is None or event.start_ns <= until_ns)


def journal_events(journal_dir: Path) -> tuple[list[Event], list[dict[str, Any]]]:
    """What the journals in `journal_dir` hold that never ended, without replaying them."""
    from . import journal

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
) -> Timeline:
    """Read the inputs and build the timeline (raises InputError for a user mistake)."""
    if journal_dir is not None and directory is None and not list(files):
        spans, logs, metrics, sources, skipped = [], [], [], [], 0
    else:
        spans, logs, metrics, sources, skipped = load(directory, files)
    events = build(spans, logs, metrics, since_ns, until_ns)
    candidates = _leak_candidates(events)
    if journal_dir is not None:
        found, unconfirmed = journal_events(journal_dir)
        in_window = [e for e in found if _in_window(e, since_ns, until_ns)]
        events = sorted(events + in_window, key=lambda e: e.start_ns)
        known = {c.get("trace_id") for c in candidates}
        candidates += [c for c in unconfirmed if c["trace_id"] not in known]
        sources = [*sources, str(journal_dir)]
    return Timeline(events, candidates, _counters(metrics), sources, skipped)


# ---- rendering ----------------------------------------------------------------------------------


def format_text(result: Timeline) -> str:
    lines = [f"stallwatch postmortem: {len(result.events)} events from {', '.join(result.sources)}"]
    if result.skipped_lines:
        lines.append(f"  ({result.skipped_lines} unreadable lines skipped: a torn write or not OTLP/JSON)")
    marks = {"error": "!!", "warning": " !", "info": "  "}
    lines.append("")
    for event in result.events:
        duration = f" [{(event.end_ns - event.start_ns) / 1e9:.3f} s]" if event.end_ns else ""
        lines.append(f"{marks[event.severity]} {event.start}  {event.lane:<9} {event.summary}{duration}")
    if not result.events:
        lines.append("   (no freezes, failures, wedges or cloud calls in this window)")
    lines += [
        "",
        f"Leak candidates (cloud resources asked for with no recorded outcome): {len(result.leak_candidates)}",
    ]
    for candidate in result.leak_candidates:
        lines.append(f"   {candidate}")
    if result.counters:
        lines += ["", "Totals at the last export:"]
        lines += [f"   {name}: {value:g}" for name, value in result.counters.items()]
    return "\n".join(lines) + "\n"


def format_json(result: Timeline) -> str:
    return json.dumps(result.to_dict(), indent=2, default=str) + "\n"


_COLORS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def format_html(result: Timeline) -> str:
    events = result.events
    width, lane_height, left = 1100, 34, 90
    lanes = [lane for lane in LANES if any(e.lane == lane for e in events)] or ["stallwatch"]
    height = lane_height * len(lanes) + 40
    if events:
        t0 = min(e.start_ns for e in events)
        t1 = max(max(e.end_ns or e.start_ns for e in events), t0 + 1_000_000)
    else:
        t0, t1 = 0, 1

    def x(ns: int) -> float:
        return left + (ns - t0) / (t1 - t0) * (width - left - 20)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">']  # fmt: skip
    for event in events:  # freezes and wedges as bands across every lane
        if event.kind in ("freeze", "wedge"):
            end = event.end_ns or event.start_ns + (t1 - t0) // 200
            color = "#d62728" if event.kind == "freeze" else "#ff7f0e"
            parts.append(f'<rect x="{x(event.start_ns):.1f}" y="20" width="{max(x(end) - x(event.start_ns), 2):.1f}" '
                         f'height="{height - 30}" fill="{color}" opacity="0.15"/>')  # fmt: skip
    for index, lane in enumerate(lanes):
        y = 20 + index * lane_height
        parts.append(f'<text x="4" y="{y + 20}">{html.escape(lane)}</text>')
        parts.append(f'<line x1="{left}" y1="{y + lane_height}" x2="{width - 20}" y2="{y + lane_height}" '
                     'stroke="#ddd"/>')  # fmt: skip
        for event in (e for e in events if e.lane == lane):
            start = x(event.start_ns)
            span_width = max((x(event.end_ns) - start) if event.end_ns else 3, 3)
            title = html.escape(f"{event.start} {event.summary}")
            parts.append(
                f'<rect x="{start:.1f}" y="{y + 8}" width="{span_width:.1f}" height="{lane_height - 14}" '
                f'fill="{_COLORS[event.severity]}"><title>{title}</title></rect>'
            )
    parts.append(f'<text x="{left}" y="14">{html.escape(_iso(t0) if events else "")}</text>')
    parts.append(f'<text x="{width - 20}" y="14" text-anchor="end">{html.escape(_iso(t1) if events else "")}</text>')
    parts.append("</svg>")
    rows = "".join(
        f'<tr class="{e.severity}"><td>{html.escape(e.start)}</td><td>{html.escape(e.lane)}</td>'
        f"<td>{html.escape(e.summary)}</td></tr>"
        for e in events
    )
    leaks = "".join(f"<li>{html.escape(json.dumps(c, default=str))}</li>" for c in result.leak_candidates)
    counters = "".join(f"<li>{html.escape(k)}: {v:g}</li>" for k, v in result.counters.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>stallwatch postmortem</title>
<style>body{{font-family:sans-serif;margin:20px}} table{{border-collapse:collapse}}
td{{padding:2px 8px;border-bottom:1px solid #eee}} tr.error td{{color:#a00}} tr.warning td{{color:#a60}}</style>
</head><body>
<h1>stallwatch postmortem</h1>
<p>{len(events)} events from {html.escape(", ".join(result.sources))}.
Red bands: freezes; orange: wedges. Hover a mark for its details.</p>
{"".join(parts)}
<h2>Timeline</h2><table>{rows}</table>
<h2>Leak candidates ({len(result.leak_candidates)})</h2><ul>{leaks or "<li>none</li>"}</ul>
<h2>Totals at the last export</h2><ul>{counters or "<li>none</li>"}</ul>
</body></html>
"""


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
