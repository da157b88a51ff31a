"""Before/after table of two benchmark runs, each row with its noise and a verdict.

Run from the repository root, on two output directories of ``run_all.sh`` (or of the benches'
``--out``), each holding ``raw/NAME.json``::

    .venvs/main/bin/python tests/bench/compare.py BEFORE_DIR AFTER_DIR            # every bench found in both
    .venvs/main/bin/python tests/bench/compare.py BEFORE_DIR AFTER_DIR executor nebius

Prints Markdown: per bench, one row per figure found in both runs: its value before and after,
after / before, the noise of each side and a verdict. The noise is the bench's own 95 % bootstrap
interval where it has one (the paired ratios), else the spread (lowest to highest) of the
per-round figures the value is the pooled or median figure of, else none. Every figure is lower
for better (time, CPU, memory, a ratio of overhead). Verdict: ``worse`` when the after interval
lies wholly above the before one, ``better`` when wholly below, ``within noise`` when they
overlap, ``no noise estimate`` when a side has a single round and no interval. Figures found in
one run only are listed below each table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One figure of one run: `value`, and its noise interval (`low`, `high`) of kind `noise`."""

    value: float
    low: float | None = None
    high: float | None = None
    noise: str = ""
    unit: str = ""


def paired(results: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Figure]]:
    """`_paired.summarize` results: the median per-pair ratio with its 95 % interval."""
    for series, found in results.items():
        low, high = found["ratio_ci95"]
        yield f"{prefix}{series}: ratio on / off (paired)", Figure(found["ratio"], low, high, "95 % CI", "x")


def over_rounds(value: float, rounds: list[float], unit: str) -> Figure:
    """`value` with the spread of the per-round figures (none from a single round)."""
    if len(rounds) < 2:
        return Figure(value, unit=unit)
    return Figure(value, min(rounds), max(rounds), f"{len(rounds)} rounds", unit)


