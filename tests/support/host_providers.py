"""A host that builds its own providers (`STALLWATCH_PROVIDERS=host`) after `setup()`, and what a careless
wrapper of stallwatch's and the host itself recorded through them, as the host's exporters received it."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import clean_env, run_python

# STALLWATCH_PROVIDERS=host: the host builds its providers after `setup()`, with a simple and a batch processor
# each exporting to memory, and a `LoggingHandler` on the root logger. A careless wrapper records each case
# unscrubbed, through an SDK span, a fast-path span and a `stallwatch` logger; the host records the same through
# its own tracer and logger. Everything exported is written to the output file as plain JSON.
HOST_PROVIDERS = """
import json, logging, os, sys
import stallwatch

session = stallwatch.setup()
assert session.error is None and session.settings.providers == "host", session.error
from opentelemetry import _logs, trace
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from stallwatch import sdk_compat
from stallwatch.core import light_span

MemoryLogs = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
spans_now, spans_later = InMemorySpanExporter(), InMemorySpanExporter()
logs_now, logs_later = MemoryLogs(), MemoryLogs()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans_now))
tracer_provider.add_span_processor(BatchSpanProcessor(spans_later))
trace.set_tracer_provider(tracer_provider)
logger_provider = LoggerProvider()
logger_provider.add_log_record_processor(log_export.SimpleLogRecordProcessor(logs_now))
logger_provider.add_log_record_processor(log_export.BatchLogRecordProcessor(logs_later))
_logs.set_logger_provider(logger_provider)
logging.getLogger().addHandler(LoggingHandler(logger_provider=logger_provider))

careless, host = trace.get_tracer("stallwatch"), trace.get_tracer("host-app")
careless_log, host_log = logging.getLogger("stallwatch.careless"), logging.getLogger("host.app")
with open(os.environ["CASES"]) as cases_file:
    cases = json.load(cases_file)
for text, argv in cases:
    attributes = {"stallwatch.test.text": text, "stallwatch.test.args": argv}
    for tracer in (careless, host):
        with tracer.start_as_current_span("ran " + text, attributes=attributes) as span:
            span.add_event("attempt", attributes)
            span.set_status(Status(StatusCode.ERROR, "failed: " + text))
    fast = light_span.start(careless, "fast " + text, None, attributes)
    assert (type(fast) is light_span.LightSpan) is sdk_compat.fast_paths(), type(fast)  # the fast path when taken
    fast.add_event("attempt", attributes)
    fast.end()
    for logger in (careless_log, host_log):
        logger.warning("ran %s", text, extra=attributes)
tracer_provider.force_flush()
logger_provider.force_flush()


def span_json(span):
    events = [[event.name, dict(event.attributes)] for event in span.events]
    return {"scope": span.instrumentation_scope.name, "name": span.name, "attributes": dict(span.attributes),
            "events": events, "status": span.status.description}


def log_json(item):
    record = item.log_record
    return {"scope": item.instrumentation_scope.name, "body": record.body, "attributes": dict(record.attributes)}


exported = {
    "spans": [span_json(s) for exporter in (spans_now, spans_later) for s in exporter.get_finished_spans()],
    "logs": [log_json(item) for exporter in (logs_now, logs_later) for item in exporter.get_finished_logs()],
}
with open(os.environ["EXPORTED"], "w") as out:
    json.dump(exported, out, default=str)
"""


def run_host_providers(tmp_path: Path, cases: list[tuple[str, list[str]]]) -> dict[str, list[dict]]:
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = clean_env(
        STALLWATCH_PROVIDERS="host",
        STALLWATCH_WATCHDOG="false",
        CASES=str(tmp_path / "cases.json"),
        EXPORTED=str(tmp_path / "exported.json"),
    )
    proc = run_python(HOST_PROVIDERS, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / "exported.json").read_text())


def by_scope(exported: dict[str, list[dict]]) -> tuple[str, str]:
    """(everything stallwatch's scopes exported, everything the host's exported), as JSON text."""
    ours = [item for items in exported.values() for item in items if item["scope"].startswith("stallwatch")]
    theirs = [item for items in exported.values() for item in items if not item["scope"].startswith("stallwatch")]
    return json.dumps(ours), json.dumps(theirs)
