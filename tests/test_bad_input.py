"""Bad input: hostile or odd host values (huge, binary, non-UTF-8, None, ten thousand elements, objects whose
`__str__` raises) reach every function that turns them into attributes or log text, and none of them raises,
exceeds its bounds or lets a seeded secret through. `test_scrub` covers the scrubber itself; here it is the
builders around it, called directly, then driven end to end through each real wrapper in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry import context as context_api
from opentelemetry import metrics
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import otlp_items, run_python
from stallwatch import config, telemetry
from stallwatch.config import Settings
from stallwatch.core.faults import Counts, Deferred, instrument
from stallwatch.core.scrub import MAX_ARG_CHARS, MAX_ARGS, MAX_NAME_CHARS, TRUNCATED, clip_text, scrub_text
from stallwatch.instrument import executor as executor_module
from stallwatch.instrument import nebius, ssh
from stallwatch.instrument import subprocess as spawns
from stallwatch.instrument.work_item import ExecutorState, WorkerDied
from stallwatch.journal import Journal, JournalRecorder, ledger, read_segment

EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Hostile:
    """A value whose every conversion raises, as a buggy or malicious host object would."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ refuses")

    __repr__ = __str__

    def __fspath__(self) -> str:
        raise RuntimeError("__fspath__ refuses")

    def __bool__(self) -> bool:
        raise RuntimeError("__bool__ refuses")

    def __iter__(self) -> Iterator[object]:
        raise RuntimeError("__iter__ refuses")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints it
        printer.text("Hostile()")


class _Huge(str):
    """200,000 characters that print short in a falsifying example."""

    def __repr__(self) -> str:
        return f"<{len(self)} characters>"


class _HugeBytes(bytes):
    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


HUGE = _Huge("h" * 200_000)
NON_UTF8_PATH = os.fsencode("/srv/d\udcff\udcfeata/\udc80file")  # bytes that are no UTF-8
SURROGATES = os.fsdecode(b"/srv/\xff\xfe/\x80")  # what Python makes of such a path as str
ODD = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    st.none(),
    st.integers(),
    st.floats(),
    st.builds(Hostile),
    st.sampled_from(
        [HUGE, _HugeBytes(b"h" * 200_000), NON_UTF8_PATH, SURROGATES, Path(SURROGATES), "", b"", "\x00\n\t"]
    ),
)
SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._~-"


@st.composite
def seeded(draw: st.DrawFn) -> tuple[list[str], str]:
    """Words that carry a secret (starting "ZQ", which nothing else produces) where a secret goes."""
    secret = "ZQ" + draw(st.text(alphabet=SAFE, min_size=4, max_size=20))
    name = draw(st.sampled_from(["password", "api_token", "PGPASSWORD", "client_secret", "auth-key"]))
    words = draw(
        st.sampled_from(
            [
                [f"--{name}={secret}"],
                [f"--{name}", secret],
                [f"{name.upper().replace('-', '_')}={secret}"],
                [f"https://deploy:{secret}@git.example.com/repo.git"],
                [f"https://api.example.com/v1?{name}={secret}&page=2"],
                ["-H", f"Authorization: Bearer {secret}"],
            ]
        )
    )
    return words, secret


def check_value(value: object, limit: int) -> None:
    """One attribute value: an OpenTelemetry type, text of at most `limit` characters that encodes."""
    values = value if isinstance(value, (list, tuple)) else [value]
    assert len(values) <= MAX_ARGS
    for item in values:
        assert isinstance(item, (str, bool, int, float)), type(item)
        if isinstance(item, str):
            assert len(item) <= limit, len(item)
            item.encode("utf-8")  # no lone surrogate: an exporter would fail on the whole batch


def check_attributes(attributes: Mapping[str, object], limit: int = MAX_ARG_CHARS) -> None:
    for key, value in attributes.items():
        assert isinstance(key, str)
        check_value(value, limit)


# ---- the generic helpers the builders use ---------------------------------------------------------


