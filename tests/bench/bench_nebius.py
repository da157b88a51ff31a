"""Nebius instrumentation overhead: latency of one SDK call against the fake server, with and without.

Run from the repository root (a full run takes about a minute)::

    .venvs/main/bin/python tests/bench/bench_nebius.py            # tests/bench/results/nebius.md, raw/nebius.json
    .venvs/main/bin/python tests/bench/bench_nebius.py --quick    # smoke test, writes to a temp dir

The peers must be installed in that environment (the bench stops first, naming what is missing)::

    .venvs/main/bin/pip install sentry-sdk ddtrace
    # its releases lag the SDK's and pin an older opentelemetry-instrumentation: without its dependencies
    .venvs/main/bin/pip install --no-deps opentelemetry-instrumentation-grpc

Options: ``--calls N`` timed calls per series and run (default 300, after 20 warm-ups), ``--rounds R``
(default 5), ``--pairs P`` and ``--processes K`` for the paired part (default 30 and 4), ``--quick``
(40 calls, 1 round, 4 pairs in 1 process), ``--out DIR``.

The fake Nebius server (`tests/support/fake_nebius.py`) runs in this process, on its own thread; each
configuration runs in a fresh interpreter that imports stallwatch first, calls
``stallwatch.setup(file_dir=<tmp>, watchdog=False)`` and drives the real SDK over loopback:

- ``instrumented``: the default (a span per call, attempt events, metrics, the ledger for creates);
- ``uninstrumented``: the same with ``STALLWATCH_INSTRUMENT_NEBIUS=false``;
- ``no_journal``: instrumented with ``STALLWATCH_JOURNAL=false`` (no durable ledger record): with
  ``instrumented``, shows what the journal's `fdatasync` of a create's intent costs;
- ``no_export``: instrumented with every exporter ``none`` and no journal: the spans, metrics and
  ledger log records are made but go nowhere, which leaves the wrapper's own work.

Series: ``get`` (``await InstanceServiceClient.get(...)``) and ``create`` (``await ...create(...)``,
which also writes the ledger's intent and outcome records). Runs are interleaved, rotated by one
per round, and samples pooled per configuration. Target: at most 5 % added latency per call.

The headline figure is the **paired** part (see ``_paired.py``): K fresh interpreters set up as
``instrumented`` and each runs P groups of three blocks of 25 calls in a shuffled order (``run_arms``):
everything off, the Nebius instrumentor on (``NebiusInstrumentor().instrument()`` /
``.uninstrument()``), and, with the instrumentor off, what a user would write instead
(``handmade_sdk_span``: an OpenTelemetry SDK span per call, started in the caller's context and
ended when the call returns, through the same provider; series ``get_sdk_span`` and
``create_sdk_span``). Each ratio's two sides share a process and each arm's on block shares its
group's off block, so the two arms are read side by side at the same moments; it reports the median
per-pair ratio with a 95 % bootstrap interval. The peers a user would pick instead run
likewise, K fresh interpreters each without stallwatch set up (``peer_worker``): sentry-sdk (series
``get_sentry``), ddtrace (``get_ddtrace``) and opentelemetry-instrumentation-grpc's `grpc.aio` client
interceptors on a stock SDK set-up (``get_otel_grpc``: a `TracerProvider` with a `BatchSpanProcessor`
whose exporter counts and drops), each alternating blocks of ``get`` on an SDK client with a plain
channel and one carrying the peer's gRPC client interceptors; each checks that its peer recorded
exactly one span per traced call and none on the plain one. The per-configuration runs
above take the cost apart (journal, export), with the noise of comparing separate processes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _machine import clean_env, machine_info, p99, raw_path, rotated, worker_result
from _paired import run_arms, run_blocks, run_processes, switch_for, verdict

CONFIGS = ("uninstrumented", "instrumented", "no_journal", "no_export")
ENV = {
    "uninstrumented": {"STALLWATCH_INSTRUMENT_NEBIUS": "false"},
    "no_journal": {"STALLWATCH_JOURNAL": "false"},
    "no_export": {"STALLWATCH_JOURNAL": "false"},
}
SERIES = ("get", "create")
WARMUPS = 20
BLOCK = 25
TARGET = 1.05
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("nebius", "grpcio", "opentelemetry-sdk", "stallwatch", "sentry-sdk", "ddtrace",
             "opentelemetry-instrumentation-grpc")  # fmt: skip


async def drive(address: str, measure: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> dict[str, Any]:
    """Each series against the fake server: `WARMUPS` calls, then what `measure(call)` returns."""
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import CreateInstanceRequest, GetInstanceRequest, InstanceServiceClient

    from support.fake_nebius import sdk_for

    async with sdk_for(address) as sdk:
        instances = InstanceServiceClient(sdk)

        async def create() -> Any:
            return await instances.create(
                CreateInstanceRequest(metadata=ResourceMetadata(name="bench", parent_id="project-bench")), timeout=10
            )

        resource = (await create()).resource_id

        async def get() -> Any:
            return await instances.get(GetInstanceRequest(id=resource), timeout=10)

        result: dict[str, Any] = {}
        for series, call in zip(SERIES, (get, create), strict=True):
            for _ in range(WARMUPS):
                await call()
            result[series] = await measure(call)
        return result


def worker(config: str, address: str, calls: int) -> dict[str, Any]:
    """One configuration in this fresh interpreter: per-call latency of each series, in ms."""
    import stallwatch

    file_dir = tempfile.mkdtemp(prefix="bench_nebius_")
    exporters = {f"{signal}_exporter": "none" for signal in ("traces", "metrics", "logs")}
    stallwatch.setup(file_dir=file_dir, watchdog=False, metric_export_interval_ms=3_600_000,
                     **(exporters if config == "no_export" else {}))  # fmt: skip

    async def timed(call: Callable[[], Awaitable[Any]]) -> list[float]:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await call()
            times.append((time.perf_counter() - start) * 1000)
        return times

    try:
        found = asyncio.run(drive(address, timed))
        return {"config": config, **{f"{series}_ms": times for series, times in found.items()}}
    finally:
        stallwatch.shutdown(10)
        shutil.rmtree(file_dir, ignore_errors=True)


def handmade_sdk_span() -> Callable[[bool], None]:
    """`switch` for `run_arms`: a span per call as a user would write it, on the method stallwatch
    wraps (the first await's coroutine): the SDK's `start_span` in the caller's context, `end()`
    with the status when the call returns."""
    import wrapt
    from nebius.aio.request import Request
    from opentelemetry import context, trace
    from opentelemetry.instrumentation.utils import unwrap
    from opentelemetry.trace import SpanKind, StatusCode

    tracer = trace.get_tracer("bench.handmade")

    def wrapper(wrapped: Any, request: Any, args: Any, kwargs: Any) -> Any:
        parent = context.get_current()

        async def call() -> Any:
            service, method = str(request._service), str(request._method)
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
            span = tracer.start_span(f"{service}/{method}", parent, SpanKind.CLIENT, attributes)
            try:
                result = await wrapped(*args, **kwargs)
            except BaseException as error:
                span.record_exception(error)
                span.set_status(StatusCode.ERROR)
                span.end()
                raise
            span.set_attribute("rpc.grpc.status_code", 0)
            span.end()
            return result

        return call()

    state = {"on": False}

    def switch(on: bool) -> None:
        if on == state["on"]:
            return
        state["on"] = on
        if on:
            wrapt.wrap_function_wrapper(Request, "_request_with_authorization_loop", wrapper)
        else:
            unwrap(Request, "_request_with_authorization_loop")

    return switch


def paired_worker(address: str, pairs: int, block: int, seed: int) -> dict[str, Any]:
    """The `instrumented` setup, in groups of blocks (µs per call): everything off, the Nebius instrumentor
    on, a hand-made SDK span per call on (`run_arms`)."""
    import stallwatch

    file_dir = tempfile.mkdtemp(prefix="bench_nebius_")
    stallwatch.setup(file_dir=file_dir, watchdog=False, metric_export_interval_ms=3_600_000)
    import nebius.aio.request  # noqa: F401 - the instrumentor wraps it now, and the hand-made span needs it

    from stallwatch.instrument.nebius import NebiusInstrumentor

    switches = {"": switch_for(NebiusInstrumentor()), "_sdk_span": handmade_sdk_span()}
    try:
        found = asyncio.run(drive(address, lambda call: run_arms(call, switches, pairs, block, seed)))
        for switch in switches.values():
            switch(False)
        return {f"{series}{arm}": found[series][arm] for arm in switches for series in found}
    finally:
        stallwatch.shutdown(10)
        shutil.rmtree(file_dir, ignore_errors=True)


PEERS = ("sentry", "ddtrace", "otel_grpc")
# peer: (the module it needs, how to install it)
PEER_PACKAGES = {
    "sentry": ("sentry_sdk", "pip install sentry-sdk"),
    "ddtrace": ("ddtrace", "pip install ddtrace"),
    "otel_grpc": ("opentelemetry.instrumentation.grpc", "pip install --no-deps opentelemetry-instrumentation-grpc"),
}


def enable_peer(peer: str, address: str) -> tuple[list[Any], Callable[[bool], None], Callable[[], int]]:
    """Turn on `peer` in this process. Returns (its gRPC aio client interceptors, for the SDK's
    `interceptors=`; `block(on)`, called before each block: for sentry, finishes the open transaction
    and starts the next, since its spans need one; `recorded()`, the peer's client spans finished so
    far, counted, then dropped before any network).

    The SDK's channels are `grpc.aio` ones, so the OpenTelemetry arm takes the contrib package's aio
    client interceptors (`aio_client_interceptors()`, what `GrpcAioInstrumentorClient` adds to each
    `grpc.aio` channel) on the stock `TracerProvider` + `BatchSpanProcessor`, set as the global one.

    The peers' documented switches (sentry's `GRPCIntegration`, `ddtrace.patch(grpc=True)`) wrap
    `grpc.aio.insecure_channel`, which breaks the SDK's channels: sentry passes `interceptors=` by
    keyword where the SDK passes it by position (TypeError), and ddtrace's interceptor runs first and
    hands the SDK's idempotency interceptor its metadata as a list (TypeError). So the same
    interceptors go in through the SDK's own option, after the SDK's. `nebius.aio.channel` binds
    `grpc.aio.insecure_channel` when it is imported: it is imported before `ddtrace.patch`, so that the
    SDK keeps the unpatched constructor and the plain channel carries no ddtrace interceptor."""
    count = [0]
    if peer == "sentry":
        import sentry_sdk
        from sentry_sdk.integrations.grpc.aio.client import (
            SentryUnaryStreamClientInterceptor,
            SentryUnaryUnaryClientInterceptor,
        )

        def drop(event: Any, hint: Any) -> None:
            count[0] += sum(span.get("op") == "grpc.client" for span in event.get("spans", []))

        sentry_sdk.init(dsn="http://public@127.0.0.1:9/1", traces_sample_rate=1.0, default_integrations=False,
                        before_send_transaction=drop)  # fmt: skip
        open_transaction: list[Any] = []

        def block(on: bool) -> None:
            if open_transaction:
                open_transaction.pop().__exit__(None, None, None)
            open_transaction.append(sentry_sdk.start_transaction(name="bench", op="bench"))
            open_transaction[-1].__enter__()

        def recorded() -> int:
            block(False)
            return count[0]

        return [SentryUnaryUnaryClientInterceptor(), SentryUnaryStreamClientInterceptor()], block, recorded
    if peer == "otel_grpc":
        from opentelemetry import trace
        from opentelemetry.instrumentation.grpc import aio_client_interceptors
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.trace import SpanKind

        class CountAndDrop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                count[0] += sum(span.kind is SpanKind.CLIENT for span in spans)
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(CountAndDrop()))
        trace.set_tracer_provider(provider)

        def flushed() -> int:
            provider.force_flush()
            return count[0]

        return aio_client_interceptors(), (lambda on: None), flushed
    os.environ.update(
        DD_TRACE_ENABLED="true",
        DD_TRACE_AGENT_URL="http://127.0.0.1:9",
        DD_INSTRUMENTATION_TELEMETRY_ENABLED="false",
        DD_REMOTE_CONFIGURATION_ENABLED="false",
    )
    import ddtrace
    import nebius.aio.channel  # noqa: F401 - before ddtrace.patch: see above
    from ddtrace.contrib.internal.grpc.aio_client_interceptor import create_aio_client_interceptors
    from ddtrace.trace import tracer

    class Drop:
        def process_trace(self, trace: list[Any]) -> None:
            count[0] += sum(span.name == "grpc" for span in trace)

    ddtrace.patch(grpc=True)
    tracer.configure(trace_processors=[Drop()])
    host, port = address.rsplit(":", 1)
    return list(create_aio_client_interceptors(host, int(port))), (lambda on: None), (lambda: count[0])


def peer_worker(peer: str, address: str, pairs: int, block: int, seed: int) -> dict[str, Any]:
    """Peer off / on in one interpreter (no stallwatch setup): SDK client A has a plain channel,
    client B one with the peer's interceptors; blocks of `get` alternate between A and B."""
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import CreateInstanceRequest, GetInstanceRequest, InstanceServiceClient

    from support.fake_nebius import sdk_for

    async def run() -> dict[str, Any]:
        interceptors, on_block, recorded = enable_peer(peer, address)
        async with sdk_for(address) as plain_sdk, sdk_for(address, interceptors=interceptors) as traced_sdk:
            plain, traced = InstanceServiceClient(plain_sdk), InstanceServiceClient(traced_sdk)
            request = CreateInstanceRequest(metadata=ResourceMetadata(name="bench", parent_id="project-bench"))
            resource = (await plain.create(request, timeout=10)).resource_id
            on_block(True)
            for sdk in (plain, traced):
                for _ in range(WARMUPS):
                    await sdk.get(GetInstanceRequest(id=resource), timeout=10)
            warm = recorded()
            if warm != WARMUPS:
                raise RuntimeError(f"{peer} recorded {warm} spans for {WARMUPS} calls on the traced client")
            client = [plain]

            def switch(on: bool) -> None:
                client[0] = traced if on else plain
                on_block(on)

            async def get() -> Any:
                return await client[0].get(GetInstanceRequest(id=resource), timeout=10)

            blocks = await run_blocks(get, switch, pairs, block, seed)
            spans = recorded() - warm
            expected = pairs * (block + 3)
            if spans != expected:
                raise RuntimeError(f"{peer} recorded {spans} spans for {expected} calls on the traced client")
            return {f"get_{peer}": blocks}

    return asyncio.run(run())


