"""Scenario for the Cloud calls dashboard: Nebius SDK calls against stallwatch's fake Nebius server.

Usage: python dash_cloud.py
First a host is killed while its create is in flight, and this process's setup() replays its
journal: one unconfirmed create (a leak candidate). Then it creates an instance and a disk, gets
them (OK, then NOT_FOUND, then a slow call in flight until a scrape sees it), deletes the instance: calls by method and
status, latency, calls in flight, resources created and deleted.
"""

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

import stallwatch  # first: the gRPC fork guard before grpc loads
from stallwatch.demo_incidents import command
from support.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for

scratch = tempfile.mkdtemp(prefix="dash-cloud-")
atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # after stallwatch's own exit handlers (LIFO)
journal_dir = os.path.join(scratch, "journal")
with FakeNebius() as killed_cloud:
    killed_cloud.delay_next(f"{INSTANCE_SERVICE}/Create", 60)
    env = {**os.environ, "STALLWATCH_JOURNAL_DIR": journal_dir, "OTEL_METRICS_EXPORTER": "none",
           "OTEL_TRACES_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}  # fmt: skip
    host = subprocess.Popen(command("create", os.path.join(scratch, "killed-host"), killed_cloud.address), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    host.stdout.readline()  # {"creating": true}
    time.sleep(1.0)
    host.send_signal(signal.SIGKILL)
    host.wait(10)
stallwatch.setup(watchdog=False, journal_dir=journal_dir)  # replays the killed host: a leak candidate

from dash_common import done, hold, ready
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
        if round_ == 0:  # a call in flight until a scrape has seen it, then cancelled by its caller
            fake.delay_next(f"{INSTANCE_SERVICE}/Get", 300)
            slow = asyncio.ensure_future(instances.get(GetInstanceRequest(id=op.resource_id), timeout=300))
            await asyncio.to_thread(hold, "call")
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError, RequestError):
                await slow
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
