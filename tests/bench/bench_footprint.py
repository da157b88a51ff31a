"""Footprint benchmark: memory, threads and start-up of `import stallwatch.auto` against a stock SDK set-up.

Run from the repository root (a full run takes about a minute)::

    .venvs/main/bin/python tests/bench/bench_footprint.py             # 7 interleaved rounds
    .venvs/main/bin/python tests/bench/bench_footprint.py --rounds 3  # shorter

Writes ``footprint.md`` (the table, committed) to ``tests/bench/results`` and the raw numbers to
``tests/bench/results/raw/footprint.json`` (not committed). ``--out DIR`` writes both into DIR.

Every configuration runs in a fresh interpreter against the same OTLP/HTTP receiver on loopback
(started by this runner, answering 200 to every export), with OTLP/HTTP exporters for the three
signals:

- ``bare``: no OpenTelemetry at all (the interpreter and this script), for reference.
- ``stock``: the set-up a user writes without stallwatch: TracerProvider + BatchSpanProcessor,
  MeterProvider + PeriodicExportingMetricReader, LoggerProvider + BatchLogRecordProcessor and a
  LoggingHandler on the root logger, each with the OTLP/HTTP exporter, installed globally.
- ``stallwatch``: ``import stallwatch.auto`` with ``OTEL_{TRACES,METRICS,LOGS}_EXPORTER=otlp``:
  its default set-up, freeze watchdog (a second process) included.
- ``floor``: ``stock`` plus the smallest Python process that could be a watchdog
  (``python -I -S -c "import time; time.sleep(...)"``, the same interpreter) as its child: the host +
  children PSS that no watchdog running as a Python process can go below.
- ``stock+asyncio`` and ``stallwatch+asyncio``: ``stock`` and ``stallwatch`` in a host that imported
  asyncio before (an async server does), outside the timed set-up.
- ``stock+wrapt``: ``stock`` that also imports wrapt inside its timed set-up: the set-up time and RSS that
  any wrapt-based instrumentation adds (wrapt 2's package imports asyncio), stallwatch's wrappers and the
  OpenTelemetry contrib instrumentations alike: the floor of those two figures for stallwatch.
- ``stallwatch_no_fast_paths``: ``stallwatch`` with ``STALLWATCH_FAST_PATHS=false``: what the
  start-up fast path (the instrumentations switched on without loading ``BaseInstrumentor``) saves.

The workers run as a user's install does, with bytecode caches: ``PYTHONDONTWRITEBYTECODE`` is
dropped from their environment and one unmeasured warm-up round writes the caches the sources lack
(an editable install's, this runner's) before the measured rounds.

Each worker times its imports and set-up (``perf_counter`` around them, interpreter start-up
excluded), then idles 3 s and reads its own RSS and PSS (``/proc/self/smaps_rollup``) and thread
count (``/proc/self/task``), and the same for every child process (the watchdog); then it records a
span, a log record and a counter point, flushes the three signals and reads its RSS again (what it
holds once it has exported: anything a set-up builds at its first export is counted there). Rounds are
interleaved (the order rotated by one per round) and the figures are medians over rounds; the
ratios are against ``stock`` (``stock+asyncio`` for ``stallwatch+asyncio``) from the same run. The
load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _machine import LoopbackReceiver, clean_env, install_stock_otlp, machine_info, rotated, worker_result

CONFIGS = (
    "bare",
    "stock",
    "stallwatch",
    "floor",
    "stock+wrapt",
    "stock+asyncio",
    "stallwatch+asyncio",
    "stallwatch_no_fast_paths",
)
PAIRS = {  # measured config: its baseline
    "stallwatch": "stock",
    "stallwatch+asyncio": "stock+asyncio",
    "stallwatch_no_fast_paths": "stock",
}
IDLE_SECONDS = 3.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http", "stallwatch")
GOALS = {  # figure: (stallwatch / stock at most, or an absolute limit)
    "host_rss_mib": ("ratio", 1.1),
    "host_threads": ("absolute", 4),
    "total_pss_mib": ("ratio", 1.25),
    "setup_ms": ("ratio", 1.2),
}


# ---- worker: one configuration in a fresh interpreter ----------------------------------------


def memory(pid: int | str) -> dict[str, float]:
    """RSS, PSS and USS (its private pages: what no other process shares, so unlike PSS not moved by
    what else runs the same interpreter on the machine) in MiB, and the thread count of a process."""
    found = {"threads": len(os.listdir(f"/proc/{pid}/task")), "uss_mib": 0.0}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, value = line.split()[:2]
        if name in ("Rss:", "Pss:"):
            found[name[:-1].lower() + "_mib"] = int(value) / 1024
        elif name in ("Private_Clean:", "Private_Dirty:"):
            found["uss_mib"] += int(value) / 1024
    return found


def children() -> list[int]:
    """Pids of this process's children (the watchdog)."""
    tasks = os.listdir("/proc/self/task")
    return [int(pid) for task in tasks for pid in Path(f"/proc/self/task/{task}/children").read_text().split()]


