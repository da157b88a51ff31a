"""The last check at the exit: a wrapper that records host data without scrubbing it (a span, its events and
status, a log record of a stallwatch logger, the journal's records of that span, the heartbeat's spawn name)
still leaks nothing, in a real host with the file and OTLP exporters and the journal on. Ids stay, and so do
the host's own spans: they are the host's to scrub."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from conftest import attrs, clean_env, otlp_items, run_python
from secrets_corpus import CORPUS, ENVIRONMENT, ENVIRONMENT_SECRETS, URLS
from secrets_corpus import TOKENS as CORPUS_TOKENS
from stallwatch.core.scrub import REDACTED, scrub_attributes, scrub_value
from stallwatch.export import exit_check
from support.fast_paths import fast_paths_off, fast_paths_on  # noqa: F401  # fixtures
from support.host_providers import by_scope, run_host_providers

pytestmark = pytest.mark.matrix  # a leak on an old SDK fails the matrix (property tests: test_exit_check_properties)

TESTS = Path(__file__).parent
# Secrets no rule lists by name: only their shape or place gives them away.
TOKENS = {
    "span_name": "Zq7LmN4vBw7KpR3tYs9DfG6hJc2Xa8",
    "attribute": "ghp_ExitCheck5301abcdefghijklmnopqrstuvwx",
    "argv": "ExitArgvGlued-5302",
    "event": "Tb4Xn9QwE2rPz7LkV5mC8yHs3Gd6Jf",
    "status": "sk_live_ExitCheckStatus5303abcdefgh",
    "hook": "ExitHookSecret5304abcdefgh",
    "log": "Pq2Wd8Zr5Ty1Ux7Vb4Nm9Kc3Hj6Lg0A",
    "log_attribute": "xoxb-5305-5306-ExitCheckSlackabcdef",
    "heartbeat": "Rk8Fs2Ld5Mw9Qz3Xc7Vb1Nh4Jg6Tp0E",
    "nested_journal": "Jn5Cb8Xv2Mz7Lk4Qw9Er1Ty6Ui3Op0A",
}
RESOURCE_ID = "computeinstance-e00exitcheck5307"
NEBIUS_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"  # an id that looks like a hex token, kept by design
HOST_VALUE = "Bearer HostOwnValue-5308"  # the host's own span: not stallwatch's to change

HOST = f"""
import json, logging
import stallwatch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from stallwatch import journal
from stallwatch.detect import heartbeat

session = stallwatch.setup()
assert session.error is None, session.error
t = {json.dumps(TOKENS)}
careless = trace.get_tracer("stallwatch")  # a wrapper of stallwatch's that forgets to scrub
with careless.start_as_current_span("deploy " + t["span_name"], attributes={{
    "stallwatch.test.value": "token " + t["attribute"],
    "stallwatch.test.args": ["mysql", "-uroot", "-p" + t["argv"], "shop"],
    "stallwatch.cloud.resource.id": {RESOURCE_ID!r},
    "stallwatch.nebius.trace_id": {NEBIUS_TRACE_ID!r},
}}) as span:
    token = journal.span_started(span, "test", durable=True)
    span.set_attribute("stallwatch.test.later", {{"nested": t["nested_journal"]}}["nested"])
    span.add_event("attempt", {{"message": "retrying with " + t["event"]}})
    span.set_status(Status(StatusCode.ERROR, "refused " + t["status"]))
    journal.span_ended(span, durable=True, started=None)
logging.getLogger("stallwatch.test").warning(
    "posted to https://hooks.slack.com/services/T0EXIT/B0EXIT/%s with %s", t["hook"], t["log"],
    extra={{"stallwatch.test.token": t["log_attribute"]}},
)
with trace.get_tracer("host-app").start_as_current_span("host request", attributes={{"auth": {HOST_VALUE!r}}}):
    pass
