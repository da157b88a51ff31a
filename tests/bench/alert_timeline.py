"""The shipped alerts through one incident timeline, against a real Prometheus at the shipped settings.

Run from the repository root (about 30 minutes; needs `prometheus` on PATH or /usr/bin)::

    .venvs/main/bin/python tests/bench/alert_timeline.py            # writes tests/bench/results/alert_timeline.md
    .venvs/main/bin/python tests/bench/alert_timeline.py --quick    # smoke test, ~2 min, writes to a temp dir

Options: ``--quick`` (every step a few seconds; the Prometheus configuration is the same), ``--out DIR``
(default ``tests/bench/results``; the raw records go to ``DIR/raw/alert_timeline-<time>/``, not committed),
``--report RAW`` (write the summary of the run recorded in RAW again, without running anything).

One Prometheus runs dashboards/provisioning/prometheus/prometheus.yml and dashboards/alerts.yaml unchanged but
for the targets (tests/support/prometheus.py, `Prometheus.shipped`). It scrapes one uvloop host
(tests/scenarios/dash_timeline.py) with stallwatch's default set-up but for uvloop's own fork (the held spawns
need it) and the async-exception guard off (or there is no wedge), and its watchdog, while the host goes
through: an 8 s and a 40 s event-loop block, a 30 s GIL hold, two uvloop spawns held 30 s before exec, a
child killed by SIGSEGV, a stale SystemExit killing the only worker of a one-worker pool with more work
behind it (left in place for 11 minutes), an `execution_timeout` overrun of 2 minutes inside those 11
minutes, and a freeze (a spawn held before exec) ended after 45 s by SIGKILL of the host; then 11 more
minutes of watching (the 10-minute windows end).

/api/v1/alerts is polled every 2 s. Each alert's expected firing intervals are derived from the event times
(and, for freezes and the host's death, the scrape times Prometheus recorded), the alert's `for` and the
15 s scrape and evaluation granularity; observed intervals are matched to them, and every firing interval
that matches none is listed as a phantom.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: conftest and support/

from _machine import machine_info

from support.prometheus import HOST_JOB, WATCHDOG_JOB, Prometheus, Scenario

REPOSITORY = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPOSITORY / "tests" / "bench" / "results"
VERSIONED = ("uvloop", "opentelemetry-sdk", "opentelemetry-exporter-prometheus", "stallwatch")
POLL = 2.0  # seconds between /api/v1/alerts polls: the resolution of the observed times
TOLERANCE = 5.0  # seconds on top of the scrape and evaluation granularity (scrape time, slow evaluation)
FREEZE_THRESHOLD = 1.0  # stallwatch's default STALLWATCH_FREEZE_THRESHOLD
QUEUE_STALL = 5.0  # stallwatch's default STALLWATCH_QUEUE_STALL_SECONDS
EVENT_WINDOW = 600.0  # the 10-minute windows of the event alerts and of last_over_time in the state alerts
FULL = {
    "block_short": 8, "block_long": 40, "gil": 30, "spawn": 30, "gap": 45,
    "wedge_held": 660, "overrun_after": 480, "overrun": 120, "final": 120, "kill_after": 45, "watch_after": 660,
}  # fmt: skip
QUICK = {
    "block_short": 2, "block_long": 5, "gil": 5, "spawn": 5, "gap": 5,
    "wedge_held": 12, "overrun_after": 3, "overrun": 4, "final": 40, "kill_after": 5, "watch_after": 30,
}  # fmt: skip
# Labels that tell one alert of a name from another in this timeline (the identity labels are the same).
KEY_LABELS = ("stallwatch_freeze_kind", "stallwatch_exit_signal", "stallwatch_wedge_kind")
SHOWN_LABELS = (*KEY_LABELS, "stallwatch_freeze_cause", "stallwatch_executor_name", "stallwatch_execution_name", "job")


@dataclasses.dataclass
class Expected:
    """An alert should fire within `fire` and clear within `clear` (None: still firing when watching ends);
    `fire` None: it should not fire for this event."""

    alert: str
    key: dict[str, str]
    because: str
    fire: tuple[float, float] | None
    clear: tuple[float, float] | None


@dataclasses.dataclass
class Observed:
    """One firing interval seen by the polls: from the first poll that saw it firing to the first that did not."""

    alert: str
    labels: dict[str, str]
    fired: float
    cleared: float | None = None
    matched: bool = False


def expectations(
    events: Mapping[str, tuple[float, float]],
    killed: float,
    scrapes: Mapping[str, list[float]],
    scrape: float,
    evaluation: float,
) -> list[Expected]:
    """What each alert should do, from the alert rules' `for` and windows, the event times and the scrape times."""
    lag = scrape + evaluation + TOLERANCE  # the state is in the next scrape, the alert in the next evaluation
    host, watchdog = scrapes[HOST_JOB], scrapes[WATCHDOG_JOB]
    final = events["final_freeze"][0]
    last_host_sample = max((t for t in host if t < final), default=final)
    out = []
    for name, kind in (
        ("block_short", "loop_blocked"),
        ("block_long", "loop_blocked"),
        ("gil_hold", "gil_held"),
        ("spawn_1", "gil_held"),
        ("spawn_2", "gil_held"),
        ("final_freeze", "gil_held"),
    ):
        start, end = events[name] if name != "final_freeze" else (events[name][0], killed)
        seen = [t for t in watchdog if start + FREEZE_THRESHOLD + 0.2 <= t <= end]
        cleared = (end, end + lag) if name != "final_freeze" else (killed, killed + lag)
        because = f"{name}: a watchdog scrape at +{seen[0] - start:.1f} s" if seen else f"{name}: no watchdog scrape"
        out.append(
            Expected(
                "FreezeActive",
                {"stallwatch_freeze_kind": kind},
                because,
                (seen[0], seen[0] + evaluation + TOLERANCE) if seen else None,
                cleared if seen else None,
            )
        )
    out.append(
        Expected(
            "FrozenHostKilled",
            {"stallwatch_freeze_kind": "gil_held"},
            "SIGKILL of the frozen host; 30 m",
            (killed, killed + lag),
            None,
        )
    )
    first_failed = min((t for t in host if t >= final), default=final)
    out.append(
        Expected(
            "HostDown",
            {},
            "final freeze then SIGKILL: up 0 for 1 m",
            (first_failed + 60, first_failed + 60 + 10 + evaluation + TOLERANCE),
            None,
        )
    )
    spawn_1, spawn_2 = events["spawn_1"], events["spawn_2"]
    out.append(
        Expected(
            "SpawnBlockedHigh",
            {},
            "two 30 s spawns: each a spawn over 0.1 s; 10 m window",
            (spawn_1[1], spawn_1[1] + lag),
            (spawn_2[1] + EVENT_WINDOW, spawn_2[1] + EVENT_WINDOW + lag),
        )
    )
    segv = events["sigsegv_child"][1]
    out.append(
        Expected(
            "ChildKilledBySignal",
            {"stallwatch_exit_signal": "SIGSEGV"},
            "SIGSEGV child; 10 m window",
            (segv, segv + lag),
            (segv + EVENT_WINDOW, segv + EVENT_WINDOW + lag),
        )
    )
    wedged = events["wedge"][0]
    overrun_start, overrun_end = events["overrun"]
    gone = (last_host_sample + EVENT_WINDOW, last_host_sample + EVENT_WINDOW + evaluation + TOLERANCE)
    out += [
        Expected(
            "ExecutorWorkerDied",
            {},
            "stale SystemExit; 10 m window",
            (wedged, wedged + lag),
            (wedged + EVENT_WINDOW, wedged + EVENT_WINDOW + lag),
        ),
        Expected(
            "ExecutorOrphanedItem", {}, "wedge, held to the death; last_over_time 10 m", (wedged, wedged + lag), gone
        ),
        Expected(
            "ExecutorQueueStalled", {}, "wedge (for 1 m), held to the death", (wedged + 60, wedged + 60 + lag), gone
        ),
        Expected("ExecutorQueueWaitHigh", {}, "wedge: age > 30 s (for 1 m)", (wedged + 90, wedged + 90 + lag), gone),
        Expected(
            "ExecutionOverdue",
            {},
            "overrun (for 1 m)",
            (overrun_start + 60, overrun_start + 60 + lag),
            (overrun_end, overrun_end + lag),
        ),
    ]
    for kind, at in (
        ("worker_died", wedged),
        ("orphaned_item", wedged),
        ("queue_stalled", wedged + QUEUE_STALL),
        ("execution_overdue", overrun_start),
    ):
        out.append(
            Expected(
                "WedgeDetected",
                {"stallwatch_wedge_kind": kind},
                f"{kind}; 10 m window",
                (at, at + lag + 1),
                (at + EVENT_WINDOW, at + EVENT_WINDOW + lag + 1),
            )
        )
    return out


