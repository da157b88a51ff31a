"""Scenario: a process that journals operations, for `tests/test_journal.py`.

Usage: python journal_child.py MODE JOURNAL_DIR [ARGS...]

- `ops DIR [hang|exit]`: a parent span with three child operations (`ssh` ended OK, `nebius` ended
  in ERROR, `tunnel` left open, journaled durably) and one create intent without outcome, then
  prints `ready` and either hangs (to be killed) or leaves with `os._exit(0)` (no close).
- `creates DIR SOCKET`: journaled creates against a fake cloud on a unix socket until killed: per
  create a span (buffered start), a durable intent, the request, the answer, a durable outcome,
  a buffered end; tiny random pauses in between so a SIGKILL lands anywhere.
- `nebius DIR ADDRESS`: creates through the real Nebius SDK against `FakeNebius` at ADDRESS, with
  `stallwatch.setup()` instrumenting the SDK and the journal as the ledger's recorder, until killed
  (prints `ready` once its first create is answered).
- `watchdog DIR HOST_PID`: the watchdog role for HOST_PID: a freeze, a heartbeat, then waits for
  the host to die (pidfd) and records `host_killed`.
- `burst DIR N`: N operations (start+end buffered, one durable intent+outcome each), close.
- `fork DIR`: one operation, then `os.fork()`; the child journals one of its own; both close.
- `full DIR [fsize]`: records until writes fail (a tiny tmpfs, or RLIMIT_FSIZE with SIGXFSZ
  ignored), with the default error reporting (log once); prints JSON with the error count.
"""

import json
import logging
import os
import random
import resource
import select
import signal
import socket
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from stallwatch.journal import Journal, install_recorder, ledger

mode, journal_dir, *args = sys.argv[1:]
tracer = TracerProvider().get_tracer("journal-child")


def ops(journal: Journal, finish: str) -> None:
    install_recorder(journal)
    with tracer.start_as_current_span("provision", kind=SpanKind.SERVER) as parent:
        journal.span_started(parent, "executor")
        ssh = tracer.start_span("ssh", kind=SpanKind.CLIENT, attributes={"process.executable.name": "ssh"})
        journal.span_started(ssh, "subprocess")
        ssh.set_attribute("process.exit.code", 0)
        ssh.end()
        journal.span_ended(ssh)
        call = tracer.start_span("nebius.compute.v1.InstanceService/Create", kind=SpanKind.CLIENT)
        journal.span_started(call, "nebius")
        context = call.get_span_context()
        intent = ledger.Intent("create", "compute.instance", "nebius.compute.v1.InstanceService/Create",
                               f"{context.trace_id:032x}", f"{context.span_id:016x}")  # fmt: skip
        ledger.recorder().intent(intent)
        call.set_attribute("error.type", "UNAVAILABLE")
        call.set_status(Status(StatusCode.ERROR))
        call.end()
        journal.span_ended(call)
        tunnel = tracer.start_span("ssh.tunnel.open", kind=SpanKind.CLIENT, attributes={"server.port": 22})
        journal.span_started(tunnel, "ssh", durable=True)
        journal.flush()
        print("ready", json.dumps({"tunnel": f"{tunnel.get_span_context().span_id:016x}",
                                   "parent": f"{parent.get_span_context().span_id:016x}",
                                   "trace": f"{context.trace_id:032x}"}), flush=True)  # fmt: skip
        if finish == "exit":
            os._exit(0)
        time.sleep(3600)


def creates(journal: Journal, address: str) -> None:
    install_recorder(journal)
    rng = random.Random(os.getpid())
    cloud = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cloud.connect(address)
    answers = cloud.makefile("r")
    print("ready", flush=True)
    while True:
        span = tracer.start_span("nebius.compute.v1.InstanceService/Create", kind=SpanKind.CLIENT)
        journal.span_started(span, "nebius")
        context = span.get_span_context()
        intent = ledger.Intent("create", "compute.instance", "nebius.compute.v1.InstanceService/Create",
                               f"{context.trace_id:032x}", f"{context.span_id:016x}")  # fmt: skip
        ledger.recorder().intent(intent)
        time.sleep(rng.random() * 0.003)
        cloud.sendall(f"create {intent.span_id} {intent.number}\n".encode())
        resource_id = answers.readline().strip()
        time.sleep(rng.random() * 0.003)
        ledger.recorder().outcome(intent, ledger.Outcome(True, "OK", f"op-{resource_id}", resource_id))
        span.set_attribute("stallwatch.cloud.resource.id", resource_id)
        span.end()
        journal.span_ended(span)


