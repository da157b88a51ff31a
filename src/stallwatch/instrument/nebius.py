"""Nebius API instrumentation: one CLIENT span per logical call, with status, attempts and ids.

The OpenTelemetry gRPC instrumentation misses the SDK's (`nebius` 0.6.x) channels, so three private
methods of `nebius.aio.request.Request` are wrapped: `_request_with_authorization_loop` is the span
(authentication, retries, result; parent and start taken in the caller's thread, none for a coroutine
never started, ended on the SDK loop before the caller has the result), `_send` counts attempts and
backoffs, and `_await_native_call` adds a `stallwatch.nebius.attempt` event per attempt. An SDK
without them (`supported()`) gets one WARNING and is left untouched. Payloads are never read but a
delete's `id`; creates and deletes go through the resource ledger (`stallwatch.journal.ledger`).

The SDK loop and the caller share one GIL, so only what the ledger's contract needs runs between the
caller's await and its result: the span's start, a create/delete's durable intent before the request
leaves, its written outcome and the span's end once the answer is in. Metrics and the ledger's log
records complete later on the SDK loop (`_waiting`: at the next call's send, after `COMPLETE_WITHIN`,
at a metric collection or at `stallwatch.shutdown()`, whichever is first).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.metadata
import inspect
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import journal, telemetry
from .._version import __version__
from ..core import light_span
from ..core.faults import FAULTS, Counts, Deferred, instrument
from ..core.scrub import MAX_NAME_CHARS, clip_text, scrub_text
from ..journal import ledger
from ._lifecycle import ForkReset, ImportHooks, start_meter

_log = logging.getLogger("stallwatch")
COMPONENT = "nebius"
SETTING = "STALLWATCH_INSTRUMENT_NEBIUS"
REQUEST_MODULE = "nebius.aio.request"
SUPPORTED_SDK = "nebius >= 0.6.13, < 0.7"  # the private `Request` methods wrapped below are 0.6.x's
_WRAPPED = ("_request_with_authorization_loop", "_send", "_await_native_call")
_ACTIONS = {"Create": "create", "Delete": "delete"}
_GRPC_CODES = {"OK": 0, "CANCELLED": 1, "DEADLINE_EXCEEDED": 4}  # grows with each status name seen
_STATUS_CODE = telemetry.RPC_GRPC_STATUS_CODE.name
_ATTEMPTS, _ERROR_TYPE = telemetry.NEBIUS_ATTEMPTS.name, telemetry.ERROR_TYPE.name
_REQUEST_ID, _TRACE_ID = telemetry.NEBIUS_REQUEST_ID.name, telemetry.NEBIUS_TRACE_ID.name
_OPERATION_ID, _RESOURCE_ID = telemetry.CLOUD_OPERATION_ID.name, telemetry.CLOUD_RESOURCE_ID.name


@dataclass
class _Instruments:
    tracer: trace.Tracer
    duration: Deferred
    active: Counts
    created: Any
    deleted: Any


# The instrumentor's instruments while it is on (it holds them too): a module global because the wrappers are
# module functions that wrapt puts on the SDK's `Request` class, shared by every call.
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


class _Method:
    """What every call of one RPC method shares: computed on its first call, then reused."""

    __slots__ = ("action", "attributes", "by_status", "method", "name", "resource_type", "service")

    def __init__(self, service: str, method: str) -> None:
        self.service = service
        self.method = method
        self.name = f"{service}/{method}"
        self.attributes = {
            "rpc.system": "grpc", "rpc.system.name": "grpc",
            telemetry.RPC_SERVICE.name: service, telemetry.RPC_METHOD.name: method,
        }  # fmt: skip
        self.action = _ACTIONS.get(method)
        self.resource_type = resource_type(service)
        self.by_status: dict[int, dict[str, Any]] = {}

    def duration_attributes(self, status_code: int) -> dict[str, Any]:
        """The attributes of `stallwatch.nebius.call.duration` for this method and status (shared, read-only)."""
        attributes = self.by_status.get(status_code)
        if attributes is None:
            attributes = {
                telemetry.RPC_SERVICE.name: self.service, telemetry.RPC_METHOD.name: self.method,
                _STATUS_CODE: status_code,
            }  # fmt: skip
            self.by_status[status_code] = attributes
        return attributes


_methods: dict[tuple[Any, Any], _Method] = {}


def _method_of(request: Any) -> _Method:
    key = (request._service, request._method)
    method = _methods.get(key)
    if method is None:
        method = _methods.setdefault(key, _Method(_name(key[0]).lstrip("."), _name(key[1])))
    return method


def _name(value: object) -> str:
    """A service or method name as an attribute: valid UTF-8, at most `MAX_NAME_CHARS` characters."""
    return clip_text(value if isinstance(value, str) else scrub_text(value), MAX_NAME_CHARS) or "unknown"


class _Call:
    """One logical call: its span, attempts and ledger intent, and what it ended with."""

    __slots__ = (
        "attempt_events", "attempt_started", "attempts", "code", "end_ns", "error_class", "error_type", "failed",
        "failed_attempts", "intent", "journaled", "later", "method", "operation_id", "request_id", "resource_id",
        "span", "started", "took", "trace_id",
    )  # fmt: skip

    def __init__(self, instruments: _Instruments, request: Any, parent: context_api.Context, start_ns: int) -> None:
        method = self.method = _method_of(request)
        self.span = light_span.start(
            instruments.tracer, method.name, parent, method.attributes, SpanKind.CLIENT, start_ns
        )
        self.started = time.monotonic() - (time.time_ns() - start_ns) / 1e9
        self.attempts = 0
        self.failed_attempts = 0
        self.attempt_events: list[tuple[int, str, float, float, int]] = []
        self.attempt_started = 0.0
        self.intent: ledger.Intent | None = None
        self.later: list[Callable[[], None]] | tuple[()] = ()  # the ledger's log records, emitted off the critical path
        instruments.active.add(1, method.service, method.method)
        self.journaled = journal.span_started(self.span, COMPONENT)  # on disk with the intent, which is durable
        if method.action is not None:
            self.later = []
            context = self.span.get_span_context()
            resource_id = _request_resource_id(request) if method.action == "delete" else None
            self.intent = ledger.Intent(
                method.action, method.resource_type, method.name,
                trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id), resource_id,
            )  # fmt: skip
            self._to_ledger(lambda intent: ledger.recorder().intent(intent))

    def attempt(self) -> None:
        self.attempts += 1
        self.attempt_started = time.monotonic()

    def attempt_ended(self, code: str) -> None:
        """Keep what the attempt's event needs; the event is built in `complete`, only if it is added."""
        self.failed_attempts += code != "OK"
        self.attempt_events.append((self.attempts, code, self.attempt_started, time.monotonic(), time.time_ns()))

    def _attempt_event(self, index: int) -> tuple[dict[str, Any], int]:
        number, code, started, ended, timestamp = self.attempt_events[index]
        attributes: dict[str, Any] = {
            "attempt": number,
            _STATUS_CODE: _code_number(code),
            "rpc.response.status_code": code,
            "duration_seconds": ended - started,
        }
        if index:
            attributes["backoff_seconds"] = started - self.attempt_events[index - 1][3]
        return attributes, timestamp

    def finish(self, request: Any, result: Any, error: BaseException | None, end_ns: int, took: float) -> None:
        """What must be done before the caller has the result: the status and ids, the ledger's
        outcome, and the span's end."""
        self.end_ns, self.took = end_ns, took
        self.failed = error is not None
        self.error_class = type(error).__qualname__
        self.code, self.error_type = ("OK", None) if error is None else _classify(request, error)
        request_id, trace_id = getattr(request, "_request_id", None), getattr(request, "_trace_id", None)
        self.request_id, self.trace_id = clip_text(request_id), clip_text(trace_id)
        self.operation_id, resource_id = _operation_ids(result)
        intent = self.intent
        self.resource_id = resource_id or (intent.resource_id if intent is not None else None)
        if intent is not None:
            outcome = ledger.Outcome(not self.failed, self.error_type or self.code, self.operation_id,
                                     self.resource_id, self.request_id)  # fmt: skip
            self._to_ledger(lambda intent: ledger.recorder().outcome(intent, outcome))
        try:
            self._end_span()
        except Exception:  # e.g. a span processor that raises: the metrics and log records still follow
            FAULTS.record(COMPONENT, SETTING)

    def _end_span(self) -> None:
        span, code = self.span, self.code
        if self.attempts > 1 or self.failed_attempts:  # one clean attempt says nothing the span does not
            for index in range(len(self.attempt_events)):
                span.add_event("stallwatch.nebius.attempt", *self._attempt_event(index))
        number = _code_number(code)
        attributes: dict[str, Any] = {_STATUS_CODE: number, "rpc.response.status_code": code, _ATTEMPTS: self.attempts}
        if self.request_id:
            attributes[_REQUEST_ID] = self.request_id
        if self.trace_id:
            attributes[_TRACE_ID] = self.trace_id
        if self.operation_id:
            attributes[_OPERATION_ID] = self.operation_id
        if self.resource_id:
            attributes[_RESOURCE_ID] = self.resource_id
        if self.failed:
            attributes[_ERROR_TYPE] = self.error_type or code
        if isinstance(span, light_span.LightSpan):
            span.set_own_attributes(attributes)  # ids clipped to valid text, numbers: as the SDK would keep them
        else:
            span.set_attributes(attributes)
        if self.failed:
            span.set_status(Status(StatusCode.ERROR, f"{code}: {self.error_class}"))
        span.end(end_time=self.end_ns)
        journal.span_ended(span, started=self.journaled)

    def complete(self, instruments: _Instruments) -> None:
        """Everything the caller need not wait for: the metrics and the ledger's log records."""
        if self.later:
            self.emit_later()
        method = self.method
        instruments.duration.record(self.took, method.duration_attributes(_code_number(self.code)))
        instruments.active.add(-1, method.service, method.method)
        intent = self.intent
        if intent is not None and not self.failed:
            counter = instruments.created if intent.action == "create" else instruments.deleted
            counter.add(1, {telemetry.CLOUD_RESOURCE_TYPE.name: intent.resource_type})

    def emit_later(self) -> None:
        """Emit the ledger's log records held back so far, in order."""
        later = self.later
        while later:
            try:
                later.pop(0)()
            except Exception:
                FAULTS.record(COMPONENT, SETTING)

    def _to_ledger(self, record: Callable[[ledger.Intent], None]) -> None:
        """Call the recorder inside the call's span (its records carry the call's ids), with its log
        records held in `later`. A failing recorder (e.g. a full disk) is counted; the call and its
        span go on."""
        token = context_api.attach(trace.set_span_in_context(self.span))
        held = ledger.EMIT_LATER.set(self.later.append)  # type: ignore[union-attr]
        try:
            record(self.intent)  # type: ignore[arg-type]
        except Exception:
            FAULTS.record(COMPONENT, SETTING)
        finally:
            ledger.EMIT_LATER.reset(held)
            context_api.detach(token)


