"""paramiko instrumentation: `ssh.connection`, `ssh.command` and `ssh.sftp` spans, with the SSH metrics.

`ParamikoInstrumentor` wraps `paramiko` once imported (`setup()` runs it unless `STALLWATCH_INSTRUMENT_SSH=false`);
a paramiko without the private names it wraps is left untouched, with one WARNING naming the setting.

- `ssh.connection` runs from `SSHClient.connect` to `close` (a connect that raises ends it in ERROR);
  `stallwatch.ssh.auth` says whether the server accepted the credentials.
- `ssh.command` starts before `Channel.exec_command` sends its request and ends as soon as the channel
  knows how the command ended: the server's `exit-status` or `exit-signal` (its handler-table entry,
  run on paramiko's transport thread, is wrapped: paramiko drops `exit-signal`, and `recv_exit_status`
  sees only statuses the host reads), else the channel's close (`Channel._set_closed`, every close).
- `ssh.sftp` runs from `SSHClient.open_sftp` until the SFTP channel closes.

Recorded: the destination host, scrubbed; the command line only with `STALLWATCH_RECORD_ARGS=true`,
scrubbed; never the user name.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from .. import journal, telemetry
from .._version import __version__
from ..core import scrub
from ..core.faults import FAULTS, Deferred, instrument, unwrap_method
from ._lifecycle import ImportHooks, is_wrapper, start_meter, start_settings
from .tunnels import MAX_HOST_CHARS

_log = logging.getLogger("stallwatch")
COMPONENT = "ssh"
SETTING = "STALLWATCH_INSTRUMENT_SSH"
MODULE = "paramiko"
DEFAULT_PORT = 22
_CLIENT_METHODS = ("connect", "close", "open_sftp")
_CHANNEL_METHODS = ("exec_command", "_set_closed")
_ERROR_TYPE = telemetry.ERROR_TYPE.name


@dataclass
class _State:
    tracer: trace.Tracer
    connect_duration: Deferred
    command_duration: Deferred
    active: Any
    failures: Any
    record_args: bool
    patterns: Sequence[re.Pattern[str]]


# The instrumentor's state while it is on (it holds it too): a module global because the wrappers are module
# functions that wrapt puts on paramiko's classes, shared by every instance.
_state: _State | None = None
_lock = threading.Lock()  # guards the maps below: channels end on paramiko's transport thread
_connections: weakref.WeakKeyDictionary[Any, _Connection] = weakref.WeakKeyDictionary()  # by SSHClient
_peers: weakref.WeakKeyDictionary[Any, dict[str, AttributeValue]] = weakref.WeakKeyDictionary()  # by Transport
_channels: weakref.WeakKeyDictionary[Any, _ChannelSpan] = weakref.WeakKeyDictionary()  # by Channel


def _guard(action: Callable[..., None], *args: Any) -> None:
    try:
        action(*args)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)


def _fail(span: trace.Span, error_type: str, description: str) -> None:
    span.set_attribute(_ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, description))


class _Connection:
    """One `SSHClient` connection: its span from connect to close."""

    __slots__ = ("journaled", "peer", "span", "started", "state")

    def __init__(self, state: _State, peer: dict[str, AttributeValue]) -> None:
        self.state = state
        self.peer = peer
        self.started = perf_counter()
        self.span = state.tracer.start_span(telemetry.SSH_CONNECTION_SPAN.name, kind=SpanKind.CLIENT, attributes=peer)
        self.journaled = journal.span_started(self.span, COMPONENT)

    def connected(self, client: Any) -> None:
        seconds = perf_counter() - self.started
        self.state.connect_duration.record_now(seconds, {})
        self.span.set_attribute(telemetry.SSH_AUTH.name, "success")
        self.span.add_event("stallwatch.ssh.connected", {"seconds": seconds})
        transport = client.get_transport()
        with _lock:
            previous = _connections.get(client)
            _connections[client] = self
            if transport is not None:
                _peers[transport] = self.peer
        if previous is not None:  # connect() again on the same client replaces its connection
            previous.closed()
        self.state.active.add(1)

    def failed(self, error: BaseException) -> None:
        self.state.connect_duration.record_now(perf_counter() - self.started, {})
        labels = {_ERROR_TYPE: type(error).__qualname__}
        if any(cls.__name__ == "AuthenticationException" for cls in type(error).__mro__):
            labels[telemetry.SSH_AUTH.name] = "failure"
            self.span.set_attribute(telemetry.SSH_AUTH.name, "failure")
        self.span.record_exception(error)
        _fail(self.span, labels[_ERROR_TYPE], "ssh connect failed")
        self._end()
        self.state.failures.add(1, labels)

    def closed(self) -> None:
        self._end()
        self.state.active.add(-1)

    def _end(self) -> None:
        self.span.end()
        journal.span_ended(self.span, started=self.journaled)


class _ChannelSpan:
    """An `ssh.command` or `ssh.sftp` span, ended once by whichever of its channel's endings comes first."""

    __slots__ = ("command", "journaled", "span", "started", "state")

    def __init__(self, state: _State, name: str, attributes: Mapping[str, AttributeValue], command: bool) -> None:
        self.state = state
        self.command = command
        self.started = perf_counter()
        self.span = state.tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        self.journaled = journal.span_started(self.span, COMPONENT)

    def end(self, status: int | None, signal: str | None, error: BaseException | None) -> None:
        span = self.span
        error_type: str | None = None
        if error is not None:
            error_type = type(error).__qualname__
            span.record_exception(error)
        elif self.command:
            if status is not None:
                span.set_attribute(telemetry.SSH_COMMAND_EXIT_STATUS.name, status)
            if signal is not None:
                span.set_attribute(telemetry.EXIT_SIGNAL.name, signal)
                error_type = signal
            elif status is None:
                error_type = "closed"
            elif status != 0:
                error_type = str(status)
        if error_type is not None:
            _fail(span, error_type, "remote command failed" if self.command else "sftp session failed")
        span.end()
        journal.span_ended(span, started=self.journaled)
        if self.command:
            labels = {_ERROR_TYPE: error_type} if error_type is not None else {}
            self.state.command_duration.record_now(perf_counter() - self.started, labels)


