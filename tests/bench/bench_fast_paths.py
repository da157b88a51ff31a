"""Each fast path against the SDK object it replaces, and what it changes end to end.

Run from the repository root (a full run takes about six minutes)::

    .venvs/main/bin/python tests/bench/bench_fast_paths.py
    .venvs/main/bin/python tests/bench/bench_fast_paths.py --quick    # smoke test, writes to a temp dir

Options: ``--pairs P`` paired blocks per micro-benchmark (default 30), ``--items N`` executor items per
timed repeat (default 2000), ``--repeats K`` (default 5), ``--rounds R`` (default 8), ``--quick``
(8 pairs, 500 items, 2 repeats, 2 rounds), ``--out DIR`` (default ``tests/bench/results``). Writes
``fast_paths.md`` and ``raw/fast_paths.json`` (raw numbers and machine info) to the output directory.

Micro-benchmarks, in this interpreter: pairs of blocks, the fast path and the SDK's object in a seeded
random order within each pair; each pair gives a ratio (median fast / median SDK), reported as the
median ratio with its 95 % bootstrap interval (``_paired.summarize``).

- ``span``: ``light_span.start(...)`` + ``end()`` against ``Tracer.start_span(...)`` + ``end()``, a
  child of a sampled local span with three attributes (an executor item's span), on an SDK
  ``TracerProvider`` whose ``BatchSpanProcessor`` hands the spans to an exporter that drops them.
- ``span_protobuf``: a batch of 512 such spans to OTLP protobuf bytes, ``encode_spans_protobuf``
  against the SDK's ``encode_spans(...).SerializeToString()`` (the bytes are checked equal first).
- ``log_protobuf``: 512 log records from a ``LoggingHandler``, ``encode_logs_protobuf`` against
  ``encode_logs(...).SerializeToString()`` (bytes checked equal).
- ``histogram``: 4,096 durations with one attribute set handed over at a collection, as
  ``core.faults.Deferred`` does: ``OwnHistogram.record_values`` against a ``Histogram.record`` call per
  value on a ``MeterProvider`` with one cumulative reader.

End to end, fresh interpreters, each pinned to one CPU (the sink to another): the traced executor
``submit`` workload of ``bench_executor.py`` (a request span, ``pool.submit(noop).result()`` on a
1-worker pool), ``stallwatch.setup()`` exporting traces and metrics (every second) over OTLP/HTTP
protobuf to a local sink that answers 200. Configurations: ``all_on`` (the defaults), and one with
each fast path off. stallwatch has no setting for any of them, so the worker turns one off before
``setup()`` by replacing the module function that chooses it (``light_span.start`` by the tracer's
own ``start_span``; ``span_protobuf.with_fast_encoding`` by the identity; ``histograms.activate`` by
a no-op, which keeps the SDK's histograms, as a delta temporality preference does). Rounds run the
configurations in an order rotated by one; reported: µs of wall time and of process CPU (every
thread: the export threads included) per item, the median of all timed repeats, and per round the
ratio of each configuration's CPU to `all_on`'s (median, 95 % bootstrap interval). A fast path
earns its place when the item costs >= 10 % more CPU with it off.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import clean_env, machine_info, raw_path
from _paired import ratio_interval, summarize

HERE = Path(__file__).resolve().parent
CONFIGS = ("all_on", "light_span_off", "protobuf_off", "histograms_off")
ATTRIBUTES = {"stallwatch.executor.name": "runner", "thread.name": "runner_0", "code.function": "noop"}
BATCH = 512
PAIRED_PROCESSES = 3
PAIRED_ITEMS = 1000  # per block
EARNS = 1 / 0.9  # the item costs >= 10 % more with the fast path off
VALUES = 4096


def _blocks(fast: Callable[[], object], sdk: Callable[[], object], pairs: int, number: int, seed: int) -> Any:
    """`pairs` (fast, sdk) pairs of blocks of `number` calls; µs per call of each block."""
    rng = random.Random(seed)
    result = []
    for _ in range(pairs):
        timed: dict[str, list[float]] = {"fast": [], "sdk": []}
        order = ["fast", "sdk"]
        rng.shuffle(order)
        for side in order:
            call = fast if side == "fast" else sdk
            for _ in range(3):  # per block: three samples of `number` calls
                started = time.perf_counter()
                for _ in range(number):
                    call()
                timed[side].append((time.perf_counter() - started) / number * 1e6)
        result.append((timed["fast"], timed["sdk"]))
    return result


def _tracing() -> tuple[Any, Any]:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=65_536, schedule_delay_millis=200))
    return provider, trace


def micro_span(pairs: int, seed: int) -> Any:
    from stallwatch.core import light_span

    provider, trace = _tracing()
    tracer = provider.get_tracer("bench")
    parent = tracer.start_span("request")
    context = trace.set_span_in_context(parent)
    parent_context = parent.get_span_context()

    def fast() -> None:
        light_span.start(tracer, "executor item", context, ATTRIBUTES, parent=parent_context).end()

    def sdk() -> None:
        tracer.start_span("executor item", context=context, attributes=ATTRIBUTES).end()

    assert type(light_span.start(tracer, "probe", context, ATTRIBUTES, parent=parent_context)) is light_span.LightSpan
    try:
        return _blocks(fast, sdk, pairs, 2000, seed)
    finally:
        provider.shutdown()


def _finished_spans() -> list[Any]:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    with tracer.start_as_current_span("request"):
        for _ in range(BATCH):
            with tracer.start_as_current_span("executor item", attributes=ATTRIBUTES) as span:
                span.set_status(trace.StatusCode.OK)
    return list(exporter.get_finished_spans())[:BATCH]


def micro_span_protobuf(pairs: int, seed: int) -> Any:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from stallwatch.export.span_protobuf import encode_spans_protobuf

    spans = _finished_spans()
    assert encode_spans_protobuf(spans) == encode_spans(spans).SerializeToString()
    return _blocks(
        lambda: encode_spans_protobuf(spans), lambda: encode_spans(spans).SerializeToString(), pairs, 5, seed
    )


def _finished_logs() -> list[Any]:
    import warnings

    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs import export as log_export

    # SDK 1.45 renamed the in-memory exporter; the old name warns
    exporter_class = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
    exporter = exporter_class()
    provider = LoggerProvider()
    provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(exporter))
    with warnings.catch_warnings():  # SDK 1.45 deprecates its handler
        warnings.simplefilter("ignore", DeprecationWarning)
        handler = LoggingHandler(logger_provider=provider)
    logger = logging.getLogger("bench.fast_paths")
    logger.propagate = False
    logger.addHandler(handler)
    for number in range(BATCH):
        logger.warning("executor worker %s died", number, extra={"stallwatch.executor.name": "runner"})
    logger.removeHandler(handler)
    return list(exporter.get_finished_logs())


def micro_log_protobuf(pairs: int, seed: int) -> Any:
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

    from stallwatch.export.log_protobuf import encode_logs_protobuf

    batch = _finished_logs()
    assert encode_logs_protobuf(batch) == encode_logs(batch).SerializeToString()
    return _blocks(lambda: encode_logs_protobuf(batch), lambda: encode_logs(batch).SerializeToString(), pairs, 5, seed)


def micro_histogram(pairs: int, seed: int) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stallwatch import telemetry
    from stallwatch.core.faults import instrument
    from stallwatch.core.histograms import OwnHistogram

    metric = telemetry.EXECUTOR_RUN_DURATION
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    sdk_histogram = instrument(provider.get_meter("bench"), metric)
    own = OwnHistogram(metric)
    rng = random.Random(seed)
    values = [rng.lognormvariate(-9, 1.5) for _ in range(VALUES)]

    def sdk() -> None:
        for value in values:
            sdk_histogram.record(value, ATTRIBUTES)

    blocks = _blocks(lambda: own.record_values(values, ATTRIBUTES), sdk, pairs, 1, seed)
    provider.shutdown()
    return [([v / VALUES * 1e3 for v in fast], [v / VALUES * 1e3 for v in slow]) for fast, slow in blocks]  # ns/value


# ---- end to end ----------------------------------------------------------------------------------

WORKER = r"""
import json, os, sys, time
config, items, repeats, cpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.sched_setaffinity(0, {cpu})  # before any thread starts: they all inherit it
import stallwatch
if config == "light_span_off":
    from stallwatch.core import light_span

    def start(tracer, name, context, attributes, kind=None, start_time=None, parent=None, shed=False):
        kind = light_span.SpanKind.INTERNAL if kind is None else kind
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)

    light_span.start = start