heartbeat.AREA.spawning("curl " + t["heartbeat"], 1, 2)
print(json.dumps({{"heartbeat": heartbeat.read(heartbeat.AREA.path)["spawn_command"]}}))
stallwatch.shutdown(10)
"""


def _run_host(tmp_path: Path, receiver_url: str) -> tuple[dict, dict[str, bytes]]:
    telemetry_dir, journal_dir, runtime = tmp_path / "telemetry", tmp_path / "journal", tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = clean_env(
        STALLWATCH_FILE_DIR=str(telemetry_dir),
        STALLWATCH_JOURNAL_DIR=str(journal_dir),
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver_url,
        OTEL_TRACES_EXPORTER="otlp,file",
        OTEL_LOGS_EXPORTER="otlp,file",
        OTEL_METRICS_EXPORTER="none",
        XDG_RUNTIME_DIR=str(runtime),  # the heartbeat file, beside the watchdog's
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    )
    proc = run_python(HOST, env=env)
    assert proc.returncode == 0, proc.stderr
    outputs = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    return json.loads(proc.stdout.strip().splitlines()[-1]), outputs


def test_what_a_careless_wrapper_records_leaves_the_process_scrubbed_through_every_exit(tmp_path, receiver):
    result, outputs = _run_host(tmp_path, receiver.url)
    outputs |= {f"OTLP {path} #{n}": body for n, (path, body) in enumerate(receiver.requests)}
    outputs["heartbeat spawn name"] = result["heartbeat"].encode()
    assert any(name.endswith(".journal") for name in outputs)
    leaks = {
        where: found
        for where, data in outputs.items()
        if (found := [name for name, token in TOKENS.items() if token.encode() in data])
    }
    assert leaks == {}

    spans = {span["name"]: attrs(span) for span in otlp_items(tmp_path / "telemetry" / "traces.jsonl", "spans")}
    ours = spans[f"deploy {REDACTED}"]
    assert ours["stallwatch.test.value"] == f"token {REDACTED}"
    assert ours["stallwatch.test.args"]["values"] == [
        {"stringValue": "mysql"},
        {"stringValue": "-uroot"},
        {"stringValue": "-p" + REDACTED},
        {"stringValue": "shop"},
    ]
    assert ours["stallwatch.cloud.resource.id"] == RESOURCE_ID and ours["stallwatch.nebius.trace_id"] == NEBIUS_TRACE_ID
    assert spans["host request"]["auth"] == HOST_VALUE
    bodies = [r["body"]["stringValue"] for r in otlp_items(tmp_path / "telemetry" / "logs.jsonl", "logs")]
    assert f"posted to https://hooks.slack.com/services/{REDACTED} with {REDACTED}" in bodies
    assert result["heartbeat"] == f"curl {REDACTED}"
    journal = b"".join(data for name, data in outputs.items() if name.endswith(".journal"))
    assert RESOURCE_ID.encode() in journal and NEBIUS_TRACE_ID.encode() in journal


def test_the_exit_check_leaves_scrubbed_text_and_ids_as_they_are():
    already = ["ssh", "-i", "key:0123456789ab", "-o", "IdentityFile=key:ba9876543210", f"--token={REDACTED}", "h"]
    assert scrub_attributes({"process.command_args": already})["process.command_args"] == already
    git = ["git", "checkout", "3f2a9c0b7e1d4f6a8b5c2e9d1a7f3b6c0d4e5f6a"]
    assert scrub_attributes({"process.command_args": git})["process.command_args"] == git
    kept = {"stallwatch.nebius.trace_id": NEBIUS_TRACE_ID, "process.pid": 42, "stallwatch.loop": "uvloop"}
    assert scrub_attributes(kept) is kept
    for text in ("psql (3 args)", '{"token":[REDACTED]}', f"PGPASSWORD={REDACTED} psql -h db"):
        assert scrub_value(text) is text


def _corpus_cases() -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Each corpus secret as a careless wrapper would record it, (text, argv) pairs, and the secrets seeded.

    Command lines go in as argument lists (a command line's words are scrubbed knowing their program); URLs,
    environment assignments and bare tokens as free text."""
    cases = [("spawn", [os.fsdecode(arg) if isinstance(arg, bytes) else os.fspath(arg) for arg in argv])
             for argv, _, _ in CORPUS]  # fmt: skip
    cases += [(f"GET {url}", ["curl", url]) for url, _ in URLS]
    cases += [(f"{name}={value} ./deploy", ["env", f"{name}={value}"]) for name, value in ENVIRONMENT.items()]
    cases += [(f"token {token}", ["app", token]) for token in CORPUS_TOKENS]
    secrets = [secret for _, seeded, _ in CORPUS for secret in seeded] + [s for _, seeded in URLS for s in seeded]
    return cases, [*secrets, *ENVIRONMENT_SECRETS, *CORPUS_TOKENS]


