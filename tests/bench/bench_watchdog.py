"""Freeze-watchdog benchmark: its CPU cost, and how fast it reports a real freeze.

Run from the repository root (about two minutes)::

    .venvs/main/bin/python tests/bench/bench_watchdog.py
    .venvs/main/bin/python tests/bench/bench_watchdog.py --quick    # smoke test, ~20 s, writes to a temp dir

Options: ``--idle S`` seconds of idle host (default 60), ``--spawns N`` uvloop spawns (default
1000), ``--freezes F`` injected freezes (default 20), ``--quick`` (5 s, 100 spawns, 3 freezes),
``--out DIR`` (default ``tests/bench/results``). Writes ``raw/watchdog.json`` and ``watchdog.md``.

Measured in two host processes (fresh interpreters) after ``stallwatch.setup(file_dir=...)``: the first
with the default uvloop spawn (``STALLWATCH_UVLOOP_SPAWN=vfork``) for the CPU figures, the second with
``STALLWATCH_UVLOOP_SPAWN=fork`` for the freezes, whose after-fork hold runs only in a forked child
(the vfork spawn runs no fork handler, so it would never freeze):

- watchdog CPU (user+system from ``/proc/<pid>/stat``) as a percentage of one core while the host
  idles, and while the host makes N uvloop spawns of ``/bin/true`` back to back;
- detection latency: F freezes, each a uvloop child held 2 s before exec by an after-fork handler
  registered before stallwatch (the incident's shape); latency = time of the watchdog's "freeze
  detected" log record minus the start of the frozen spawn call, with a 1 s threshold. The
  baseline is the threshold itself: the ratio says how much the watchdog adds to it;
- what naming the frozen span costs the host: CPU time of a span entered and left on the main
  thread (`start_as_current_span`, a no-op body) with the heartbeat's span tracking on, against
  the same with it off (`heartbeat.untrack_current_span()`), in alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import clean_env, command_line, machine_info, raw_path

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("uvloop", "opentelemetry-sdk", "stallwatch")
THRESHOLD = 1.0
HOLD_SECONDS = 2.0
SPAN_ROUNDS, SPANS_PER_ROUND = 10, 20_000


def span_cost() -> dict[str, list[float]]:
    """CPU µs (this thread's) per span entered and left on the main thread, per round, with span
    tracking on and off: CPU time, so that other processes on a shared machine do not count."""
    from opentelemetry import trace

    from stallwatch.detect import heartbeat

    tracer = trace.get_tracer("bench")

    def one_round() -> float:
        started = time.thread_time()
        for _ in range(SPANS_PER_ROUND):
            with tracer.start_as_current_span("request"):
                pass
        return (time.thread_time() - started) / SPANS_PER_ROUND * 1e6

    rounds: dict[str, list[float]] = {"on": [], "off": []}
    for index in range(2 * SPAN_ROUNDS):
        tracking = index % 2 == 0
        if not tracking:
            heartbeat.untrack_current_span()
        rounds["on" if tracking else "off"].append(one_round())
        heartbeat.track_current_span()
    return rounds


def worker(out: str, idle: float, spawns: int, freezes: int) -> dict[str, Any]:
    """The host: runs in a fresh interpreter, returns raw numbers. With `freezes`, it only injects them
    (`STALLWATCH_UVLOOP_SPAWN=fork` needed); else it measures the CPU figures."""
    hold = {"seconds": 0.0}

    def library_child_handler() -> None:
        if hold["seconds"]:
            time.sleep(hold["seconds"])

    os.register_at_fork(after_in_child=library_child_handler)  # before stallwatch: not guarded
    import stallwatch

    session = stallwatch.setup(file_dir=out, freeze_threshold=THRESHOLD)
    import asyncio

    import uvloop

    pid = session.watchdog_pid
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    async def main() -> dict[str, Any]:
        await asyncio.sleep(2)  # past the watchdog's start-up
        if freezes:
            return {"freeze_starts_ns": await freeze_starts()}
        spans = span_cost()
        c0, t0 = cpu(), time.monotonic()
        await asyncio.sleep(idle)
        idle_percent = 100 * (cpu() - c0) / (time.monotonic() - t0)
        c0, t0 = cpu(), time.monotonic()
        for _ in range(spawns):
            child = await asyncio.create_subprocess_exec("/bin/true")
            await child.wait()
        spawn_seconds = time.monotonic() - t0
        spawning_percent = 100 * (cpu() - c0) / spawn_seconds
        return {
            "idle_seconds": idle,
            "idle_cpu_percent": idle_percent,
            "spawns": spawns,
            "spawns_seconds": spawn_seconds,
            "spawning_cpu_percent": spawning_percent,
            "span_us": spans,
        }

    async def freeze_starts() -> list[int]:
        starts = []
        for _ in range(freezes):
            hold["seconds"] = HOLD_SECONDS
            starts.append(time.time_ns())
            child = await asyncio.create_subprocess_exec("/bin/true")
            hold["seconds"] = 0.0
            await child.wait()
            await asyncio.sleep(1.0)
        return starts

    result = uvloop.run(main())
    stallwatch.shutdown(timeout=5)
    return result


def detections(out: Path) -> list[int]:
    times = []
    for line in (out / "logs.jsonl").read_text().splitlines():
        request = json.loads(line)
        for resource in request["resourceLogs"]:
            for scope in resource["scopeLogs"]:
                for record in scope["logRecords"]:
                    if "freeze detected" in record["body"]["stringValue"]:
                        times.append(int(record["timeUnixNano"]))
    return sorted(times)


def latencies(starts: list[int], detected: list[int]) -> list[float]:
    """For each freeze, seconds from its spawn call to the first detection after it."""
    found = []
    for start in starts:
        after = [t for t in detected if t >= start]
        if after:
            found.append((after[0] - start) / 1e9)
    return found


def render(result: dict[str, Any], lat: list[float], info: dict[str, Any]) -> str:
    quantiles = statistics.quantiles(lat, n=20, method="inclusive") if len(lat) > 1 else lat * 19
    p50, p95 = statistics.median(lat), quantiles[18]
    on, off = (statistics.median(result["span_us"][mode]) for mode in ("on", "off"))
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return "\n".join(
        [
            "# Freeze watchdog: CPU cost and detection latency",
            "",
            f"Generated by `{command_line(__file__, [])}`. Machine: {info['nproc']} CPUs, "
            f"Python {info['python']}; {versions}; commit {info['git_commit']}; {info['date']}.",
            "CPU figures with the default uvloop spawn (vfork); the freezes with `STALLWATCH_UVLOOP_SPAWN=fork`, "
            "since their hold is an after-fork handler.",
            "",
            "| measure | value | against |",
            "|---|---|---|",
            f"| watchdog CPU, host idle {result['idle_seconds']:.0f} s | {result['idle_cpu_percent']:.2f} % of one "
            "core | target ≤ 1 % |",
            f"| watchdog CPU, host making {result['spawns']} uvloop spawns ({result['spawns_seconds']:.1f} s) | "
            f"{result['spawning_cpu_percent']:.2f} % of one core | target ≤ 1 % |",
            f"| detection latency p50 ({len(lat)}/{len(result['freeze_starts_ns'])} freezes seen) | {p50:.2f} s | "
            f"{p50 / THRESHOLD:.2f}x the {THRESHOLD:.0f} s threshold |",
            f"| detection latency p95 / max | {p95:.2f} s / {max(lat):.2f} s | "
            f"{max(lat) / THRESHOLD:.2f}x the threshold at most |",
            f"| CPU per span entered and left on the main thread, span tracking on (median of {SPAN_ROUNDS} rounds of "
            f"{SPANS_PER_ROUND}) | {on:.2f} µs | {on - off:+.2f} µs ({on / off:.2f}x) against off: {off:.2f} µs |",
            "",
        ]
    )


def run_worker(idle: float, spawns: int, freezes: int, env: dict[str, str]) -> tuple[dict[str, Any], Path]:
    """One host in a fresh interpreter: its raw numbers and the directory of its telemetry files."""
    telemetry = Path(tempfile.mkdtemp(prefix="bench_watchdog_telemetry_"))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(telemetry), str(idle), str(spawns)]
    proc = subprocess.run([*command, str(freezes)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), telemetry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--idle", type=float, help="idle seconds (default 60; 5 with --quick)")
    parser.add_argument("--spawns", type=int, help="uvloop spawns (default 1000; 100 with --quick)")
    parser.add_argument("--freezes", type=int, help="injected freezes (default 20; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        out, idle, spawns, freezes = args.worker
        print(json.dumps(worker(out, float(idle), int(spawns), int(freezes))))
        return
    idle = args.idle if args.idle is not None else (5.0 if args.quick else 60.0)
    spawns = args.spawns if args.spawns is not None else (100 if args.quick else 1000)
    freezes = args.freezes if args.freezes is not None else (3 if args.quick else 20)
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_watchdog_")) if args.quick else DEFAULT_OUT)
    result = run_worker(idle, spawns, 0, clean_env())[0]
    # The freezes are held by an after-fork handler: only uvloop's own fork runs it.
    frozen, telemetry = run_worker(0.0, 0, freezes, {**clean_env(), "STALLWATCH_UVLOOP_SPAWN": "fork"})
    result["freeze_starts_ns"] = frozen["freeze_starts_ns"]
    lat = latencies(result["freeze_starts_ns"], detections(telemetry))
    info = machine_info(VERSIONED)
    out.mkdir(parents=True, exist_ok=True)
    raw_path(out, "watchdog.json").write_text(
        json.dumps({"machine": info, "result": result, "latencies_s": lat}, indent=1)
    )
    markdown = render(result, lat, info)
    (out / "watchdog.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
