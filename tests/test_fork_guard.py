"""The freeze of incident 000: what runs inside fork children, with and without stallwatch.

Every scenario is a fresh interpreter doing real forks: real `os.fork()`, real uvloop
`asyncio.create_subprocess_exec`, real `Popen(preexec_fn=...)`, a real gRPC server and grpc.aio
client on loopback. The children report what they saw over a pipe before they exec.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SCENARIOS, clean_env, otlp_items, run_python, run_scenario, span_names

pytestmark = pytest.mark.matrix


def uvloop_fork_env() -> dict[str, str]:
    """uvloop's own fork (the opt-out of the default vfork spawn): the guard is what keeps its children clean."""
    return clean_env(STALLWATCH_UVLOOP_SPAWN="fork")


def test_uvloop_children_start_no_thread_and_run_no_handler():
    seen = run_scenario("uvloop_spawn_probe.py", "stallwatch", "20", env=uvloop_fork_env())

    assert seen["thread_starts"] == []
    assert seen["handler_runs"] == 0
    assert seen["fork_counts"] == [[["exec_bound", False, "uvloop"], 20]]
    # every handler registered after import (the SDK's 3 to 6 hooks, the probe, ...) in every child
    assert seen["handlers_registered_after_import"] >= 4
    assert seen["handlers_skipped"] == 20 * seen["handlers_registered_after_import"]


def test_without_stallwatch_the_same_children_start_otel_threads():
    # The control that proves the probe sees thread starts when they happen.
    seen = run_scenario("uvloop_spawn_probe.py", "stock", "5")

    assert seen["handler_runs"] == 5
    assert any(name.startswith("OtelBatchSpan") for name in seen["thread_starts"])  # name varies by SDK
    assert "OtelPeriodicExportingMetricReader" in seen["thread_starts"]


@pytest.mark.parametrize("mode", ["setup", "host"])
def test_forked_child_starts_no_thread_until_it_uses_telemetry_then_exports(mode, telemetry_dir):
    child = run_scenario("fork_child_probe.py", mode, str(telemetry_dir))

    assert child["python_threads_after_fork"] == ["MainThread"]
    assert child["os_tasks_after_fork"] == 1
    started = child["python_threads_after_use"]
    if mode == "setup":  # stallwatch's pipeline: one thread exports the three signals
        assert "stallwatch-export" in started
    else:
        assert any(name.startswith("OtelBatchSpan") for name in started)  # the name changed in SDK 1.34
        assert any(name.startswith("OtelBatchLog") for name in started)
        assert "OtelPeriodicExportingMetricReader" in started
    assert child["exit_status"] == 0
    assert "child-work" in span_names(telemetry_dir / "traces.jsonl")
    assert "child says hello" in (telemetry_dir / "logs.jsonl").read_text()
    assert '"child"' in (telemetry_dir / "metrics.jsonl").read_text()
    if mode == "setup":  # stallwatch's executor span (a light span) is made and exported in the child too
        spans = {span["name"]: span for span in otlp_items(telemetry_dir / "traces.jsonl", "spans")}
        assert spans["child-pool work item"]["parentSpanId"] == spans["child-work"]["spanId"]


_CHILD_TELEMETRY_AT_EXIT = """
import atexit, json, logging, os, subprocess, sys, warnings
import stallwatch
from opentelemetry import metrics, trace

stallwatch.setup(file_dir={file_dir!r}, watchdog=False)

def at_exit():  # registered after setup(): runs before stallwatch's own shutdown at exit
    with trace.get_tracer("host").start_as_current_span("child-at-exit"):
        subprocess.run(["true"])
    logging.getLogger("host").warning("child says goodbye")
    metrics.get_meter("host").create_counter("host.exits").add(1, {{"who": "child"}})

warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)  # Python 3.12+
pid = os.fork()
if pid == 0:
    atexit.register(at_exit)
    sys.exit(0)  # the child's first telemetry happens while the interpreter exits
_, status = os.waitpid(pid, 0)
print(json.dumps({{"exit_status": os.waitstatus_to_exitcode(status)}}), flush=True)
os._exit(0)
"""


def test_a_fork_child_whose_first_telemetry_happens_at_exit_exports_it_and_prints_nothing(telemetry_dir):
    # Python 3.12 refuses new threads once exit begins, so the child's export workers cannot
    # restart then: before the fix its span, log record and metric were lost and the refusal
    # printed a traceback from the log handler and from stallwatch's atexit shutdown.
    env = clean_env(STALLWATCH_INSTRUMENT_SUBPROCESS="true")
    proc = run_python(_CHILD_TELEMETRY_AT_EXIT.format(file_dir=str(telemetry_dir)), env=env, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"exit_status": 0}
    assert proc.stderr.splitlines() == ["child says goodbye"]  # the host's own warning (Python's lastResort)
    spans = {span["name"]: span for span in otlp_items(telemetry_dir / "traces.jsonl", "spans")}
    assert spans["true"]["parentSpanId"] == spans["child-at-exit"]["spanId"]
    assert "child says goodbye" in (telemetry_dir / "logs.jsonl").read_text()
    assert '"child"' in (telemetry_dir / "metrics.jsonl").read_text()