def _code_number(code: str) -> int:
    number = _GRPC_CODES.get(code)
    if number is not None:
        return number
    try:
        # optional: grpc comes with nebius, and is never loaded by setup()
        import grpc

        number = int(grpc.StatusCode[code].value[0])
    except (ImportError, KeyError):
        return 2  # UNKNOWN
    _GRPC_CODES[code] = number
    return number


def _classify(request: Any, error: BaseException) -> tuple[str, str | None]:
    """(gRPC status name, error.type) of a failed call."""
    if getattr(request, "_deadline_expired", False) or isinstance(error, TimeoutError):
        return "DEADLINE_EXCEEDED", "timeout"
    if isinstance(error, asyncio.CancelledError) or type(error).__name__ == "RequestIsCancelledError":
        return "CANCELLED", "cancelled"
    status = getattr(error, "status", None)
    code = getattr(getattr(status, "code", None), "name", None)
    if isinstance(code, str) and code:
        code = clip_text(code, MAX_NAME_CHARS) or "UNKNOWN"
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
    return clip_text(operation_id), clip_text(resource_id)


def _request_resource_id(request: Any) -> str | None:
    """The `id` field of a delete request: the one payload field read, to name the resource."""
    message = getattr(request, "_input", None)
    message = getattr(message, "__pb2_message__", message)
    return clip_text(getattr(message, "id", None))


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
        _end(call, instruments, request, None, error)
        raise
    finally:
        _current.reset(token)
    _end(call, instruments, request, result, None)
    return result