elif config == "protobuf_off":
    from stallwatch.export import log_protobuf, span_protobuf

    span_protobuf.with_fast_encoding = log_protobuf.with_fast_encoding = lambda exporter_class: exporter_class
elif config == "histograms_off":
    from stallwatch.core import histograms

    histograms.activate = lambda resource: None
stallwatch.setup(
    traces_exporter="otlp", metrics_exporter="otlp", logs_exporter="none", metric_export_interval_ms=1000,
    watchdog=False,
)
from concurrent.futures import ThreadPoolExecutor
from opentelemetry import trace

tracer = trace.get_tracer("bench")
pool = ThreadPoolExecutor(max_workers=1)


def noop():
    return None


def run(count):
    for _ in range(count):
        with tracer.start_as_current_span("request"):
            pool.submit(noop).result()


run(min(items, 500))
if config == "paired":  # pairs of blocks, each fast path switched off and on in this interpreter
    import random
    from stallwatch.export import span_protobuf
    from stallwatch.core import light_span

    def sdk_start(tracer, name, context, attributes, kind=light_span.SpanKind.INTERNAL, start_time=None, **_):
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)

    def refuse(spans):
        raise span_protobuf._Unsupported("the SDK's encoder, for this block")  # the exporter falls back

    switches = {
        "light_span": (light_span, "start", light_span.start, sdk_start),
        "span_protobuf": (span_protobuf, "encode_spans_protobuf", span_protobuf.encode_spans_protobuf, refuse),
    }
    rng = random.Random(cpu)
    found = {series: [] for series in switches}
    for _ in range(repeats):
        for series, (module, name, fast, slow) in switches.items():
            timed = {}
            for on in rng.sample([True, False], 2):
                setattr(module, name, fast if on else slow)
                run(50)  # settle
                started = time.process_time()
                run(items)
                timed[on] = (time.process_time() - started) / items * 1e6
            setattr(module, name, fast)
            found[series].append([timed[False], timed[True]])
    pool.shutdown()
    stallwatch.shutdown(5)
    print(json.dumps(found))
    sys.exit(0)
