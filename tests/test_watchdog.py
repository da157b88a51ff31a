"""The freeze of incident 000, seen from outside while it lasts: real uvloop spawns whose child
hangs before exec, a real watchdog process reading real /proc (tests/scenarios/freeze_probe.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    SCENARIOS,
    attrs,
    clean_env,
    latest_total,
    metric_points,
    otlp_items,
    read_jsonl,
    run_python,
    run_scenario,
)
from support.loopback import HeldPort, free_port, prometheus_env, scrape
from support.processes import is_gone
from support.served import Served
from support.waiting import wait_until

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)"),
]


def log_records(path: Path) -> list[dict]:
    return otlp_items(path, "logs")


def freeze_spans(path: Path) -> list[dict]:
    return [span for span in otlp_items(path, "spans") if span["name"] == "stallwatch.freeze"]


def wait_for_freeze_detected(logs: Path, timeout: float = 30) -> None:
    """Until the watchdog's "freeze detected" record is in the file exporter's logs (flushed at once)."""
    wait_until(
        lambda: "freeze detected" in (logs.read_text() if logs.exists() else ""), "a freeze is reported", timeout
    )


def test_gil_held_freeze_is_reported_while_the_host_is_still_frozen(telemetry_dir):
    result = run_scenario("freeze_probe.py", str(telemetry_dir), "5")

    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert len(detected) == 1
    # Decided at the first poll past the 1 s threshold (a loaded machine wakes the poll late)...
    frozen_for = float(re.search(r"frozen \(gil_held\) for ([0-9.]+)s", detected[0]["body"]["stringValue"])[1])
    assert 1.0 <= frozen_for <= 1.0 + 1.5
    record = attrs(detected[0])
    assert record["stallwatch.freeze.kind"] == "gil_held"
    assert record["stallwatch.freeze.cause"] == "child_before_exec"
    assert int(record["stallwatch.freeze.child.pid"]) == result["child_pid"]
    assert record["stallwatch.freeze.main_thread.syscall"] == "read"
    assert "true (1 args)" in detected[0]["body"]["stringValue"]
    # ...and exported while the host is still frozen, once the watchdog has loaded its pipeline (lazily: on a
    # loaded 2-core machine that alone has taken 1.6 s).
    assert int(detected[0]["timeUnixNano"]) < result["spawn_ended_ns"]
    (span,) = freeze_spans(telemetry_dir / "traces.jsonl")
    assert attrs(span)["stallwatch.freeze.outcome"] == "thawed"
    assert span["links"][0]["spanId"] == result["span_id"]  # joined to the frozen probe's span
    assert (detected[0]["traceId"], detected[0]["spanId"]) == (result["trace_id"], result["span_id"])
    assert 4.5e9 <= int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"]) <= 12e9  # 5 s, on a loaded machine


@pytest.mark.parametrize(("spawn", "count"), [("--args", 3), ("--shell", 1)])
def test_a_frozen_spawn_has_the_same_argument_count_in_the_freeze_record_and_on_its_span(telemetry_dir, spawn, count):
    result = run_scenario("freeze_probe.py", str(telemetry_dir), "2", spawn)

    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert f"spawning 'true ({count} args)'" in detected[0]["body"]["stringValue"]
    (freeze,) = freeze_spans(telemetry_dir / "traces.jsonl")
    assert attrs(freeze)["stallwatch.freeze.spawn"] == f"true ({count} args)"
    (child,) = [
        s
        for s in otlp_items(telemetry_dir / "traces.jsonl", "spans")
        if attrs(s).get("process.pid") == str(result["child_pid"])
    ]
    assert attrs(child)["process.args_count"] == str(count)


def test_a_loop_blocked_by_sync_code_is_not_a_held_gil(telemetry_dir):
    run_scenario("freeze_probe.py", str(telemetry_dir), "2", "--block-loop")

    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert [attrs(r)["stallwatch.freeze.kind"] for r in detected] == ["loop_blocked"]
    lag = metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.loop.lag")[-1]
    assert attrs(lag) == {"stallwatch.loop": "uvloop"}
    # The heartbeat thread asks for a beat every 0.1 s, so its request came within a beat of the block's
    # start plus that thread's own scheduling delay (hundreds of ms on a loaded machine): the loop ran it
    # at least half the 2 s late, where an unblocked loop runs it within milliseconds.
    assert float(lag["max"]) >= 1.0


def test_the_watchdogs_records_of_a_uvloop_host_frozen_inside_a_span_carry_that_spans_trace_id(telemetry_dir):
    result = run_scenario("freeze_probe.py", str(telemetry_dir), "2", "--block-loop")

    records = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze" in r["body"]["stringValue"]]
    assert "freeze detected" in records[0]["body"]["stringValue"]
    for record in records:  # every freeze record leads to the request that froze the loop
        assert (record["traceId"], record["spanId"]) == (result["trace_id"], result["span_id"])
    (span,) = freeze_spans(telemetry_dir / "traces.jsonl")
    assert span["links"][0]["traceId"] == result["trace_id"]


@pytest.mark.parametrize("fork_guard", ["true", "false"])
def test_a_forked_child_entering_spans_never_names_them_in_its_parents_freeze(telemetry_dir, fork_guard):
    proc = run_python(
        f"""
        import asyncio, os, time
        import stallwatch
        session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, freeze_threshold=1.0)
        assert session.wait_for_watchdog(30)
        import uvloop
        from opentelemetry import trace

        tracer = trace.get_tracer("probe")

        async def main():
            await asyncio.sleep(0.3)
            child = os.fork()
            if child == 0:  # shares the parent's heartbeat mapping: enters spans the whole time
                deadline = time.monotonic() + 4
                while time.monotonic() < deadline:
                    with tracer.start_as_current_span("child work"):
                        time.sleep(0.01)
                os._exit(0)
            await asyncio.sleep(0.5)
            time.sleep(2)  # the parent's loop blocked, inside no span
            await asyncio.sleep(1.5)
            os.waitpid(child, 0)

        uvloop.run(main())
        stallwatch.shutdown(timeout=5)
        """,
        env=clean_env(STALLWATCH_FORK_GUARD=fork_guard),
    )

    assert proc.returncode == 0, proc.stderr
    records = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze" in r["body"]["stringValue"]]
    assert records and "freeze detected" in records[0]["body"]["stringValue"]
    assert [r.get("traceId", "") for r in records] == [""] * len(records)  # the child's spans are not the parent's


def test_a_loop_blocked_reading_an_execd_interpreter_is_not_a_child_before_exec(telemetry_dir):
    result = run_scenario("freeze_probe.py", str(telemetry_dir), "2", "--read-child")

    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert len(detected) == 1
    record = attrs(detected[0])
    assert record["stallwatch.freeze.kind"] == "loop_blocked"
    assert int(record["stallwatch.freeze.child.pid"]) == result["child_pid"]  # the pipe's other end
    assert record["stallwatch.freeze.cause"] == "blocked_syscall"  # it runs the host's executable, exec'd


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_host_killed_during_a_freeze_is_recorded_and_the_watchdog_leaves(telemetry_dir, tmp_path):
    runtime = tmp_path / "run"  # where the heartbeat file lives (it would be /dev/shm)
    runtime.mkdir()
    host = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "20"],
        env=clean_env(XDG_RUNTIME_DIR=str(runtime)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    watchdog_pid = json.loads(host.stdout.readline())["watchdog_pid"]  # watching; the 20 s freeze starts 0.5 s later
    wait_for_freeze_detected(telemetry_dir / "logs.jsonl")  # frozen, as a load balancer's health check finds it
    assert [p.suffix for p in runtime.iterdir()] == [".hb"]
    host.send_signal(signal.SIGKILL)
    # The host stays a zombie until we reap it: the watchdog reads its wait status from /proc meanwhile.
    wait_until(lambda: is_gone(watchdog_pid), "the watchdog left after the host was killed")
    host.wait(30)

    (span,) = freeze_spans(telemetry_dir / "traces.jsonl")
    assert attrs(span)["stallwatch.freeze.outcome"] == "host_killed"
    assert attrs(span)["stallwatch.freeze.kind"] == "gil_held"
    assert attrs(span)["stallwatch.freeze.host.exit_signal"] == "SIGKILL"
    assert list(runtime.iterdir()) == []  # the watchdog removed what the killed host could not


@pytest.mark.parametrize(
    ("blocking", "main_thread"),
    [  # time.sleep() is clock_nanosleep from Python 3.11 on, pselect6 before
        ("--block-loop", r"; main thread S in (clock_nanosleep|pselect6) \(wchan \w+"),
        ("--spin-loop", r"; main thread running \(state R\)"),
    ],
)
def test_the_watchdogs_freeze_lines_on_the_hosts_stderr_say_they_are_the_watchdogs(
    telemetry_dir, tmp_path, blocking, main_thread
):
    # The watchdog shares the host's stderr: its lines read as the host's own unless they say otherwise; and a
    # line names where the main thread is, without a '?' where the watchdog could read it.
    host = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "2", blocking],
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, stderr = host.communicate(timeout=120)

    assert host.returncode == 0, stderr
    prefix = f"stallwatch watchdog (host pid {host.pid}): "
    lines = stderr.splitlines()
    assert all(line.startswith(prefix) for line in lines), stderr
    (detected,) = [line for line in lines if "freeze detected" in line]
    assert detected.startswith(f"{prefix}freeze detected: host {host.pid} frozen (loop_blocked)"), detected
    assert re.search(main_thread, detected) and "?" not in detected, detected


def test_the_watchdogs_shutdown_timeout_line_says_it_is_the_watchdogs(tmp_path):
    # A host gone without stallwatch's shutdown (a killed worker) leaves its watchdog to flush on its own,
    # here to a collector that takes connections and never answers. The watchdog has something to flush
    # once it has reported a freeze (an idle one has set no pipeline up): the host blocks its loop first.
    collector = socket.socket()
    collector.bind(("127.0.0.1", 0))
    collector.listen(64)
    code = (
        "import asyncio, os, time, stallwatch\n"
        "session = stallwatch.setup(logs_exporter='none')\n"
        "async def main():\n"
        "    assert await asyncio.to_thread(session.wait_for_watchdog, 30)\n"
        "    time.sleep(2.5)\n"
        "asyncio.run(main())\n"
        "os._exit(0)\n"
    )
    env = clean_env(
        XDG_RUNTIME_DIR=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.getsockname()[1]}"
    )
    with collector:
        host = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        _, stderr = host.communicate(timeout=120)  # the watchdog holds the pipe until it has exited

    assert host.returncode == 0
    lines = stderr.splitlines()  # SDK 1.27's reader also logs its export's read timeout, later, with a traceback
    assert any(
        line.startswith(
            f"stallwatch watchdog (host pid {host.pid}): telemetry shutdown did not finish within 1.0s "
            "(STALLWATCH_SHUTDOWN_TIMEOUT); dropped "
        )
        for line in lines
    ), stderr
    assert all(line.startswith(f"stallwatch watchdog (host pid {host.pid}): ") for line in lines), stderr
    # The exports that hang (10 s each) never held the watchdog's look at the heartbeats: the 2.5 s freeze
    # ended when the host thawed or left, not when an export gave up (its end is on stderr when the host
    # left frozen: a WARNING, where a thaw is INFO).
    over = [float(m.group(1)) for m in map(re.compile(r"freeze over after ([\d.]+)s").search, lines) if m]
    assert all(seconds < 8 for seconds in over), stderr


def test_a_host_exporting_through_its_own_providers_still_has_its_freeze_exported_by_the_watchdog(telemetry_dir):
    # STALLWATCH_PROVIDERS=host names the host's providers, which live in the host's process only: the
    # watchdog, which sets its pipeline up at the first late heartbeat, exports through providers of its own.
    code = f"""
        import asyncio, time
        import stallwatch
        session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, freeze_threshold=1.0)
        async def main():
            assert await asyncio.to_thread(session.wait_for_watchdog, 30)
            time.sleep(2.5)  # the loop blocked
        asyncio.run(main())
        stallwatch.shutdown(timeout=5)
        """
    proc = run_python(code, env=clean_env(STALLWATCH_PROVIDERS="host"))  # returns once the watchdog has left

    assert proc.returncode == 0, proc.stderr
    logs = telemetry_dir / "logs.jsonl"
    requests = [json.loads(line) for line in (logs.read_text() if logs.exists() else "").splitlines()]
    detected = [
        attrs(resource["resource"])
        for request in requests
        for resource in request["resourceLogs"]
        for scope in resource["scopeLogs"]
        for record in scope["logRecords"]
        if "freeze detected" in record["body"]["stringValue"]
    ]
    assert [resource.get("stallwatch.process.role") for resource in detected] == ["watchdog"], proc.stderr


# The watchdog's bootstrap with a fault injected into one poll: `module.name` raises once, when `when` holds
# for its arguments (`args`).
_FAILING_ONCE = """from stallwatch.detect import {module}
original, raised = {module}.{name}, []
def failing_once(*args):
    if not raised and ({when}):
        raised.append(True)
        raise RuntimeError("injected into one poll")
    return original(*args)
{module}.{name} = failing_once
from stallwatch._watchdog import main
"""


@pytest.mark.parametrize(
    ("module", "name", "when", "counted"),
    [
        ("watchdog", "Watchdog.check", "True", 0),  # the first poll: the watchdog's telemetry is not set up
        ("watchdog", "Watchdog.check", "args[0].freeze is not None", 1),  # a freeze reported: set up
        # The first diagnosis of the freeze, as the /proc race did: the telemetry is set up then if the
        # pipeline has loaded within the threshold (not on a loaded machine), so the count is not checked.
        ("freeze_report", "diagnose", "True", None),
    ],
)
def test_a_poll_of_the_watchdog_that_raises_is_logged_once_and_it_reports_the_freeze_and_its_thaw(
    telemetry_dir, module, name, when, counted
):
    """A bug cannot be produced on demand (the /proc race of a child reaped while it was read was one): the
    host hands its watchdog a bootstrap in which a part of its poll raises once (`_FAILING_ONCE`), in a real
    watchdog process that watches a real freeze of the host. Such a poll used to end the watchdog."""
    code = f"""
        import asyncio, pathlib, time
        import stallwatch
        from stallwatch.detect import heartbeat
        heartbeat._BOOTSTRAP = heartbeat._BOOTSTRAP.replace(
            "from stallwatch._watchdog import main\\n", {_FAILING_ONCE.format(module=module, name=name, when=when)!r}
        )
        session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, freeze_threshold=1.0)
        async def main():
            assert await asyncio.to_thread(session.wait_for_watchdog, 30)
            time.sleep(2.5)  # the loop blocked
        asyncio.run(main())
        traces, deadline = pathlib.Path({str(telemetry_dir / "traces.jsonl")!r}), time.monotonic() + 30
        while time.monotonic() < deadline:  # until the watchdog has seen the thaw: its freeze span, exported at once
            if traces.exists() and '"stallwatch.freeze"' in traces.read_text():
                break
            time.sleep(0.02)
        stallwatch.shutdown(timeout=5)
        """
    proc = run_python(code)  # returns once the watchdog has left: it holds the stderr pipe

    assert proc.returncode == 0, proc.stderr
    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert [attrs(record)["stallwatch.freeze.kind"] for record in detected] == ["loop_blocked"]
    (span,) = freeze_spans(telemetry_dir / "traces.jsonl")
    assert attrs(span)["stallwatch.freeze.outcome"] == "thawed"
    lines = proc.stderr.splitlines()
    failed = [line for line in lines if "a poll of the freeze watchdog" in line]
    assert len(failed) == 1, proc.stderr
    assert failed[0].endswith("it goes on watching. Set STALLWATCH_WATCHDOG=false to turn this part off.")
    assert any(line.endswith("RuntimeError: injected into one poll") for line in lines), proc.stderr  # its traceback
    prefix = re.match(r"stallwatch watchdog \(host pid \d+\): ", failed[0])
    assert prefix is not None and all(line.startswith(prefix[0]) for line in lines), proc.stderr
    metrics = telemetry_dir / "metrics.jsonl"
    errors = latest_total(metrics, "stallwatch.instrumentation.errors", **{"stallwatch.component": "watchdog"})
    assert latest_total(metrics, "stallwatch.instrumentation.errors") == errors  # no other part's
    assert errors == counted if counted is not None else errors in (0, 1)  # counted once its telemetry is set up


# The watchdog's bootstrap that appends a line to the file `calls` at each set-up of its pipeline
# (`_watchdog._setup`) and cannot import the modules named `blocked...`, as if only the host's import hook found
# them (the watchdog runs without `site`: `heartbeat.watchdog_command`).
_COUNTING_SETUPS = """class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if {blocked!r} and name.startswith({blocked!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Blocked())
import stallwatch._watchdog as counted
original = counted._setup
def counting(**overrides):
    with open({calls!r}, "a") as calls:
        calls.write("setup\\n")
    return original(**overrides)
counted._setup = counting
from stallwatch._watchdog import main
"""

# A host whose loop stays blocked in a read() until its watchdog has reported the freeze in the journal or through
# the file exporter (60 s at most; a thread of its own looks), then waits for the thaw's report there and prints the
# journal's records of both.
_FROZEN_UNTIL_REPORTED = """
import asyncio, json, os, sys, threading, time
from pathlib import Path
import stallwatch
from stallwatch.detect import heartbeat
from stallwatch.journal import read_segment
heartbeat._BOOTSTRAP = heartbeat._BOOTSTRAP.replace("from stallwatch._watchdog import main\\n", sys.argv[1])
session = stallwatch.setup(freeze_threshold=0.5)

def journaled(kind):
    segments = Path(session.settings.journal_dir).glob("*.watchdog.*.journal")
    return [r for segment in segments for r in read_segment(segment).records if r["type"] == kind]

def exported(signal, text):
    path = session.files.get(signal)
    return path is not None and path.exists() and text in path.read_text()

def look(deadline, done):
    while not (journaled("freeze") or exported("logs", "freeze detected")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.write(done, b"x")

async def main():
    assert await asyncio.to_thread(session.wait_for_watchdog, 30)
    deadline = time.monotonic() + 60
    wait, done = os.pipe()
    threading.Thread(target=look, args=(deadline, done), daemon=True).start()
    os.read(wait, 1)  # the loop blocked in a syscall, as the freeze's cause says, until the freeze is reported
    while not (journaled("freeze_end") or exported("traces", '"stallwatch.freeze"')) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
asyncio.run(main())
print(json.dumps({"freeze": journaled("freeze"), "freeze_end": journaled("freeze_end")}))
stallwatch.shutdown(timeout=5)
"""


# The watchdog's bootstrap whose pipeline set-up (`_watchdog._setup`) takes 3 s, as on a loaded machine.
_SLOW_SETUP = """import time
import stallwatch._watchdog as slowed
original = slowed._setup
def slow(**overrides):
    time.sleep(3)
    return original(**overrides)
slowed._setup = slow
from stallwatch._watchdog import main
"""


def test_a_slow_pipeline_set_up_never_holds_the_polls_that_detect_a_freeze():
    # The host's loop blocks (0.5 s threshold) while the watchdog's imports are ready: the set-up used to run
    # in the next poll and hold the polls 3 s, so the freeze was detected, and its length reported, 3 s late.
    env = clean_env(OTEL_LOGS_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_TRACES_EXPORTER="none")
    proc = subprocess.run(
        [sys.executable, "-c", _FROZEN_UNTIL_REPORTED, _SLOW_SETUP], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    detected = re.search(r"freeze detected: host \d+ frozen \(loop_blocked\) for ([0-9.]+)s", proc.stderr)
    assert detected is not None, proc.stderr
    assert float(detected[1]) < 0.5 + 2.0  # detected at a poll past the threshold, not after the 3 s set-up


@pytest.mark.parametrize("strict", ["true", "false"])
@pytest.mark.parametrize(
    ("failure", "blocked", "expected"),
    [
        (  # at the first late heartbeat
            "grpc_exporter_not_importable",
            "opentelemetry.exporter.otlp.proto.grpc",
            "(ConfigError: OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the grpc extra: pip install 'stallwatch[grpc]')",
        ),
        (  # at the watchdog's start, which sets up a Prometheus exporter's pipeline at once
            "scrape_port_busy",
            "",
            "(ConfigError: OTEL_EXPORTER_PROMETHEUS_PORT={port}: cannot listen on 127.0.0.1:{port} (Address already "
            "in use); choose a free port, or 0)",
        ),
    ],
)
def test_a_watchdog_whose_pipeline_cannot_be_set_up_says_so_once_never_retries_and_still_reports_the_freeze(
    tmp_path, failure, blocked, expected, strict
):
    """A real host whose loop is blocked until its real watchdog has journaled the freeze, where setting up the
    watchdog's pipeline fails: the freeze is on the watchdog's stderr lines and in the journal, one line says why
    the pipeline is missing, and the set-up ran once (it used to run again at every poll, the freeze unreported,
    or, at the start, to end the watchdog). Without STALLWATCH_STRICT that line was setup()'s own, which named
    neither the watchdog nor its setting."""
    calls = tmp_path / "setup-calls"
    bootstrap = _COUNTING_SETUPS.format(blocked=blocked, calls=str(calls))
    with HeldPort() as port:
        if failure == "scrape_port_busy":
            env = clean_env(**prometheus_env(free_port(), port, STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT="0"))
        else:
            env = clean_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")  # fmt: skip
        env |= {"STALLWATCH_STRICT": strict, "OTEL_LOGS_EXPORTER": "none"}
        env.setdefault("OTEL_METRICS_EXPORTER", "none")
        proc = subprocess.run(
            [sys.executable, "-c", _FROZEN_UNTIL_REPORTED, bootstrap],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )  # returns once the watchdog has left: it holds the stderr pipe

    assert proc.returncode == 0, proc.stderr
    journaled = json.loads(proc.stdout.splitlines()[-1])
    assert [(r["kind"], r["cause"]) for r in journaled["freeze"]] == [("loop_blocked", "blocked_syscall")]
    assert [r["outcome"] for r in journaled["freeze_end"]] == ["thawed"], proc.stderr
    assert calls.read_text() == "setup\n", proc.stderr  # once, the freeze's polls notwithstanding
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stallwatch watchdog (host pid ")]
    failed = [line for line in lines if "cannot set up its telemetry pipeline" in line]
    assert len(failed) == 1, proc.stderr
    assert expected.format(port=port) in failed[0], proc.stderr
    assert failed[0].endswith("only. Set STALLWATCH_WATCHDOG=false to turn this part off."), proc.stderr
    assert len([line for line in lines if ": freeze detected: " in line and "(loop_blocked)" in line]) == 1, proc.stderr
    assert not [line for line in lines if "a poll of the freeze watchdog" in line], proc.stderr
    assert "Traceback" not in proc.stderr  # a refused setting is named, without one
    assert "Exception in thread" not in proc.stderr
    assert "Telemetry is off" not in proc.stderr  # setup()'s own line, said for the host


# The watchdog's bootstrap in which `module.name` raises at each call for which `when` holds (`args`, `kwargs`),
# appending a line to the file `calls` each time.
_FAILING = """import importlib
patched = importlib.import_module({module!r})
original = getattr(patched, {name!r})
def failing(*args, **kwargs):
    if {when}:
        with open({calls!r}, "a") as calls:
            calls.write("raised\\n")
        raise OSError(28, "No space left on device (injected)")
    return original(*args, **kwargs)
setattr(patched, {name!r}, failing)
from stallwatch._watchdog import main
"""


@pytest.mark.parametrize(
    ("part", "module", "name", "when", "reported"),
    [
        ("side of the host's journal", "stallwatch.journal", "Journal", "kwargs.get('role') == 'watchdog'",
         "on these lines and through its telemetry pipeline"),
        ("freeze metrics and span", "stallwatch.core.faults", "instrument",
         "args[1:] and args[1].name == 'stallwatch.freeze.active'",
         "on these lines, in the host's journal and through its telemetry pipeline"),
    ],
)  # fmt: skip
def test_a_watchdog_whose_journal_or_freeze_metrics_cannot_be_set_up_says_so_once_and_reports_the_freeze_elsewhere(
    tmp_path, part, module, name, when, reported
):
    """A real host whose loop is blocked until its real watchdog has reported the freeze, where the watchdog's side
    of the journal, or its freeze metrics and span, cannot be made (a full disk; a bug). Either used to be
    made again at every poll of the freeze through the poll's failure path, the freeze reported nowhere."""
    calls = tmp_path / "calls"
    bootstrap = _FAILING.format(module=module, name=name, when=when, calls=str(calls))
    env = clean_env(STALLWATCH_FILE_DIR=str(tmp_path / "telemetry"), OTEL_METRICS_EXPORTER="none")
    proc = subprocess.run(
        [sys.executable, "-c", _FROZEN_UNTIL_REPORTED, bootstrap], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert calls.read_text() == "raised\n", proc.stderr  # once, the freeze's polls notwithstanding
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stallwatch watchdog (host pid ")]
    failed = [line for line in lines if f"cannot set up its {part} (OSError: " in line]
    assert len(failed) == 1, proc.stderr
    assert failed[0].endswith(
        f"will not try again; it reports freezes {reported} only. Set STALLWATCH_WATCHDOG=false to turn this part off."
    ), proc.stderr
    assert len([line for line in lines if ": freeze detected: " in line and "(loop_blocked)" in line]) == 1, proc.stderr
    assert not [line for line in lines if "a poll of the freeze watchdog" in line], proc.stderr
    journaled = json.loads(proc.stdout.splitlines()[-1])
    exported = [r for r in log_records(tmp_path / "telemetry" / "logs.jsonl") if "freeze" in r["body"]["stringValue"]]
    if part == "freeze metrics and span":
        assert [(r["kind"], r["cause"]) for r in journaled["freeze"]] == [("loop_blocked", "blocked_syscall")]
        assert [r["outcome"] for r in journaled["freeze_end"]] == ["thawed"], proc.stderr
        assert not freeze_spans(tmp_path / "telemetry" / "traces.jsonl")
    else:
        assert journaled == {"freeze": [], "freeze_end": []}
        assert [
            attrs(r)["stallwatch.freeze.kind"] for r in exported if "freeze detected" in r["body"]["stringValue"]
        ] == ["loop_blocked"]
        (span,) = freeze_spans(tmp_path / "telemetry" / "traces.jsonl")
        assert attrs(span)["stallwatch.freeze.outcome"] == "thawed"


_HOST = """
import json, os, stallwatch, sys
session = stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
from stallwatch.detect import heartbeat
print(json.dumps({"watchdog": session.watchdog_pid, "heartbeat": str(heartbeat.AREA.path)}), flush=True)
sys.stdin.readline()
print(json.dumps({"shutdown": stallwatch.shutdown()}), flush=True)
"""


def _start_host(runtime: Path, **settings: str) -> tuple[subprocess.Popen[str], dict]:
    host = subprocess.Popen([sys.executable, "-c", _HOST], env=clean_env(XDG_RUNTIME_DIR=str(runtime), **settings),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    return host, json.loads(host.stdout.readline())


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_setup_removes_the_heartbeat_files_of_hosts_killed_with_their_watchdog(tmp_path):
    # systemd stopping a unit kills the host and its watchdog together: nobody removes the files.
    runtime = tmp_path / "run"
    runtime.mkdir()
    dead, dead_info = _start_host(runtime, STALLWATCH_FAULTHANDLER="true")
    dead_hb = Path(dead_info["heartbeat"])
    dead_hb.with_suffix(".sentry").write_text("{}")  # as a host using Sentry hands its options over
    os.kill(dead_info["watchdog"], signal.SIGKILL)
    dead.kill()
    dead.wait(10)
    live, live_info = _start_host(runtime)
    live_hb = Path(live_info["heartbeat"])
    young = runtime / "stallwatch-1-00000000.hb"  # unlocked, but as young as a file a host is making
    young.write_bytes(b"")
    others = [runtime / "stallwatch-notes.txt", runtime / "other.hb"]
    for path in others:
        path.write_text("not stallwatch's")
    for path in [*runtime.iterdir()]:
        if path != young:
            _age(path, 60)  # older than SWEEP_AGE_SECONDS: only the lock tells the live from the dead
    left = {p.name for p in runtime.iterdir()}
    assert {dead_hb.name, dead_hb.with_suffix(".stacks").name, dead_hb.with_suffix(".sentry").name} <= left

    new, new_info = _start_host(runtime)

    kept = {live_hb.name, young.name, Path(new_info["heartbeat"]).name, *(p.name for p in others)}
    assert {p.name for p in runtime.iterdir()} == kept
    for host in (live, new):
        out, _ = host.communicate("\n", timeout=30)
        assert json.loads(out)["shutdown"] is True
    assert {p.name for p in runtime.iterdir()} == {young.name, *(p.name for p in others)}


def test_a_host_that_execs_another_program_is_not_reported_frozen(telemetry_dir, tmp_path):
    # A launcher that sets stallwatch up and then execs the server: the heartbeats stop, and the
    # watchdog used to report a `gil_held` freeze for as long as the new program ran.
    runtime = tmp_path / "run"
    runtime.mkdir()
    code = (
        "import os, sys, stallwatch\n"
        f"session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, freeze_threshold=0.3)\n"
        "print(session.watchdog_pid, flush=True)\n"
        "os.execv(sys.executable, [sys.executable, '-c', 'import sys, time; sys.stdin.readline()'])\n"
    )
    env = clean_env(XDG_RUNTIME_DIR=str(runtime))
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    host = subprocess.Popen([sys.executable, "-c", code], env=env, text=True, **pipes)
    watchdog_pid = int(host.stdout.readline())
    deadline = time.monotonic() + 10
    while not is_gone(watchdog_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog_left = is_gone(watchdog_pid)  # so nothing can report the new program as a freeze any more
    host_alive = host.poll() is None
    _, stderr = host.communicate("\n", timeout=10)

    assert watchdog_left and host_alive
    assert "freeze" not in stderr
    assert [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze" in r["body"]["stringValue"]] == []
    assert list(runtime.iterdir()) == []


def test_a_fork_child_exiting_normally_leaves_its_parents_heartbeat_files_and_watchdog(tmp_path):
    # The child's exit runs stallwatch's shutdown (atexit), which used to remove the parent's
    # stacks and companion files, and for one commit its heartbeat file too.
    runtime = tmp_path / "run"
    runtime.mkdir()
    code = (
        "import json, os, sys, time, stallwatch\n"
        "session = stallwatch.setup(traces_exporter='none', metrics_exporter='none', logs_exporter='none',\n"
        "                           faulthandler=True)\n"
        "from stallwatch.detect import heartbeat\n"
        "heartbeat.sentry_path(heartbeat.AREA.path).write_text('{}')  # as a host using Sentry makes it\n"
        "before = sorted(os.listdir(os.environ['XDG_RUNTIME_DIR']))\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)  # a worker that lives on, then exits through the interpreter's exit\n"
        "os.waitpid(child, 0)  # its exit is over: whatever it removed is gone now\n"
        "after = sorted(os.listdir(os.environ['XDG_RUNTIME_DIR']))\n"
        "alive = session._watchdog[1].poll() is None\n"
        "print(json.dumps({'before': before, 'after': after, 'watchdog_alive': alive,\n"
        "                  'shutdown': stallwatch.shutdown()}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(XDG_RUNTIME_DIR=str(runtime)),
                          capture_output=True, text=True, timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [Path(name).suffix for name in result["before"]] == [".hb", ".sentry", ".stacks"]
    assert result["after"] == result["before"]
    assert result["watchdog_alive"] and result["shutdown"]
    assert "heartbeat file" not in proc.stderr
    assert list(runtime.iterdir()) == []


_FORKED_WORKER = """
import asyncio, json, os, pathlib, sys, time, stallwatch
session = stallwatch.setup(file_dir=sys.argv[1], freeze_threshold=0.5)
parent_watchdog = session.watchdog_pid
child = os.fork()
if child == 0:  # a worker that lives on and serves, as gunicorn forks them after preloading the app
    before_loop = session.watchdog_pid
    watched_before_loop = session.wait_for_watchdog(0)  # its parent's watchdog does not watch it
    async def serve():
        watched = await asyncio.to_thread(session.wait_for_watchdog, 30)  # its own, started with this loop
        time.sleep(1.5)  # sync code blocks the worker's loop
        traces, deadline = pathlib.Path(sys.argv[1], "traces.jsonl"), time.monotonic() + 30
        while watched and not (traces.exists() and b'"stallwatch.freeze"' in traces.read_bytes()):
            assert time.monotonic() < deadline, "its watchdog exported no freeze"
            await asyncio.sleep(0.01)  # until its watchdog has seen the thaw and exported the freeze
        return session.watchdog_pid, watched
    serving, watched = asyncio.run(serve())
    print(json.dumps({"worker": os.getpid(), "before_loop": before_loop, "serving": serving, "watched": watched,
                      "watched_before_loop": watched_before_loop}), flush=True)
    sys.exit(0)
os.waitpid(child, 0)
after_worker = sorted(os.listdir(os.environ["XDG_RUNTIME_DIR"]))
print(json.dumps({"host": os.getpid(), "watchdog": parent_watchdog, "after_worker": after_worker,
                  "shutdown": stallwatch.shutdown()}))
"""


@pytest.mark.parametrize(
    ("metrics", "watched"), [("file", "true"), ("prometheus", "true"), ("file", "false")],
    ids=["file", "prometheus", "turned_off"],
)  # fmt: skip
def test_a_forked_worker_that_runs_an_event_loop_is_watched_as_a_host_of_its_own(
    telemetry_dir, tmp_path, metrics, watched
):
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = clean_env(XDG_RUNTIME_DIR=str(runtime), OTEL_METRICS_EXPORTER=metrics,
                    STALLWATCH_WATCHDOG_FORKED_WORKERS=watched)  # fmt: skip
    if metrics == "prometheus":  # the host's watchdog holds its port: the worker's must take another
        env.update(prometheus_env(free_port(), free_port()))
    proc = subprocess.run([sys.executable, "-c", _FORKED_WORKER, str(telemetry_dir)],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    worker, host = (json.loads(line) for line in proc.stdout.splitlines())
    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    assert worker["watched_before_loop"] is False
    if watched == "false":
        assert worker["serving"] == worker["before_loop"] == host["watchdog"]
        assert worker["watched"] is False  # at once: no watchdog of its own to wait for
        assert detected == []
        return
    # Its own watchdog, started as its loop started: not at the fork, not before.
    assert worker["before_loop"] == host["watchdog"]
    assert worker["watched"] is True
    assert worker["serving"] not in (None, host["watchdog"])
    assert [(attrs(r)["stallwatch.freeze.kind"], f"host {worker['worker']} " in r["body"]["stringValue"])
            for r in detected] == [("loop_blocked", True)]  # fmt: skip
    # Its watchdog is not one of the worker's children in its telemetry (nor its end a kill).
    assert [s["name"] for s in otlp_items(telemetry_dir / "traces.jsonl", "spans")] == ["stallwatch.freeze"]
    if metrics == "file":
        assert metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.subprocess.spawn.duration") == []
    # The worker's exit removed its own heartbeat file and left the host's.
    assert [name.split("-")[1] for name in host["after_worker"]] == [str(host["host"])]
    assert host["shutdown"] is True
    # Shutdown signals the worker's watchdog and does not wait for it (the host is never held up).
    wait_until(lambda: is_gone(worker["serving"]), "the worker's watchdog left after the worker exited")
    assert list(runtime.iterdir()) == []


_FORK_IN_A_LOOP = """
import asyncio, json, os, pathlib, sys, time, stallwatch
# The default threshold: at 0.5 s a loaded machine's scheduler alone once held the host's heartbeat thread long
# enough for a freeze (gil_held, its main thread in wait4), beside the worker's.
session = stallwatch.setup(file_dir=sys.argv[1], faulthandler=True, freeze_threshold=1.0)
from stallwatch.detect import heartbeat
async def main():
    deadline = time.monotonic() + 30
    while heartbeat._armed_by != os.getpid():  # until the heartbeat has armed faulthandler's timer
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    return os.fork()
child = asyncio.run(main())
if child == 0:  # the worker
    async def serve():
        assert await asyncio.to_thread(session.wait_for_watchdog, 30)  # its own watchdog, started with this loop
        logs, deadline = pathlib.Path(sys.argv[1], "logs.jsonl"), time.monotonic() + 60
        while not (logs.exists() and b"freeze detected" in logs.read_bytes()):  # blocks the worker's own loop
            assert time.monotonic() < deadline, "the worker's watchdog reported no freeze"
            time.sleep(0.05)  # until its watchdog has reported it, with the stacks that its exit removes
    if sys.argv[2] == "serves":
        asyncio.run(serve())
    sys.exit(0)  # the interpreter's exit cancels faulthandler's timer: it hung here, in CPython's code
os.waitpid(child, 0)  # off the loop: the host itself is not frozen meanwhile
print(json.dumps({"host": os.getpid(), "shutdown": stallwatch.shutdown()}))
"""


@pytest.mark.parametrize("worker", ["exits", "serves"])
@pytest.mark.parametrize("fork_guard", ["true", "false"])
def test_a_worker_forked_while_faulthandler_is_armed_exits_and_is_watched_with_stacks(
    telemetry_dir, tmp_path, worker, fork_guard
):
    # CPython's faulthandler timer thread does not survive a fork; cancelling it in the child
    # (which interpreter exit does) waited for it forever, so the host waited for its worker.
    env = clean_env(XDG_RUNTIME_DIR=str(tmp_path), STALLWATCH_FORK_GUARD=fork_guard)
    proc = subprocess.run([sys.executable, "-c", _FORK_IN_A_LOOP, str(telemetry_dir), worker],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shutdown"] is True
    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    if worker == "exits":
        assert detected == []
        return
    (record,) = detected
    assert attrs(record)["stallwatch.freeze.kind"] == "loop_blocked"
    stacks = attrs(record)["stallwatch.freeze.stacks"]
    assert stacks.startswith("Timeout (") and "in serve" in stacks  # the worker's own, not the host's


def test_a_host_can_wait_until_its_watchdog_watches_it(tmp_path):
    proc = run_python(
        """
        import json, stallwatch
        from stallwatch.detect import heartbeat
        session = stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
        watched = session.wait_for_watchdog(30)
        marked = heartbeat.read(heartbeat.AREA.path)["watchdog_pid"]
        print(json.dumps({"watched": watched, "marked": marked, "watchdog": session.watchdog_pid,
                          "shutdown": stallwatch.shutdown()}))
        """,
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)),
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["watched"] is True
    assert result["marked"] == result["watchdog"]  # written by the watchdog into the host's heartbeat file
    assert result["shutdown"] is True


# stallwatch found by an import hook alone, as a `.pth` file's editable finder installs it (setuptools' strict
# editable mode): no `sys.path` entry holds it. The host blocks its loop past the threshold once watched.
_HOOKED_HOST = """
import asyncio, importlib.machinery, os, sys, time
out, source = sys.argv[1:3]
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != source]

class EditableFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, [source]) if name == "stallwatch" else None

sys.meta_path.append(EditableFinder)
import stallwatch
session = stallwatch.setup(file_dir=out, freeze_threshold=1.0)

async def main():
    assert await asyncio.to_thread(session.wait_for_watchdog, 30)
    time.sleep(2.5)

asyncio.run(main())
stallwatch.shutdown()
"""


def test_a_host_whose_stallwatch_only_an_import_hook_finds_has_its_freeze_reported_by_its_watchdog(
    telemetry_dir, tmp_path
):
    # The watchdog runs no `.pth` file, so no such hook: it is given the package's directory instead.
    source = os.path.dirname(importlib.util.find_spec("stallwatch").submodule_search_locations[0])
    if importlib.util.find_spec("opentelemetry").submodule_search_locations[0].startswith(source + os.sep):
        pytest.skip("stallwatch is installed beside the SDK: no directory of its own to take off sys.path")
    host = subprocess.run(
        [sys.executable, "-c", _HOOKED_HOST, str(telemetry_dir), source], env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert host.returncode == 0, host.stderr
    wait_for_freeze_detected(telemetry_dir / "logs.jsonl")  # by the watchdog's pipeline, from the host's packages


def test_a_host_whose_sys_path_is_longer_than_one_command_line_argument_may_be_is_watched(tmp_path):
    proc = run_python(
        """
        import json, sys, stallwatch
        sys.path += [f"/nonexistent/{'d' * 90}/{n}" for n in range(2000)]  # 200 KB: one argument holds 128 KiB
        session = stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
        print(json.dumps({"watched": session.wait_for_watchdog(30), "shutdown": stallwatch.shutdown()}))
        """,
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)),
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"watched": True, "shutdown": True}, proc.stderr


@pytest.mark.parametrize("how", ["turned_off", "killed", "killed_while_the_heartbeat_reaps", "shut_down"])
def test_waiting_for_a_watchdog_that_does_not_watch_the_host_returns_false_without_waiting_out_the_timeout(
    tmp_path, how
):
    proc = run_python(
        f"""
        import json, os, signal, time, stallwatch
        session = stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none",
                                   watchdog={how != "turned_off"})
        if {how!r}.startswith("killed"):
            assert session.wait_for_watchdog(30)
            os.kill(session.watchdog_pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until it is a zombie (or the heartbeat thread reaped it)
                try:
                    with open(f"/proc/{{session.watchdog_pid}}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except OSError:
                    break
                time.sleep(0.02)
        if {how!r} == "shut_down":
            assert session.wait_for_watchdog(30)
            stallwatch.shutdown()
        started = time.monotonic()
        if {how!r} == "killed_while_the_heartbeat_reaps":  # its check of the watchdog holds Popen's wait lock
            with session._watchdog[1]._waitpid_lock:
                watched = session.wait_for_watchdog(30)
        else:
            watched = session.wait_for_watchdog(30)
        print(json.dumps({{"watched": watched, "waited": time.monotonic() - started}}))
        """,
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)),
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["watched"] is False
    assert result["waited"] < 10  # at once, not after the 30 s timeout


def test_a_killed_watchdog_leaves_the_host_unaffected():
    proc = subprocess.run(
        [sys.executable, "-c", (
            "import asyncio, json, os, signal, stallwatch, time\n"
            "session = stallwatch.setup(traces_exporter='none', metrics_exporter='none', logs_exporter='none')\n"
            "os.kill(session.watchdog_pid, signal.SIGKILL)\n"
            "session._watchdog[1].wait(30)  # it is dead, whoever reaps it\n"
            "report = stallwatch.doctor(probe=False)\n"
            "async def main():\n"
            "    child = await asyncio.create_subprocess_exec('/bin/true')\n"
            "    return await child.wait()\n"
            "print(json.dumps({'exit': asyncio.run(main()), 'watchdog': report.watchdog['alive'],\n"
            "                  'advice': report.advice, 'shutdown': stallwatch.shutdown()}))\n"
        )],
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["exit"], result["shutdown"], result["watchdog"]) == (0, True, False)
    assert any("freeze watchdog" in a and "not running (exit status -9)" in a for a in result["advice"])


def _core_files_land_in_cwd() -> bool:
    try:
        pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
        hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_CORE)[1]
    except OSError:
        return False
    return not pattern.startswith("|") and "/" not in pattern and hard != 0


def _core_dump_freeze(tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs the core-dump scenario (a child killed by SIGSEGV before exec, dumping `args[0]` MB), checks a
    report during the spawn and the freeze's span name the dump, and returns the result and that span."""
    result = run_scenario("freeze_kinds.py", "core_dump", str(tmp_path), *args, timeout=120)
    for core in tmp_path.glob("core*"):
        core.unlink()  # hundreds of MB: do not leave it to pytest's retention

    assert result["returncode"] == -11  # SIGSEGV before exec, as in the incident
    records = [r for r in log_records(tmp_path / "telemetry" / "logs.jsonl") if "froze" in r["body"]["stringValue"]
               or "frozen" in r["body"]["stringValue"]]  # fmt: skip
    during = [r for r in records if int(r["timeUnixNano"]) < result["spawn_ended_ns"]]
    assert any(attrs(r)["stallwatch.freeze.cause"] == "child_core_dump" for r in during)
    (span,) = [
        s
        for s in freeze_spans(tmp_path / "telemetry" / "traces.jsonl")
        if int(s["startTimeUnixNano"]) <= result["spawn_ended_ns"]
        and int(s["endTimeUnixNano"]) >= result["spawn_started_ns"]
    ]
    assert attrs(span)["stallwatch.freeze.cause"] == "child_core_dump"
    return result, span


@pytest.mark.skipif(
    not _core_files_land_in_cwd(),
    reason="core dumps need kernel.core_pattern as a plain file name and a raisable RLIMIT_CORE on this machine",
)
def test_child_dumping_core_before_exec_is_named(tmp_path):
    if __import__("shutil").disk_usage(tmp_path).free < 4 << 30:
        pytest.skip("needs 4 GB free for a 1 GB core file")
    # 1 GB, so the dump outlasts the scenario's 0.25 s threshold with room to spare even when the
    # page cache takes it fast (512 MB took 0.3 s on a machine with 23 GB free, and was missed at 0.5 s)
    result, span = _core_dump_freeze(tmp_path, "1024")
    assert attrs(span)["stallwatch.freeze.kind"] == "gil_held"
    # The spawn's own span says the child died before exec, however long its core took to write.
    (child,) = [
        s
        for s in otlp_items(tmp_path / "telemetry" / "traces.jsonl", "spans")
        if attrs(s).get("process.pid") == str(result["child_pid"])
    ]
    assert attrs(child)["stallwatch.subprocess.exec"] == "not_done"
    assert [e["name"] for e in child["events"]] == ["stallwatch.subprocess.early_signal"]
    assert child["status"]["message"] == "killed by SIGSEGV before exec"


@pytest.mark.skipif(
    not _core_files_land_in_cwd(),
    reason="core dumps need kernel.core_pattern as a plain file name and a raisable RLIMIT_CORE on this machine",
)
def test_a_child_that_starts_dumping_core_after_the_freeze_is_reported_is_named_while_the_host_is_frozen(tmp_path):
    if __import__("shutil").disk_usage(tmp_path).free < 2 << 30:
        pytest.skip("needs 2 GB free for a 512 MB core file")
    # The child works 1 s in its after-fork handler before it crashes: the freeze is reported first
    # (0.25 s threshold), and the dump of 512 MB is over long before the next report, 2 s after it.
    _core_dump_freeze(tmp_path, "512", "1")  # its span names the dump also after the child's exit


def test_a_child_seen_dumping_core_stays_the_cause_after_its_dump_until_it_is_reaped():
    from stallwatch.detect.freeze_report import diagnose

    child = subprocess.Popen(["true"])  # its exit stands for the dumped child's: not reaped while the host is frozen
    wait_until(lambda: is_gone(child.pid), "the child has exited")
    assert diagnose(os.getpid(), frozenset({child.pid})).cause == "child_core_dump"
    child.wait()
    assert diagnose(os.getpid(), frozenset({child.pid})).cause != "child_core_dump"


def test_a_diagnosis_while_the_hosts_children_come_and_go_leaves_the_gone_ones_out_and_never_raises():
    """A child the diagnosis lists may be reaped before its own /proc entries are read (a host blocked in
    `os.waitpid`, or thawed at once, reaps it meanwhile). That raised FileNotFoundError out of the watchdog's
    poll and ended the watchdog: every later freeze of its host went unreported (FreezeActive cannot fire
    without the watchdog's scrape). Before the fix, 4 to 10 of these 3000 raised."""
    from stallwatch.detect.freeze_report import diagnose

    stop = threading.Event()
    spawned = []

    def churn() -> None:
        while not stop.is_set():
            spawned.append(subprocess.run(["true"], check=True).returncode)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        listed = sum(len(diagnose(os.getpid()).children) for _ in range(3000))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert listed and len(spawned) > 100  # the children did come and go under the diagnoses


def test_standard_loop_child_hanging_in_preexec_fn_blocks_the_loop_not_the_gil(tmp_path):
    result = run_scenario("freeze_kinds.py", "preexec", str(tmp_path))

    assert result["returncode"] == 0
    detected = [
        r for r in log_records(tmp_path / "telemetry" / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]
    ]
    assert len(detected) == 1
    assert attrs(detected[0])["stallwatch.freeze.kind"] == "loop_blocked"  # os.read released the GIL
    assert attrs(detected[0])["stallwatch.freeze.cause"] == "child_before_exec"
    assert int(attrs(detected[0])["stallwatch.freeze.child.pid"]) == result["child_pid"]


def test_stacks_from_faulthandler_are_attached_to_the_freeze_report(telemetry_dir):
    env = clean_env(STALLWATCH_FAULTHANDLER="true")
    run_scenario("freeze_probe.py", str(telemetry_dir), "2", env=env)

    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    stacks = attrs(detected[0])["stallwatch.freeze.stacks"]
    assert stacks.startswith("Timeout (")  # written by faulthandler's C timer while the GIL was held
    assert "freeze_probe.py" in stacks and "in main" in stacks  # the frozen coroutine, by name


# The watchdog's bootstrap whose pipeline imports (`_watchdog._prepare`) end only once its host has exited and
# removed its heartbeat file and stacks (60 s at most), as a loaded machine's imports can outlast a short freeze.
_PREPARED_AFTER_THE_HOST = """import os, time
import stallwatch._watchdog as slowed
original, heartbeat_file = slowed._prepare, sys.argv[sys.argv.index("--heartbeat") + 1]
def prepare_after_the_host():
    deadline = time.monotonic() + 60
    while os.path.exists(heartbeat_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    original()
slowed._prepare = prepare_after_the_host
from stallwatch._watchdog import main
"""


def test_the_stacks_of_a_freeze_are_reported_when_the_host_exits_before_the_watchdogs_pipeline_is_set_up(
    telemetry_dir, tmp_path
):
    # They were read once the pipeline was set up, from a file the host's exit had removed meanwhile.
    proc = run_python(
        f"""
        import asyncio, time
        import stallwatch
        from stallwatch.detect import heartbeat
        heartbeat._BOOTSTRAP = heartbeat._BOOTSTRAP.replace(
            "from stallwatch._watchdog import main\\n", {_PREPARED_AFTER_THE_HOST!r}
        )
        session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, faulthandler=True, freeze_threshold=0.5)
        async def blocked_here():
            assert await asyncio.to_thread(session.wait_for_watchdog, 30)
            time.sleep(3)  # the freeze: the loop blocked six thresholds long
        asyncio.run(blocked_here())
        stallwatch.shutdown()
        """,
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path)),
    )  # returns once the watchdog has left: it holds the stderr pipe

    assert proc.returncode == 0, proc.stderr
    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    (record,) = detected
    assert attrs(record)["stallwatch.freeze.kind"] == "loop_blocked"
    stacks = attrs(record)["stallwatch.freeze.stacks"]
    assert stacks.startswith("Timeout (") and "in blocked_here" in stacks
    assert list(tmp_path.glob("stallwatch-*")) == []  # the host's exit removed its heartbeat file and stacks


def test_faulthandlers_timer_does_not_fire_into_the_hosts_code_after_its_event_loop_has_stopped(tmp_path):
    # The dump walks the frames of threads that run Python meanwhile: after the loop, that is the
    # host's own clean-up, with no loop left to freeze.
    proc = run_python(
        """
        import asyncio, json, os, sys, time, stallwatch
        from stallwatch.detect import heartbeat
        stallwatch.setup(faulthandler=True, freeze_threshold=0.2)
        async def main():
            deadline = time.monotonic() + 30
            while heartbeat._armed_by != os.getpid():  # until the heartbeat has armed the timer
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        asyncio.run(main())
        stacks = heartbeat.stacks_path(heartbeat.AREA.path)
        time.sleep(1.0)  # the host's work after its loop, five thresholds long
        print(json.dumps({"stacks": stacks.read_text(), "shutdown": stallwatch.shutdown()}))
        """,
        env=clean_env(XDG_RUNTIME_DIR=str(tmp_path), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                      OTEL_LOGS_EXPORTER="none"),
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"stacks": "", "shutdown": True}


_LOOP_BLOCKED_BY_PYTHON = """
import asyncio, json, pathlib, sys, time, stallwatch
import uvloop
session = stallwatch.setup(file_dir=sys.argv[1], faulthandler=True, freeze_threshold=0.2)
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"
traces = pathlib.Path(sys.argv[1], "traces.jsonl")
def nested(depth):
    return nested(depth - 1) if depth else sum(len(str(n)) for n in range(3))
def crunch(seconds):  # pure Python: pushes and pops frames all along, as a long computation does
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        nested(60)
async def main():
    for _ in range(60):  # the crash was a race: a few blocks in a hundred
        crunch(0.25)  # blocks the loop past the threshold
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 30
    while not (traces.exists() and b'"stallwatch.freeze"' in traces.read_bytes()):
        assert time.monotonic() < deadline, "the watchdog exported no freeze"
        await asyncio.sleep(0.05)
uvloop.run(main())
print(json.dumps({"shutdown": stallwatch.shutdown()}))
"""


def test_a_loop_blocked_by_running_python_code_with_faulthandler_on_runs_on_and_its_stacks_name_the_code(
    telemetry_dir,
):
    # faulthandler's C timer walks the frames of running threads without the GIL: fired into a loop
    # that runs Python, it crashed the host (SIGSEGV). The heartbeat thread takes those stacks.
    proc = subprocess.run([sys.executable, "-c", _LOOP_BLOCKED_BY_PYTHON, str(telemetry_dir)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"shutdown": True}
    detected = [r for r in log_records(telemetry_dir / "logs.jsonl") if "freeze detected" in r["body"]["stringValue"]]
    blocked = [attrs(r) for r in detected if attrs(r)["stallwatch.freeze.kind"] == "loop_blocked"]
    assert blocked
    assert any("in crunch" in a.get("stallwatch.freeze.stacks", "") for a in blocked)


def test_the_watchdog_answers_a_prometheus_scrape_while_the_frozen_host_cannot(telemetry_dir):
    host_port, watchdog_port = free_port(), free_port()
    env = clean_env(**prometheus_env(host_port, watchdog_port))
    host = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "4"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    json.loads(host.stdout.readline())  # watching; the 4 s freeze starts 0.5 s later
    wait_for_freeze_detected(telemetry_dir / "logs.jsonl")
    from_host = scrape(host_port, timeout=1.0)
    from_watchdog = scrape(watchdog_port, timeout=2.0)
    host.communicate(timeout=60)

    assert from_host.startswith("no answer")  # up == 0 for the host while it is frozen
    lines = from_watchdog.splitlines()
    active = [line for line in lines if line.startswith("stallwatch_freeze_active{")]
    assert len(active) == 10, from_watchdog[-2000:]  # every kind and cause: "not frozen" is a value
    (frozen,) = [line for line in active if line.endswith(" 1.0")]
    assert 'stallwatch_freeze_kind="gil_held"' in frozen
    assert 'stallwatch_freeze_cause="child_before_exec"' in frozen
    # No freeze has ended yet, and each kind and cause already has its duration series, at 0: the first
    # freeze to end is then an increase, with buckets fine enough to read its length.
    counts = [line for line in lines if line.startswith("stallwatch_freeze_duration_seconds_count{")]
    assert len(counts) == 10 and all(line.endswith(" 0.0") for line in counts)
    assert any('le="30.0"' in line for line in lines) and any('le="35.0"' in line for line in lines)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_loop_heartbeat_puts_no_timer_on_the_host_loop(telemetry_dir, loop_kind):
    """A timer in an asyncio loop's heap costs every iteration (clock reads, an epoll_wait with a
    timeout): the heartbeat thread hands the loop one callback at a time instead."""
    result = run_scenario("loop_beats.py", str(telemetry_dir), loop_kind)

    assert result["kind"] == loop_kind
    if loop_kind == "asyncio":
        assert result["timers"] == [0] * 6
    assert result["loop_beats"] >= 4  # 6 waits of 0.1 s, a beat every 0.1 s
    lag = metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.loop.lag")[-1]
    assert attrs(lag) == {"stallwatch.loop": loop_kind}
    assert int(lag["count"]) >= 4
    assert float(lag["max"]) < 0.5  # the loop was free: each beat ran soon after it was handed over


IDENTIFIED_HOST = """
import json, sys, stallwatch
session = stallwatch.setup(file_dir=sys.argv[1], freeze_threshold=1.0)
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"
print(json.dumps({"watching": True}), flush=True)
sys.stdin.read()  # until the test closes stdin
stallwatch.shutdown()
"""


def _labels_of(scrape: str, prefix: str, label_name: str) -> set[str]:
    """The values of `label_name` on the sample lines of `scrape` whose metric name starts with `prefix`."""
    values = set()
    for line in scrape.splitlines():
        if line.startswith(prefix) and "{" in line:
            found = re.search(rf'[{{,]{label_name}="([^"]*)"', line)
            values.add(found.group(1) if found else "")
    return values


def test_the_watchdogs_freeze_series_carry_the_service_name_and_instance_id_of_the_host_it_watches(telemetry_dir):
    host_port, watchdog_port = free_port(), free_port()
    env = clean_env(**prometheus_env(host_port, watchdog_port, OTEL_SERVICE_NAME="checkout"))
    host = subprocess.Popen(
        [sys.executable, "-c", IDENTIFIED_HOST, str(telemetry_dir)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        json.loads(host.stdout.readline())
        from_host = scrape(host_port, timeout=10.0)
        from_watchdog = scrape(watchdog_port, timeout=10.0)
    finally:
        host.communicate(input="", timeout=60)

    # No service.instance.id was set: the host made one, and its watchdog carries the same on every series.
    (identity,) = _labels_of(from_host, "stallwatch_", "service_instance_id")
    assert len(identity) == 36 and identity.count("-") == 4, from_host[-2000:]  # a UUID
    assert _labels_of(from_host, "stallwatch_", "service_name") == {"checkout"}
    assert _labels_of(from_watchdog, "stallwatch_freeze_", "service_instance_id") == {identity}, from_watchdog[-2000:]
    assert _labels_of(from_watchdog, "stallwatch_freeze_", "service_name") == {"checkout"}
    assert _labels_of(from_watchdog, "stallwatch_", "service_instance_id") == {identity}
    (role,) = [line for line in from_watchdog.splitlines() if line.startswith("target_info{")]
    assert 'stallwatch_process_role="watchdog"' in role and f'service_instance_id="{identity}"' in role


def _resources(path: Path, level: str) -> list[dict[str, str]]:
    if not path.exists():
        return []
    return [
        {a["key"]: next(iter(a["value"].values())) for a in resource["resource"].get("attributes", [])}
        for request in read_jsonl(path)
        for resource in request.get(level, [])
    ]


def test_each_worker_gunicorn_forks_after_preload_has_a_watchdog_carrying_its_own_instance_id(tmp_path):
    # A fork child's providers take a service.instance.id of their own (SDK 1.45); the worker's watchdog
    # must carry that one, not the master's, or every worker's freezes land on the master.
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("gunicorn")
    pytest.importorskip("uvicorn")
    telemetry, runtime = tmp_path / "telemetry", tmp_path / "run"
    runtime.mkdir()
    # Each worker's instance id reaches the metrics file at its exit alone: a shutdown budget no loaded machine
    # outlasts, since that budget is not what this test is about.
    env = clean_env(STALLWATCH_FILE_DIR=str(telemetry), OTEL_METRIC_EXPORT_INTERVAL="3600000",
                    STALLWATCH_FREEZE_THRESHOLD="0.5", STALLWATCH_SHUTDOWN_TIMEOUT="30",
                    XDG_RUNTIME_DIR=str(runtime))  # fmt: skip
    command = [sys.executable, "-m", "gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker",
               "-w", "2", "-b", "127.0.0.1:0", "--preload"]  # fmt: skip

    def watchdogs() -> dict[int, str]:
        return {
            int(r["stallwatch.watched.pid"]): r["service.instance.id"]
            for r in _resources(telemetry / "traces.jsonl", "resourceSpans")
            if r.get("stallwatch.process.role") == "watchdog" and int(r["stallwatch.watched.pid"]) in workers
        }

    host = Served(command, env, cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        workers = {int(host.wait_for(r"Booting worker with pid: (\d+)", count=n).group(1)) for n in (1, 2)}
        host.wait_for(r"Application startup complete", count=2)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for number in range(20):
                assert client.get(f"/spawn/{number}").status_code == 200

            def block(blocked: set[int]) -> None:
                # A connection of its own: two kept alive to one worker would take every later block there.
                blocked.add(int(client.get("/block/1.5", headers={"Connection": "close"}).text))

            # An idle watchdog exports nothing: a freeze in each worker makes it report (its span, at the thaw).
            # Blocked is not yet reported: a block a loaded machine's watchdog missed is made again.
            deadline = time.monotonic() + 120
            while set(watchdogs()) != workers:
                assert time.monotonic() < deadline, f"freezes reported of {set(watchdogs())} of {workers}"
                blocked: set[int] = set()
                pair = [threading.Thread(target=block, args=(blocked,)) for _ in range(2)]
                for thread in pair:  # two at once: a worker whose loop is blocked accepts nothing
                    thread.start()
                for thread in pair:
                    thread.join()
                settled = time.monotonic() + 10  # the thaw is seen at the watchdog's next poll, then exported
                while not blocked <= set(watchdogs()) and time.monotonic() < settled:
                    time.sleep(0.05)
        host.process.send_signal(signal.SIGTERM)
        assert host.finish() == 0, host.stderr()
    finally:
        host.kill()

    hosts = {  # each worker exports its metrics at its exit
        r["service.instance.id"]
        for r in _resources(telemetry / "metrics.jsonl", "resourceMetrics")
        if r.get("stallwatch.process.role") != "watchdog"
    }
    assert len(set(watchdogs().values())) == 2 and set(watchdogs().values()) <= hosts
    wait_until(lambda: not list(runtime.glob("stallwatch-*")), "the watchdogs removed the heartbeat files")
