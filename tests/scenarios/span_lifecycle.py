"""Scenario: a host reads its spans right after each instrumented call returns, as a test or a flush would.

Usage: python span_lifecycle.py OWNER PROCESSOR GROUP [ARGS...]
OWNER: `stallwatch` (setup() builds the providers; the host adds its processor to stallwatch's tracer
provider) or `host` (the host builds and installs a TracerProvider and a MeterProvider with an
in-memory reader before setup(), with STALLWATCH_PROVIDERS=host).
PROCESSOR: `simple` (SimpleSpanProcessor: a span is exported when it ends) or `batch`
(BatchSpanProcessor that never exports on its own: the tracer provider's `force_flush()` right after
the call exports what has ended).
GROUP: `subprocess`, `loop` (ARGS: asyncio|uvloop; STALLWATCH_UVLOOP_SPAWN from the environment),
`nebius`, `executor`, `ssh` (ARGS: USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR) or `metrics`.

Each call runs inside a host span named after the case; right after it returns (or raises), the
scenario reads the in-memory exporter and keeps the spans of that call's trace. Prints one JSON line:
{case: [span, ...]} with each span's name, parent name, ended flag, attributes, status and event names,
and "returned_ns" per case; `metrics` prints the histogram counts read right after
`force_flush()` of the meter provider.
"""

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import stallwatch  # first, as a server's first import

owner, processor_kind, group, *args = sys.argv[1:]

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
span_processor = (
    SimpleSpanProcessor(exporter)
    if processor_kind == "simple"
    else BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000, max_export_batch_size=512)
)
file_dir = tempfile.mkdtemp(prefix="span-lifecycle-")
# Registered before setup(), so it runs after stallwatch's own exit hook has written its last files.
atexit.register(shutil.rmtree, file_dir, ignore_errors=True)
reader = None
if owner == "host":
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(span_processor)
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    stallwatch.setup(providers="host", watchdog=False)
else:
    stallwatch.setup(file_dir=file_dir, watchdog=False, metric_export_interval_ms=3_600_000)
    tracer_provider = trace.get_tracer_provider()
    tracer_provider.add_span_processor(span_processor)

tracer = trace.get_tracer("host")
found: dict[str, object] = {}


def summary(span, names):
    return {
        "name": span.name,
        "parent": names.get(span.parent.span_id) if span.parent else None,
        "ended": span.end_time is not None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {key: value for key, value in span.attributes.items()},
        "status": span.status.status_code.name,
        "events": [event.name for event in span.events],
    }


def read(case, case_span):
    """What the exporter holds of `case`'s trace now, right after its call returned."""
    returned_ns = time.time_ns()
    if processor_kind == "batch":
        tracer_provider.force_flush()
    trace_id = case_span.get_span_context().trace_id
    spans = [span for span in exporter.get_finished_spans() if span.context.trace_id == trace_id]
    names = {span.context.span_id: span.name for span in spans}
    names[case_span.get_span_context().span_id] = case
    found[case] = {"returned_ns": returned_ns, "spans": [summary(span, names) for span in spans]}


class Case:
    """`with Case("label") as case: <call>; case.read()`: the call inside the host span `label`."""

    def __init__(self, label):
        self.label = label

    def __enter__(self):
        self._manager = tracer.start_as_current_span(self.label)
        self.span = self._manager.__enter__()
        return self

    def read(self):
        read(self.label, self.span)

    def __exit__(self, *exc_info):
        return self._manager.__exit__(*exc_info)


# ---- subprocess.Popen and os.posix_spawn, called synchronously ---------------------------------------


def subprocess_calls():
    with Case("run") as case:
        subprocess.run(["sh", "-c", "exit 3"])
        case.read()
    with Case("check_output") as case:
        subprocess.check_output(["echo", "hi"])
        case.read()
    with Case("popen_wait") as case:
        subprocess.Popen(["true"]).wait()
        case.read()
    with Case("popen_poll") as case:
        child = subprocess.Popen(["true"])
        while child.poll() is None:
            time.sleep(0.001)
        case.read()
    with Case("communicate") as case:
        subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE).communicate(b"x")
        case.read()
    with Case("killed") as case:
        child = subprocess.Popen(["sleep", "30"])
        child.kill()
        child.wait()
        case.read()
    with Case("spawn_failed") as case:
        try:
            subprocess.run(["/nonexistent/stallwatch-missing"])
        except FileNotFoundError:
            case.read()
    with Case("posix_spawn") as case:
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 5"], os.environ)
        os.waitpid(pid, 0)
        case.read()


# ---- a loop's subprocess_exec / subprocess_shell ------------------------------------------------------