def _peer(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """`server.address` (scrubbed, without any `user@`) and `server.port` of `connect(hostname, port, ...)`."""
    host = args[0] if args else kwargs.get("hostname")
    port = args[1] if len(args) > 1 else kwargs.get("port", DEFAULT_PORT)
    attributes: dict[str, AttributeValue] = {}
    if isinstance(host, str) and host:
        attributes[telemetry.SERVER_ADDRESS.name] = scrub.scrub_text(host.rpartition("@")[2], MAX_HOST_CHARS)
    if isinstance(port, int) and not isinstance(port, bool):
        attributes[telemetry.SERVER_PORT.name] = port
    return attributes


def _transport_peer(transport: Any) -> dict[str, AttributeValue]:
    """The peer its `SSHClient.connect` named, else the socket's address (a Transport the host made itself)."""
    with _lock:
        peer = _peers.get(transport)
    if peer is not None:
        return dict(peer)
    try:
        address, port = transport.getpeername()[:2]
    except Exception:  # closed, or not a socket: the span goes without
        return {}
    return {telemetry.SERVER_ADDRESS.name: str(address), telemetry.SERVER_PORT.name: int(port)}


def _connect(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    state = _state
    if state is None or not is_instrumentation_enabled():
        return wrapped(*args, **kwargs)
    try:
        connection: _Connection | None
        connection = _Connection(state, _peer(args, kwargs))
        token: object = context_api.attach(trace.set_span_in_context(connection.span))
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
        connection, token = None, None
    try:
        result = wrapped(*args, **kwargs)
    except BaseException as error:
        if connection is not None:
            _guard(context_api.detach, token)
            _guard(connection.failed, error)
        raise
    if connection is not None:
        _guard(context_api.detach, token)
        _guard(connection.connected, instance)
    return result


def _close(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    try:
        return wrapped(*args, **kwargs)
    finally:
        with _lock:
            connection = _connections.pop(instance, None)
        if connection is not None:
            _guard(connection.closed)


def _register(channel: Any, operation: _ChannelSpan) -> None:
    with _lock:
        _channels[channel] = operation


def _end_channel(channel: Any, status: int | None, signal: str | None, error: BaseException | None) -> None:
    with _lock:
        operation = _channels.pop(channel, None)
    if operation is not None:
        operation.end(status, signal, error)


def _exec_command(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    state = _state
    if state is None or not is_instrumentation_enabled():
        return wrapped(*args, **kwargs)
    try:
        command = args[0] if args else kwargs.get("command")
        attributes: dict[str, Any] = _transport_peer(instance.transport)
        attributes[telemetry.PROCESS_EXECUTABLE_NAME.name] = scrub.executable_name(command)
        if state.record_args:
            attributes[telemetry.PROCESS_COMMAND_ARGS.name] = scrub.scrub_args([command], state.patterns)
        _register(instance, _ChannelSpan(state, telemetry.SSH_COMMAND_SPAN.name, attributes, command=True))
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
    try:
        return wrapped(*args, **kwargs)
    except BaseException as error:
        _guard(_end_channel, instance, None, None, error)
        raise


def _exit_request(message: Any) -> tuple[str, str | None] | None:
    """("exit-status", None) or ("exit-signal", "SIGKILL") for a channel request that ends a command, without
    moving the message's read position; None for any other request."""
    peek = type(message)(message.get_remainder())
    key = peek.get_text()
    if key == "exit-status":
        return key, None
    if key == "exit-signal":
        peek.get_boolean()  # want-reply
        return key, "SIG" + (scrub.clip_text(peek.get_text(), scrub.MAX_NAME_CHARS) or "?")
    return None


def _channel_request(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The handler-table entry `Channel._handle_request(channel, message)`: a plain function, so no `instance`."""
    channel = args[0] if args else None
    if not _channels or channel not in _channels:
        return wrapped(*args, **kwargs)
    try:
        request = _exit_request(args[1])
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
        request = None
    result = wrapped(*args, **kwargs)
    if request is not None:
        key, signal = request
        status = getattr(channel, "exit_status", None) if key == "exit-status" else None
        _guard(_end_channel, channel, status if isinstance(status, int) else None, signal, None)
    return result


def _channel_closed(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    if _channels and instance in _channels:
        _guard(_end_channel, instance, None, None, None)
    return result


def _open_sftp(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    state = _state
    if state is None or not is_instrumentation_enabled():
        return wrapped(*args, **kwargs)
    try:
        transport = instance.get_transport()
        attributes = _transport_peer(transport) if transport is not None else {}
        session: _ChannelSpan | None = _ChannelSpan(state, telemetry.SSH_SFTP_SPAN.name, attributes, command=False)
    except Exception:
        FAULTS.record(COMPONENT, SETTING)
        session = None
    try:
        sftp = wrapped(*args, **kwargs)
    except BaseException as error:
        if session is not None:
            _guard(session.end, None, None, error)
        raise
    if session is not None:
        _guard(_watch_sftp_channel, sftp, session)
    return sftp


def _watch_sftp_channel(sftp: Any, session: _ChannelSpan) -> None:
    channel = sftp.sock
    _register(channel, session)
    if channel.closed:  # closed before it was registered: nothing else will end the span
        _end_channel(channel, None, None, None)


def _handler_table(module: Any) -> tuple[dict[Any, Any], Any] | None:
    """paramiko's `Transport._channel_handler_table` and its key for channel requests, if both are there."""
    table = getattr(getattr(module, "Transport", None), "_channel_handler_table", None)
    key = getattr(getattr(module, "common", None), "MSG_CHANNEL_REQUEST", None)
    return (table, key) if isinstance(table, dict) and key in table else None


def supported(module: Any) -> str | None:
    """None when paramiko has the methods and the handler table wrapped here, else what is missing."""
    for owner, names in (("SSHClient", _CLIENT_METHODS), ("Channel", _CHANNEL_METHODS)):
        cls = getattr(module, owner, None)
        if cls is None:
            return f"paramiko.{owner} is missing"
        for name in names:
            if not callable(getattr(cls, name, None)):
                return f"paramiko.{owner}.{name} is missing"
    if _handler_table(module) is None:
        return "paramiko.Transport._channel_handler_table has no channel request handler"
    return None


def _patch(module: Any) -> None:
    problem = supported(module)
    if problem is not None:
        _log.warning(
            "stallwatch: paramiko %s is not supported (%s); its connections are not instrumented. "
            "%s=false silences this.",
            getattr(module, "__version__", "?"),
            problem,
            SETTING,
        )
        return
    wrappers = (
        (module.SSHClient, "connect", _connect),
        (module.SSHClient, "close", _close),
        (module.SSHClient, "open_sftp", _open_sftp),
        (module.Channel, "exec_command", _exec_command),
        (module.Channel, "_set_closed", _channel_closed),
    )
    for owner, name, wrapper in wrappers:
        if not is_wrapper(vars(owner).get(name)):  # instrument() again: no second layer
            wrapt.wrap_function_wrapper(owner, name, wrapper)
    table, key = _handler_table(module)  # type: ignore[misc]
    if not is_wrapper(table[key]):
        table[key] = wrapt.FunctionWrapper(table[key], _channel_request)


class ParamikoInstrumentor(BaseInstrumentor):
    """Spans for paramiko connections, remote commands and SFTP sessions (see the module docstring).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global ones)
    and `settings` (a `stallwatch.Settings`: argument recording and scrub patterns; default: read from
    the environment).
    """

    _state: _State | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("paramiko >= 2.7",)

    def _instrument(self, **kwargs: Any) -> None:
        global _state

        settings = start_settings(kwargs, "paramiko")
        if settings is None:
            return
        meter_ = start_meter(kwargs)
        self._state = _state = _State(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__, kwargs.get("tracer_provider")),
            connect_duration=Deferred(meter_, telemetry.SSH_CONNECT_DURATION),
            command_duration=Deferred(meter_, telemetry.SSH_COMMAND_DURATION),
            active=instrument(meter_, telemetry.SSH_CONNECTIONS_ACTIVE),
            failures=instrument(meter_, telemetry.SSH_CONNECTION_FAILURES),
            record_args=settings.record_args,
            patterns=settings.scrub_patterns,
        )
        _state.connect_duration.zero({})
        _state.active.add(0)  # a backend sees the first connection as an increase
        ImportHooks.of(self).on_import(MODULE, _patch)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _state
        self._state = _state = None
        ImportHooks.of(self).clear()
        module = sys.modules.get(MODULE)
        if module is None:
            return
        for owner, names in ((module.SSHClient, _CLIENT_METHODS), (module.Channel, _CHANNEL_METHODS)):
            for name in names:
                unwrap_method(owner, name)
        found = _handler_table(module)
        if found is not None and is_wrapper(found[0][found[1]]):
            found[0][found[1]] = found[0][found[1]].__wrapped__