@EXAMPLES
@given(ODD, seeded(), st.integers(1, 1000))
def test_scrub_text_and_clip_text_take_anything(value, seed, limit):
    words, secret = seed
    bound = min(max(limit, 28), MAX_ARG_CHARS)  # a limit below 28 leaves no room for the truncation marker
    check_value(scrub_text(value), MAX_ARG_CHARS)
    check_value(scrub_text([value, *words]), MAX_ARG_CHARS)
    scrubbed = scrub_text(" ".join(words), limit)
    check_value(scrubbed, bound)
    assert secret not in scrubbed and secret not in scrub_text(" ".join(words))
    clipped = clip_text(value, limit)
    assert clipped is None or (isinstance(value, str) and value and len(clipped) <= bound)
    assert clip_text("computeinstance-e00abc", limit) == "computeinstance-e00abc"  # never scrubbed: an id
    assert clip_text("0af7651916cd43dd8448eb211c80319c", 512) == "0af7651916cd43dd8448eb211c80319c"


@EXAMPLES
@given(st.text(st.characters(max_codepoint=127), max_size=700) | st.text(max_size=700), st.integers(1, 1000))
def test_clip_text_keeps_or_cuts_text_the_same_way_on_its_ascii_fast_path(text, limit):
    bound = min(max(limit, 28), MAX_ARG_CHARS)
    expected = text if len(text) <= bound else text[: bound - len(TRUNCATED)] + TRUNCATED  # (no lone surrogates here)
    assert clip_text(text, limit) == (expected or None)


# ---- subprocess: executable name, argument count, scrubbed arguments ------------------------------


def _spawn_attributes(record_args: bool, program: object, argv: list[object]) -> dict[str, Any]:
    return spawns.describe(program, argv, "asyncio", record_args)[1]


COMMANDS = st.one_of(
    st.lists(ODD, min_size=1, max_size=70),
    st.sampled_from([["echo"] * 10_000, ["echo", NON_UTF8_PATH, SURROGATES, HUGE], [Path(SURROGATES), "-v"]]),
)


@EXAMPLES
@given(COMMANDS, st.lists(seeded(), min_size=1, max_size=3), st.booleans(), st.booleans())
def test_spawn_attributes_from_any_command_line(argv, seeds, shell, record_args):
    command = ["/usr/bin/tool", *argv[:3], *(word for words, _ in seeds for word in words), *argv[3:]]
    if shell:  # Popen("...", shell=True): one command string
        text = " ".join(str(word) if isinstance(word, str) else "x" for word in command)
        program, recorded = spawns.popen_command((text,), {"shell": True})
    else:
        program, recorded = spawns.popen_command((command,), {"executable": argv[0]})
    attributes = _spawn_attributes(record_args, program, recorded)
    method = spawns.popen_method((command,), {"preexec_fn": argv[0], "user": argv[-1]})

    assert method in ("fork", "vfork")
    check_attributes(attributes)
    assert len(attributes[telemetry.PROCESS_EXECUTABLE_NAME.name]) <= MAX_NAME_CHARS
    assert attributes[telemetry.PROCESS_ARGS_COUNT.name] == len(recorded)
    assert (telemetry.PROCESS_COMMAND_ARGS.name in attributes) == record_args
    text = repr(attributes)
    assert not [secret for _, secret in seeds if secret in text], attributes


@pytest.mark.parametrize(
    "program", [None, 42, Hostile(), b"/bin/\xff", NON_UTF8_PATH, SURROGATES, HUGE, "", "PGPASSWORD=ZQx psql"]
)
def test_spawn_attributes_from_an_odd_program(program):
    attributes = _spawn_attributes(True, program, [program, "--token=ZQtoken-1"])
    check_attributes(attributes)
    assert "ZQ" not in repr(attributes)


# ---- ssh: the tunnel's destination, port, forwards and mode ----------------------------------------


def _tunnel(values: dict[str, object], raising: frozenset[str]) -> object:
    """A tunnel object with `values` as attributes, and properties named in `raising` that raise."""

    def refuse(self: object) -> object:
        raise RuntimeError("property refuses")

    namespace: dict[str, object] = {name: property(refuse) for name in raising}
    tunnel = type("Tunnel", (), namespace)()
    for name, value in values.items():
        if name not in raising:
            setattr(tunnel, name, value)
    return tunnel