_MULTIPROCESSING_WORKER = """
import multiprocessing, sys
import stallwatch
from opentelemetry import metrics, trace

stallwatch.setup(file_dir={file_dir!r}, watchdog=False, metric_export_interval_ms=3600000)

def work():
    trace.get_tracer("worker").start_span("worker's span").end()
    metrics.get_meter("worker").create_counter("worker.items").add(1)

if __name__ == "__main__":
    worker = multiprocessing.get_context(sys.argv[1]).Process(target=work)
    worker.start()
    worker.join()
    sys.exit(worker.exitcode)
"""


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_a_multiprocessing_worker_exports_what_it_recorded_though_its_context_ends_it_with_os_exit(
    tmp_path, telemetry_dir, context
):
    # The fork and forkserver contexts end a worker with os._exit once its target returns: no atexit.
    script = tmp_path / "worker.py"
    script.write_text(_MULTIPROCESSING_WORKER.format(file_dir=str(telemetry_dir)))
    proc = subprocess.run(
        [sys.executable, str(script), context], env=clean_env(), capture_output=True, text=True, timeout=120
    )

    assert (proc.returncode, proc.stderr) == (0, "")
    assert span_names(telemetry_dir / "traces.jsonl") == ["worker's span"]
    assert '"worker.items"' in (telemetry_dir / "metrics.jsonl").read_text()


# A uvloop host with spans and log records queued (their batches due in 10 minutes) spawns with a `preexec_fn`:
# uvloop's own fork (libuv's fork() from C), whose at-fork handlers `forksafe.guard` skips as exec-bound, so
# no handler empties the lanes in the child. The `preexec_fn` records spans and log records and flushes every
# provider (`force_flush`, the metrics' too) on its own thread, then the child execs. With `held`, a thread of
# the parent holds that lock across the fork, as the export thread holds its lane's turn during an export (and
# the SDK reader's export lock during a metric export) and the heartbeat's thread the lanes' lock at each
# `watch`. The child writes its task count after its flushes to a pipe; the parent then shuts down.
_EXEC_BOUND_CHILD = """
import asyncio, json, logging, os, threading
import uvloop
import stallwatch
from opentelemetry import _logs, metrics, trace
from stallwatch.export.batching import EXPORTS

stallwatch.setup(file_dir={file_dir!r}, watchdog=False)
tracer, log = trace.get_tracer("host"), logging.getLogger("host")
for i in range(3):
    tracer.start_span(f"parent-{{i}}").end()
    log.warning("parent record %d", i)
lanes = {{lane.signal: lane for lane in EXPORTS.lanes() if hasattr(lane, "queue")}}
queued = {{signal: len(lane.queue) for signal, lane in lanes.items()}}
reader = next(lane.reader for lane in EXPORTS.lanes() if hasattr(lane, "reader"))
lock = {{"lane turn": lanes["traces"].turn, "lanes lock": EXPORTS._lock, "metric export": reader._export_lock,
         None: None}}[{held!r}]
taken, forked = threading.Event(), threading.Event()
read, write = os.pipe()

def hold():
    with lock:
        taken.set()
        forked.wait()

def record():  # in the child, before it execs
    for i in range(2):
        tracer.start_span(f"child-{{i}}").end()
        log.warning("child record %d", i)
    for provider in (trace.get_tracer_provider(), _logs.get_logger_provider(), metrics.get_meter_provider()):
        provider.force_flush()
    os.write(write, str(len(os.listdir("/proc/self/task"))).encode())

async def main():
    if lock is not None:
        threading.Thread(target=hold).start()
        taken.wait()
    child = await asyncio.create_subprocess_exec("true", preexec_fn=record)
    forked.set()
    return await child.wait()  # a deadlocked child never execs: the test kills it

status = uvloop.run(main())
stallwatch.shutdown(timeout=10)
tasks = os.read(read, 100).decode() if status == 0 else None
print(json.dumps({{"queued": queued, "status": status, "tasks": tasks}}), flush=True)
"""