def export_once() -> dict[str, float]:
    """Record a span, a log record and a counter point through the global providers, flush all three
    (each exporter sends one request), and read the host's memory then: what a set-up that builds
    anything at its first export instead of at set-up holds once it has exported."""
    import logging

    from opentelemetry import _logs, metrics, trace

    with trace.get_tracer("bench_footprint").start_as_current_span("export-once"):
        logging.getLogger("bench_footprint").warning("export once")
        metrics.get_meter("bench_footprint").create_counter("bench_footprint.exports").add(1)
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider()):
        provider.force_flush()  # type: ignore[attr-defined]  # the SDK providers both set-ups install
    return memory("self")


def worker(config: str) -> dict[str, Any]:
    setup, _, host_kind = config.partition("+")
    if host_kind == "asyncio":
        import asyncio  # noqa: F401  # the host's own, before the set-up
    start = time.perf_counter()
    if setup in ("stock", "floor"):
        install_stock_otlp(logging_handler=True)
        if host_kind == "wrapt":
            import wrapt  # noqa: F401
    elif setup in ("stallwatch", "stallwatch_no_fast_paths"):
        import stallwatch.auto  # noqa: F401
    setup_ms = (time.perf_counter() - start) * 1000
    floor = None
    if setup == "floor":  # outside the timed set-up: a watchdog's start is not the host's
        sleep = f"import time; time.sleep({IDLE_SECONDS * 10})"
        floor = subprocess.Popen([sys.executable, "-I", "-S", "-c", sleep])
    time.sleep(IDLE_SECONDS)
    host = memory("self")
    kids = {str(pid): memory(pid) for pid in children()}
    if floor is not None:
        floor.kill()
        floor.wait()
    exported = export_once() if setup != "bare" else host
    return {
        "config": config,
        "setup_ms": setup_ms,
        "host_rss_mib": host["rss_mib"],
        "host_rss_exported_mib": exported["rss_mib"],
        "host_pss_mib": host["pss_mib"],
        "host_threads": host["threads"],
        "thread_names": sorted(thread.name for thread in threading.enumerate()),
        "children": kids,
        "total_pss_mib": host["pss_mib"] + sum(kid["pss_mib"] for kid in kids.values()),
        "total_rss_mib": host["rss_mib"] + sum(kid["rss_mib"] for kid in kids.values()),
        "total_uss_mib": host["uss_mib"] + sum(kid["uss_mib"] for kid in kids.values()),
        "modules": len(sys.modules),
    }


# ---- runner -----------------------------------------------------------------------------------


def run_worker(config: str, endpoint: str) -> dict[str, Any]:
    env = {k: v for k, v in clean_env().items() if k != "PYTHONDONTWRITEBYTECODE"} | {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "otlp",
    }
    if config == "stallwatch_no_fast_paths":
        env["STALLWATCH_FAST_PATHS"] = "false"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    return worker_result(proc, f"worker {config}")


FIGURES = (
    "setup_ms",
    "host_rss_mib",
    "host_rss_exported_mib",
    "host_pss_mib",
    "host_threads",
    "total_pss_mib",
    "total_rss_mib",
    "total_uss_mib",
)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median of every figure over the rounds, per configuration."""
    mine = {config: [run for run in runs if run["config"] == config] for config in CONFIGS}
    return {config: {figure: statistics.median(run[figure] for run in found) for figure in FIGURES}
            for config, found in mine.items()}  # fmt: skip


def judge(summary: dict[str, dict[str, float]]) -> list[tuple[str, str, float, str, str]]:
    """(config, figure, its value, the goal, met or not) for every goal and measured config, the
    floor's host + children PSS against the same goal (what no Python watchdog process can go below) and
    ``stock+wrapt``'s set-up time and RSS against theirs (what no wrapt-based instrumentation can go below)."""
    verdicts = []
    for config, baseline in PAIRS.items():
        for figure, (kind, limit) in GOALS.items():
            mine = summary[config][figure]
            if kind == "ratio":
                value, goal = mine / summary[baseline][figure], f"≤ {limit}x {baseline}"
            else:
                value, goal = mine, f"≤ {limit}"
            verdicts.append((config, figure, value, goal, "met" if value <= limit else "**not met**"))
    limit = GOALS["total_pss_mib"][1]
    floor = summary["floor"]["total_pss_mib"] / summary["stock"]["total_pss_mib"]
    verdicts.append(("floor", "total_pss_mib", floor, f"≤ {limit}x stock", "met" if floor <= limit else "**not met**"))
    for figure in ("setup_ms", "host_rss_mib"):
        limit = GOALS[figure][1]
        floor = summary["stock+wrapt"][figure] / summary["stock"][figure]
        verdicts.append(("stock+wrapt", figure, floor, f"≤ {limit}x stock", "met" if floor <= limit else "**not met**"))
    return verdicts