PAIR = SimpleNamespace(local=type("UnixSocket", (), {})(), remote=type("IPSocket", (), {})())
FORWARDS = st.one_of(
    st.lists(st.sampled_from([PAIR, None, object(), Hostile()]), max_size=4),
    st.sampled_from([[PAIR] * 10_000, Hostile(), None, (p for p in [PAIR])]),
)
TUNNEL_FIELDS = ("destination", "hostname", "host", "port", "forwarded_sockets", "reverse_forwarded_sockets",
                 "control_sock_path", "background")  # fmt: skip


@EXAMPLES
@given(
    user=st.text(alphabet=SAFE, max_size=12),
    secret=st.text(alphabet=SAFE, min_size=4, max_size=20).map(lambda s: "ZQ" + s),
    host=st.one_of(st.text(max_size=30), st.sampled_from([HUGE, SURROGATES, "[::1]", "bastion.example.com"])),
    form=st.sampled_from(["user@host", "user:secret@host", "host", "odd"]),
    odd=ODD,
    port=st.one_of(st.integers(), st.booleans(), ODD),
    forwards=FORWARDS,
    reverse=FORWARDS,
    background=st.one_of(st.booleans(), ODD),
    raising=st.frozensets(st.sampled_from(TUNNEL_FIELDS)),
)
def test_tunnel_attributes_from_any_tunnel(user, secret, host, form, odd, port, forwards, reverse, background, raising):
    destination = {"user@host": f"ZQ{user}@{host}", "user:secret@host": f"{user}:{secret}@{host}", "host": host}
    values = {
        "destination": destination.get(form, odd),
        "hostname": odd,
        "port": port,
        "forwarded_sockets": forwards,
        "reverse_forwarded_sockets": reverse,
        "control_sock_path": odd,
        "background": background,
    }
    for describe in (ssh.describe_generic, ssh.describe_dstack):
        attributes = describe(_tunnel(values, raising))
        check_attributes(attributes, ssh.MAX_HOST_CHARS)
        assert "ZQ" not in repr(attributes), attributes  # never the user name, never the password
    if form != "odd" and "destination" not in raising and host.rpartition("@")[2] in ("[::1]", "bastion.example.com"):
        assert attributes[telemetry.SERVER_ADDRESS.name] == host


# ---- Nebius: the call's span, its attempt events and the ledger records ------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _Request:
    """What the instrumentation reads of a `nebius.aio.request.Request`."""

    def __init__(self, service: str, method: str, message: object, request_id: object, trace_id: object) -> None:
        self._service, self._method, self._input = service, method, message
        self._request_id, self._trace_id = request_id, trace_id


class _Operation:
    def __init__(self, operation_id: object, resource_id: object) -> None:
        self.id, self.resource_id = operation_id, resource_id

    def done(self) -> bool:
        return True


class _StatusError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(f"request failed with {code}")
        self.status = SimpleNamespace(code=SimpleNamespace(name=code))


IDS = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["computeinstance-e00abc123", "fakereq-0001", "0af7651916cd43dd8448eb211c80319c", HUGE]),
    ODD,
)


def _nebius_instruments() -> tuple[nebius._Instruments, InMemorySpanExporter]:
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    meter = metrics.NoOpMeter("test")
    instruments = nebius._Instruments(
        tracer=provider.get_tracer("test"),
        duration=Deferred(meter, telemetry.NEBIUS_CALL_DURATION),
        active=Counts(meter, telemetry.NEBIUS_CALLS_ACTIVE),
        created=instrument(meter, telemetry.CLOUD_RESOURCES_CREATED),
        deleted=instrument(meter, telemetry.CLOUD_RESOURCES_DELETED),
    )
    return instruments, spans