def run_paired(address: str, pairs: int, block: int, processes: int) -> dict[str, Any]:
    me = str(Path(__file__).resolve())
    commands = [[sys.executable, me, "--paired-worker", address, str(pairs), str(block), str(number)]
                for number in range(processes)]  # fmt: skip
    commands += [[sys.executable, me, "--peer-worker", peer, address, str(pairs), str(block), str(number)]
                 for number in range(processes) for peer in PEERS]  # fmt: skip
    return run_processes(commands, timeout=600)


def run_worker(config: str, address: str, calls: int) -> dict[str, Any]:
    env = {**clean_env(), **ENV.get(config, {})}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", config, address, str(calls)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    return worker_result(proc, f"worker {config}")


def summarize_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for series in SERIES:
        base: dict[str, float] = {}
        for config in CONFIGS:
            samples = [ms for run in runs if run["config"] == config for ms in run[f"{series}_ms"]]
            row = {
                "series": series,
                "config": config,
                "p50_ms": statistics.median(samples),
                "p99_ms": p99(samples),
                "mean_ms": statistics.fmean(samples),
                "round_p50_ms": [statistics.median(r[f"{series}_ms"]) for r in runs if r["config"] == config],
            }
            if config == "uninstrumented":
                base = row
            row["p50_ratio"] = row["p50_ms"] / base["p50_ms"]
            row["p99_ratio"] = row["p99_ms"] / base["p99_ms"]
            row["mean_ratio"] = row["mean_ms"] / base["mean_ms"]
            rows.append(row)
    return rows


