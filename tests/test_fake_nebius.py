"""The real `nebius` SDK against `support.fake_nebius`, on loopback; no stallwatch instrumentation involved."""

from __future__ import annotations

import asyncio
import contextvars
import re
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import stallwatch  # noqa: F401 - first, so its gRPC fork guard runs before grpc loads

# isort: split
import grpc
import pytest
from nebius.aio.service_error import RequestError
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    CreateDiskRequest,
    CreateInstanceRequest,
    DeleteDiskRequest,
    DeleteInstanceRequest,
    DiskServiceClient,
    DiskSpec,
    GetDiskRequest,
    GetInstanceRequest,
    InstanceServiceClient,
    InstanceSpec,
    ListInstancesRequest,
    ResourcesSpec,
)

from support.fake_nebius import DISK_SERVICE, INSTANCE_SERVICE, OPERATION_SERVICE, FakeNebius, sdk_for
from support.waiting import wait_until

T = TypeVar("T")
CREATE = f"{INSTANCE_SERVICE}/Create"
GET = f"{INSTANCE_SERVICE}/Get"
LIST = f"{INSTANCE_SERVICE}/List"
OP_GET = f"{OPERATION_SERVICE}/Get"
PARENT = "project-e00test"
CALLER = contextvars.ContextVar("caller", default="unset")


@pytest.fixture
def fake() -> Iterator[FakeNebius]:
    with FakeNebius() as server:
        yield server
    assert not [t for t in threading.enumerate() if t.name == "fake-nebius"]


def instance_request(name: str = "vm-1") -> CreateInstanceRequest:
    spec = InstanceSpec(resources=ResourcesSpec(platform="cpu-d3", preset="4vcpu-16gb"))
    return CreateInstanceRequest(metadata=ResourceMetadata(name=name, parent_id=PARENT), spec=spec)


class Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Where and in which context the SDK starts each native call."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        self.seen.append((method, CALLER.get(), threading.current_thread().name))
        return await continuation(client_call_details, request)


def test_instance_lifecycle(fake: FakeNebius) -> None:
    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            instances = InstanceServiceClient(sdk)
            op = await instances.create(instance_request(), timeout=5)
            assert re.fullmatch(r"computeoperation-\w+", op.id)
            assert re.fullmatch(r"computeinstance-\w+", op.resource_id)
            assert not op.done()
            await op.wait(interval=0.02, timeout=5)
            assert op.done() and op.successful()

            instance = await instances.get(GetInstanceRequest(id=op.resource_id), timeout=5)
            assert (instance.metadata.id, instance.metadata.name) == (op.resource_id, "vm-1")
            assert instance.metadata.parent_id == PARENT
            assert instance.spec.resources.preset == "4vcpu-16gb"
            listed = await instances.list(ListInstancesRequest(parent_id=PARENT), timeout=5)
            assert [i.metadata.id for i in listed.items] == [op.resource_id]

            deleted = await instances.delete(DeleteInstanceRequest(id=op.resource_id), timeout=5)
            assert deleted.resource_id == op.resource_id and deleted.id != op.id
            await deleted.wait(interval=0.02, timeout=5)
            with pytest.raises(RequestError) as err:
                await instances.get(GetInstanceRequest(id=op.resource_id), timeout=5)
            assert err.value.status.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())
    assert [c.method for c in fake.calls] == [CREATE, OP_GET, GET, LIST, f"{INSTANCE_SERVICE}/Delete", OP_GET, GET]


def test_disk_operation_polled_by_update() -> None:
    async def main(fake: FakeNebius) -> None:
        async with sdk_for(fake.address) as sdk:
            disks = DiskServiceClient(sdk)
            spec = DiskSpec(size_gibibytes=10, type=DiskSpec.DiskType.NETWORK_SSD)
            op = await disks.create(CreateDiskRequest(metadata=ResourceMetadata(name="d", parent_id=PARENT), spec=spec))
            assert op.resource_id.startswith("computedisk-")
            for _ in range(2):
                assert not op.done()
                await op.update(timeout=5)
            assert op.done() and op.successful()
            disk = await disks.get(GetDiskRequest(id=op.resource_id), timeout=5)
            assert disk.spec.size_gibibytes == 10
            await disks.delete(DeleteDiskRequest(id=op.resource_id), timeout=5)
            assert fake.count(OP_GET) == 2 and fake.count(f"{DISK_SERVICE}/Delete") == 1

    async def run() -> None:
        async with FakeNebius(polls_until_done=2) as fake:
            await main(fake)

    asyncio.run(run())