@EXAMPLES
@given(
    service=st.sampled_from(
        ["nebius.compute.v1.InstanceService", "nebius.compute.v1.DiskService", ".x.y.ZService", "", "."]
    ),
    method=st.sampled_from(["Create", "Delete", "Get", "List", ""]),
    message_id=IDS,
    request_id=IDS,
    trace_id=IDS,
    result=st.one_of(st.none(), st.builds(_Operation, IDS, IDS), st.just(Hostile()), st.just(object())),
    error=st.sampled_from(
        [None, TimeoutError(), asyncio.CancelledError(), _StatusError("NOT_FOUND"), _StatusError("NO_SUCH_CODE")]
    ),
    attempts=st.lists(st.sampled_from(["OK", "UNAVAILABLE", "CANCELLED", "nonsense"]), max_size=4),
    secret=st.text(alphabet=SAFE, min_size=4, max_size=20).map(lambda s: "ZQ" + s),
)
def test_nebius_call_attributes_and_ledger_records_from_any_request(
    service, method, message_id, request_id, trace_id, result, error, attempts, secret
):
    instruments, spans = _nebius_instruments()
    # The payload around the id is never read: a secret anywhere else in it must not come out.
    message = SimpleNamespace(
        id=message_id, name=f"vm-{secret}", labels={"api_token": secret}, spec=SimpleNamespace(user_data=secret)
    )
    request = _Request(service, method, message, request_id, trace_id)
    cloud_log = logging.getLogger(ledger.LOGGER_NAME)
    records = _Records()
    cloud_log.addHandler(records)
    previous = ledger.set_recorder(ledger.LogRecorder())
    try:
        call = nebius._Call(instruments, request, context_api.get_current(), time.time_ns())
        for code in attempts:
            call.attempt()
            call.attempt_ended(code)
        call.finish(request, result, error, time.time_ns(), 0.01)
        call.complete(instruments)
    finally:
        ledger.set_recorder(previous)
        cloud_log.removeHandler(records)

    (span,) = spans.get_finished_spans()
    assert len(span.name) <= 2 * MAX_NAME_CHARS
    check_attributes(span.attributes)
    for event in span.events:
        check_attributes(event.attributes)
    assert secret not in repr((span.name, span.attributes, [e.attributes for e in span.events]))
    for record in records.records:
        text = record.getMessage()
        extras = {k: v for k, v in record.__dict__.items() if k.startswith(("stallwatch.", "rpc."))}
        assert len(text) <= 100 and secret not in text + repr(extras)
        check_attributes(extras, ledger.MAX_FIELD_CHARS)


class _CodeError(Exception):
    """An error with a gRPC-style `code()`, which may itself fail or answer something odd."""

    def __init__(self, code: object) -> None:
        super().__init__("attempt failed")
        self._code = code

    def code(self) -> object:
        if isinstance(self._code, BaseException):
            raise self._code
        return self._code


@EXAMPLES
@given(
    code=st.one_of(
        st.builds(SimpleNamespace, name=st.one_of(st.sampled_from(["UNAVAILABLE", "NO_SUCH_CODE", ""]), ODD)),
        st.sampled_from([None, RuntimeError("code() refuses"), TypeError("code() takes arguments"), "UNAVAILABLE"]),
    )
)
def test_a_failed_attempt_is_recorded_from_any_error_and_the_error_reaches_the_caller_unchanged(code):
    instruments, _ = _nebius_instruments()
    request = _Request("nebius.compute.v1.InstanceService", "Get", None, None, None)
    call = nebius._Call(instruments, request, context_api.get_current(), time.time_ns())
    error = _CodeError(code)

    async def attempt() -> None:
        raise error

    token = nebius._current.set(call)
    try:
        with pytest.raises(BaseException) as caught:
            nebius._attempt_wrapper(attempt, None, (), {}).send(None)
    finally:
        nebius._current.reset(token)
    assert caught.value is error
    assert len(call.attempt_events) == 1
    attributes, _ = call._attempt_event(0)  # what the span's attempt event will carry
    check_attributes(attributes)


# ---- executor: the executor's name, and the error a healed future gets ---------------------------


class _Executor:
    def __init__(self, prefix: object) -> None:
        self._thread_name_prefix = prefix


@EXAMPLES
@given(prefix=st.one_of(st.text(max_size=40), st.sampled_from([HUGE, SURROGATES, "", None, b"pool", 7, "asyncio"])))
def test_executor_attributes_from_any_thread_name_prefix(prefix):
    # ThreadPoolExecutor takes any thread_name_prefix it can `%s`-format into thread names.
    executor = _Executor(prefix)
    state = ExecutorState(executor_module.executor_name(executor), weakref.ref(executor))
    check_attributes(state.attributes, MAX_NAME_CHARS)
    assert isinstance(state.name, str) and f"{state.name} work item"


