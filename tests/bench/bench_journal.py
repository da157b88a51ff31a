"""Journal benchmark: what one journaled operation costs the calling thread, and what a durable
record costs with each storage the journal could have used.

Run from the repository root (a full run takes about a minute)::

    .venvs/main/bin/python tests/bench/bench_journal.py
    .venvs/main/bin/python tests/bench/bench_journal.py --quick    # smoke test, < 15 s, writes to a temp dir

Options: ``--ops N`` operations per run for the buffered configurations (default 5000; the durable
ones make N/10), ``--rounds R`` (default 3), ``--quick`` (1000 ops, 1 round), ``--dir DIR`` where
the journals are written (default: a fresh directory under the system temp dir; its filesystem is
recorded), ``--out DIR`` (default ``tests/bench/results``; with ``--quick``, a fresh temporary
directory). Writes ``raw/journal.json`` and ``journal.md``.

Each sample is the wall time of one call in the calling thread (``perf_counter_ns``). ``cpu_us``
is the process CPU time per operation over the whole series, flusher thread included (the
buffered configurations end with a flush). Configurations, each in a fresh interpreter:

- ``no_journal``: an SDK span started and ended (no processor): the operation without a journal.
- ``buffered``: the same span, with ``Journal.span_started`` and ``span_ended`` (two buffered
  records); the difference to ``no_journal`` is the journal's hot-path cost per operation.
- ``durable``: ``Journal.cloud_intent``, one durable record (preallocated framed file,
  ``pwrite`` + ``os.fdatasync``), as every Nebius create/delete pays before it is sent.
- ``append_fdatasync``: the same frame ``write`` to an ``O_APPEND`` file that grows, then
  ``os.fdatasync`` (the framed file without preallocation).
- ``sqlite_wal_full``: the same record inserted into SQLite in WAL mode with
  ``synchronous=FULL`` (autocommit), the standard library's durable alternative.
- ``sqlite_wal_normal``: as above with ``synchronous=NORMAL`` (not durable across a power loss
  in WAL mode: shown for scale).

The runs are interleaved: every round runs all configurations, in an order rotated by one each
round, and samples are pooled per configuration across rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _machine import clean_env, command_line, machine_info, p99, raw_path, rotated, worker_result

CONFIGS = ("no_journal", "buffered", "durable", "append_fdatasync", "sqlite_wal_full", "sqlite_wal_normal")
DURABLE = ("durable", "append_fdatasync", "sqlite_wal_full", "sqlite_wal_normal")
WARMUPS = 50
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("opentelemetry-api", "opentelemetry-sdk", "stallwatch")


# ---- worker: one configuration in a fresh interpreter ----------------------------------------


def intent_record() -> Any:
    from stallwatch.journal import ledger

    return ledger.Intent("create", "compute.instance", "nebius.compute.v1.InstanceService/Create",
                         "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")  # fmt: skip


def timed(call: Callable[[], Any], count: int) -> list[float]:
    """Microseconds per call, after warm-ups."""
    for _ in range(WARMUPS):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        call()
        samples.append((clock() - start) / 1000)
    return samples


def span_series(journal: Any, count: int) -> tuple[list[float], list[float]]:
    """Microseconds per operation (span start to end, journal calls included) and, of that, in the
    two journal calls alone."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import SpanKind

    tracer = TracerProvider().get_tracer("bench_journal")
    clock = time.perf_counter_ns
    totals, in_journal = [], []
    for number in range(WARMUPS + count):
        start = clock()
        span = tracer.start_span("ssh", kind=SpanKind.CLIENT, attributes={"process.executable.name": "ssh"})
        before = clock()
        if journal is not None:
            journal.span_started(span, "subprocess")
        after = clock()
        span.set_attribute("process.exit.code", 0)
        span.end()
        before_end = clock()
        if journal is not None:
            journal.span_ended(span)
        end = clock()
        if number >= WARMUPS:
            totals.append((end - start) / 1000)
            in_journal.append((after - before + end - before_end) / 1000)
    return totals, in_journal