def test_not_found_is_the_sdk_request_error(fake: FakeNebius) -> None:
    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            with pytest.raises(RequestError) as err:
                await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-nope"), timeout=5)
            assert err.value.status.code == grpc.StatusCode.NOT_FOUND
            assert err.value.status.request_id == fake.calls[-1].request_id

    asyncio.run(main())


def test_unavailable_is_retried_with_the_same_idempotency_key(fake: FakeNebius) -> None:
    fake.fail_next(CREATE, grpc.StatusCode.UNAVAILABLE)

    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            op = await InstanceServiceClient(sdk).create(instance_request(), timeout=5)
            assert op.resource_id.startswith("computeinstance-")

    asyncio.run(main())
    first, second = fake.calls
    assert first.method == second.method == CREATE
    assert first.metadata["x-idempotency-key"] == second.metadata["x-idempotency-key"]
    assert first.request_id != second.request_id


def test_failures_exhaust_the_retries(fake: FakeNebius) -> None:
    fake.fail_next(LIST, grpc.StatusCode.UNAVAILABLE, times=3, message="try later")

    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            with pytest.raises(RequestError) as err:
                await InstanceServiceClient(sdk).list(ListInstancesRequest(parent_id=PARENT), timeout=5, retries=3)
            assert err.value.status.code == grpc.StatusCode.UNAVAILABLE
            assert err.value.status.message == "try later"

    asyncio.run(main())
    assert fake.count(LIST) == 3


def test_delay_beyond_the_per_retry_timeout_is_deadline_exceeded(fake: FakeNebius) -> None:
    fake.delay_next(GET, 3.0)

    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            started = time.monotonic()
            with pytest.raises(RequestError) as err:
                await InstanceServiceClient(sdk).get(
                    GetInstanceRequest(id="computeinstance-x"), timeout=5, per_retry_timeout=0.2, retries=1
                )
            assert time.monotonic() - started < 1
            assert err.value.status.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # The fake sends its headers before sleeping, so even a timed-out call carries the request id.
            assert err.value.status.request_id == fake.calls[-1].request_id

    asyncio.run(main())


def test_delay_beyond_the_request_timeout(fake: FakeNebius) -> None:
    fake.delay_next(GET, 3.0)

    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            started = time.monotonic()
            # The caller-side deadline and gRPC's race; either error may win.
            with pytest.raises((TimeoutError, RequestError)) as err:
                await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-x"), timeout=0.3)
            assert time.monotonic() - started < 1
            if isinstance(err.value, RequestError):
                assert err.value.status.code == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(main())


def test_a_timed_out_attempt_is_retried(fake: FakeNebius) -> None:
    fake.delay_next(LIST, 0.5)

    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            await InstanceServiceClient(sdk).list(
                ListInstancesRequest(parent_id=PARENT), timeout=5, per_retry_timeout=0.2
            )

    asyncio.run(main())
    assert fake.count(LIST) == 2


def test_request_and_trace_ids_reach_the_sdk(fake: FakeNebius) -> None:
    async def main() -> None:
        async with sdk_for(fake.address) as sdk:
            request = InstanceServiceClient(sdk).list(ListInstancesRequest(parent_id=PARENT), timeout=5)
            await request
            assert await request.request_id() == fake.calls[-1].request_id
            assert re.fullmatch(r"[0-9a-f]{32}", await request.trace_id())

    asyncio.run(main())
    assert fake.calls[-1].request_id.startswith("fakereq-")


def test_sync_use_from_a_plain_thread(fake: FakeNebius) -> None:
    sdk = sdk_for(fake.address)
    try:
        instances = InstanceServiceClient(sdk)
        request = instances.create(instance_request(), timeout=5)
        op = request.wait()
        assert request.request_id_sync() == fake.calls[0].request_id
        op.sync_wait(interval=0.02, timeout=5)
        assert op.successful()
        assert instances.get(GetInstanceRequest(id=op.resource_id), timeout=5).wait().metadata.name == "vm-1"

        fake.delay_next(LIST, 3.0)
        with pytest.raises(RequestError) as err:  # synchronous waits convert timeouts to DEADLINE_EXCEEDED
            instances.list(ListInstancesRequest(parent_id=PARENT), timeout=0.3).wait()
        assert err.value.status.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        sdk.sync_close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("nebius-sdk")]