def render_markdown(
    rows: list[dict[str, Any]], paired: dict[str, Any], info: dict[str, Any], settings: dict[str, Any]
) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    lines = [
        "# Nebius instrumentation overhead: one SDK call against the fake server on loopback",
        "",
        f"Generated by `tests/bench/bench_nebius.py` (calls={settings['calls']} after {WARMUPS} warm-ups, "
        f"rounds={settings['rounds']}, interleaved). Ratios: each configuration / uninstrumented "
        "(`STALLWATCH_INSTRUMENT_NEBIUS=false`), same run. Target: ≤ 1.05 (at most 5 % added per call). "
        "`no_journal`: instrumented, `STALLWATCH_JOURNAL=false`; `no_export`: instrumented, no journal, every "
        "exporter `none` (the wrapper's own work).",
        "",
        f"Machine: {info['nproc']} CPUs, Linux {info['kernel']}, Python {info['python']}; {versions}; "
        f"commit {info['git_commit']}; {info['date']}.",
        "",
        f"**Paired** ({settings['processes']} interpreters x {settings['pairs']} groups of blocks of {BLOCK} calls, "
        "the Nebius instrumentor switched on and off inside each; see `_paired.py`): median per-pair ratio "
        "on / off, its 95 % bootstrap interval, and the median added per call. `*_sdk_span`: a hand-made "
        "OpenTelemetry SDK span per call instead, in the same groups of blocks (off, stallwatch, hand-made "
        "span, shuffled), against the same off blocks. `get_sentry`, `get_ddtrace`, "
        f"`get_otel_grpc` (opentelemetry-instrumentation-grpc on a stock SDK set-up): {settings['processes']} "
        "more interpreters each, no stallwatch, blocks alternating between an SDK client with a plain channel "
        "and one with the peer's gRPC aio client interceptors (one span per call, counted and dropped).",
        "",
        f"| series | off p50 ms | on p50 ms | ratio | 95 % interval | added ms | ≤ {TARGET} |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {series} | {p['off_p50_us'] / 1000:.3f} | {p['on_p50_us'] / 1000:.3f} | {p['ratio']:.3f}x "
            f"| {p['ratio_ci95'][0]:.3f} to {p['ratio_ci95'][1]:.3f} | {p['added_us'] / 1000:+.3f} "
            f"| {verdict(p, TARGET)} |"
            for series, p in paired.items()
        ),
        "",
        "Per configuration, each in its own interpreter (interleaved rounds, samples pooled):",
        "",
        "| series | config | p50 ms | p99 ms | mean ms | p50 ratio | p99 ratio | mean ratio | round p50s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rounds = ", ".join(f"{ms:.3f}" for ms in r["round_p50_ms"])
        lines.append(
            f"| {r['series']} | {r['config']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} "
            f"| {r['p50_ratio']:.3f}x | {r['p99_ratio']:.3f}x | {r['mean_ratio']:.3f}x | {rounds} |"
        )
    return "\n".join(lines) + "\n"