def storage_call(config: str, directory: Path) -> Callable[[], Any]:
    """One durable record with the storage `config` names."""
    from stallwatch.journal import Journal, frames
    from stallwatch.journal.writer import _intent_fields

    intent = intent_record()
    if config == "durable":
        journal = Journal(directory)
        return lambda: journal.cloud_intent(intent)
    record = {**_intent_fields(intent), "type": "intent", "wall_ns": time.time_ns(), "mono_ns": time.monotonic_ns()}
    if config == "append_fdatasync":
        fd = os.open(directory / "append.journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

        def append() -> None:
            os.write(fd, frames.encode(record))
            os.fdatasync(fd)

        return append
    connection = sqlite3.connect(directory / "journal.db", isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={'FULL' if config == 'sqlite_wal_full' else 'NORMAL'}")
    connection.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, body TEXT)")
    return lambda: connection.execute("INSERT INTO records (body) VALUES (?)", (json.dumps(record),))


def worker(config: str, ops: int, base: Path) -> dict[str, Any]:
    """Run one configuration in this (fresh) interpreter and return its raw numbers."""
    from stallwatch.journal import Journal

    directory = Path(tempfile.mkdtemp(prefix=f"{config}_", dir=base))
    journal = Journal(directory) if config == "buffered" else None
    count = ops // 10 if config in DURABLE else ops
    cpu_start = time.process_time()
    if config in DURABLE:
        samples, in_journal = timed(storage_call(config, directory), count), []
    else:
        samples, in_journal = span_series(journal, count)
    if journal is not None:
        journal.close()
    cpu_us = (time.process_time() - cpu_start) * 1e6 / (count + WARMUPS)
    dropped = journal.dropped if journal is not None else 0
    return {"config": config, "samples_us": [round(us, 2) for us in samples],
            "journal_us": [round(us, 2) for us in in_journal], "cpu_us": cpu_us, "dropped": dropped}  # fmt: skip


# ---- runner: interleaved rounds of workers, aggregation, report -------------------------------


def run_worker(config: str, ops: int, base: Path) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, str(ops), str(base)]
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=600, check=False)
    return worker_result(proc, f"worker {config}")


def schedule(rounds: int) -> Iterator[tuple[int, str]]:
    """(round, config) in run order: every round runs all configurations, rotated by one per round."""
    yield from rotated(CONFIGS, rounds)


@dataclass
class Row:
    config: str
    samples: int
    p50_us: float
    p99_us: float
    mean_us: float
    cpu_us: float
    dropped: int
    round_p50_us: list[float]
    journal_p50_us: float
    journal_p99_us: float


def summarize(runs: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for config in CONFIGS:
        mine = [run for run in runs if run["config"] == config]
        samples = [us for run in mine for us in run["samples_us"]]
        in_journal = [us for run in mine for us in run["journal_us"]] or [0.0, 0.0]
        rows.append(
            Row(
                config,
                len(samples),
                statistics.median(samples),
                p99(samples),
                statistics.fmean(samples),
                statistics.fmean(run["cpu_us"] for run in mine),
                sum(run["dropped"] for run in mine),
                [statistics.median(run["samples_us"]) for run in mine],
                statistics.median(in_journal),
                p99(in_journal),
            )
        )
    return rows


def filesystem(path: Path) -> str:
    """The filesystem type and device `path` lives on (from df)."""
    proc = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False)
    fields = proc.stdout.splitlines()[-1].split() if proc.stdout else []
    return f"{fields[1]} on {fields[0]}" if len(fields) > 1 else "unknown"