class _LoudError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ refuses")


@EXAMPLES
@given(
    thread_name=st.one_of(st.text(max_size=30), st.just(HUGE)),
    cause=st.sampled_from([None, SystemExit("stop"), TimeoutError(HUGE), _LoudError(), KeyError(SURROGATES)]),
    dequeued_only=st.booleans(),
)
def test_the_error_of_a_healed_future_is_built_from_any_dead_worker(thread_name, cause, dequeued_only):
    error = WorkerDied(thread_name, cause, dequeued_only)
    message = str(error)
    assert len(message) <= 2 * MAX_ARG_CHARS
    message.encode("utf-8")
    assert error.cause is cause


# ---- the ledger and the journal: intents and outcomes of any shape ---------------------------------


_FAST_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # a journal preallocates 1 MiB per file
LEDGER_FIELDS = st.one_of(
    st.text(max_size=30), st.sampled_from(["create", "delete", HUGE, SURROGATES, "", "0" * 32]), ODD
)


@EXAMPLES
@given(
    intent_fields=st.tuples(*[LEDGER_FIELDS] * 6),
    outcome_fields=st.tuples(st.booleans(), *[LEDGER_FIELDS] * 4),
)
def test_ledger_records_and_journal_frames_from_any_intent_and_outcome(intent_fields, outcome_fields):
    intent = ledger.Intent(*intent_fields)
    outcome = ledger.Outcome(*outcome_fields)
    for value in (*(getattr(intent, name) for name in intent.__slots__),
                  *(getattr(outcome, name) for name in outcome.__slots__)):  # fmt: skip
        assert value is None or isinstance(value, (bool, int)) or len(value) <= ledger.MAX_FIELD_CHARS
    cloud_log = logging.getLogger(ledger.LOGGER_NAME)
    records = _Records()
    cloud_log.addHandler(records)
    failures: list[int] = []
    with tempfile.TemporaryDirectory(dir=_FAST_DIR) as directory:
        journal = Journal(Path(directory) / "journal", on_error=lambda: failures.append(1))
        recorder = JournalRecorder(journal, ledger.LogRecorder())
        try:
            recorder.intent(intent)
            recorder.outcome(intent, outcome)
        finally:
            journal.close()
            cloud_log.removeHandler(records)
        (segment,) = (read_segment(path) for path in (Path(directory) / "journal").glob("*.journal"))
    assert failures == [] and segment.corruption == []
    assert [r["type"] for r in segment.records] == ["open", "intent", "outcome", "close"]
    assert len(records.records) == 2
    for record in records.records:
        check_attributes({k: v for k, v in record.__dict__.items() if k.startswith("stallwatch.")})


def test_one_unencodable_record_costs_the_journal_that_record_alone(tmp_path):
    failures: list[int] = []
    journal = Journal(tmp_path / "journal", on_error=lambda: failures.append(1))
    intent = ledger.Intent("create", "compute.instance", "svc/Create", "1" * 32, "2" * 16)
    journal.cloud_intent(intent)
    journal.freeze_started("gil_held", "unknown", time.time_ns(), {"odd": Hostile()})  # json's `str()` raises
    journal.freeze_started("gil_held", "unknown", time.time_ns(), {"stacks": "s" * (2 << 20)})  # over the frame limit
    journal.freeze_ended("thawed")
    journal.cloud_outcome(intent, ledger.Outcome(True, "OK", "op-1", "res-1"))
    journal.close()
    (path,) = (tmp_path / "journal").glob("*.journal")
    segment = read_segment(path)
    assert segment.corruption == [] and len(failures) == 2
    assert [r["type"] for r in segment.records] == ["open", "intent", "freeze_end", "outcome", "close"]