def render(summary: dict[str, dict[str, float]], runs: list[dict[str, Any]], info: dict[str, Any], rounds: int) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    lines = [
        "# Footprint after 3 s idle: `import stallwatch.auto` against a stock SDK set-up",
        "",
        f"Generated by `.venvs/main/bin/python tests/bench/bench_footprint.py --rounds {rounds}`: every "
        "configuration in a fresh interpreter, OTLP/HTTP exporters for traces, metrics and logs against a "
        f"loopback receiver, {rounds} interleaved rounds, medians over rounds, ratios against `stock` from "
        "this run. `setup ms` is the imports plus set-up (interpreter start-up excluded); `total PSS` "
        "is the host's PSS plus its child processes' (stallwatch's freeze watchdog). Bytecode caches "
        "present, as in a user's install (an unmeasured warm-up round writes them). `floor` is `stock` "
        'plus the smallest Python process that could be a watchdog (`python -I -S -c "import time; '
        'time.sleep(...)"`) as its child; `stock+wrapt` is `stock` that also imports wrapt in its timed '
        "set-up (what every wrapt-based instrumentation loads; wrapt 2 imports asyncio). The `+asyncio` "
        "configurations import asyncio before their "
        "set-up, as an async server does; `stallwatch_no_fast_paths` runs with `STALLWATCH_FAST_PATHS=false`. "
        "`host RSS after one export` is read after the idle figures, once the host has recorded a span, a "
        "log record and a counter point and flushed each signal (one export each): what a set-up holds "
        "once it has exported, including anything built at the first export rather than at set-up. "
        "USS counts the private pages only: PSS also divides the shared "
        "ones among every process that maps them, the other Python processes on the machine included, so "
        "it moves with what else runs there; USS does not.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}; {info['date']}; load average "
        f"{' '.join(info['loadavg'])} before, {' '.join(info['loadavg_after'])} after.",
        "",
        "| config | setup ms | host RSS MiB | host RSS after one export MiB | host PSS MiB | host threads "
        "| host + children PSS MiB | host + children RSS MiB | host + children USS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config, row in summary.items():
        lines.append(
            f"| {config} | {row['setup_ms']:.0f} | {row['host_rss_mib']:.1f} | {row['host_rss_exported_mib']:.1f} | "
            f"{row['host_pss_mib']:.1f} | "
            f"{row['host_threads']:.0f} | {row['total_pss_mib']:.1f} | {row['total_rss_mib']:.1f} | "
            f"{row['total_uss_mib']:.1f} |"
        )
    lines += ["", "| config | goal | value | target | verdict |", "|---|---|---|---|---|"]
    for config, figure, value, goal, verdict in judge(summary):
        shown = f"{value:.2f}x" if "x" in goal else f"{value:.0f}"
        lines.append(f"| {config} | {figure} | {shown} | {goal} | {verdict} |")
    last = {run["config"]: run for run in runs}
    lines += ["", "Threads of the last run of each configuration:", ""]
    lines += [f"- {config}: {', '.join(run['thread_names'])}" for config, run in last.items()]
    for config, what in (("stallwatch", "stallwatch's watchdog process"), ("floor", "The floor's process")):
        kids = list(last[config]["children"].values())
        if kids:
            lines += ["", f"{what} (last run): " + "; ".join(
                f"RSS {kid['rss_mib']:.1f} MiB, PSS {kid['pss_mib']:.1f} MiB, {kid['threads']} threads" for kid in kids
            ) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def benchmark(rounds: int, out: Path) -> str:
    info = machine_info(VERSIONED)
    receiver = LoopbackReceiver()
    endpoint = receiver.url
    runs = []
    try:
        for config in CONFIGS:  # the warm-up: writes the bytecode caches, measures nothing
            run_worker(config, endpoint)
        for number, config in rotated(CONFIGS, rounds):
            run = run_worker(config, endpoint) | {"round": number}
            runs.append(run)
            print(f"round {number} {config:<10} setup {run['setup_ms']:6.0f} ms, total PSS "
                  f"{run['total_pss_mib']:5.1f} MiB, {run['host_threads']} threads", file=sys.stderr)  # fmt: skip
    finally:
        receiver.close()
    info["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    summary = summarize(runs)
    markdown = render(summary, runs, info, rounds)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "rounds": rounds, "summary": summary, "goals": judge(summary), "runs": runs}
    (out / "raw" / "footprint.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "footprint.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default tests/bench/results)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    print(benchmark(args.rounds, args.out))


if __name__ == "__main__":
    main()