def benchmark(calls: int, rounds: int, pairs: int, processes: int, block: int, out: Path) -> str:
    missing = [install for module, install in PEER_PACKAGES.values() if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"bench_nebius: peers missing from {sys.prefix}: {'; '.join(missing)}")
    import stallwatch  # noqa: F401 - the gRPC fork guard before grpc loads in this process
    from support.fake_nebius import FakeNebius

    info = machine_info(VERSIONED)
    runs = []
    with FakeNebius() as fake:
        for number, config in rotated(CONFIGS, rounds):
            run = run_worker(config, fake.address, calls)
            run["round"] = number
            runs.append(run)
            print(f"round {number} {config:<15} get p50 {statistics.median(run['get_ms']):.3f} ms", file=sys.stderr)
        paired = run_paired(fake.address, pairs, block, processes)
    rows = summarize_runs(runs)
    settings = {"calls": calls, "rounds": rounds, "warmups": WARMUPS, "pairs": pairs, "processes": processes,
                "block": block}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    raw_path(out, "nebius.json").write_text(json.dumps({"machine": info, "settings": settings, "paired": paired,
                                                 "summary": rows, "runs": runs}, indent=1) + "\n")  # fmt: skip
    markdown = render_markdown(rows, paired, info, settings)
    (out / "nebius.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, help="timed calls per series and run (default 300; 40 with --quick)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--out", type=Path, help="output directory (default tests/bench/results; temp with --quick)")
    parser.add_argument("--pairs", type=int, help="paired: block pairs per interpreter (default 30; 4 with --quick)")
    parser.add_argument("--processes", type=int, help="paired part: interpreters (default 4; 1 with --quick)")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "ADDRESS", "N"), help=argparse.SUPPRESS)
    paired_metavar = ("ADDRESS", "PAIRS", "BLOCK", "SEED")
    parser.add_argument("--paired-worker", nargs=4, metavar=paired_metavar, help=argparse.SUPPRESS)
    parser.add_argument("--peer-worker", nargs=5, metavar=("PEER", *paired_metavar), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker or args.paired_worker or args.peer_worker:
        if args.peer_worker:
            peer, address, pairs, block, seed = args.peer_worker
            print(json.dumps(peer_worker(peer, address, int(pairs), int(block), int(seed))))
        elif args.worker:
            config, address, calls = args.worker
            print(json.dumps(worker(config, address, int(calls))))
        else:
            address, pairs, block, seed = args.paired_worker
            print(json.dumps(paired_worker(address, int(pairs), int(block), int(seed))))
        sys.stdout.flush()
        os._exit(0)
    calls = args.calls or (40 if args.quick else 300)
    rounds = args.rounds or (1 if args.quick else 5)
    pairs = args.pairs or (4 if args.quick else 30)
    processes = args.processes or (1 if args.quick else 4)
    block = 10 if args.quick else BLOCK
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_nebius_")) if args.quick else DEFAULT_OUT)
    print(benchmark(calls, rounds, pairs, processes, block, out))
    print(f"results: {raw_path(out, 'nebius.json')}, {out / 'nebius.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
