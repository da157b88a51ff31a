"""Scenario: a control plane calls the real Nebius SDK (against stallwatch's fake server) with stallwatch on.

Usage: python nebius_calls.py FILE_DIR {before|after} {on|off}
`before`/`after`: nebius is imported before or after stallwatch.setup(); `off` runs with
STALLWATCH_INSTRUMENT_NEBIUS=false semantics (setup(instrument_nebius=False)).
Prints one JSON line with what each call returned or raised, so the test can compare on and off.
"""

import asyncio
import json
import sys
import threading
import time

import stallwatch

file_dir, order, mode = sys.argv[1:]
if order == "before":
    import nebius.aio.request
stallwatch.setup(file_dir=file_dir, watchdog=False, metric_export_interval_ms=3600000, instrument_nebius=(mode == "on"))

import grpc
from nebius.aio.service_error import RequestError
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    CreateDiskRequest,
    CreateInstanceRequest,
    DeleteInstanceRequest,
    DiskServiceClient,
    DiskSpec,
    GetInstanceRequest,
    InstanceServiceClient,
    InstanceSpec,
    ResourcesSpec,
)
from opentelemetry import trace

from support.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for

GET = f"{INSTANCE_SERVICE}/Get"
tracer = trace.get_tracer("control-plane")
result = {}


def outcome(error):
    status = getattr(error, "status", None)
    code = getattr(getattr(status, "code", None), "name", None)
    return ["raised", type(error).__name__, code]


async def main(fake, sdk):
    instances = InstanceServiceClient(sdk)
    with tracer.start_as_current_span("provision"):
        op = await instances.create(
            CreateInstanceRequest(
                metadata=ResourceMetadata(name="vm-1", parent_id="project-e00test"),
                spec=InstanceSpec(resources=ResourcesSpec(platform="gpu-h200-sxm", preset="1gpu-16vcpu-200gb")),
            ),
            timeout=5,
        )
        await op.wait(interval=0.02, timeout=5)
        result["create"] = [op.id.startswith("computeoperation-"), op.resource_id.startswith("computeinstance-")]
        result["ids"] = [op.id, op.resource_id]
    with tracer.start_as_current_span("retried"):
        fake.fail_next(GET, grpc.StatusCode.UNAVAILABLE)
        got = await instances.get(GetInstanceRequest(id=op.resource_id), timeout=5)
        result["retried"] = got.metadata.name
    with tracer.start_as_current_span("missing"):
        try:
            await instances.get(GetInstanceRequest(id="computeinstance-nope"), timeout=5)
        except RequestError as error:
            result["missing"] = outcome(error)
    with tracer.start_as_current_span("deadline"):
        fake.delay_next(GET, 3, times=5)
        try:
            await instances.get(GetInstanceRequest(id=op.resource_id), timeout=5, per_retry_timeout=0.3, retries=1)
        except RequestError as error:
            result["deadline"] = outcome(error)
    with tracer.start_as_current_span("cancelled"):
        fake.delay_next(GET, 3)
        gets = fake.count(GET)
        task = asyncio.ensure_future(instances.get(GetInstanceRequest(id=op.resource_id), timeout=10))
        deadline = time.monotonic() + 30
        while fake.count(GET) == gets:  # until the call is in flight: the fake sits on it
            assert time.monotonic() < deadline, "the call never reached the fake"
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            result["cancelled"] = "cancelled"
    with tracer.start_as_current_span("disk"):
        disk_op = await DiskServiceClient(sdk).create(
            CreateDiskRequest(metadata=ResourceMetadata(name="d", parent_id="project-e00test"), spec=DiskSpec()),
            timeout=5,
        )
        result["disk"] = disk_op.resource_id.startswith("computedisk-")
    return op.resource_id


def threads_and_bridge(sdk, resource_id):
    instances = InstanceServiceClient(sdk)
    names = []

    def worker(number):
        with tracer.start_as_current_span(f"thread-{number}"):
            names.append(instances.get(GetInstanceRequest(id=resource_id), timeout=5).wait().metadata.name)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result["threads"] = sorted(names)
    # dstack-style bridge: a sync caller awaits on a separate daemon loop thread.
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="daemon-loop").start()

    async def delete():
        return await instances.delete(DeleteInstanceRequest(id=resource_id), timeout=5)

    with tracer.start_as_current_span("bridge"):
        op = asyncio.run_coroutine_threadsafe(delete(), loop).result(10)
    result["deleted"] = op.resource_id == resource_id
    loop.call_soon_threadsafe(loop.stop)


with FakeNebius() as fake:
    sdk = sdk_for(fake.address)
    runner = asyncio.new_event_loop()
    resource = runner.run_until_complete(main(fake, sdk))
    threads_and_bridge(sdk, resource)
    runner.run_until_complete(sdk.close())
    runner.close()
    result["server_calls"] = fake.count(GET)
stallwatch.shutdown(10)
print(json.dumps(result))
