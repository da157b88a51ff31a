"""Paired A/B blocks inside one interpreter: the overhead of an instrumentor, with a confidence interval.

Comparing fresh interpreters, one per configuration, mixes the instrumentation's cost with the
difference between two processes (memory layout, which CPU each thread lands on, a slow stretch of
the shared machine): on this VM a loopback Nebius call's p50 moves by ±10 % from one interpreter to
the next, more than the 2-5 % targets. Here one interpreter alternates short blocks with the
instrumentor on and off (`instrument()` / `uninstrument()`), in a seeded random order within each
pair, so both halves of a pair share the process and the moment. Several arms (an instrumentor and
what a user would pick instead, `run_arms`) run in groups of blocks instead, one with every arm off
and one per arm alone on, shuffled per group: each arm is paired with its group's off block, so the
arms are compared at the same moments, not in passes minutes apart. Each pair gives one ratio
(median latency on / median off); the figure is the median of those ratios, with a 95 % bootstrap
interval (resampled pairs). The telemetry an "on" block queues is exported by background threads
that may run during any later block: an off block (its own figure a little lower) or another arm's
(that arm's a little higher); they export a few µs of CPU per call, against calls of hundreds of µs
to milliseconds.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from _machine import clean_env

BOOTSTRAP_SAMPLES = 2000


async def run_blocks(
    call: Callable[[], Awaitable[object]],
    switch: Callable[[bool], None],
    pairs: int,
    block: int,
    seed: int,
    settle: int = 3,
) -> list[tuple[list[float], list[float]]]:
    """`pairs` pairs of (on, off) blocks of `block` timed awaits of `call()`, in µs: `run_arms` with one arm.

    `switch(True)` turns the instrumentation on, `switch(False)` off; `settle` untimed calls follow
    each switch.
    """
    return (await run_arms(call, {"": switch}, pairs, block, seed, settle))[""]


async def run_arms(
    call: Callable[[], Awaitable[object]],
    switches: Mapping[str, Callable[[bool], None]],
    pairs: int,
    block: int,
    seed: int,
    settle: int = 3,
) -> dict[str, list[tuple[list[float], list[float]]]]:
    """`pairs` groups of blocks of `block` timed awaits of `call()`, one block with every arm off and
    one per arm with it alone on, in a seeded random order within each group; each arm's pairs are
    (its block, the group's off block), in µs. Arms measured in separate passes are minutes apart,
    and an added cost that grows with the machine's load then differs between them for that alone;
    here each group compares them at the same moment, against the same off block.

    Before each block every other arm is switched off (`switch(False)`), then its own on, so no two
    arms are ever on together and whatever switching does (a transaction opened or closed) happens
    outside the timed calls; `settle` untimed calls follow.
    """
    rng = random.Random(seed)
    result: dict[str, list[tuple[list[float], list[float]]]] = {name: [] for name in switches}
    for _ in range(pairs):
        order: list[str | None] = [*switches, None]  # one arm: the order `run_blocks` always had, per seed
        rng.shuffle(order)
        timed: dict[str | None, list[float]] = {}
        for arm in order:
            for name, switch in switches.items():
                if name != arm:
                    switch(False)
            if arm is not None:
                switches[arm](True)
            for _ in range(settle):
                await call()
            samples = []
            for _ in range(block):
                start = time.perf_counter()
                await call()
                samples.append((time.perf_counter() - start) * 1e6)
            timed[arm] = samples
        for name in switches:
            result[name].append((timed[name], timed[None]))
    return result


def switch_for(instrumentor: Any) -> Callable[[bool], None]:
    """`switch` for `run_blocks` and `run_arms`: turns an OpenTelemetry `BaseInstrumentor` on or off."""

    def switch(on: bool) -> None:
        if on != instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument() if on else instrumentor.uninstrument()

    return switch


def summarize(pairs: list[tuple[list[float], list[float]]], seed: int = 0) -> dict[str, Any]:
    """Median per-pair ratio with its 95 % bootstrap interval, the median µs added, and the medians."""
    ratios = [statistics.median(on) / statistics.median(off) for on, off in pairs]
    added = [statistics.median(on) - statistics.median(off) for on, off in pairs]
    return {
        "pairs": len(pairs),
        **ratio_interval(ratios, seed),
        "added_us": statistics.median(added),
        "on_p50_us": statistics.median([us for on, _ in pairs for us in on]),
        "off_p50_us": statistics.median([us for _, off in pairs for us in off]),
    }


def ratio_interval(ratios: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """The median of per-pair `ratios` and its 95 % bootstrap interval (resampled pairs)."""
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP_SAMPLES))
    return {
        "ratio": statistics.median(ratios),
        "ratio_ci95": [boots[int(0.025 * BOOTSTRAP_SAMPLES)], boots[int(0.975 * BOOTSTRAP_SAMPLES) - 1]],
    }


def verdict(summary: dict[str, Any], target: float) -> str:
    """`met` when the whole interval is at or under `target`, `not met` when it is all above, else `undecided`."""
    low, high = summary["ratio_ci95"]
    if high <= target:
        return "met"
    return "**not met**" if low > target else "undecided"


def table(paired: dict[str, Any], title: Callable[[str], str], target: str, judge: Callable[[dict], str]) -> list[str]:
    """Markdown table lines, one row per series of `paired`; the last column is `judge(summary)`."""
    lines = [
        f"| series | pairs | off p50 µs | on p50 µs | ratio | 95 % interval | added µs | {target} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for series, found in paired.items():
        low, high = found["ratio_ci95"]
        lines.append(
            f"| {title(series)} | {found['pairs']} | {found['off_p50_us']:.1f} | {found['on_p50_us']:.1f} "
            f"| {found['ratio']:.3f}x | {low:.3f} to {high:.3f} | {found['added_us']:+.1f} | {judge(found)} |"
        )
    return lines


def run_processes(commands: Sequence[list[str]], timeout: float) -> dict[str, Any]:
    """Run each paired worker (a fresh interpreter whose last stdout line is JSON {series: pairs}),
    pool the pairs per series and summarize them; the raw pairs stay under "blocks"."""
    collected: dict[str, list[Any]] = {}
    for number, command in enumerate(commands):
        proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"paired worker failed ({proc.returncode}):\n{proc.stderr}")
        for series, found in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            collected.setdefault(series, []).extend(found)
        print(f"paired process {number + 1}/{len(commands)} done", file=sys.stderr)
    return {series: {**summarize(found), "blocks": found} for series, found in collected.items()}
