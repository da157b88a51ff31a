"""Scenario for the Cloud calls dashboard: Nebius SDK calls against stallwatch's fake Nebius server.

Usage: python dash_cloud.py
Creates an instance and a disk, gets them (OK, then NOT_FOUND, then a slow call in flight), deletes
the instance: calls by method and status, latency, calls in flight, resources created and deleted.
"""

import stallwatch

stallwatch.setup(watchdog=False)

import asyncio
import contextlib

from dash_common import done, ready
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

from stallwatch.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for


async def calls(fake: FakeNebius, sdk) -> None:
    instances = InstanceServiceClient(sdk)
    for round_ in range(3):
        op = await instances.create(
            CreateInstanceRequest(
                metadata=ResourceMetadata(name=f"vm-{round_}", parent_id="project-e00test"),
                spec=InstanceSpec(resources=ResourcesSpec(platform="gpu-h200-sxm", preset="1gpu-16vcpu-200gb")),
            ),
            timeout=5,
        )
        await op.wait(interval=0.02, timeout=5)
        await instances.get(GetInstanceRequest(id=op.resource_id), timeout=5)
        with contextlib.suppress(RequestError):  # NOT_FOUND
            await instances.get(GetInstanceRequest(id="computeinstance-nope"), timeout=5)
        await DiskServiceClient(sdk).create(
            CreateDiskRequest(
                metadata=ResourceMetadata(name=f"d-{round_}", parent_id="project-e00test"), spec=DiskSpec()
            ),
            timeout=5,
        )
        fake.delay_next(f"{INSTANCE_SERVICE}/Get", 2.5)
        await instances.get(GetInstanceRequest(id=op.resource_id), timeout=10)  # in flight across scrapes
        await instances.delete(DeleteInstanceRequest(id=op.resource_id), timeout=5)
        await asyncio.sleep(1.0)


async def run(fake: FakeNebius) -> None:
    sdk = sdk_for(fake.address)
    await asyncio.to_thread(ready)
    await calls(fake, sdk)
    await sdk.close()
    await asyncio.to_thread(done)


with FakeNebius() as fake:
    asyncio.run(run(fake))
stallwatch.shutdown(timeout=5)
