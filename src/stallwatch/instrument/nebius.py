"""Nebius API instrumentation: one CLIENT span per logical call, with status, attempts and ids.

The Nebius SDK (`nebius` 0.6.x) builds a `nebius.aio.request.Request` for every call. The first
await (or `.wait()`) creates `Request._request_with_authorization_loop()` in the caller's thread
and runs it on the SDK's own loop thread. That coroutine covers authentication, every retry
(`_retry_loop` → `_send` per attempt → `_await_native_call`) and result wrapping. The
OpenTelemetry gRPC instrumentation misses the SDK's channels, so the instrumentation wraps those
three private methods instead:

- `_request_with_authorization_loop`: the span. The parent context and start time are taken in
  the caller's thread when the coroutine is created; the span starts and ends on the SDK loop, so
  the caller never waits on it. A coroutine that never starts (the SDK rejected the submission)
  leaves no span.
- `_send`: counts attempts and measures the backoff before each one.
- `_await_native_call`: one `stallwatch.nebius.attempt` event per attempt, with its gRPC status.

Create and delete calls go through the resource ledger (`stallwatch.ledger`): the intent is
recorded before the request leaves, the outcome (operation and resource ids, or the failure) when
known. Payloads are never read, except for the `id` of a delete request. The names are private,
so `supported()` checks them. An SDK without them gets one WARNING naming its version and is
left untouched; `doctor` reports it too.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.metadata
import inspect
import logging
import sys
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import journal, ledger, telemetry
from .._version import __version__
from ._common import FAULTS, Counts, Deferred, instrument, meter

_log = logging.getLogger("stallwatch")
COMPONENT = "nebius"
SETTING = "STALLWATCH_INSTRUMENT_NEBIUS"
REQUEST_MODULE = "nebius.aio.request"
_WRAPPED = ("_request_with_authorization_loop", "_send", "_await_native_call")
_ACTIONS = {"Create": "create", "Delete": "delete"}
_GRPC_CODES = {"OK": 0, "CANCELLED": 1, "DEADLINE_EXCEEDED": 4}


@dataclass
class _Instruments:
    tracer: trace.Tracer
    duration: Deferred
    active: Counts
    created: Any
    deleted: Any


_instruments: _Instruments | None = None
_status = "off (setup() not run, or STALLWATCH_INSTRUMENT_NEBIUS=false)"
_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("stallwatch_nebius_call", default=None)


def status() -> str:
    """What the Nebius instrumentation is doing in this process, for `doctor`."""
    return _status


def sdk_version() -> str | None:
    """Installed `nebius` version, without importing it."""
    try:
        return importlib.metadata.version("nebius")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(request_class: type) -> str | None:
    """None when `Request` has the private methods this instrumentation wraps, else what is missing."""
    for name in _WRAPPED:
        method = getattr(request_class, name, None)
        if method is None:
            return f"Request.{name} is missing"
        if (name != "_send") != inspect.iscoroutinefunction(method):
            return f"Request.{name} changed kind"
    return None


def resource_type(service: str) -> str:
    """`compute.instance` for `nebius.compute.v1.InstanceService`."""
    parts = service.lstrip(".").split(".")
    name = parts[-1].removesuffix("Service").lower() or "unknown"
    package = parts[1] if len(parts) > 2 else ""
    return f"{package}.{name}" if package else name


class _Call:
    """One logical call: its span, attempts and ledger intent."""

    __slots__ = (
        "attempt_events", "attempt_started", "attempts", "failed_attempts", "intent", "labels", "last_attempt_end",
        "service", "span", "started",
    )  # fmt: skip

    def __init__(self, instruments: _Instruments, request: Any, parent: context_api.Context, start_ns: int) -> None:
        self.service = str(request._service).lstrip(".")
        method = str(request._method)
        self.labels = {telemetry.RPC_SERVICE.name: self.service, telemetry.RPC_METHOD.name: method}
        self.span = instruments.tracer.start_span(
            f"{self.service}/{method}",
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=start_ns,
            attributes={"rpc.system": "grpc", "rpc.system.name": "grpc", **self.labels},
        )
        self.started = time.monotonic() - (time.time_ns() - start_ns) / 1e9
        self.attempts = 0
        self.failed_attempts = 0
        self.attempt_events: list[tuple[dict[str, Any], int]] = []
        self.attempt_started = 0.0
        self.last_attempt_end: float | None = None
        self.intent: ledger.Intent | None = None
        instruments.active.add(1, self.service, method)
        journal.span_started(self.span, COMPONENT)  # on disk with the intent, which is durable
        action = _ACTIONS.get(method)
        if action is not None:
            context = self.span.get_span_context()
            resource_id = _request_resource_id(request) if action == "delete" else None
            self.intent = ledger.Intent(
                action, resource_type(self.service), f"{self.service}/{method}",
                trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id), resource_id,
            )  # fmt: skip
            token = context_api.attach(trace.set_span_in_context(self.span))  # the record carries the call's ids
            try:
                _to_ledger(lambda: ledger.recorder().intent(self.intent))
            finally:
                context_api.detach(token)

    def attempt(self) -> None:
        self.attempts += 1
        self.attempt_started = time.monotonic()

    def attempt_ended(self, code: str) -> None:
        now = time.monotonic()
        attributes: dict[str, Any] = {
            "attempt": self.attempts,
            telemetry.RPC_GRPC_STATUS_CODE.name: _code_number(code),
            "rpc.response.status_code": code,
            "duration_seconds": now - self.attempt_started,
        }
        if self.last_attempt_end is not None:
            attributes["backoff_seconds"] = self.attempt_started - self.last_attempt_end
        self.last_attempt_end = now
        self.failed_attempts += code != "OK"
        self.attempt_events.append((attributes, time.time_ns()))

    def end(
        self,
        instruments: _Instruments,
        request: Any,
        result: Any,
        error: BaseException | None,
        end_ns: int,
        took: float,
    ) -> None:
        span = self.span
        if self.attempts > 1 or self.failed_attempts:  # one clean attempt says nothing the span does not
            for event, timestamp in self.attempt_events:
                span.add_event("stallwatch.nebius.attempt", event, timestamp)
        code, error_type = ("OK", None) if error is None else _classify(request, error)
        attributes: dict[str, Any] = {
            telemetry.RPC_GRPC_STATUS_CODE.name: _code_number(code),
            "rpc.response.status_code": code,
            telemetry.NEBIUS_ATTEMPTS.name: self.attempts,
        }
        for attribute, value in (
            (telemetry.NEBIUS_REQUEST_ID, getattr(request, "_request_id", None)),
            (telemetry.NEBIUS_TRACE_ID, getattr(request, "_trace_id", None)),
        ):
            if isinstance(value, str) and value:
                attributes[attribute.name] = value
        operation_id, resource_id = _operation_ids(result)
        if operation_id:
            attributes[telemetry.CLOUD_OPERATION_ID.name] = operation_id
        resource_id = resource_id or (self.intent.resource_id if self.intent else None)
        if resource_id:
            attributes[telemetry.CLOUD_RESOURCE_ID.name] = resource_id
        span.set_attributes(attributes)
        if error is not None:
            span.set_attribute(telemetry.ERROR_TYPE.name, error_type or code)
            span.set_status(Status(StatusCode.ERROR, f"{code}: {type(error).__qualname__}"))
        labels = {**self.labels, telemetry.RPC_GRPC_STATUS_CODE.name: _code_number(code)}
        instruments.duration.record(took, labels)
        instruments.active.add(-1, self.labels[telemetry.RPC_SERVICE.name], self.labels[telemetry.RPC_METHOD.name])
        if self.intent is not None:
            ok = error is None
            if ok:
                counter = instruments.created if self.intent.action == "create" else instruments.deleted
                counter.add(1, {telemetry.CLOUD_RESOURCE_TYPE.name: self.intent.resource_type})
            outcome = ledger.Outcome(ok, error_type or code, operation_id, resource_id, attributes.get(
                telemetry.NEBIUS_REQUEST_ID.name))  # fmt: skip
            token = context_api.attach(trace.set_span_in_context(span))
            try:
                _to_ledger(lambda: ledger.recorder().outcome(self.intent, outcome))
            finally:
                context_api.detach(token)
        span.end(end_time=end_ns)
        journal.span_ended(span)


def _to_ledger(record: Callable[[], None]) -> None:
    """A failing recorder (e.g. a full disk) is counted; the call and its span go on."""
    try:
        record()
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _code_number(code: str) -> int:
    if code in _GRPC_CODES:
        return _GRPC_CODES[code]
    try:
        import grpc

        return int(grpc.StatusCode[code].value[0])
    except (ImportError, KeyError):
        return 2  # UNKNOWN


def _classify(request: Any, error: BaseException) -> tuple[str, str | None]:
    """(gRPC status name, error.type) of a failed call."""
    if getattr(request, "_deadline_expired", False) or isinstance(error, TimeoutError):
        return "DEADLINE_EXCEEDED", "timeout"
    if isinstance(error, asyncio.CancelledError) or type(error).__name__ == "RequestIsCancelledError":
        return "CANCELLED", "cancelled"
    status = getattr(error, "status", None)
    code = getattr(getattr(status, "code", None), "name", None)
    if isinstance(code, str):
        return code, {"DEADLINE_EXCEEDED": "timeout", "CANCELLED": "cancelled"}.get(code, code)
    return "UNKNOWN", type(error).__qualname__


def _operation_ids(result: Any) -> tuple[str | None, str | None]:
    """`.id` and `.resource_id` of an `Operation` result (never the payload of anything else)."""
    if result is None or not hasattr(result, "resource_id") or not callable(getattr(result, "done", None)):
        return None, None
    try:
        operation_id, resource_id = result.id, result.resource_id
    except Exception:
        return None, None
    return (operation_id or None) if isinstance(operation_id, str) else None, (
        (resource_id or None) if isinstance(resource_id, str) else None
    )


def _request_resource_id(request: Any) -> str | None:
    """The `id` field of a delete request: the one payload field read, to name the resource."""
    message = getattr(request, "_input", None)
    message = getattr(message, "__pb2_message__", message)
    value = getattr(message, "id", None)
    return value if isinstance(value, str) and value else None


# ---- wrappers ------------------------------------------------------------------------------------


def _call_wrapper(wrapped: Callable[..., Coroutine[Any, Any, Any]], instance: Any, args: Any, kwargs: Any) -> Any:
    instruments = _instruments
    if instruments is None:
        return wrapped(*args, **kwargs)
    parent = context_api.get_current()  # the caller's thread and context: the span's parent
    start_ns = time.time_ns()
    return _run(instruments, wrapped, instance, args, kwargs, parent, start_ns)


async def _run(
    instruments: _Instruments,
    wrapped: Callable[..., Coroutine[Any, Any, Any]],
    request: Any,
    args: Any,
    kwargs: Any,
    parent: context_api.Context,
    start_ns: int,
) -> Any:
    try:
        call: _Call | None = _Call(instruments, request, parent, start_ns)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
        call = None
    if call is None:
        return await wrapped(*args, **kwargs)
    token = _current.set(call)
    try:
        result = await wrapped(*args, **kwargs)
    except BaseException as error:
        _end_soon(call, instruments, request, None, error)
        raise
    finally:
        _current.reset(token)
    _end_soon(call, instruments, request, result, None)
    return result


def _end_soon(call: _Call, instruments: _Instruments, request: Any, result: Any, error: BaseException | None) -> None:
    """End the call's span right after the SDK hands the result to the caller, not before.

    The span's attributes, its end, the metrics and the ledger outcome cost 50-100 µs; done inline
    they would delay every call's result by that much.
    """
    end_ns, took = time.time_ns(), time.monotonic() - call.started
    try:
        asyncio.get_running_loop().call_soon(_end, call, instruments, request, result, error, end_ns, took)
    except RuntimeError:  # no running loop (or it is closing): end it now
        _end(call, instruments, request, result, error, end_ns, took)


def _end(
    call: _Call, instruments: _Instruments, request: Any, result: Any, error: BaseException | None, end_ns: int,
    took: float,
) -> None:  # fmt: skip
    try:
        call.end(instruments, request, result, error, end_ns, took)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _send_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    call = _current.get()
    if call is not None:
        try:
            call.attempt()
        except Exception:
            FAULTS.record(COMPONENT, SETTING)
    return wrapped(*args, **kwargs)


async def _attempt_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    call = _current.get()
    if call is None:
        return await wrapped(*args, **kwargs)
    try:
        result = await wrapped(*args, **kwargs)
    except BaseException as error:
        status = error.code() if callable(getattr(error, "code", None)) else None
        name = getattr(status, "name", None) or (
            "CANCELLED" if isinstance(error, asyncio.CancelledError) else type(error).__qualname__
        )
        _attempt_ended(call, str(name))
        raise
    _attempt_ended(call, "OK")
    return result


def _attempt_ended(call: _Call, code: str) -> None:
    try:
        call.attempt_ended(code)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _patch(module: Any) -> None:
    global _status
    request_class = getattr(module, "Request", None)
    problem = "Request is missing" if request_class is None else supported(request_class)
    if problem is not None:
        _log.warning(
            "stallwatch: nebius %s is not supported (%s); its calls are not instrumented. %s=false silences this.",
            sdk_version(),
            problem,
            SETTING,
        )
        _status = f"UNSUPPORTED nebius {sdk_version()}: {problem}"
        return
    _status = f"instrumented (nebius {sdk_version()})"
    wrapt.wrap_function_wrapper(request_class, "_request_with_authorization_loop", _call_wrapper)
    wrapt.wrap_function_wrapper(request_class, "_send", _send_wrapper)
    wrapt.wrap_function_wrapper(request_class, "_await_native_call", _attempt_wrapper)


class NebiusInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """One span per Nebius API call; installed when `nebius.aio.request` is imported (now, if it is).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global ones).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        global _instruments, _status
        meter_ = meter(kwargs.get("meter_provider"))
        FAULTS.bind(meter_)
        duration = Deferred(meter_, telemetry.NEBIUS_CALL_DURATION)
        _instruments = _Instruments(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__, kwargs.get("tracer_provider")),
            duration=duration,
            active=Counts(meter_, telemetry.NEBIUS_CALLS_ACTIVE, before=duration.drain),
            created=instrument(meter_, telemetry.CLOUD_RESOURCES_CREATED),
            deleted=instrument(meter_, telemetry.CLOUD_RESOURCES_DELETED),
        )
        _status = "waiting for nebius.aio.request to be imported"
        wrapt.register_post_import_hook(_patch, REQUEST_MODULE)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _instruments, _status
        _instruments = None
        _status = "off (uninstrumented)"
        module = sys.modules.get(REQUEST_MODULE)
        request_class = getattr(module, "Request", None)
        for name in _WRAPPED:
            if request_class is not None and isinstance(getattr(request_class, name, None), wrapt.FunctionWrapper):
                unwrap(request_class, name)