def test_with_the_hosts_providers_what_a_careless_wrapper_records_leaves_scrubbed_and_the_hosts_own_items_do_not_change(
    tmp_path,
):
    cases, secrets = _corpus_cases()
    exported = run_host_providers(tmp_path, cases)
    # Per case: one SDK span and one fast-path span of stallwatch's, one of the host's, each through both
    # processors; one log record of each side through both processors.
    assert len(exported["spans"]) == 3 * 2 * len(cases) and len(exported["logs"]) == 2 * 2 * len(cases)
    # The careless logger's records carry its name as their scope on every SDK: the exit check knows them by it.
    assert [item["scope"] for item in exported["logs"]].count("stallwatch.careless") == 2 * len(cases)
    ours, theirs = by_scope(exported)
    assert [secret for secret in secrets if secret in ours] == []
    assert REDACTED in ours
    assert [secret for secret in secrets if secret not in theirs] == []  # the host's are the host's to scrub


_RECORDS_OF_A_FEW_LOGGERS = """
import collections, json, logging
import stallwatch

session = stallwatch.setup()
assert session.error is None and session.settings.providers == "host", session.error
from opentelemetry import _logs
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export

MemoryLogs = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter


class NotingProvider(LoggerProvider):  # the SDK's provider, keeping every logger it hands out
    handed = collections.defaultdict(list)

    def get_logger(self, name, *args, **kwargs):
        logger = super().get_logger(name, *args, **kwargs)
        self.handed[name].append(logger)
        return logger


exported = MemoryLogs()
provider = NotingProvider()
provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(exported))
_logs.set_logger_provider(provider)
handler = LoggingHandler(logger_provider=provider)
logging.getLogger().addHandler(handler)
for _ in range(50):
    for name in ("stallwatch.careless", "stallwatch.other", "host.app"):
        logging.getLogger(name).warning("ran")
for number in range(100):  # more names than a handler keeps loggers of
    logging.getLogger(f"stallwatch.many.{number}").warning("ran")
print(json.dumps({
    "loggers": {name: len({id(logger) for logger in handed}) for name, handed in provider.handed.items()},
    "scopes": collections.Counter(item.instrumentation_scope.name for item in exported.get_finished_logs()),
    "kept": len(handler.__dict__.get("_stallwatch_record_loggers", {})),
}))
"""


def test_a_hosts_logging_handler_emits_a_stallwatch_loggers_records_through_one_logger_of_its_provider():
    env = clean_env(STALLWATCH_PROVIDERS="host", STALLWATCH_WATCHDOG="false")
    proc = run_python(_RECORDS_OF_A_FEW_LOGGERS, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])

    # Every SDK keeps one logger per name: the provider's cache since 1.28, the handler up to 1.27.
    assert report["loggers"]["stallwatch.careless"] == report["loggers"]["stallwatch.other"] == 1
    assert report["scopes"]["stallwatch.careless"] == report["scopes"]["stallwatch.other"] == 50
    assert all(report["scopes"][f"stallwatch.many.{number}"] == 1 for number in range(100))
    assert report["kept"] <= 64  # up to 1.27, the handler's loggers by name are bounded (none on later SDKs)


