"""Scrubbing cost per spawn, with STALLWATCH_RECORD_ARGS on and off.

Run from the repository root (about a minute)::

    .venvs/main/bin/python tests/bench/bench_scrubbing.py

Writes ``raw/scrubbing.json`` (raw numbers, machine) and ``scrubbing.md`` (the table) to ``tests/bench/results``
(``--out DIR`` elsewhere; ``--repeat N`` timed calls per command line, default 200). ``--baseline REV`` (default
``60f7be5``, the commit before the exit check and the shape rules) also times that commit's scrubber, loaded from
git, on the same command lines: the ``before`` column.

What stallwatch spends scrubbing one spawn, in µs of CPU, in the places it does (the exit check in one of two):

- ``name and args``: `instrument.subprocess.describe` on the subprocess instrumentation's builder thread (the
  calling thread only keeps references): the executable's name (`executable_name`), and with args on,
  `scrub_args` of the argv. Before the exit check this was all the scrubbing a spawn did.
- ``heartbeat``: the heartbeat's spawn name (`name (N args)`) checked once more (`scrub_value`), on the calling
  thread just before the fork of a uvloop exec spawn (`forksafe.guard`).
- ``exit check``: the spawn's finished span through `export.exit_check.checked`, on the batch exporter's thread.
- ``exit check, host providers``: the same span through `export.exit_check.CheckedSpans.on_end` (in front of a
  processor that does nothing), with ``STALLWATCH_PROVIDERS=host``: on the thread that ends the span.

Command lines: the ordinary ones of `tests/secrets_corpus.py` (``HARMLESS``, what a server spawns every day)
and its command lines with secrets (``CORPUS``). Each is timed warm (the same command line spawned again: the
executable-name cache and the clean-value cache hit, the usual case of a server that runs the same tools) and
cold (both caches emptied before each call: every command line new). Figures are the median over command lines
of each one's median time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess as processes
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent / "src")]

from _machine import machine_info, raw_path  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor  # noqa: E402
from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: E402
from opentelemetry.trace import SpanContext, SpanKind  # noqa: E402

from secrets_corpus import CORPUS, HARMLESS  # noqa: E402
from stallwatch.core import scrub  # noqa: E402
from stallwatch.export import exit_check  # noqa: E402
from stallwatch.instrument import subprocess  # noqa: E402

SCOPE = InstrumentationScope("stallwatch", "bench")
RESOURCE = Resource({"service.name": "bench"})
HOST = "exit check, host providers"


def _span(name: str, attributes: dict[str, Any]) -> ReadableSpan:
    """The finished span of a spawn, as the exporter gets it."""
    finished = attributes | {"process.pid": 4242, "process.exit.code": 0, "stallwatch.spawn.method": "fork",
                             "stallwatch.spawn.blocked_seconds": 0.0031}  # fmt: skip
    context = SpanContext(0x5CB1, 0x77, is_remote=False)
    return ReadableSpan(name=name, context=context, attributes=finished, kind=SpanKind.CLIENT, resource=RESOURCE,
                        instrumentation_scope=SCOPE, start_time=1, end_time=2)  # fmt: skip


def _forget_names(module: ModuleType) -> None:
    """Empty a scrub module's cache of executable names (a dict now, an lru_cache in older revisions)."""
    names = getattr(module, "_NAMES_OF_PATHS", None)
    if names is not None:
        names.clear()
    else:
        module._executable_name_of_path.cache_clear()


def _forget() -> None:
    scrub._clean_values.clear()
    scrub._clean_lists.clear()
    _forget_names(scrub)
    before = sys.modules.get("scrub_before")
    if before is not None:
        _forget_names(before)


def _median_us(call: Callable[[], object], repeat: int, cold: bool) -> float:
    samples = []
    for _ in range(repeat):
        if cold:
            _forget()
        started = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000


def _name_and_args(module: Any, argv: list[object], record_args: bool) -> Callable[[], object]:
    if record_args:
        return lambda: (module.executable_name(argv[0]), module.scrub_args(argv))
    return lambda: module.executable_name(argv[0])