wall, cpu_time = [], []
for _ in range(repeats):
    started, started_cpu = time.perf_counter(), time.process_time()
    run(items)
    wall.append((time.perf_counter() - started) / items * 1e6)
    cpu_time.append((time.process_time() - started_cpu) / items * 1e6)
pool.shutdown()
stallwatch.shutdown(5)
print(json.dumps({"wall": wall, "cpu": cpu_time}))
"""

SINK = r"""
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
os.sched_setaffinity(0, {int(sys.argv[1])})


class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def end_to_end(items: int, repeats: int, rounds: int, pairs: int) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpu, sink_cpu = cpus[-1], cpus[0]
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(sink_cpu)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        env = {
            **clean_env(),
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        runs: dict[str, list[dict[str, list[float]]]] = {config: [] for config in CONFIGS}  # per round
        for number in range(rounds):
            order = CONFIGS[number % len(CONFIGS) :] + CONFIGS[: number % len(CONFIGS)]
            for config in order:
                command = [sys.executable, "-c", WORKER, config, str(items), str(repeats), str(worker_cpu)]
                proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
                if proc.returncode != 0:
                    raise RuntimeError(f"{config} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                runs[config].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        paired: dict[str, list[list[float]]] = {}
        for _ in range(PAIRED_PROCESSES):
            command = [sys.executable, "-c", WORKER, "paired", str(PAIRED_ITEMS), str(pairs), str(worker_cpu)]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"paired failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            for series, found in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                paired.setdefault(series, []).extend(found)
    finally:
        sink.kill()
        sink.wait()
    return {"pinned_cpu": worker_cpu, "sink_cpu": sink_cpu, "runs": runs, "paired": paired}


# ---- results -------------------------------------------------------------------------------------

MICRO = {
    "span": ("µs per span (start + end)", micro_span),
    "span_protobuf": (f"µs per batch of {BATCH} spans", micro_span_protobuf),
    "log_protobuf": (f"µs per batch of {BATCH} log records", micro_log_protobuf),
    "histogram": ("ns per value", micro_histogram),
}
REPLACES = {"light_span_off": "span", "protobuf_off": "span_protobuf, log_protobuf", "histograms_off": "histogram"}


def _round_medians(rounds: list[dict[str, list[float]]]) -> str:
    return ", ".join(f"{statistics.median(found['cpu']):.1f}" for found in rounds)


def report(micro: dict[str, Any], e2e: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Fast paths against the SDK objects they replace",
        "",
        "Generated by `.venvs/main/bin/python tests/bench/bench_fast_paths.py"
        f"{' --quick' if args.quick else ''}`; see its docstring for what each row does.",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; "
        + ", ".join(f"{name} {version}" for name, version in info["versions"].items())
        + f"; commit {info['git_commit']}{' (sources changed)' if info['git_dirty'] else ''}; "
        f"load {' '.join(info['loadavg'])}; {info['date']}.",
        "",
        "**Micro-benchmarks** (one interpreter, paired blocks; ratio = fast path / SDK, the median of the "
        "per-pair ratios with its 95 % bootstrap interval):",
        "",
        "| fast path | unit | pairs | SDK p50 | fast p50 | ratio | 95 % interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, summary in micro.items():
        low, high = summary["ratio_ci95"]
        lines.append(
            f"| {name} | {MICRO[name][0]} | {summary['pairs']} | {summary['off_p50_us']:.2f} "
            f"| {summary['on_p50_us']:.2f} | {summary['ratio']:.3f}x | {low:.3f} to {high:.3f} |"
        )
    runs = e2e["runs"]

    def pooled(config: str, kind: str) -> float:
        return statistics.median(value for found in runs[config] for value in found[kind])

    lines += [
        "",
        f"**End to end**: the traced executor `submit` workload exporting over OTLP/HTTP, each interpreter "
        f"pinned to CPU {e2e['pinned_cpu']} (the sink on CPU {e2e['sink_cpu']}); {args.items} items per "
        f"repeat, {args.repeats} repeats, {args.rounds} rounds. µs per item, the median of every timed repeat. "
        "`off / all_on`: per round, the configuration's median CPU µs over `all_on`'s in the same round; the "
        "median of those ratios with its 95 % bootstrap interval. A fast path earns its place when it makes "
        "the item >= 10 % cheaper in CPU, i.e. the ratio >= 1.111 (on a shared machine the wall time also "
        "holds the waits for the CPU): `yes` when the whole interval is at or above, `no` when it is all "
        "below, else `undecided`.",
        "",
        "| configuration | replaces | wall µs | CPU µs | CPU off / all_on | 95 % interval | all_on cheaper by "
        "| >= 10 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config in CONFIGS:
        wall, cpu = pooled(config, "wall"), pooled(config, "cpu")
        if config == "all_on":
            lines.append(f"| all_on | | {wall:.2f} | {cpu:.2f} | | | | |")
            continue
        ratios = [
            statistics.median(off["cpu"]) / statistics.median(on["cpu"])
            for off, on in zip(runs[config], runs["all_on"], strict=True)
        ]
        found = ratio_interval(ratios)
        low, high = found["ratio_ci95"]
        earned = "yes" if low >= EARNS else "no" if high < EARNS else "undecided"
        lines.append(
            f"| {config} | {REPLACES[config]} | {wall:.2f} | {cpu:.2f} | {found['ratio']:.3f} "
            f"| {low:.3f} to {high:.3f} | {1 - 1 / found['ratio']:.1%} | {earned} |"
        )
    lines += [
        "",
        f"**End to end, paired**: {PAIRED_PROCESSES} interpreters set up as `all_on` (pinned as above) alternate "
        f"pairs of blocks of {PAIRED_ITEMS} items with one fast path off and on, in a seeded random order "
        "(`light_span.start` replaced by the tracer's `start_span`; `encode_spans_protobuf` replaced by a "
        "function that refuses every batch, so the exporter falls back to the SDK's encoder). Each pair "
        "gives the ratio of CPU µs per item off / on. The histograms cannot be switched inside an "
        "interpreter (each histogram picks its aggregation when it is made).",
        "",
        "| fast path | pairs | on CPU µs | off CPU µs | off / on | 95 % interval | on cheaper by | >= 10 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for series, found in e2e["paired"].items():
        summary = summarize([([off], [on]) for off, on in found])  # "on" of `summarize` = the fast path off
        low, high = summary["ratio_ci95"]
        earned = "yes" if low >= EARNS else "no" if high < EARNS else "undecided"
        lines.append(
            f"| {series} | {summary['pairs']} | {summary['off_p50_us']:.2f} | {summary['on_p50_us']:.2f} "
            f"| {summary['ratio']:.3f} | {low:.3f} to {high:.3f} | {1 - 1 / summary['ratio']:.1%} | {earned} |"
        )
    lines += [
        "",
        "Per configuration, the median CPU µs of each round, in round order (run-to-run noise):",
        "",
        *[f"- {config}: {_round_medians(runs[config])}" for config in CONFIGS],
        "",
        "Not measured here: the spawn benchmark with each fast path off (a child's span is a `LightSpan` too; "
        "its encoding and durations go the same ways).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.items, args.repeats, args.rounds = 8, 500, 2, 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench-fast-paths-")) if args.quick else HERE / "results")
    micro = {}
    for name, (_, bench) in MICRO.items():
        print(f"micro {name} ...", flush=True)
        micro[name] = summarize(bench(args.pairs, seed=len(name)))
    print("end to end ...", flush=True)
    e2e = end_to_end(args.items, args.repeats, args.rounds, args.pairs)
    info = machine_info(("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http", "wrapt"))
    raw_path(out, "fast_paths.json").write_text(json.dumps({"machine": info, "micro": micro, "end_to_end": e2e}))
    (out / "fast_paths.md").write_text(report(micro, e2e, info, args))
    print(out / "fast_paths.md")


if __name__ == "__main__":
    main()