class SpanView(ReadableSpan):
    """A host's read-only view of a finished span, as a processor may hand its exporters: the public
    `ReadableSpan` properties, delegated to the span; none of the SDK's private fields."""

    def __init__(self, span: ReadableSpan) -> None:  # the base's `__init__` would set the private fields
        self.span = span

    def get_span_context(self) -> Any:
        return self.span.get_span_context()

    name = property(lambda self: self.span.name)
    context = property(lambda self: self.span.context)
    parent = property(lambda self: self.span.parent)
    kind = property(lambda self: self.span.kind)
    start_time = property(lambda self: self.span.start_time)
    end_time = property(lambda self: self.span.end_time)
    status = property(lambda self: self.span.status)
    attributes = property(lambda self: self.span.attributes)
    events = property(lambda self: self.span.events)
    links = property(lambda self: self.span.links)
    resource = property(lambda self: self.span.resource)
    instrumentation_scope = property(lambda self: self.span.instrumentation_scope)
    dropped_attributes = property(lambda self: self.span.dropped_attributes)
    dropped_events = property(lambda self: self.span.dropped_events)
    dropped_links = property(lambda self: self.span.dropped_links)


def _careless_sdk_span(secret: str) -> ReadableSpan:
    """A finished SDK span of stallwatch's scope with `secret` in its name, attributes, event, link and status,
    that dropped one attribute, one event and one link at its limits."""
    spans = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=3, max_events=1, max_links=1))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    linked = [SpanContext(0xA1, n, is_remote=True) for n in (1, 2)]
    links = [Link(linked[0], {"stallwatch.test.first": "x"}), Link(linked[1], {"stallwatch.test.link": secret})]
    careless = provider.get_tracer("stallwatch")
    with careless.start_as_current_span("deploy " + secret, kind=SpanKind.CLIENT, links=links) as span:
        span.set_attributes({"process.pid": 42, "stallwatch.test.value": "token " + secret})
        span.set_attributes({"stallwatch.test.more": "x", "stallwatch.test.dropped": "y"})
        span.add_event("dropped", {"stallwatch.test.n": 1})
        span.add_event("attempt", {"message": "retrying with " + secret})
        span.set_status(Status(StatusCode.ERROR, "refused " + secret))
    provider.shutdown()
    (finished,) = spans.get_finished_spans()
    assert secret in finished.name  # no exit check in front of this provider: the test's own
    return finished


@pytest.mark.parametrize("span_type", ["SDK span", "view with the public properties only"])
@pytest.mark.parametrize("mode", ["fast_paths_on", "fast_paths_off"])
def test_the_exit_check_scrubs_a_span_of_either_type_in_either_mode_and_what_leaves_keeps_its_dropped_counts(
    request, mode, span_type
):
    request.getfixturevalue(mode)
    secret = TOKENS["span_name"]
    span = _careless_sdk_span(secret)
    given = span if span_type == "SDK span" else SpanView(span)
    (checked,) = exit_check.checked("traces", [given])
    request_sent = encode_spans([checked])
    assert secret.encode() not in request_sent.SerializeToString()
    (scope_spans,) = request_sent.resource_spans[0].scope_spans
    assert scope_spans.scope.name == "stallwatch"
    (sent,) = scope_spans.spans
    assert sent.name == f"deploy {REDACTED}" and sent.status.message == f"refused {REDACTED}"
    assert {kv.key: kv.value.string_value for kv in sent.attributes}["stallwatch.test.value"] == f"token {REDACTED}"
    assert [event.name for event in sent.events] == ["attempt"]
    assert (sent.dropped_attributes_count, sent.dropped_events_count, sent.dropped_links_count) == (1, 1, 1)
    context = span.get_span_context()
    assert (sent.trace_id, sent.span_id) == (context.trace_id.to_bytes(16, "big"), context.span_id.to_bytes(8, "big"))
    assert (sent.start_time_unix_nano, sent.end_time_unix_nano) == (span.start_time, span.end_time)
    assert sent.kind == sent.SPAN_KIND_CLIENT
    assert secret in span.name and secret in span.attributes["stallwatch.test.value"]  # the finished span is shared
