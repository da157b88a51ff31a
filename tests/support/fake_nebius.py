"""A fake Nebius gRPC API on loopback, for the test-suite (it is not shipped in the wheel).

It imports `grpc` and `nebius`. `sdk_for` is the demo's (`stallwatch.demo_incidents.sdk_for`), re-exported.

`FakeNebius` runs a `grpc.aio` server on 127.0.0.1 (a free port), on its own daemon thread and event loop,
and answers with the SDK's own message classes:

- `nebius.compute.v1.InstanceService`: Create, Get, List, Delete;
- `nebius.compute.v1.DiskService`: Create, Get, List, Delete;
- `nebius.common.v1.OperationService`: Get, List. An `Operation` wrapper of a compute v1 call polls
  `nebius.common.v1.OperationService/Get` at the address of the service that created it.

Create and Delete return a `nebius.common.v1.Operation` that is not done yet; it becomes done (status OK)
on the `polls_until_done`-th OperationService/Get. Create stores the resource at once (Get finds it while
the operation runs); Delete removes it at once. An unknown id answers NOT_FOUND, an unserved method
UNIMPLEMENTED. Every call, failed or not, first sends initial metadata `x-request-id` and `x-trace-id` (the
headers the SDK's `Request._parse_request_id` reads), then applies any injected delay, then any injected
failure.

Use the real SDK against it::

    with FakeNebius() as fake:
        sdk = sdk_for(fake.address)
        try:
            op = InstanceServiceClient(sdk).create(CreateInstanceRequest(...), timeout=5).wait()
            op.sync_wait(interval=0.05, timeout=5)
        finally:
            sdk.sync_close()  # or `await sdk.close()` / `async with sdk_for(...) as sdk:` inside a loop

The SDK has no SDK-wide request timeout: pass `timeout=` and `per_retry_timeout=` to each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timezone
from types import TracebackType
from typing import NamedTuple, Protocol, TypeVar

import grpc
from nebius.aio.request_status import RequestStatus
from nebius.api.nebius.common.v1 import (
    GetOperationRequest,
    ListOperationsRequest,
    ListOperationsResponse,
    Operation,
    ResourceMetadata,
)
from nebius.api.nebius.compute.v1 import (
    CreateDiskRequest,
    CreateInstanceRequest,
    DeleteDiskRequest,
    DeleteInstanceRequest,
    Disk,
    GetDiskRequest,
    GetInstanceRequest,
    Instance,
    ListDisksRequest,
    ListDisksResponse,
    ListInstancesRequest,
    ListInstancesResponse,
)

from stallwatch.demo_incidents import sdk_for

__all__ = ["DISK_SERVICE", "INSTANCE_SERVICE", "OPERATION_SERVICE", "Call", "FakeNebius", "sdk_for"]

INSTANCE_SERVICE = "nebius.compute.v1.InstanceService"
DISK_SERVICE = "nebius.compute.v1.DiskService"
OPERATION_SERVICE = "nebius.common.v1.OperationService"

STOP_GRACE_SECONDS = 0.5
"""How long `stop()` lets in-flight calls finish; an injected delay ends at once, answering UNAVAILABLE."""

_Req = TypeVar("_Req")
_Req_co = TypeVar("_Req_co", covariant=True)
_Stored = TypeVar("_Stored", Instance, Disk)
_V = TypeVar("_V")


class _Message(Protocol):
    def SerializeToString(self) -> bytes: ...


class _Decoder(Protocol[_Req_co]):
    def FromString(self, payload: bytes, /) -> _Req_co: ...


class _NotFoundError(Exception):
    """Answered as NOT_FOUND."""


class Call(NamedTuple):
    """One call the fake received, in arrival order; the payload is not kept."""

    method: str
    """Like `"nebius.compute.v1.InstanceService/Create"`."""
    request_id: str
    """The `x-request-id` the fake answered with."""
    metadata: dict[str, str | bytes]
    """The client's invocation metadata (`user-agent`, `x-idempotency-key`, `traceparent`, ...)."""


class _Fault(NamedTuple):
    code: grpc.StatusCode
    message: str


def _lookup(items: dict[str, _V], resource_id: str) -> _V:
    try:
        return items[resource_id]
    except KeyError:
        raise _NotFoundError(f"{resource_id!r} not found") from None


def _new_id(prefix: str) -> str:
    return f"{prefix}-e00fake{secrets.token_hex(6)}"


def _serialize(message: _Message) -> bytes:
    return message.SerializeToString()