def _end(call: _Call, instruments: _Instruments, request: Any, result: Any, error: BaseException | None) -> None:
    """Finish the call now (its span ends) and complete it later, off the caller's path (see the
    module docstring)."""
    end_ns, took = time.time_ns(), time.monotonic() - call.started
    try:
        call.finish(request, result, error, end_ns, took)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
        return
    _waiting.append((call, instruments))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no running loop: complete it now
        complete_waiting()
        return
    global _timer_loop
    if _timer_loop is not loop:
        _timer_loop = loop
        try:
            loop.call_later(COMPLETE_WITHIN, _timer_fired, loop)
        except RuntimeError:  # the loop is closing
            _timer_loop = None
            complete_waiting()


COMPLETE_WITHIN = 0.05
"""Seconds after which a finished call is completed on its loop if no other call came to do it."""
_waiting: deque[tuple[_Call, _Instruments]] = deque()  # finished calls whose completion is still to run
_timer_loop: asyncio.AbstractEventLoop | None = None  # the loop with a completion timer pending


def _forget_the_parents_calls() -> None:
    """In a fork child that lives on: the parent completes its own calls; this process would
    otherwise export them again at its shutdown."""
    global _timer_loop
    _waiting.clear()
    _timer_loop = None


_FORK_RESET = ForkReset(_forget_the_parents_calls)  # starts nothing


