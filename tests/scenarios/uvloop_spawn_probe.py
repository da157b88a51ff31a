"""Scenario: a server on uvloop with stock-style OTel providers spawns children.

Usage: python uvloop_spawn_probe.py {stallwatch|stock} SPAWNS
Prints one JSON line: thread starts and Python handler runs observed inside the children
(reported by the children themselves over a pipe, before they exec), and stallwatch's fork counts.
"""

import json
import os
import sys
import threading

mode, spawns = sys.argv[1], int(sys.argv[2])
if mode == "stallwatch":
    import stallwatch  # first import, as a server would do

import asyncio

import uvloop
from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, InMemoryLogExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# Stock-style providers, built by the host after import (as dstack does).
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
trace.set_tracer_provider(tracer_provider)
meter_provider = MeterProvider(
    metric_readers=[
        PeriodicExportingMetricReader(ConsoleMetricExporter(out=open(os.devnull, "w"))),
        InMemoryMetricReader(),
    ]
)
metrics.set_meter_provider(meter_provider)
logger_provider = LoggerProvider()
logger_provider.add_log_record_processor(BatchLogRecordProcessor(InMemoryLogExporter()))
_logs.set_logger_provider(logger_provider)

PARENT = os.getpid()
read_fd, write_fd = os.pipe()
original_start = threading.Thread.start


def reporting_start(self):
    if os.getpid() != PARENT:
        os.write(write_fd, f"thread {self.name}\n".encode())
    original_start(self)


threading.Thread.start = reporting_start
os.register_at_fork(after_in_child=lambda: os.write(write_fd, b"handler probe\n"))


async def main():
    for _ in range(spawns):
        with trace.get_tracer("probe").start_as_current_span("spawn"):
            proc = await asyncio.create_subprocess_exec("/bin/true")
            await proc.wait()
            assert proc.returncode == 0


uvloop.run(main()) if hasattr(uvloop, "run") else uvloop.install() or asyncio.run(main())
os.close(write_fd)
data = b""
while chunk := os.read(read_fd, 65536):
    data += chunk
lines = data.decode().splitlines()
result = {
    "thread_starts": [line.split(" ", 1)[1] for line in lines if line.startswith("thread ")],
    "handler_runs": sum(1 for line in lines if line == "handler probe"),
}
if mode == "stallwatch":
    from stallwatch.forksafe import guard

    result["fork_counts"] = [[list(k), v] for k, v in guard.fork_counts()]
    result["handlers_skipped"] = guard.STATE.handlers_skipped
    result["handlers_registered_after_import"] = sum(
        (r.before is not None) + (r.after_in_parent is not None) + (r.after_in_child is not None)
        for r in guard.REGISTRATIONS
    )
print(json.dumps(result))
