"""SSH tunnel instrumentation: `ssh.tunnel.open`/`close` spans and metrics, with the ssh children nested.

`instrument_tunnel(cls, ...)` wraps the open/close methods of any tunnel class, sync or async.
`uninstrument_tunnel(cls)` undoes it. `INSTALLATION` (for `setup()`, and for
`stallwatch.instrument.ssh.SSHTunnelInstrumentor`) instruments dstack's `SSHTunnel`
(`dstack._internal.core.services.ssh.tunnel`, 0.22.x) when that module is imported, so the order of
imports does not matter.

A tunnel class often reports a failed close only in its log. dstack logs
`Failed to close SSH tunnel, exit status: -11` and returns. So each operation also takes the return
code of the last ssh child it spawned: the subprocess instrumentation reports every reaped child to
the operation that was current when the child was spawned (`core.faults.SPAWN_OBSERVER`). A close
whose ssh child failed is a failure (span status ERROR, `stallwatch.ssh.tunnel.failures`), even if
nothing was raised. That part needs `STALLWATCH_INSTRUMENT_SUBPROCESS` (on by default).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from .. import journal, telemetry
from .._version import __version__
from ..core import scrub
from ..core.faults import FAULTS, SPAWN_OBSERVER, Deferred, first_record, instrument, meter, signal_name, unwrap_method
from ._lifecycle import ImportHooks, Installation

_log = logging.getLogger("stallwatch")
COMPONENT = "ssh"
SETTING = "STALLWATCH_INSTRUMENT_SSH"
DSTACK_TUNNEL_MODULE = "dstack._internal.core.services.ssh.tunnel"
MAX_HOST_CHARS = 255  # a DNS name has at most 253
_TUNNEL_METHODS = "_stallwatch_tunnel_methods"  # on an instrumented tunnel class: the names wrapped

Describe = Callable[[Any], Mapping[str, AttributeValue]]


class _Instruments:
    def __init__(self, tracer: trace.Tracer, durations: dict[str, Deferred], active: Any, failures: Any) -> None:
        self.tracer = tracer
        self.durations = durations
        self.active = active
        self.failures = failures


# Module globals, not the instrumentor's: `instrument_tunnel()` works on a tunnel class without the instrumentor.
_instruments: _Instruments | None = None
_instruments_meter_provider: Any = None
_open_tunnels: weakref.WeakSet[Any] = weakref.WeakSet()
_current: contextvars.ContextVar[_Operation | None] = contextvars.ContextVar("stallwatch_ssh_op", default=None)


def _get_instruments() -> _Instruments:
    """The instruments, made on first need; the durations and the active count start at zero, so that
    a backend sees the first tunnel as an increase."""
    global _instruments
    if _instruments is None:
        meter_ = meter(_instruments_meter_provider)
        _instruments = _Instruments(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__),
            durations={
                "open": Deferred(meter_, telemetry.SSH_TUNNEL_OPEN_DURATION),
                "close": Deferred(meter_, telemetry.SSH_TUNNEL_CLOSE_DURATION),
            },
            active=instrument(meter_, telemetry.SSH_TUNNEL_ACTIVE),
            failures=instrument(meter_, telemetry.SSH_TUNNEL_FAILURES),
        )
        for durations in _instruments.durations.values():
            durations.zero({})
        _instruments.active.add(0)
    return _instruments


class _Operation:
    """One open/close/check/exec call on a tunnel, with the return code of its last ssh child."""

    __slots__ = ("ended", "instruments", "journaled", "phase", "returncode", "span", "started")

    def __init__(self, phase: str, span_name: str, attributes: Mapping[str, AttributeValue]) -> None:
        self.instruments = _get_instruments()
        self.phase = phase
        self.started = perf_counter()
        self.returncode: int | None = None
        self.ended = False
        first_record()
        self.span = self.instruments.tracer.start_span(span_name, kind=SpanKind.CLIENT, attributes=attributes)
        self.journaled = journal.span_started(self.span, COMPONENT, durable=phase == "open")

    def child_exited(self, returncode: int) -> None:
        if not self.ended:
            self.returncode = returncode

    def end(self, instance: Any, error: BaseException | None) -> None:
        self.ended = True
        span = self.span
        labels: dict[str, str] = {telemetry.SSH_PHASE.name: self.phase}
        failed = error is not None
        if self.returncode is not None:
            span.set_attribute(telemetry.SSH_EXIT_STATUS.name, self.returncode)
            if self.returncode < 0:
                name = signal_name(-self.returncode)
                span.set_attribute(telemetry.EXIT_SIGNAL.name, name)
                labels[telemetry.EXIT_SIGNAL.name] = name
        if error is not None:
            labels[telemetry.ERROR_TYPE.name] = type(error).__qualname__
            span.record_exception(error)
        elif self.returncode and self.phase in ("open", "close"):
            failed = True
            labels[telemetry.ERROR_TYPE.name] = labels.get(telemetry.EXIT_SIGNAL.name) or str(self.returncode)
        if failed:
            span.set_attribute(telemetry.ERROR_TYPE.name, labels[telemetry.ERROR_TYPE.name])
            span.set_status(Status(StatusCode.ERROR, f"ssh tunnel {self.phase} failed"))
        span.end()
        journal.span_ended(span, started=self.journaled)
        if self.phase not in ("open", "close"):
            return
        self.instruments.durations[self.phase].record_now(perf_counter() - self.started, {})
        if failed:
            self.instruments.failures.add(1, labels)
        if self.phase == "open" and not failed and instance not in _open_tunnels:
            _open_tunnels.add(instance)
            self.instruments.active.add(1)
        elif self.phase == "close" and instance in _open_tunnels:
            _open_tunnels.discard(instance)
            self.instruments.active.add(-1)


def _begin(phase: str, span_name: str, instance: Any, describe: Describe) -> tuple[_Operation, object, object]:
    attributes = dict(describe(instance))
    operation = _Operation(phase, span_name, attributes)
    context_token = context_api.attach(trace.set_span_in_context(operation.span))
    observer_token = SPAWN_OBSERVER.set(operation.child_exited)
    return operation, context_token, observer_token


def _finish(
    operation: _Operation | None, tokens: tuple[object, object], instance: Any, error: BaseException | None
) -> None:
    if operation is None:
        return
    try:
        SPAWN_OBSERVER.reset(tokens[1])  # type: ignore[arg-type]
        context_api.detach(tokens[0])  # type: ignore[arg-type]
        operation.end(instance, error)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _wrapper(phase: str, span_name: str, describe: Describe, is_async: bool) -> Callable[..., Any]:
    def start(instance: Any) -> tuple[_Operation | None, tuple[object, object]]:
        try:
            operation, context_token, observer_token = _begin(phase, span_name, instance, describe)
        except Exception:
            FAULTS.record(COMPONENT, SETTING)
            return None, (None, None)
        return operation, (context_token, observer_token)

    if is_async:

        async def async_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            operation, tokens = start(instance)
            try:
                result = await wrapped(*args, **kwargs)
            except BaseException as error:
                _finish(operation, tokens, instance, error)
                raise
            _finish(operation, tokens, instance, None)
            return result

        return async_wrapper

    def sync_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        operation, tokens = start(instance)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as error:
            _finish(operation, tokens, instance, error)
            raise
        _finish(operation, tokens, instance, None)
        return result

    return sync_wrapper


def describe_generic(tunnel: Any) -> dict[str, AttributeValue]:
    """Destination host and port from `destination` ("user@host"), `hostname` or `host`, and `port`.

    Never the user name, and never an exception: an attribute that is missing, of another type or raises is
    left out; the host is scrubbed like a command-line argument and cut to `MAX_HOST_CHARS`.
    """
    attributes: dict[str, AttributeValue] = {}
    for name in ("destination", "hostname", "host"):
        host = _read(tunnel, name)
        if isinstance(host, str) and host:
            attributes[telemetry.SERVER_ADDRESS.name] = scrub.scrub_text(host.rpartition("@")[2], MAX_HOST_CHARS)
            break
    port = _read(tunnel, "port")
    if isinstance(port, int) and not isinstance(port, bool):
        attributes[telemetry.SERVER_PORT.name] = port
    return attributes


def _read(tunnel: Any, name: str) -> Any:
    """`tunnel.<name>`, or None if it is missing or raises."""
    try:
        return getattr(tunnel, name, None)
    except Exception:
        return None


def _socket_kind(socket: Any) -> str:
    return "unix" if "unix" in type(socket).__name__.lower() else "tcp"


def _forwards(tunnel: Any, name: str) -> list[Any]:
    """The socket pairs in `tunnel.<name>`; [] if they cannot be listed."""
    try:
        return list(_read(tunnel, name) or ())
    except Exception:
        return []


def _socket_kinds(pairs: list[Any]) -> str:
    """`tcp`, `unix` or `tcp,unix`: the kinds of socket on either side of the forwards."""
    kinds: set[str] = set()
    for pair in pairs:
        for side in ("local", "remote"):
            socket = _read(pair, side)
            if socket is not None:
                kinds.add(_socket_kind(socket))
        if len(kinds) == 2:  # no need to look at ten thousand more
            break
    return ",".join(sorted(kinds))


def describe_dstack(tunnel: Any) -> dict[str, AttributeValue]:
    """Attributes of a dstack `SSHTunnel`: destination without user, forwards, control socket, mode.

    Never raises (see `describe_generic`); forwards that cannot be listed count as none.
    """
    attributes = describe_generic(tunnel)
    local = _forwards(tunnel, "forwarded_sockets")
    remote = _forwards(tunnel, "reverse_forwarded_sockets")
    try:
        background = bool(getattr(tunnel, "background", True))
    except Exception:
        background = True
    attributes.update(
        {
            telemetry.SSH_FORWARDS_LOCAL.name: len(local),
            telemetry.SSH_FORWARDS_REMOTE.name: len(remote),
            telemetry.SSH_SOCKET_KINDS.name: _socket_kinds([*local, *remote]),
            telemetry.SSH_CONTROL_SOCKET.name: _read(tunnel, "control_sock_path") is not None,
            telemetry.SSH_BACKGROUND.name: background,
        }
    )
    return attributes


_SPANS = {
    "open": ("open", telemetry.SSH_OPEN_SPAN.name),
    "close": ("close", telemetry.SSH_CLOSE_SPAN.name),
    "check": ("check", telemetry.SSH_CHECK_SPAN.name),
    "exec": ("exec", telemetry.SSH_EXEC_SPAN.name),
}


def instrument_tunnel(
    cls: type,
    *,
    open: str | None = "open",
    close: str | None = "close",
    aopen: str | None = "aopen",
    aclose: str | None = "aclose",
    check: str | None = None,
    acheck: str | None = None,
    aexec: str | None = None,
    describe: Describe | None = None,
) -> None:
    """Record `ssh.tunnel.open`/`ssh.tunnel.close` spans and tunnel metrics for a tunnel class.

    Each keyword names the method of `cls` to wrap (None: do not wrap it). `open`/`close` are
    sync, `aopen`/`aclose` coroutines; `check`/`acheck` become `ssh.tunnel.check` spans and `aexec`
    `ssh.tunnel.exec`. `describe(tunnel)` returns span attributes; the default takes the host (never
    the user name) from `destination`/`hostname`/`host` and `port`. ssh children spawned inside
    each call nest under its span, and the return code of the last one decides whether a close
    that raised nothing failed. Calling it twice for the same class does nothing the second time.
    """
    if getattr(cls, _TUNNEL_METHODS, None) is not None:  # this class or a base it inherits from
        return
    describe = describe or describe_generic
    methods = {
        open: ("open", False), close: ("close", False), aopen: ("open", True), aclose: ("close", True),
        check: ("check", False), acheck: ("check", True), aexec: ("exec", True),
    }  # fmt: skip
    for method, (_operation, is_async) in methods.items():
        if method is None:
            continue
        target = getattr(cls, method, None)
        if target is None:
            raise AttributeError(f"stallwatch.instrument_tunnel: {cls.__qualname__} has no method {method!r}")
        if is_async != inspect.iscoroutinefunction(target):
            kind = "a coroutine function" if is_async else "a plain function"
            raise TypeError(f"stallwatch.instrument_tunnel: {cls.__qualname__}.{method} is not {kind}")
    wrapped = []
    for method, (operation, is_async) in methods.items():
        if method is not None:
            phase, span_name = _SPANS[operation]
            wrapt.wrap_function_wrapper(cls, method, _wrapper(phase, span_name, describe, is_async))
            wrapped.append(method)
    setattr(cls, _TUNNEL_METHODS, tuple(wrapped))


def uninstrument_tunnel(cls: type) -> None:
    """Undo `instrument_tunnel(cls)`: every method it wrapped is what it was before (a no-op if none)."""
    for method in vars(cls).get(_TUNNEL_METHODS, ()):
        unwrap_method(cls, method)
    if _TUNNEL_METHODS in vars(cls):
        delattr(cls, _TUNNEL_METHODS)


def _instrument_dstack(module: Any) -> None:
    try:
        instrument_tunnel(
            module.SSHTunnel,
            open="open", close="close", aopen="aopen", aclose="aclose",
            check="check", acheck="acheck", aexec="aexec", describe=describe_dstack,
        )  # fmt: skip
    except (AttributeError, TypeError) as error:
        _log.warning(
            "stallwatch: dstack's SSHTunnel does not look like 0.22.x (%s); its tunnels are not instrumented. "
            "%s=false silences this.",
            error,
            SETTING,
        )
    else:
        _get_instruments()  # the tunnel metrics at zero before the first tunnel


_HOOKS = ImportHooks()  # the instrumentation's, not an instrumentor's: `setup()` installs it without one


def install(**kwargs: Any) -> None:
    """`SSHTunnelInstrumentor.instrument()`'s work, with its keyword arguments (`meter_provider`)."""
    global _instruments_meter_provider
    _instruments_meter_provider = kwargs.get("meter_provider")
    _HOOKS.on_import(DSTACK_TUNNEL_MODULE, _instrument_dstack)


def uninstall(**kwargs: Any) -> None:
    _HOOKS.clear()
    tunnel_class = getattr(sys.modules.get(DSTACK_TUNNEL_MODULE), "SSHTunnel", None)
    if tunnel_class is not None:
        uninstrument_tunnel(tunnel_class)


INSTALLATION = Installation(install, uninstall)