def key_of(alert: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = alert["labels"]
    return labels["alertname"], tuple(sorted((k, v) for k, v in labels.items() if k != "alertname"))


def observe(prometheus: Prometheus, scenario: Scenario, plan: Mapping[str, float], polls: Path) -> float:
    """Poll the alerts into `polls` (JSON lines) until `watch_after` seconds after the host's SIGKILL, sent
    `kill_after` seconds into the final freeze; returns when it was sent."""
    killed = 0.0
    with polls.open("w") as out:
        while not killed or time.time() < killed + plan["watch_after"]:
            now = time.time()
            out.write(json.dumps({"t": now, "alerts": prometheus.alerts()}) + "\n")
            final = next((e for e in scenario.lines if e.get("event") == "final_freeze"), None)
            if final and not killed and now >= final["t"] + plan["kill_after"]:
                scenario.kill(signal.SIGKILL)
                killed = time.time()
                print(f"{killed - scenario.started:7.1f} s: host killed", flush=True)
            assert killed or scenario.proc is None or scenario.proc.poll() is None, "the host ended early"
            time.sleep(max(0.0, now + POLL - time.time()))
    return killed


def firing_intervals(polls: Path) -> list[Observed]:
    """Each alert's firing intervals in the polls: from the first poll that saw it firing to the first that did not."""
    firing: dict[tuple[str, tuple[tuple[str, str], ...]], Observed] = {}
    done: list[Observed] = []
    for line in polls.read_text().splitlines():
        poll = json.loads(line)
        seen = {key_of(alert) for alert in poll["alerts"] if alert["state"] == "firing"}
        for key in seen - set(firing):
            firing[key] = Observed(key[0], dict(key[1]), poll["t"])
        for key in set(firing) - seen:
            firing[key].cleared = poll["t"]
            done.append(firing.pop(key))
    return done + list(firing.values())


def sample_times(prometheus: Prometheus, expr: str, since: float) -> list[float]:
    """The timestamps of the raw samples of `expr` (one series) since `since`: its scrape times."""
    window = int(time.time() - since) + 60
    result = prometheus.query(f"{expr}[{window}s]")
    return sorted(float(t) for series in result for t, _ in series["values"])


def judge(
    expected: list[Expected], observed: list[Observed], end: float
) -> list[tuple[Expected, Observed | None, str]]:
    """Each expectation with the firing interval that meets it (marked matched) and a verdict.

    A window that opens after the watching ended is not judged ("not due"). An interval of the alert that
    overlaps the expected firing but starts outside its window counts as firing early or late.
    """
    rows: list[tuple[Expected, Observed | None, str]] = []
    for exp in sorted(expected, key=lambda e: (e.alert, e.fire[0] if e.fire else 0.0)):
        same = [o for o in observed if o.alert == exp.alert and exp.key.items() <= o.labels.items() and not o.matched]
        if exp.fire is None:
            rows.append((exp, None, "not expected; none"))
            continue
        lo, hi = exp.fire
        hit = next((o for o in sorted(same, key=lambda o: o.fired) if lo - POLL <= o.fired <= hi + POLL), None)
        verdict = "ok"
        if hit is None:
            until = exp.clear[1] if exp.clear else end
            hit = next((o for o in same if o.fired <= until and (o.cleared is None or o.cleared >= lo)), None)
            if hit is None:
                rows.append((exp, None, "not due by the end" if lo > end else "MISSED"))
                continue
            verdict = "fired EARLY" if hit.fired < lo else "fired LATE"
        hit.matched = True
        clear = exp.clear if exp.clear is None or exp.clear[0] <= end else None
        if clear is None and hit.cleared is not None:
            verdict += "; CLEARED EARLY"
        elif clear is not None and hit.cleared is None:
            verdict += "; DID NOT CLEAR"
        elif clear is not None and hit.cleared is not None and hit.cleared < clear[0] - POLL:
            verdict += "; CLEARED EARLY"
        elif clear is not None and hit.cleared is not None and hit.cleared > clear[1] + POLL:
            verdict += "; CLEARED LATE"
        rows.append((exp, hit, verdict))
    return rows


def span(window: tuple[float, float] | None, zero: float, never: str) -> str:
    return never if window is None else f"{window[0] - zero:.0f}-{window[1] - zero:.0f}"


def at(moment: float | None, zero: float, never: str) -> str:
    return never if moment is None else f"{moment - zero:.0f}"


def labels_text(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={labels[k]}" for k in SHOWN_LABELS if k in labels)


def summary(
    rows: list[tuple[Expected, Observed | None, str]],
    phantoms: Iterable[Observed],
    events: Mapping[str, tuple[float, float]],
    zero: float,
    killed: float,
    info: Mapping[str, Any],
    plan: Mapping[str, float],
    raw: Path,
) -> str:
    shown = raw.resolve().relative_to(REPOSITORY) if raw.resolve().is_relative_to(REPOSITORY) else raw
    lines = [
        "# Alert timeline: the shipped alerts through one incident, real Prometheus at shipped settings",
        "",
        "Written by `tests/bench/alert_timeline.py` (see its docstring for the method). Times are seconds from the",
        f"timeline's start; observed times come from polls every {POLL:.0f} s. Expected windows: event time + the",
        f"alert's `for` + one 15 s scrape + one 15 s evaluation + {TOLERANCE:.0f} s.",
        f"Raw records (not committed): `{shown}`.",
        "",
        f"Machine: {info['nproc']} cores, load {' '.join(info['loadavg'])}, Python {info['python']}, commit "
        f"{info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}, {info['date']}; versions "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
        + f"; Prometheus {info.get('prometheus', '?')}. Plan: `{json.dumps(dict(plan))}`.",
        "",
        "## Timeline",
        "",
        "| event | start | end |",
        "|---|---|---|",
        *(f"| {name} | {s - zero:.1f} | {e - zero:.1f} |" for name, (s, e) in events.items()),
        f"| SIGKILL of the host | {killed - zero:.1f} | |",
        "",
        "## Alerts",
        "",
        "| alert | labels | because | expected fire | observed fire | expected clear | observed clear | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for exp, hit, verdict in rows:
        lines.append(
            f"| {exp.alert} | {labels_text(hit.labels if hit else exp.key)} | {exp.because} | "
            f"{span(exp.fire, zero, 'none')} | {at(hit.fired if hit else None, zero, '—')} | "
            f"{span(exp.clear, zero, 'after the end') if exp.fire else '—'} | "
            f"{at(hit.cleared, zero, 'firing at the end') if hit else '—'} | {verdict} |"
        )
    lines += ["", "## Phantoms: firing intervals no event explains", ""]
    listed = sorted(phantoms, key=lambda o: o.fired)
    if not listed:
        lines.append("None.")
    for o in listed:
        before = max(
            ((n, s) for n, (s, _) in events.items() if s <= o.fired), key=lambda p: p[1], default=("start", zero)
        )
        lines.append(
            f"- {o.alert} ({labels_text(o.labels)}): fired {o.fired - zero:.0f}, "
            f"{'firing at the end' if o.cleared is None else f'cleared {o.cleared - zero:.0f}'} "
            f"(last event before it: {before[0]} at {before[1] - zero:.0f})"
        )
    return "\n".join(lines) + "\n"


def run(plan: Mapping[str, float], raw: Path) -> None:
    """Run the timeline under a shipped Prometheus; the records go to `raw` (what `report` reads)."""
    info = machine_info(VERSIONED)
    scenario = Scenario("timeline", json.dumps(plan), watchdog=True, env={"STALLWATCH_GUARD_ASYNC_EXC": "false"})
    prometheus: Prometheus | None = None
    try:
        scenario.start()
        scenario.wait_for("ready", 60)
        assert scenario.watchdog_target is not None
        targets = {HOST_JOB: [scenario.host_target], WATCHDOG_JOB: [scenario.watchdog_target]}
        prometheus = Prometheus.shipped(raw, targets)
        info["prometheus"] = prometheus.api("status/buildinfo")["data"]["version"]
        assert (prometheus.scrape_interval, prometheus.evaluation_interval) == (15, 15), "not the shipped intervals"
        prometheus.wait_until_up(2)
        scenario.go()
        print(f"timeline started; raw records in {raw}", flush=True)
        killed = observe(prometheus, scenario, plan, raw / "alerts.jsonl")
        end = time.time()
        events: dict[str, tuple[float, float]] = {}
        for line in scenario.lines:
            if "event" in line:
                start = events.get(line["event"], (line["t"],))[0]
                events[line["event"]] = (line["t"], line["t"]) if line["phase"] == "start" else (start, line["t"])
        since = scenario.started - 60
        scrapes = {job: sample_times(prometheus, f'up{{job="{job}"}}', since) for job in (HOST_JOB, WATCHDOG_JOB)}
        for expr in ("ALERTS", "up", "stallwatch_freeze_active", "stallwatch_freeze_host_killed_seconds"):
            (raw / f"{expr}.json").write_text(json.dumps(prometheus.query(f"{expr}[{int(end - since)}s]")))
    finally:
        if prometheus is not None:
            prometheus.stop()
        scenario.ensure_dead()
    record = {"events": events, "killed": killed, "started": scenario.started, "end": end, "plan": dict(plan)}
    (raw / "run.json").write_text(json.dumps({**record, "info": info, "scrapes": scrapes}))


def report(raw: Path) -> str:
    """The summary of the run recorded in `raw`."""
    record = json.loads((raw / "run.json").read_text())
    events = {name: (start, end) for name, (start, end) in record["events"].items()}
    observed = firing_intervals(raw / "alerts.jsonl")
    expected = expectations(events, record["killed"], record["scrapes"], 15.0, 15.0)
    rows = judge(expected, observed, record["end"])
    phantoms = [o for o in observed if not o.matched]
    return summary(rows, phantoms, events, record["started"], record["killed"], record["info"], record["plan"], raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: every step a few seconds")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--report", type=Path, metavar="RAW", help="only summarize the run recorded in RAW again")
    args = parser.parse_args()
    out = args.out or (Path(tempfile.mkdtemp(prefix="alert-timeline-")) if args.quick else DEFAULT_OUT)
    if args.report is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        raw = out / "raw" / f"alert_timeline-{stamp}"
        raw.mkdir(parents=True)
        run(QUICK if args.quick else FULL, raw)
    else:
        raw = args.report
    text = report(raw)
    (out / "alert_timeline.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