def test_the_journal_creates_every_missing_directory_private(tmp_path):
    journal = Journal(tmp_path / "state" / "stallwatch" / "journal")
    journal.cloud_intent(ledger.Intent("create", "compute.disk", "svc/Create", "1" * 32, "2" * 16))
    journal.close()
    for directory in (
        tmp_path / "state",
        tmp_path / "state" / "stallwatch",
        tmp_path / "state" / "stallwatch" / "journal",
    ):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


# ---- settings: any value of any setting parses, or falls back naming it -----------------------------------

VARIABLES = sorted(
    {option.env for option in config.OPTIONS if option.keyword}
    | {f"OTEL_EXPORTER_OTLP_{s}_{k}" for s in ("TRACES", "METRICS", "LOGS") for k in ("ENDPOINT", "PROTOCOL")}
    | set(config.SDK_VARIABLES) - {"OTEL_PROPAGATORS"}  # read at import (tests/test_otel_env.py), not here
)
VALUES = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789.-e~/²١", max_size=12),
    st.sampled_from(["~nosuchuser-zz/x", "http://[::1", "a{99999999999}", "9" * 5000, HUGE, SURROGATES, "1e999"]),
)


_SEED = (["--password", "ZQseeded"], "ZQseeded")


@EXAMPLES
@given(variable=st.sampled_from(VARIABLES), value=VALUES, seed=seeded(), where=st.sampled_from(["alone", "in"]))
@example("STALLWATCH_LOG_LEVEL", "²", _SEED, "alone")  # a digit `int()` refuses
@example("STALLWATCH_LOG_LEVEL", "9" * 5000, _SEED, "alone")  # more digits than `int()` converts
@example("STALLWATCH_JOURNAL_DIR", "9" * 5000, _SEED, "alone")  # a path too long to make: its reason names it
@example("STALLWATCH_FILE_DIR", "~nosuchuser-zz/x", _SEED, "alone")  # `expanduser()` raises
@example("OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1", _SEED, "alone")  # `urlsplit()` raises
@example("STALLWATCH_SCRUB_PATTERNS", "a{99999999999}", _SEED, "alone")  # `re.compile()` overflows
@example("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "ftp://collector:ZQseeded@otel.internal", _SEED, "in")
@example("OTEL_RESOURCE_ATTRIBUTES", "deployment=prod,api_token:ZQseeded", _SEED, "in")
def test_any_value_of_any_setting_parses_or_falls_back_naming_it(variable, value, seed, where):
    words, secret = seed
    for text in (value, " ".join(words) if where == "alone" else f"{value} {' '.join(words)}"):
        for problem in Settings.load(environ={variable: text}).problems:
            message = str(problem)
            assert problem.setting == variable and message.startswith(f"{variable}="), message
            assert len(message) < 2 * MAX_ARG_CHARS + 400 and secret not in message
            message.encode("utf-8")


class _HostileSetting:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ refuses")

    __str__ = __repr__


@pytest.mark.parametrize("keyword", config.KEYWORDS)
def test_a_hostile_keyword_value_falls_back_naming_the_keyword(keyword):
    settings = Settings.load(environ={}, **{keyword: _HostileSetting()})

    assert settings == Settings.load(environ={})
    (problem,) = settings.problems
    assert problem.setting == keyword and str(problem).startswith(f"{keyword}=<_HostileSetting object> is invalid")


def test_an_endpoint_with_a_password_is_refused_without_showing_it():
    (problem,) = Settings.load(
        environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector:CfgEndpointPw-1@otel.internal"}
    ).problems
    assert "CfgEndpointPw-1" not in str(problem)
    assert str(problem).startswith("OTEL_EXPORTER_OTLP_ENDPOINT='ftp://[REDACTED]@otel.internal' is invalid")


# ---- end to end: each real wrapper with hostile input, in a fresh interpreter ------------------------


def test_every_wrapper_takes_hostile_input_and_keeps_its_attributes_bounded(tmp_path):
    proc = run_python(
        f"""
        import asyncio, concurrent.futures, json, os, subprocess
        import stallwatch

        stallwatch.setup(file_dir={str(tmp_path / "telemetry")!r}, journal_dir={str(tmp_path / "journal")!r},
                         watchdog=False, record_args=True, metric_export_interval_ms=3600000)
        from stallwatch.instrument.ssh import describe_dstack

        result = {{}}

        def outcome(name, call):
            try:
                result[name] = call()
            except Exception as exc:
                result[name] = f"raised {{type(exc).__name__}}: {{exc}}"

        # subprocess: ten thousand arguments, non-UTF-8 bytes, a generator of arguments
        outcome("many", lambda: subprocess.run(["true", *["--token=ZQmany"] * 10_000]).returncode)
        outcome("bytes", lambda: subprocess.run([b"/bin/echo", {NON_UTF8_PATH!r}, b"\\xff"],
                                                 capture_output=True).returncode)
        outcome("generator", lambda: subprocess.run((w for w in ["echo", "hi"]), capture_output=True,
                                                    text=True).stdout)

        # ssh: a destination of 200,000 characters with a password, ten thousand forwards, a raising property
        class Tunnel:
            destination = "deploy:ZQsshpw@" + "h" * 200_000
            port = 22
            forwarded_sockets = [object()] * 10_000
            @property
            def hostname(self):
                raise RuntimeError("no")
            def open(self):
                return subprocess.run(["true"]).returncode
            def close(self):
                return 0
        stallwatch.instrument_tunnel(Tunnel, aopen=None, aclose=None, describe=describe_dstack)
        outcome("tunnel", lambda: Tunnel().open())

        # executor: a 200,000-character thread name prefix, arguments whose str() raises
        class Loud:
            def __str__(self):
                raise RuntimeError("no")
            __repr__ = __str__
        def submit():
            with concurrent.futures.ThreadPoolExecutor(thread_name_prefix="p" * 200_000) as pool:
                return pool.submit(lambda value: type(value).__name__, Loud()).result()
        outcome("executor", submit)

        # Nebius and the ledger: deleting an instance by an id of 100,000 characters, which the server does not know
        from nebius.aio.service_error import RequestError
        from nebius.api.nebius.compute.v1 import DeleteInstanceRequest, InstanceServiceClient
        from support.fake_nebius import FakeNebius, sdk_for

        async def delete():
            with FakeNebius() as fake:
                async with sdk_for(fake.address) as sdk:
                    try:
                        await InstanceServiceClient(sdk).delete(DeleteInstanceRequest(id="i" * 100_000), timeout=5)
                    except RequestError as error:
                        return type(error).__name__
        outcome("nebius", lambda: asyncio.run(delete()))
        stallwatch.shutdown(10)
        print(json.dumps(result))
        """
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "many": 0, "bytes": 0, "generator": "hi\n", "tunnel": 0, "executor": "Loud", "nebius": "RequestError",
    }  # fmt: skip
    assert "instrumentation failed" not in proc.stderr, proc.stderr
    spans = otlp_items(tmp_path / "telemetry" / "traces.jsonl", "spans")
    assert {"true", "echo", "ssh.tunnel.open", "nebius.compute.v1.InstanceService/Delete"} <= {s["name"] for s in spans}
    for span in spans:
        assert len(span["name"]) <= MAX_ARG_CHARS
        for attribute in span.get("attributes", []):
            value = next(iter(attribute["value"].values()))
            values = value.get("values", []) if isinstance(value, dict) else [{"stringValue": value}]
            assert len(values) <= MAX_ARGS, attribute["key"]
            for item in values:
                assert len(str(next(iter(item.values()), ""))) <= MAX_ARG_CHARS, attribute["key"]
    for path in (tmp_path / "telemetry").glob("*.jsonl"):
        # The secrets seeded above, whole: log records carry source paths, and a checkout in a
        # `mktemp -d` directory (/tmp/tmp.Nq596ZQyIj, as CI once drew) can hold the bare prefix.
        assert not [secret for secret in ("ZQmany", "ZQsshpw") if secret in path.read_text()], path
        assert max(map(len, path.read_text().splitlines()), default=0) < 100_000, path
    (segment,) = (read_segment(path) for path in (tmp_path / "journal").glob("*.journal"))
    assert segment.corruption == [] and {"intent", "outcome"} <= {r["type"] for r in segment.records}
    assert max(len(json.dumps(record)) for record in segment.records) < 10_000