def _timer_fired(loop: asyncio.AbstractEventLoop) -> None:
    global _timer_loop
    if _timer_loop is loop:
        _timer_loop = None
    complete_waiting()


def complete_waiting() -> None:
    """Complete every finished call still waiting: spans, metrics, log records (shutdown calls it)."""
    waiting = _waiting
    while waiting:
        try:
            call, instruments = waiting.popleft()
        except IndexError:  # another thread took the last one
            return
        try:
            call.complete(instruments)
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
    if call.later or _waiting:  # the intent's log record, earlier calls' completions: while this one waits
        _emit_soon(call)
    try:
        result = await wrapped(*args, **kwargs)
    except BaseException as error:
        _attempt_ended(call, error)
        raise
    _attempt_ended(call, None)
    return result


def _emit_soon(call: _Call) -> None:
    try:
        asyncio.get_running_loop().call_soon(_while_on_the_network, call)
    except RuntimeError:
        _while_on_the_network(call)


def _while_on_the_network(call: _Call) -> None:
    call.emit_later()
    complete_waiting()


def _attempt_ended(call: _Call, error: BaseException | None) -> None:
    try:
        call.attempt_ended("OK" if error is None else _attempt_code(error))
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _attempt_code(error: BaseException) -> str:
    """The gRPC status name of a failed attempt: its `code()`, else what the error says."""
    code = getattr(error, "code", None)
    try:
        name = getattr(code(), "name", None) if callable(code) else None
    except Exception:  # a `code()` that fails says nothing; the error itself still reaches the caller
        name = None
    if isinstance(name, str) and name:
        return clip_text(name, MAX_NAME_CHARS) or "UNKNOWN"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError) else type(error).__qualname__


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


class NebiusInstrumentor(BaseInstrumentor):
    """One span per Nebius API call; installed when `nebius.aio.request` is imported (now, if it is).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global ones).
    """

    _nebius_instruments: _Instruments | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return (SUPPORTED_SDK,)

    def _instrument(self, **kwargs: Any) -> None:
        global _instruments, _status
        meter_ = start_meter(kwargs)
        duration = Deferred(meter_, telemetry.NEBIUS_CALL_DURATION)

        def before_collection() -> None:  # the calls waiting to be completed hold their metrics
            complete_waiting()
            duration.drain()

        self._nebius_instruments = _instruments = _Instruments(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__, kwargs.get("tracer_provider")),
            duration=duration,
            active=Counts(meter_, telemetry.NEBIUS_CALLS_ACTIVE, before=before_collection),
            created=instrument(meter_, telemetry.CLOUD_RESOURCES_CREATED),
            deleted=instrument(meter_, telemetry.CLOUD_RESOURCES_DELETED),
        )
        _status = "waiting for nebius.aio.request to be imported"
        _FORK_RESET.register()
        ImportHooks.of(self).on_import(REQUEST_MODULE, _patch)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _instruments, _status
        self._nebius_instruments = _instruments = None
        ImportHooks.of(self).clear()
        _status = "off (uninstrumented)"
        module = sys.modules.get(REQUEST_MODULE)
        request_class = getattr(module, "Request", None)
        if request_class is not None:
            for name in _WRAPPED:
                unwrap(request_class, name)  # a no-op where nothing is wrapped