async def next_turn_with(condition):
    """Yield one loop turn at a time until `condition()` holds (at most 30 s)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0)


async def loop_calls():
    with Case("exec_wait") as case:
        child = await asyncio.create_subprocess_exec("sh", "-c", "exit 4")
        await child.wait()
        case.read()
    with Case("exec_communicate") as case:
        child = await asyncio.create_subprocess_exec("cat", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        await child.communicate(b"x")
        case.read()
    with Case("shell_wait") as case:
        child = await asyncio.create_subprocess_shell("exit 6")
        await child.wait()
        case.read()
    # The exit seen on the loop turn that set the return code, before the loop's `process_exited`: a
    # loop turn at a time (`sleep(0)`) until the transport has it, then `wait()`, or `returncode` itself.
    with Case("wait_after_exit") as case:
        child = await asyncio.create_subprocess_exec("sh", "-c", "exit 7")
        await next_turn_with(lambda: child._transport.get_returncode() is not None)
        await child.wait()
        case.read()
    with Case("returncode_read") as case:
        child = await asyncio.create_subprocess_exec("sh", "-c", "exit 8")
        await next_turn_with(lambda: child.returncode is not None)
        case.read()
    with Case("never_waited") as case:  # nobody waits: the span ends when the loop hears of the exit
        child = await asyncio.create_subprocess_exec("true")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            if child.returncode is not None:
                case.read()
                break


# ---- Nebius: the real SDK against the fake server ----------------------------------------------------


async def nebius_calls(address):
    from nebius.aio.service_error import RequestError
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import (
        CreateInstanceRequest,
        DeleteInstanceRequest,
        GetInstanceRequest,
        InstanceServiceClient,
        InstanceSpec,
        ResourcesSpec,
    )

    from support.fake_nebius import sdk_for

    async with sdk_for(address) as sdk:
        instances = InstanceServiceClient(sdk)
        with Case("create") as case:
            spec = InstanceSpec(resources=ResourcesSpec(platform="gpu-h200-sxm", preset="1gpu-16vcpu-200gb"))
            metadata = ResourceMetadata(name="vm-1", parent_id="project-e00test")
            operation = await instances.create(CreateInstanceRequest(metadata=metadata, spec=spec), timeout=5)
            case.read()
        with Case("operation_wait") as case:
            await operation.wait(interval=0.02, timeout=5)
            case.read()
        with Case("get") as case:
            await instances.get(GetInstanceRequest(id=operation.resource_id), timeout=5)
            case.read()
        with Case("get_missing") as case:
            try:
                await instances.get(GetInstanceRequest(id="computeinstance-missing"), timeout=5)
            except RequestError:
                case.read()
        with Case("delete") as case:
            await instances.delete(DeleteInstanceRequest(id=operation.resource_id), timeout=5)
            case.read()


# ---- executor work items -------------------------------------------------------------------------------


async def executor_calls():
    with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
        with Case("submit") as case:
            pool.submit(sum, [1, 2]).result()
            case.read()
        with Case("run_in_executor") as case:
            await asyncio.get_running_loop().run_in_executor(pool, sum, [1, 2])
            case.read()
    with Case("to_thread") as case:
        await asyncio.to_thread(sum, [1, 2])
        case.read()


# ---- SSH tunnels: dstack's SSHTunnel against the loopback sshd -----------------------------------------


async def ssh_calls(user, host, port, identity, http_port, sock_dir):
    from support.ssh_tunnels import loopback_tunnel

    tunnel = loopback_tunnel(user, host, port, identity, http_port, Path(sock_dir) / "http.sock")
    with Case("aopen") as case:
        await tunnel.aopen()
        case.read()
    with Case("aclose") as case:
        await tunnel.aclose()
        case.read()
    with Case("open") as case:
        tunnel.open()
        case.read()
    with Case("close") as case:
        tunnel.close()
        case.read()


# ---- metrics: a meter provider's force_flush right after the calls -------------------------------------


def histogram_counts(metrics_data):
    counts = {}
    for resource_metrics in metrics_data.resource_metrics if metrics_data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = getattr(metric.data, "data_points", ())
                if points and hasattr(points[0], "bucket_counts"):
                    counts[metric.name] = counts.get(metric.name, 0) + sum(point.count for point in points)
    return counts


async def metric_calls(address):
    from nebius.aio.service_error import RequestError
    from nebius.api.nebius.compute.v1 import GetInstanceRequest, InstanceServiceClient

    from support.fake_nebius import sdk_for

    subprocess.run(["true"])
    running = subprocess.Popen(["sleep", "30"])
    async with sdk_for(address) as sdk:
        with contextlib.suppress(RequestError):
            await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-missing"), timeout=5)
        metrics.get_meter_provider().force_flush()
        if reader is not None:
            counts = histogram_counts(reader.get_metrics_data())
        else:
            counts = {}
            for line in (Path(file_dir) / "metrics.jsonl").read_text().splitlines():
                for resource in json.loads(line).get("resourceMetrics", []):
                    for scope in resource.get("scopeMetrics", []):
                        for metric in scope.get("metrics", []):
                            for point in metric.get("histogram", {}).get("dataPoints", []):
                                counts[metric["name"]] = counts.get(metric["name"], 0) + int(point.get("count", 0))
        found["histogram_counts"] = counts
    running.kill()
    running.wait()


if group == "subprocess":
    subprocess_calls()
elif group == "loop":
    if args[0] == "uvloop":
        import uvloop

        uvloop.run(loop_calls())
    else:
        asyncio.run(loop_calls())
elif group == "executor":
    asyncio.run(executor_calls())
elif group == "ssh":
    asyncio.run(ssh_calls(*args))
elif group in ("nebius", "metrics"):
    from support.fake_nebius import FakeNebius

    with FakeNebius() as fake:
        asyncio.run((nebius_calls if group == "nebius" else metric_calls)(fake.address))
print(json.dumps(found, default=str))