def render_markdown(rows: list[Row], info: dict[str, Any], settings: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    by_config = {row.config: row for row in rows}
    hot_p50 = by_config["buffered"].p50_us - by_config["no_journal"].p50_us
    hot_p99 = by_config["buffered"].p99_us - by_config["no_journal"].p99_us
    lines = [
        "# Journal: cost per record in the calling thread",
        "",
        f"Generated by `{command_line(__file__, [])}` "
        f"(ops={settings['ops']} per buffered run, {settings['ops'] // 10} per durable run, after {WARMUPS} "
        f"warm-ups, rounds={settings['rounds']}). Each configuration runs in a fresh interpreter; runs are "
        "**interleaved** (every round runs all configurations, rotated by one per round) and samples are "
        "pooled per configuration. Times are per call, in microseconds; `cpu µs` is process CPU time per "
        "operation, flusher thread included.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"journals on {settings['filesystem']}; commit {info['git_commit']}; {info['date']}.",
        "",
        "| config | samples | p50 µs | p99 µs | mean µs | cpu µs | in journal calls p50 / p99 µs | dropped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.config} | {r.samples} | {r.p50_us:.2f} | {r.p99_us:.2f} | {r.mean_us:.2f} | {r.cpu_us:.2f} "
        f"| {f'{r.journal_p50_us:.2f} / {r.journal_p99_us:.2f}' if r.config == 'buffered' else '-'} | {r.dropped} |"
        for r in rows
    ]
    lines += [
        "",
        "Journal hot-path cost per operation (two buffered records), timed around the two calls: "
        f"{by_config['buffered'].journal_p50_us:.2f} µs at p50, {by_config['buffered'].journal_p99_us:.2f} µs "
        f"at p99; as the difference of whole operations (`buffered` - `no_journal`): {hot_p50:.2f} µs at p50, "
        f"{hot_p99:.2f} µs at p99.",
        f"Durable record: {by_config['durable'].p50_us:.0f} µs p50 / {by_config['durable'].p99_us:.0f} µs p99 "
        f"(preallocated framed file) against {by_config['append_fdatasync'].p50_us:.0f} / "
        f"{by_config['append_fdatasync'].p99_us:.0f} µs (growing file) and "
        f"{by_config['sqlite_wal_full'].p50_us:.0f} / {by_config['sqlite_wal_full'].p99_us:.0f} µs "
        "(SQLite WAL, synchronous=FULL).",
        "",
        "Median of each round's own p50 (µs), in round order, to show the run-to-run noise:",
        "",
    ]
    lines += [f"- {r.config}: " + ", ".join(f"{us:.2f}" for us in r.round_p50_us) for r in rows]
    return "\n".join(lines) + "\n"


def benchmark(ops: int, rounds: int, base: Path, out: Path) -> str:
    """Run every round, write raw/journal.json and journal.md into `out`, return the markdown."""
    info = machine_info(VERSIONED)
    runs = []
    for number, config in schedule(rounds):
        run = run_worker(config, ops, base)
        run["round"] = number
        runs.append(run)
        print(f"round {number} {config:<18} p50 {statistics.median(run['samples_us']):8.2f} µs", file=sys.stderr)
    rows = summarize(runs)
    settings = {"ops": ops, "warmups": WARMUPS, "rounds": rounds, "filesystem": filesystem(base)}
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "settings": settings, "summary": [asdict(r) for r in rows], "runs": runs}
    raw_path(out, "journal.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(rows, info, settings)
    (out / "journal.md").write_text(markdown)
    return markdown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ops", type=int, help="operations per buffered run (default 5000; 1000 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: few operations, one round")
    parser.add_argument("--dir", type=Path, help="where journals are written (default: a fresh temp dir)")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "OPS", "DIR"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        config, ops, base = args.worker
        print(json.dumps(worker(config, int(ops), Path(base))))
        return
    ops = args.ops or (1000 if args.quick else 5000)
    rounds = args.rounds or (1 if args.quick else 3)
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench_journal_"))
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_journal_out_")) if args.quick else DEFAULT_OUT)
    print(benchmark(ops, rounds, base, out))
    print(f"results: {raw_path(out, 'journal.json')}, {out / 'journal.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