@pytest.mark.parametrize("held", [None, "lane turn", "lanes lock", "metric export"])
def test_a_child_whose_fork_handlers_were_skipped_exports_its_own_telemetry_once_and_none_of_its_parents(
    telemetry_dir, held
):
    """`export.batching`'s contract for a fork child (its lanes' queues emptied, their locks new), kept where
    no at-fork handler of stallwatch's ran: `BatchLane.add` sees the new pid. Without that check the child's
    flush exported the parent's queued spans and records a second time, or waited forever on a lock the
    parent's thread held at the fork; a child about to exec starts no thread, even when it exports."""
    env = clean_env(OTEL_BSP_SCHEDULE_DELAY="600000", OTEL_BLRP_SCHEDULE_DELAY="600000")
    host = subprocess.Popen(
        [sys.executable, "-c", _EXEC_BOUND_CHILD.format(file_dir=str(telemetry_dir), held=held)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = _communicate_killing_stuck_children(host, timeout=120)

    assert host.returncode == 0, err
    outcome = json.loads(out.splitlines()[-1])
    assert outcome["queued"] == {"traces": 3, "logs": 3}  # queued in the parent when it forked
    assert outcome["status"] == 0, f"the child never exec'd (deadlocked, killed after 5 s):\n{err}"
    assert outcome["tasks"] == "1"  # the child about to exec started no thread at its records nor its flushes
    names = [name for name in span_names(telemetry_dir / "traces.jsonl") if name.startswith(("parent", "child"))]
    assert sorted(names) == ["child-0", "child-1", "parent-0", "parent-1", "parent-2"]  # each once
    bodies = [record["body"]["stringValue"] for record in otlp_items(telemetry_dir / "logs.jsonl", "logs")]
    assert sorted(b for b in bodies if b.startswith(("parent", "child"))) == [
        "child record 0", "child record 1", "parent record 0", "parent record 1", "parent record 2"
    ]  # fmt: skip


# A host whose export thread is in a metric export (it holds the SDK reader's export lock) when it forks a
# child that lives on, as a gunicorn master forks its workers at any moment of its periodic export. The
# child counts, flushes its meter provider, and exits; a deadlocked child is killed after 30 s.
_FORK_DURING_A_METRIC_EXPORT = """
import json, os, threading
import stallwatch
from opentelemetry import metrics
from stallwatch.export.batching import EXPORTS

stallwatch.setup(file_dir={file_dir!r}, watchdog=False)
reader = next(lane.reader for lane in EXPORTS.lanes() if hasattr(lane, "reader"))
taken, forked = threading.Event(), threading.Event()

def export():  # what the export thread holds while the reader's exporter writes
    with reader._export_lock:
        taken.set()
        forked.wait()

threading.Thread(target=export).start()
taken.wait()
pid = os.fork()
if pid == 0:
    metrics.get_meter("child").create_counter("child.items").add(1)
    metrics.get_meter_provider().force_flush(timeout_millis=10_000)
    os._exit(0)
forked.set()
waited = 0
while waited < 300 and os.waitpid(pid, os.WNOHANG) == (0, 0):
    threading.Event().wait(0.1)
    waited += 1
if waited >= 300:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
stallwatch.shutdown(timeout=10)
print(json.dumps({{"child_finished": waited < 300}}), flush=True)
"""


def test_a_child_forked_during_a_metric_export_flushes_its_metrics(telemetry_dir):
    """The reader's export lock is the SDK's, renewed by the SDK's at-fork handler only for a reader with its own
    thread; stallwatch's reader has none (its lane renews it). The child of a fork made while the export thread
    held it waited forever at its first metric export, its export thread too (1 run of the suite at load)."""
    proc = run_python(_FORK_DURING_A_METRIC_EXPORT.format(file_dir=str(telemetry_dir)))

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"child_finished": True}, proc.stderr
    assert '"child.items"' in (telemetry_dir / "metrics.jsonl").read_text()


def test_a_preexec_fn_that_records_telemetry_starts_no_thread_in_its_child_about_to_exec(telemetry_dir):
    # The guard skips the export threads' at-fork handler in that child, so its first record finds the parent's
    # lanes by their pid (`BatchLane.add`); it used to start the export and heartbeat threads there.
    proc = run_python(
        f"""
        import logging, os, subprocess, stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, watchdog=False)
        read, write = os.pipe()
        def record():
            before = len(os.listdir("/proc/self/task"))
            logging.getLogger("host").warning("in preexec_fn")
            os.write(write, f"{{before}} {{len(os.listdir('/proc/self/task'))}}".encode())
        subprocess.run(["true"], preexec_fn=record, check=True)
        print(os.read(read, 100).decode())
        stallwatch.shutdown()
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1"]  # the child's tasks before and after its record: one thread alone
    assert proc.stderr.splitlines() == ["in preexec_fn"]


def test_stock_sdk_starts_threads_in_forked_child(telemetry_dir):
    child = run_scenario("fork_child_probe.py", "stock", str(telemetry_dir))

    assert not child["stallwatch_loaded"]
    assert child["os_tasks_after_fork"] > 1
    assert any(name.startswith("OtelBatchSpan") for name in child["python_threads_after_fork"])


def test_grpc_threads_never_start_in_uvloop_children():
    seen = run_scenario("grpc_spawn_probe.py", "stallwatch", "10", env=uvloop_fork_env())

    assert seen["env"] == "false"
    assert seen["rpc_calls"] > 0
    assert seen["children"] == 10
    assert seen["grpc_threads_in_children"] == 0
    assert all(tasks == ["python"] for tasks in seen["child_tasks"])
    kinds = dict((tuple(key), count) for key, count in seen["fork_counts"])
    assert kinds == {("exec_bound", True, "uvloop"): 10}


def _communicate_killing_stuck_children(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`process.communicate(timeout)` while `_kill_children_stuck_before_exec` watches its children."""
    stop = threading.Event()
    reaper = threading.Thread(target=_kill_children_stuck_before_exec, args=(process, stop), daemon=True)
    reaper.start()
    try:
        return process.communicate(timeout=timeout)
    finally:
        stop.set()


def _kill_children_stuck_before_exec(parent: subprocess.Popen, stop: threading.Event) -> None:
    """The incident's hazard, kept from hanging the test: a uvloop child that deadlocks in gRPC's
    fork handler never execs, and the parent waits on it holding the GIL. Kill any child of the
    scenario still running the scenario's own interpreter after 5 s (a health check would do worse)."""
    seen: dict[int, float] = {}
    while not stop.wait(0.5):
        try:
            children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        except OSError:
            return
        for pid in map(int, children):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if exe != os.readlink(f"/proc/{parent.pid}/exe"):
                continue  # it exec'd: a stuck copy still runs the scenario's interpreter
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"stallwatch._watchdog" in cmdline:
                continue
            if time.monotonic() - seen.setdefault(pid, time.monotonic()) > 5:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_grpc_fork_support_chosen_by_user_is_kept_and_reported():
    proc_env = clean_env(GRPC_ENABLE_FORK_SUPPORT="true", STALLWATCH_UVLOOP_SPAWN="fork")
    # gRPC skips its fork handlers while another thread is mid-call, and some children crash before
    # reporting: 20 spawns make sure the probe sees the threads gRPC does start.
    scenario = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "grpc_spawn_probe.py"), "stallwatch", "20"],
        env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = _communicate_killing_stuck_children(scenario, timeout=180)
    assert scenario.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])

    assert seen["env"] == "true"
    assert seen["grpc_threads_in_children"] > 0  # the probe does see gRPC threads when they start