def executor(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    yield from paired(raw["paired"])
    for row in raw["summary"]:
        figure = over_rounds(row["median_us"], row["round_median_us"], "µs")
        yield f"{row['workload']} {row['config']}: µs per item", figure


def nebius(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    yield from paired(raw["paired"])
    for row in raw["summary"]:
        yield f"{row['series']} {row['config']}: p50 ms", over_rounds(row["p50_ms"], row["round_p50_ms"], "ms")


def subprocess_(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    yield from paired(raw["paired"])
    for row in raw["blocked"]:
        figure = over_rounds(row["p50_ms"], row["round_p50_ms"], "ms")
        yield f"blocked {row['config']} {row['rss']}: p50 ms", figure
    for row in raw["overhead"]:
        yield f"{row['series']} {row['config']}: p50 ms", over_rounds(row["p50_ms"], row["round_p50_ms"], "ms")


def journal(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for row in raw["summary"]:
        yield f"{row['config']}: p50 µs", over_rounds(row["p50_us"], row["round_p50_us"], "µs")


def spawn(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for row in raw["summary"]:
        yield f"{row['config']} {row['rss']}: p50 ms", over_rounds(row["p50_ms"], row["round_p50_ms"], "ms")


def spawn_incident(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for config, row in raw["summary"].items():
        yield f"{config}: p50 ms", over_rounds(row["p50_ms"], row["round_p50_ms"], "ms")


def spread(samples: list[float], unit: str, kind: str) -> Figure:
    """The median of `samples`, with their spread as its noise."""
    if len(samples) < 2:
        return Figure(samples[0] if samples else float("nan"), unit=unit)
    return Figure(statistics.median(samples), min(samples), max(samples), kind, unit)


def watchdog(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    result = raw["result"]
    for side in ("on", "off"):
        yield f"span with tracking {side}: µs", spread(result["span_us"][side], "µs", "rounds")
    yield "watchdog CPU, host idle: %", Figure(result["idle_cpu_percent"], unit="%")
    yield "watchdog CPU, host spawning: %", Figure(result["spawning_cpu_percent"], unit="%")
    if raw["latencies_s"]:
        yield "freeze detection latency: s", spread(raw["latencies_s"], "s", "freezes")


def fast_paths(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for series, found in raw["micro"].items():
        low, high = found["ratio_ci95"]
        yield f"{series}: ratio fast / SDK (paired)", Figure(found["ratio"], low, high, "95 % CI", "x")
    for config, rounds in raw["end_to_end"]["runs"].items():
        walls = [statistics.median(run["wall"]) for run in rounds]
        yield f"end to end {config}: µs per item", spread(walls, "µs", "rounds")


def footprint(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for config, summary in raw["summary"].items():
        if config == "bare":
            continue
        for key, label, unit in (("setup_ms", "import + set-up ms", "ms"), ("total_pss_mib", "PSS MiB", "MiB")):
            rounds = [run[key] for run in raw["runs"] if run["config"] == config]
            yield f"{config}: {label}", over_rounds(summary[key], rounds, unit)


def scrubbing(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for row in raw["results"]:
        args = "args on" if row["record_args"] else "args off"
        yield f"{row['corpus']}, {args}, {row['cache']}: total µs", Figure(row["total"], unit="µs")


def backend_faults(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for row in raw["summary"]:
        yield f"{row['config']}: request p99 ms", over_rounds(row["p99_ms"], row["round_p99_ms"], "ms")


def backend_faults_paired(raw: dict[str, Any]) -> Iterator[tuple[str, Figure]]:
    for config, found in raw["summary"].items():
        low, high = found["ratio_ci95"]
        yield f"{config}: p99 / baseline p99 (paired)", Figure(found["ratio"], low, high, "95 % CI", "x")


EXTRACTORS: dict[str, Callable[[dict[str, Any]], Iterator[tuple[str, Figure]]]] = {
    "spawn": spawn,
    "spawn-incident": spawn_incident,
    "footprint": footprint,
    "subprocess": subprocess_,
    "executor": executor,
    "nebius": nebius,
    "journal": journal,
    "watchdog": watchdog,
    "backend_faults": backend_faults,
    "backend_faults_paired": backend_faults_paired,
    "fast_paths": fast_paths,
    "scrubbing": scrubbing,
}


def verdict(before: Figure, after: Figure) -> str:
    if before.low is None or before.high is None or after.low is None or after.high is None:
        return "no noise estimate"
    if after.low > before.high:
        return "**worse**"
    if after.high < before.low:
        return "better"
    return "within noise"


def number(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def noise(figure: Figure) -> str:
    if figure.low is None or figure.high is None:
        return "-"
    return f"{number(figure.low)} to {number(figure.high)} ({figure.noise})"


def figures(directory: Path, name: str) -> dict[str, Figure] | None:
    path = directory / "raw" / f"{name}.json"
    if not path.exists():
        return None
    return dict(EXTRACTORS[name](json.loads(path.read_text())))


def commit_of(directory: Path, name: str) -> str:
    machine = json.loads((directory / "raw" / f"{name}.json").read_text()).get("machine", {})
    return f"{machine.get('git_commit', '?')}, {machine.get('date', '?')}"


def table(name: str, before_dir: Path, after_dir: Path) -> list[str]:
    before, after = figures(before_dir, name), figures(after_dir, name)
    if before is None or after is None:
        missing = " and ".join(str(d) for d, f in ((before_dir, before), (after_dir, after)) if f is None)
        return [f"## {name}", "", f"No `raw/{name}.json` in {missing}.", ""]
    lines = [
        f"## {name}",
        "",
        f"Before: {commit_of(before_dir, name)}. After: {commit_of(after_dir, name)}.",
        "",
        "| figure | before | after | after / before | noise before | noise after | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, old in before.items():
        new = after.get(key)
        if new is None:
            continue
        ratio = f"{new.value / old.value:.3f}" if old.value else "-"
        lines.append(
            f"| {key} | {number(old.value)} | {number(new.value)} | {ratio} | {noise(old)} | {noise(new)} "
            f"| {verdict(old, new)} |"
        )
    only_before = [key for key in before if key not in after]
    only_after = [key for key in after if key not in before]
    lines.append("")
    if only_before:
        lines += [f"Before only: {'; '.join(only_before)}.", ""]
    if only_after:
        lines += [f"After only: {'; '.join(only_after)}.", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("before", type=Path, help="output directory of the before run (holding raw/)")
    parser.add_argument("after", type=Path, help="output directory of the after run (holding raw/)")
    parser.add_argument("names", nargs="*", help=f"benches (default: those in both runs): {', '.join(EXTRACTORS)}")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(EXTRACTORS)
    if unknown:
        parser.error(f"no comparison for {', '.join(sorted(unknown))}")
    names = args.names or [
        name for name in EXTRACTORS if all((d / "raw" / f"{name}.json").exists() for d in (args.before, args.after))
    ]
    if not names:
        sys.exit(f"no raw/NAME.json in both {args.before} and {args.after}")
    lines = ["# Before / after", ""]
    for name in names:
        lines += table(name, args.before, args.after)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