def _old_scrubber(revision: str) -> ModuleType:
    """`core/scrub.py` (`instrument/scrub.py` before it moved) as it was at `revision` (it imports
    only the standard library)."""
    for place in ("core", "instrument"):
        shown = processes.run(["git", "show", f"{revision}:src/stallwatch/{place}/scrub.py"], cwd=HERE,
                              capture_output=True, text=True)  # fmt: skip
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "scrub_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("scrub_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scrub_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure(lines: list[list[object]], record_args: bool, cold: bool, repeat: int, before: ModuleType) -> dict:
    parts: dict[str, list[float]] = {
        "before": [], "name and args": [], "heartbeat": [], "exit check": [], HOST: []
    }  # fmt: skip
    host = exit_check.CheckedSpans(SpanProcessor())
    for argv in lines:
        name, attributes = subprocess.describe(argv[0], argv, "uvloop", record_args)
        command = f"{name} ({len(argv) - 1} args)"
        span = _span(name, attributes)
        parts["before"].append(_median_us(_name_and_args(before, argv, record_args), repeat, cold))
        parts["name and args"].append(_median_us(_name_and_args(scrub, argv, record_args), repeat, cold))
        parts["heartbeat"].append(_median_us(lambda: scrub.scrub_value(command), repeat, cold))  # noqa: B023
        parts["exit check"].append(_median_us(lambda: exit_check.checked("traces", [span]), repeat, cold))  # noqa: B023
        parts[HOST].append(_median_us(lambda: host.on_end(span), repeat, cold))  # noqa: B023
    medians = {part: statistics.median(values) for part, values in parts.items()}
    medians["total"] = medians["name and args"] + medians["heartbeat"] + medians["exit check"]
    return medians


def _summary(results: list[dict[str, Any]]) -> str:
    """The figures a reader wants, in words: ordinary command lines, warm and cold caches."""
    row = {(r["record_args"], r["cache"]): r for r in results if r["corpus"] == "ordinary"}
    off, off_cold, on, on_cold = row[False, "warm"], row[False, "cold"], row[True, "warm"], row[True, "cold"]
    return (
        f"Ordinary command lines, median per spawn. **Args off (the default)**: naming the executable costs "
        f"{off['name and args']:.2f} µs on the builder thread, as before ({off['before']:.2f}); new: "
        f"{off['heartbeat']:.2f} µs on the calling thread to check the heartbeat's spawn name "
        f"({off_cold['heartbeat']:.1f} the first time a name is seen) and {off['exit check']:.1f} µs on the export "
        f"thread for the exit check. **Args on**: the scrubber costs {on['name and args']:.1f} µs on the builder "
        f"thread against {on['before']:.1f} before ({on_cold['name and args']:.1f} against "
        f"{on_cold['before']:.1f} with cold caches); the exit check adds {on['exit check']:.1f} µs on the export "
        f"thread for a command line seen before and {on_cold['exit check']:.1f} for a new one (its argument list is "
        f"scrubbed again there). With `STALLWATCH_PROVIDERS=host` the exit check runs on the thread that ends the "
        f"span instead: {off[HOST]:.1f} µs with args off, {on[HOST]:.1f} with args on ({on_cold[HOST]:.1f} for a new "
        "command line)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--baseline", default="60f7be5")
    options = parser.parse_args()
    before = _old_scrubber(options.baseline)
    corpora = {
        "ordinary": [list(argv) for argv in HARMLESS],
        "with secrets": [list(argv) for argv, _, _ in CORPUS],
    }
    results = []
    for corpus, lines in corpora.items():
        for record_args in (False, True):
            for cold in (False, True):
                figures = measure(lines, record_args, cold, options.repeat, before)
                results.append({"corpus": corpus, "record_args": record_args, "cache": "cold" if cold else "warm",
                                "lines": len(lines), **figures})  # fmt: skip
                print(results[-1], flush=True)
    machine = machine_info(("opentelemetry-sdk",))
    options.out.mkdir(parents=True, exist_ok=True)
    raw_path(options.out, "scrubbing.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    rows = [
        f"| {r['corpus']} ({r['lines']}) | {'on' if r['record_args'] else 'off'} | {r['cache']} | {r['before']:.1f} "
        f"| {r['name and args']:.1f} | {r['heartbeat']:.2f} | {r['exit check']:.1f} "
        f"| {r[HOST]:.1f} | {r['total']:.1f} |"
        for r in results
    ]
    (options.out / "scrubbing.md").write_text(
        "# Scrubbing cost per spawn (µs of CPU)\n\n" + _summary(results) + "\n\n"
        f"Generated by `.venvs/main/bin/python tests/bench/bench_scrubbing.py` (repeat={options.repeat}, "
        f"baseline {options.baseline}). "
        f"Machine: {machine['nproc']} CPUs, Linux {machine['kernel']}, Python {machine['python']}, "
        f"opentelemetry-sdk {machine['versions']['opentelemetry-sdk']}; commit {machine['git_commit']}; "
        f"{machine['date']}; load {' '.join(machine['loadavg'])}.\n\n"
        "| command lines | STALLWATCH_RECORD_ARGS | caches | before: name and args | name and args (builder thread) "
        "| heartbeat (calling thread) | exit check (export thread) | exit check, host providers (ending thread) "
        "| total (stallwatch providers) |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    main()