def test_dstack_style_bridge_and_context_propagation(fake: FakeNebius) -> None:
    """dstack's `DaemonEventLoop.await_`: its own loop on a daemon thread, the caller blocks on a future."""
    loop = asyncio.new_event_loop()
    bridge = threading.Thread(target=loop.run_forever, name="bridge-loop", daemon=True)
    bridge.start()

    async def wrap(awaitable: Awaitable[T]) -> T:
        return await awaitable

    def await_(awaitable: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(wrap(awaitable), loop).result(timeout=5)

    recorder = Recorder()
    sdk = sdk_for(fake.address, interceptors=[recorder])
    try:
        instances = InstanceServiceClient(sdk)
        CALLER.set("caller-thread")
        op = await_(instances.create(instance_request(), timeout=5))
        await_(op.wait(interval=0.02, timeout=5))
        assert op.successful()
        instance = await_(instances.get(GetInstanceRequest(id=op.resource_id), timeout=5))
        assert instance.metadata.id == op.resource_id
    finally:
        sdk.sync_close()
        loop.call_soon_threadsafe(loop.stop)
        bridge.join(timeout=2)
        loop.close()
    # The SDK starts every call on its own loop thread, in a copy of the submitting task's context, which
    # run_coroutine_threadsafe copied from the caller: a contextvar set by the caller is visible there.
    assert recorder.seen == [
        (f"/{CREATE}", "caller-thread", "nebius-sdk-loop"),
        (f"/{OP_GET}", "caller-thread", "nebius-sdk-loop"),
        (f"/{GET}", "caller-thread", "nebius-sdk-loop"),
    ]


def test_fault_injection_rejects_unknown_methods(fake: FakeNebius) -> None:
    with pytest.raises(ValueError, match="does not serve"):
        fake.fail_next("nebius.compute.v1.InstanceService/Frobnicate", grpc.StatusCode.INTERNAL)
    with pytest.raises(ValueError, match="does not serve"):
        fake.delay_next("Create", 1.0)


def test_stop_is_bounded_with_a_call_in_flight() -> None:
    fake = FakeNebius().start()
    address = fake.address
    fake.delay_next(LIST, 30.0)
    sdk = sdk_for(address)
    try:
        request = InstanceServiceClient(sdk).list(ListInstancesRequest(parent_id=PARENT), timeout=10, retries=1)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                request.wait()
            except BaseException as exc:  # examined below
                outcome.append(exc)

        pending = threading.Thread(target=wait, daemon=True)
        pending.start()
        wait_until(lambda: fake.count(LIST), "the call reached the fake")
        started = time.monotonic()
        fake.stop()
        assert time.monotonic() - started < 8  # not held until the call's 10 s timeout
        pending.join(timeout=30)
        assert not pending.is_alive()
        assert isinstance(outcome[0], RequestError), outcome
    finally:
        sdk.sync_close()
    fake.stop()  # idempotent
    assert not [t for t in threading.enumerate() if t.name == "fake-nebius"]
    assert fake.address == address
    with pytest.raises(RuntimeError, match="never started"):
        _ = FakeNebius().address


def test_a_restart_keeps_the_address_and_the_state(fake: FakeNebius) -> None:
    address = fake.address
    sdk = sdk_for(address)
    try:
        instances = InstanceServiceClient(sdk)
        op = instances.create(instance_request(), timeout=5).wait()
        fake.stop()
        # The SDK waits for the channel to be ready: a call to a server that is gone hangs until its deadline.
        started = time.monotonic()
        with pytest.raises(RequestError) as err:
            instances.get(GetInstanceRequest(id=op.resource_id), timeout=0.3).wait()
        assert 0.25 < time.monotonic() - started < 1
        assert err.value.status.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.value.status.request_id == ""
        fake.start()
        assert fake.address == address
        instance = instances.get(GetInstanceRequest(id=op.resource_id), timeout=5).wait()
        assert instance.metadata.id == op.resource_id
    finally:
        sdk.sync_close()
    assert [c.method for c in fake.calls] == [CREATE, GET]