def nebius_creates(journal_dir: str, address: str) -> None:
    import asyncio

    import stallwatch

    stallwatch.setup(watchdog=False, traces_exporter="none", metrics_exporter="none", logs_exporter="none")
    install_recorder(Journal(journal_dir))
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient

    from support.fake_nebius import sdk_for

    async def create_forever() -> None:
        async with sdk_for(address) as sdk:
            instances = InstanceServiceClient(sdk)
            for number in range(1_000_000):
                metadata = ResourceMetadata(name=f"vm-{number}", parent_id="project-e00test")
                await instances.create(CreateInstanceRequest(metadata=metadata), timeout=5)
                if number == 0:  # the channel is up and a create went through: kills land among creates
                    print("ready", flush=True)

    asyncio.run(create_forever())


def watchdog(journal: Journal, host_pid: int) -> None:
    pidfd = os.pidfd_open(host_pid)
    journal.freeze_started("gil_held", "child_before_exec", time.time_ns() - 1_000_000_000,
                           {"stallwatch.freeze.child.pid": 4242})  # fmt: skip
    journal.heartbeat(time.time_ns() - 1_000_000_000)
    print("ready", flush=True)
    select.select([pidfd], [], [], 60)
    journal.freeze_ended("host_killed")


def burst(journal: Journal, count: int) -> None:
    install_recorder(journal)
    for number in range(count):
        span = tracer.start_span(f"op-{number}", kind=SpanKind.CLIENT)
        journal.span_started(span, "executor")
        context = span.get_span_context()
        intent = ledger.Intent("create", "compute.disk", "nebius.compute.v1.DiskService/Create",
                               f"{context.trace_id:032x}", f"{context.span_id:016x}")  # fmt: skip
        ledger.recorder().intent(intent)
        ledger.recorder().outcome(intent, ledger.Outcome(True, "OK", f"op-{number}", f"disk-{os.getpid()}-{number}"))
        span.end()
        journal.span_ended(span)
    journal.close()


def fork(journal: Journal) -> None:
    span = tracer.start_span("before-fork")
    journal.span_started(span, "executor")
    journal.flush()
    child = os.fork()
    span = tracer.start_span("child-op" if child == 0 else "parent-op")
    journal.span_started(span, "executor")
    journal.close()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)


def full(journal: Journal) -> None:
    install_recorder(journal)
    for number in range(400):
        span = tracer.start_span(f"op-{number}", attributes={"padding": "x" * 200})
        journal.span_started(span, "executor")
        context = span.get_span_context()
        intent = ledger.Intent("create", "compute.instance", "nebius.compute.v1.InstanceService/Create",
                               f"{context.trace_id:032x}", f"{context.span_id:016x}")  # fmt: skip
        ledger.recorder().intent(intent)
        span.end()
        journal.span_ended(span)
    journal.close()
    print(json.dumps({"errors": journal.errors, "still_running": True}), flush=True)


logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
if mode == "nebius":
    nebius_creates(journal_dir, args[0])
elif mode == "watchdog":
    watchdog(Journal(journal_dir, role="watchdog", host_pid=int(args[0])), int(args[0]))
elif mode == "full":
    if args and args[0] == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    full(Journal(journal_dir))
else:
    journal = Journal(journal_dir)
    if mode == "ops":
        ops(journal, args[0] if args else "hang")
    elif mode == "creates":
        creates(journal, args[0])
    elif mode == "burst":
        burst(journal, int(args[0]))
    elif mode == "fork":
        fork(journal)