class FakeNebius:
    """The fake server. Thread-safe; `start()`/`stop()` from any thread, or use it as a context manager.

    :param polls_until_done: OperationService/Get calls after which an operation is done (0: done at once).
    """

    def __init__(self, *, polls_until_done: int = 1) -> None:
        if polls_until_done < 0:
            raise ValueError("polls_until_done must be >= 0")
        self._polls_until_done = polls_until_done
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._faults: dict[str, deque[_Fault]] = {}
        self._delays: dict[str, deque[float]] = {}
        self._instances: dict[str, Instance] = {}
        self._disks: dict[str, Disk] = {}
        self._operations: dict[str, Operation] = {}
        self._polls_left: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._port = 0
        self._methods: dict[str, dict[str, grpc.RpcMethodHandler]] = {
            INSTANCE_SERVICE: {
                "Create": self._unary(INSTANCE_SERVICE, "Create", CreateInstanceRequest, self._create_instance),
                "Get": self._unary(INSTANCE_SERVICE, "Get", GetInstanceRequest, self._get_instance),
                "List": self._unary(INSTANCE_SERVICE, "List", ListInstancesRequest, self._list_instances),
                "Delete": self._unary(INSTANCE_SERVICE, "Delete", DeleteInstanceRequest, self._delete_instance),
            },
            DISK_SERVICE: {
                "Create": self._unary(DISK_SERVICE, "Create", CreateDiskRequest, self._create_disk),
                "Get": self._unary(DISK_SERVICE, "Get", GetDiskRequest, self._get_disk),
                "List": self._unary(DISK_SERVICE, "List", ListDisksRequest, self._list_disks),
                "Delete": self._unary(DISK_SERVICE, "Delete", DeleteDiskRequest, self._delete_disk),
            },
            OPERATION_SERVICE: {
                "Get": self._unary(OPERATION_SERVICE, "Get", GetOperationRequest, self._get_operation),
                "List": self._unary(OPERATION_SERVICE, "List", ListOperationsRequest, self._list_operations),
            },
        }

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """`"127.0.0.1:PORT"`, known from the first `start()` on; it stays the same across restarts."""
        if not self._port:
            raise RuntimeError("FakeNebius was never started")
        return f"127.0.0.1:{self._port}"

    def start(self) -> FakeNebius:
        """Serve on a daemon thread with its own event loop; returns once the port is bound.

        The first start binds a free port, a restart after `stop()` binds the same one again, and the stored
        resources and `calls` survive: a client sees a server that went away and came back.
        """
        if self._thread is not None:
            raise RuntimeError("FakeNebius is already started")
        ready: Future[int] = Future()
        self._stopping = asyncio.Event()  # binds to the server's loop on first use
        self._thread = threading.Thread(target=self._run, args=(ready,), name="fake-nebius", daemon=True)
        self._thread.start()
        try:
            self._port = ready.result(timeout=10)
        except BaseException:
            self._thread.join(timeout=STOP_GRACE_SECONDS + 5)
            self._thread = None
            raise
        return self

    def stop(self) -> None:
        """Stop serving (in-flight calls get `STOP_GRACE_SECONDS`) and join the thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(self._stopping.set)
        thread.join(timeout=STOP_GRACE_SECONDS + 5)
        if thread.is_alive():
            raise RuntimeError("the fake-nebius thread did not stop")
        self._thread = None

    def __enter__(self) -> FakeNebius:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> FakeNebius:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    def _run(self, ready: Future[int]) -> None:
        try:
            # asyncio.run also cancels and drains what server.stop() left behind (grpc's rpc tasks).
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # reported to start() unless it already returned
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self._loop = None

    async def _serve(self, ready: Future[int]) -> None:
        self._loop = asyncio.get_running_loop()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, methods) for service, methods in self._methods.items()]
        )
        port = server.add_insecure_port(f"127.0.0.1:{self._port}")
        await server.start()
        ready.set_result(port)
        try:
            await self._stopping.wait()
        finally:
            await server.stop(STOP_GRACE_SECONDS)

    # -- fault injection and observation ---------------------------------------------------------------------

    def fail_next(self, method: str, code: grpc.StatusCode, times: int = 1, message: str = "") -> None:
        """Answer the next `times` calls of `method` (`"service/Method"`) with `code` instead of running them."""
        self._check_method(method)
        with self._lock:
            self._faults.setdefault(method, deque()).extend([_Fault(code, message or f"injected {code.name}")] * times)

    def delay_next(self, method: str, seconds: float, times: int = 1) -> None:
        """Make the next `times` calls of `method` sleep `seconds` (asynchronously) before answering."""
        self._check_method(method)
        with self._lock:
            self._delays.setdefault(method, deque()).extend([seconds] * times)

    @property
    def calls(self) -> list[Call]:
        """A snapshot of every call received so far, in arrival order."""
        with self._lock:
            return list(self._calls)

    def count(self, method: str) -> int:
        """How many calls of `method` arrived so far."""
        with self._lock:
            return sum(1 for call in self._calls if call.method == method)

    def _check_method(self, method: str) -> None:
        service, _, name = method.partition("/")
        if name not in self._methods.get(service, {}):
            raise ValueError(f"FakeNebius does not serve {method!r}")

    # -- RPC plumbing ----------------------------------------------------------------------------------------

    def _unary(
        self,
        service: str,
        name: str,
        request_class: _Decoder[_Req],
        handle: Callable[[_Req], _Message],
    ) -> grpc.RpcMethodHandler:
        method = f"{service}/{name}"

        async def behavior(request: _Req, context: grpc.aio.ServicerContext) -> _Message:
            request_id = f"fakereq-{uuid.uuid4().hex}"
            await context.send_initial_metadata((("x-request-id", request_id), ("x-trace-id", uuid.uuid4().hex)))
            with self._lock:
                self._calls.append(Call(method, request_id, dict(context.invocation_metadata() or ())))
                delays = self._delays.get(method)
                delay = delays.popleft() if delays else 0.0
            if delay and await self._interrupted(delay):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake-nebius is stopping")
            with self._lock:
                faults = self._faults.get(method)
                fault = faults.popleft() if faults else None
            if fault is not None:
                await context.abort(fault.code, fault.message)
            with self._lock:
                try:
                    return handle(request)
                except _NotFoundError as missing:
                    not_found = str(missing)
            await context.abort(grpc.StatusCode.NOT_FOUND, not_found)

        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=request_class.FromString,
            response_serializer=_serialize,
        )

    async def _interrupted(self, seconds: float) -> bool:
        """Sleep `seconds`; True if `stop()` cut the sleep short."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    # -- handlers (called with self._lock held) --------------------------------------------------------------

    def _start_operation(self, description: str, resource_id: str) -> Operation:
        operation = Operation(
            id=_new_id("computeoperation"),
            description=description,
            created_at=datetime.now(timezone.utc),
            created_by="fake-nebius",
            resource_id=resource_id,
        )
        self._operations[operation.id] = operation
        self._polls_left[operation.id] = self._polls_until_done
        if not self._polls_until_done:
            self._finish(operation)
        return operation

    @staticmethod
    def _finish(operation: Operation) -> None:
        operation.finished_at = datetime.now(timezone.utc)
        operation.status = RequestStatus(code=grpc.StatusCode.OK, message=None, details=[], request_id="", trace_id="")

    def _get_operation(self, request: GetOperationRequest) -> Operation:
        operation = _lookup(self._operations, request.id)
        if operation.status is None:
            self._polls_left[operation.id] -= 1
            if self._polls_left[operation.id] <= 0:
                self._finish(operation)
        return operation

    def _list_operations(self, request: ListOperationsRequest) -> ListOperationsResponse:
        return ListOperationsResponse(
            operations=[op for op in self._operations.values() if op.resource_id == request.resource_id]
        )

    def _create(
        self, items: dict[str, _Stored], prefix: str, resource: _Stored, metadata: ResourceMetadata, kind: str
    ) -> Operation:
        resource_id = _new_id(prefix)
        resource.metadata = ResourceMetadata(
            id=resource_id,
            name=metadata.name,
            parent_id=metadata.parent_id,
            labels=dict(metadata.labels),
            resource_version=1,
            created_at=datetime.now(timezone.utc),
        )
        items[resource_id] = resource
        return self._start_operation(f"Create {kind} {metadata.name}", resource_id)

    def _delete(self, items: dict[str, _Stored], resource_id: str, kind: str) -> Operation:
        _lookup(items, resource_id)
        del items[resource_id]
        return self._start_operation(f"Delete {kind} {resource_id}", resource_id)

    def _create_instance(self, request: CreateInstanceRequest) -> Operation:
        return self._create(
            self._instances, "computeinstance", Instance(spec=request.spec), request.metadata, "instance"
        )

    def _get_instance(self, request: GetInstanceRequest) -> Instance:
        return _lookup(self._instances, request.id)

    def _list_instances(self, request: ListInstancesRequest) -> ListInstancesResponse:
        items = [i for i in self._instances.values() if i.metadata.parent_id == request.parent_id]
        return ListInstancesResponse(items=items)

    def _delete_instance(self, request: DeleteInstanceRequest) -> Operation:
        return self._delete(self._instances, request.id, "instance")

    def _create_disk(self, request: CreateDiskRequest) -> Operation:
        return self._create(self._disks, "computedisk", Disk(spec=request.spec), request.metadata, "disk")

    def _get_disk(self, request: GetDiskRequest) -> Disk:
        return _lookup(self._disks, request.id)

    def _list_disks(self, request: ListDisksRequest) -> ListDisksResponse:
        return ListDisksResponse(items=[d for d in self._disks.values() if d.metadata.parent_id == request.parent_id])

    def _delete_disk(self, request: DeleteDiskRequest) -> Operation:
        return self._delete(self._disks, request.id, "disk")