def test_warning_when_grpc_was_imported_before_stallwatch():
    proc = run_python(
        """
        import grpc
        import stallwatch
        print(stallwatch.FORK_SAFETY.grpc.hazard is not None)
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert "GRPC_ENABLE_FORK_SUPPORT" in proc.stderr
    assert "imported before stallwatch" in proc.stderr


def test_popen_with_preexec_fn_is_exec_bound_and_plain_popen_does_not_fork():
    proc = run_python(
        """
        import os, subprocess, json
        import stallwatch
        from stallwatch.forksafe import guard
        r, w = os.pipe()
        os.register_at_fork(after_in_child=lambda: os.write(w, b"handler ran\\n"))
        subprocess.run(["/bin/true"], preexec_fn=lambda: None, check=True)
        subprocess.run(["/bin/true"], check=True)  # vfork: no fork, no handler, not counted
        os.close(w)
        print(json.dumps({"probe": os.read(r, 100).decode(),
                          "forks": [[list(k), v] for k, v in guard.fork_counts()]}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = __import__("json").loads(proc.stdout)
    assert result["probe"] == ""
    assert result["forks"] == [[["exec_bound", False, "none"], 1]]


def test_os_fork_children_keep_handlers_registered_after_import():
    proc = run_python(
        """
        import os
        import stallwatch
        r, w = os.pipe()
        os.register_at_fork(after_in_child=lambda: os.write(w, b"handler ran"))
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        os.close(w)
        print(os.read(r, 100).decode())
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "handler ran"


def test_register_at_fork_keeps_its_errors():
    proc = run_python(
        """
        import os
        import stallwatch
        for kwargs in ({}, {"before": 42}):
            try:
                os.register_at_fork(**kwargs)
            except TypeError as exc:
                print("TypeError", exc)
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("TypeError") == 2
