"""stallwatch as a Sentry user sees it: the real sentry-sdk in real hosts, sending over HTTP to a
Sentry envelope endpoint on loopback (`support.sentry_sink`); freezes sent by the real watchdog."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from conftest import SCENARIOS, clean_env, run_python
from support.sentry_sink import SentrySink

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)")


@pytest.fixture
def sink() -> Iterator[SentrySink]:
    server = SentrySink().start()
    yield server
    server.stop()


def ours(events: list[dict], kind: str | None = None) -> list[dict]:
    """stallwatch's events (not sentry-sdk's own), of one `stallwatch.kind` if given."""
    return [
        e
        for e in events
        if e.get("logger") == "stallwatch" and kind in (None, e.get("tags", {}).get("stallwatch.kind"))
    ]


# Kills one idle worker of the pool with a stale SystemExit (as incident 002's timeout did), then
# submits an item inside a traced request: the worker dies holding it. Returns the request's trace id.
# Kills one idle worker of `pool` with a stale SystemExit (as incident 002's timeout did), then
# submits an item inside a traced request: the worker dies holding it. Waits until stallwatch has
# reported the orphaned item; returns the request's trace id. Indented to sit in the hosts' code.
STRAND = textwrap.indent(
    textwrap.dedent(
        """\
        import ctypes, json, logging, sys, threading, time
        from opentelemetry import trace

        class Orphans(logging.Handler):
            def __init__(self):
                super().__init__()
                self.seen = threading.Semaphore(0)

            def emit(self, record):
                if "wedge orphaned_item" in record.getMessage():
                    self.seen.release()

        orphans = Orphans()
        logging.getLogger("stallwatch").addHandler(orphans)

        def strand(pool, pause):
            ident = pool.submit(threading.get_ident).result()
            deadline = time.monotonic() + 30
            while getattr(getattr(sys._current_frames().get(ident), "f_code", None), "co_name", "") != "_worker":
                assert time.monotonic() < deadline, "the worker never went back to its queue"
                time.sleep(0.005)  # until the worker is back waiting on its queue
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(SystemExit))
            time.sleep(pause)  # a different age for each stranded item
            with trace.get_tracer("app").start_as_current_span("GET /predict") as span:
                pool.submit(lambda: "never")
            assert orphans.seen.acquire(timeout=30), "no orphaned item reported"
            return format(span.get_span_context().trace_id, "032x")
        """
    ),
    " " * 8,
).lstrip()


def test_wedges_keep_one_fingerprint_per_executor_across_threads_and_timings(sink, telemetry_dir):
    proc = run_python(
        f"""
        import sentry_sdk, stallwatch
        sentry_sdk.init(dsn={sink.dsn!r}, release="app@1")
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, guard_async_exc=False, watchdog=False)
        from concurrent.futures import ThreadPoolExecutor
        {STRAND}
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="model")
        traces = [strand(pool, 0.0), strand(pool, 0.5)]  # workers model_0, then model_1
        sentry_sdk.flush(10)
        print(json.dumps(traces), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    traces = json.loads(proc.stdout)
    events = sink.wait_for_events(lambda e: len(ours(e, "orphaned_item")) == 2 and len(ours(e, "worker_died")) == 2)

    died = ours(events, "worker_died")
    assert [e["fingerprint"] for e in died] == [["stallwatch", "worker_died", "model", "SystemExit"]] * 2
    assert {e["message"] for e in died} == {"stallwatch: executor worker died of SystemExit (model)"}
    assert sorted(e["tags"]["thread.name"] for e in died) == ["model_0", "model_1"]
    assert {e["level"] for e in died} == {"warning"}
    orphaned = ours(events, "orphaned_item")
    assert [e["fingerprint"] for e in orphaned] == [["stallwatch", "orphaned_item", "model"]] * 2
    assert {e["message"] for e in orphaned} == {"stallwatch: executor item will never complete (model)"}
    assert {e["level"] for e in orphaned} == {"error"}
    assert [e["tags"]["thread.name"] for e in orphaned] == ["model_0", "model_1"]
    facts = [e["contexts"]["stallwatch"] for e in orphaned]
    assert all(f["worker_died_before_running_it"] is True and f["healed"] is False for f in facts)
    assert all(0 < f["item_age_seconds"] < 30 and "will never complete" in f["description"] for f in facts)
    # Each orphaned item names the request that awaits it forever, in Sentry's trace context and a tag.
    assert [e["contexts"]["trace"]["trace_id"] for e in orphaned] == traces
    assert [e["tags"]["otel.trace_id"] for e in orphaned] == traces
    assert all("stallwatch" in e["sdk"]["integrations"] and e["release"] == "app@1" for e in orphaned)


def test_a_stale_async_exception_refused_is_sent_with_the_callers_trace(sink, telemetry_dir):
    proc = run_python(
        f"""
        import ctypes, json, threading, time
        import sentry_sdk, stallwatch
        sentry_sdk.init(dsn={sink.dsn!r})
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, watchdog=False)
        from concurrent.futures import ThreadPoolExecutor
        from opentelemetry import trace
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        ident = pool.submit(threading.get_ident).result()
        with trace.get_tracer("app").start_as_current_span("timeout handler") as span:  # the timed-out request
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(SystemExit))
        sentry_sdk.flush(10)
        print(json.dumps(format(span.get_span_context().trace_id, "032x")), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    (event,) = ours(sink.wait_for_events(lambda e: ours(e, "stale_async_exception")))
    assert event["fingerprint"] == ["stallwatch", "stale_async_exception", "SystemExit"]
    assert event["message"] == "stallwatch: stale SystemExit aimed at an idle executor worker refused"
    assert event["tags"]["thread.name"] == "model_0"
    assert event["contexts"]["trace"]["trace_id"] == json.loads(proc.stdout)


def _freeze_probe(sink: SentrySink, telemetry_dir, seconds: str, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), seconds, f"--sentry={sink.dsn}",
         *more],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_loop_frozen_inside_a_span_is_in_sentry_with_that_spans_trace(sink, telemetry_dir):
    host = _freeze_probe(sink, telemetry_dir, "3", "--block-loop")
    (event,) = ours(sink.wait_for_events(lambda e: ours(e, "freeze")))
    stdout, stderr = host.communicate(timeout=60)
    assert host.returncode == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    assert event["fingerprint"][:3] == ["stallwatch", "freeze", "loop_blocked"]
    assert event["contexts"]["trace"]["trace_id"] == event["tags"]["otel.trace_id"] == result["trace_id"]
    assert event["contexts"]["trace"]["span_id"] == result["span_id"]


def test_a_freeze_is_in_sentry_while_the_host_is_still_frozen_and_only_once(sink, telemetry_dir):
    host = _freeze_probe(sink, telemetry_dir, "6")
    (event,) = ours(sink.wait_for_events(lambda e: ours(e, "freeze")))
    assert host.poll() is None  # still frozen: the host could not have sent it
    stdout, stderr = host.communicate(timeout=60)
    assert host.returncode == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    assert event["fingerprint"] == ["stallwatch", "freeze", "gil_held", "child_before_exec"]
    assert event["message"] == "stallwatch: host frozen, gil_held (child_before_exec)"
    assert event["level"] == "error"
    assert event["tags"]["stallwatch.freeze.spawn"] == "true (1 args)"
    assert event["contexts"]["trace"]["trace_id"] == event["tags"]["otel.trace_id"] == result["trace_id"]
    assert event["contexts"]["trace"]["span_id"] == result["span_id"]  # the frozen probe's span
    facts = event["contexts"]["stallwatch"]
    assert facts["main_thread_syscall"] == "read" and facts["child"]["pid"] == result["child_pid"]
    assert facts["frozen_seconds"] >= 1.0 and "cause child_before_exec" in facts["description"]
    assert (event["release"], event["environment"]) == ("probe@1", "test")  # the host's, handed over
    # The host thawed and ran on: no second event for the same freeze.
    assert len(ours(sink.events(), "freeze")) == 1


def test_a_host_killed_while_frozen_still_has_its_freeze_in_sentry(sink, telemetry_dir):
    host = _freeze_probe(sink, telemetry_dir, "30")
    for line in host.stderr:  # the watchdog's WARNING, on the stderr it shares with the host
        if "freeze detected" in line:
            break
    host.send_signal(signal.SIGKILL)  # what a load balancer's health check ends with
    host.communicate(timeout=30)

    (event,) = ours(sink.wait_for_events(lambda e: ours(e, "freeze")))
    assert event["tags"]["stallwatch.freeze.kind"] == "gil_held"
    assert event["contexts"]["stallwatch"]["host_pid"] == host.pid


def test_a_leak_candidate_found_at_the_next_start_is_sent_with_the_trace_of_its_create(sink, tmp_path):
    journal_dir = tmp_path / "journal"
    killed = run_python(
        f"""
        import json, os, signal, stallwatch
        from opentelemetry import trace
        from stallwatch.journal import ledger
        stallwatch.setup(journal_dir={str(journal_dir)!r}, file_dir={str(tmp_path / "first")!r}, watchdog=False)
        with trace.get_tracer("control-plane").start_as_current_span("provision") as span:
            ids = span.get_span_context()
            ledger.recorder().intent(ledger.Intent("create", "compute.instance",
                "nebius.compute.v1.InstanceService/Create", f"{{ids.trace_id:032x}}", f"{{ids.span_id:016x}}"))
            print(json.dumps([os.getpid(), f"{{ids.trace_id:032x}}"]), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # before the cloud answered
        """
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    pid, trace_id = json.loads(killed.stdout)
    restart = run_python(
        f"""
        import sentry_sdk, stallwatch
        sentry_sdk.init(dsn={sink.dsn!r})
        stallwatch.setup(journal_dir={str(journal_dir)!r}, file_dir={str(tmp_path / "second")!r}, watchdog=False)
        sentry_sdk.flush(10)
        """
    )
    assert restart.returncode == 0, restart.stderr

    (event,) = ours(sink.wait_for_events(lambda e: ours(e, "leak_candidate")))
    assert event["fingerprint"] == ["stallwatch", "leak_candidate", "create", "compute.instance"]
    assert event["message"] == "stallwatch: cloud resource create unconfirmed (compute.instance)"
    assert event["tags"]["stallwatch.cloud.rpc"] == "nebius.compute.v1.InstanceService/Create"
    assert event["contexts"]["trace"]["trace_id"] == trace_id
    assert event["contexts"]["stallwatch"]["dead_process_pid"] == pid


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: init reaps the orphaned watchdog when it gets to it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize(
    "options",
    [
        "disabled_integrations=[StallwatchIntegration()]",
        "default_integrations=False",
        "integrations=[StallwatchIntegration(freezes=False, wedges=False)]",
    ],
)
def test_the_integration_turned_off_sends_nothing_while_sentry_works(sink, telemetry_dir, options):
    proc = run_python(
        f"""
        import asyncio, pathlib
        import sentry_sdk, stallwatch
        from stallwatch.sentry import StallwatchIntegration
        sentry_sdk.init(dsn={sink.dsn!r}, {options})
        session = stallwatch.setup(file_dir={str(telemetry_dir)!r}, guard_async_exc=False, freeze_threshold=1.0)
        from concurrent.futures import ThreadPoolExecutor
        {STRAND}
        strand(ThreadPoolExecutor(max_workers=1, thread_name_prefix="model"), 0.0)

        async def main():
            time.sleep(2.5)  # sync code on the loop: a loop_blocked freeze

        assert session.wait_for_watchdog(30)
        asyncio.run(main())
        logs = pathlib.Path({str(telemetry_dir / "logs.jsonl")!r})
        deadline = time.monotonic() + 30
        while "freeze detected" not in (logs.read_text() if logs.exists() else ""):
            assert time.monotonic() < deadline, "the watchdog reported no freeze"
            time.sleep(0.1)
        sentry_sdk.capture_message("the host's own event")
        sentry_sdk.flush(10)
        print(json.dumps(session.watchdog_pid))
        """
    )
    assert proc.returncode == 0, proc.stderr
    watchdog = json.loads(proc.stdout)
    sink.wait_for_events(lambda e: any(x.get("message") == "the host's own event" for x in e))
    deadline = time.monotonic() + 30
    while not _gone(watchdog):  # it leaves after its host: whatever it sent has arrived by then
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [e["message"] for e in ours(sink.events())] == []


def test_without_sentry_in_the_host_stallwatch_never_imports_it(telemetry_dir):
    proc = run_python(
        f"""
        import sys, stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, guard_async_exc=False, watchdog=False)
        from concurrent.futures import ThreadPoolExecutor
        {STRAND}
        strand(ThreadPoolExecutor(max_workers=1, thread_name_prefix="model"), 0.0)
        print(json.dumps("sentry_sdk" in sys.modules))
        """
    )
    assert proc.returncode == 0, proc.stderr  # `strand` saw the orphaned item reported
    assert json.loads(proc.stdout) is False
