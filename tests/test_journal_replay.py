"""Incident 000 end to end: a host frozen and killed mid-create; the next start replays its journal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import attrs, clean_env, latest_total, otlp_items, run_python
from support.fake_nebius import INSTANCE_SERVICE, FakeNebius
from support.processes import command_line, is_gone
from support.waiting import wait_until

HOST = """
import os, sys, time
HANG = [0.0]
os.register_at_fork(after_in_child=lambda: HANG[0] and time.sleep(HANG[0]))  # a library's, before stallwatch
import asyncio, json
import stallwatch
journal_dir, file_dir, address, freeze = sys.argv[1:]
session = stallwatch.setup(journal_dir=journal_dir, file_dir=file_dir, freeze_threshold=1.0, uvloop_spawn="fork")
assert session.wait_for_watchdog(30)
import uvloop
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
from opentelemetry import trace
from support.fake_nebius import sdk_for

async def main():
    async with sdk_for(address) as sdk:
        with trace.get_tracer("control-plane").start_as_current_span("provision") as span:
            create = asyncio.ensure_future(InstanceServiceClient(sdk).create(
                CreateInstanceRequest(metadata=ResourceMetadata(name="h200", parent_id="project-x")), timeout=600))
            context = span.get_span_context()
            print(json.dumps({"trace_id": f"{context.trace_id:032x}"}), flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # the create reached the fake cloud, which sits on it
            if freeze == "freeze":
                HANG[0] = 60.0  # a probe's ssh spawn, held before exec: the whole host freezes here
                await asyncio.create_subprocess_exec("/bin/true")
            await create

loop = uvloop.new_event_loop()
loop.run_until_complete(main())
"""


def _kill_during_create(tmp_path, freeze: str) -> str:
    journal_dir, first = tmp_path / "journal", tmp_path / "first"
    with FakeNebius() as fake:
        fake.delay_next(f"{INSTANCE_SERVICE}/Create", 120)
        host = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOST), str(journal_dir), str(first), fake.address, freeze],
            env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        trace_id = json.loads(host.stdout.readline())["trace_id"]
        wait_until(lambda: fake.count(f"{INSTANCE_SERVICE}/Create") == 1, "the create is in flight")
        host.stdin.write("go\n")
        host.stdin.flush()
        if freeze == "freeze":  # frozen past the threshold: the watchdog reports it, the health check gives up
            wait_until(lambda: _spawn_freeze_reported(first / "logs.jsonl"), "the held spawn's freeze is reported")
        held = _children(host.pid)  # the forked copy held before exec, and the watchdog
        watchdogs = [pid for pid in held if "stallwatch._watchdog" in command_line(pid)]
        host.send_signal(signal.SIGKILL)
        host.wait(30)
        for pid in watchdogs:  # it sees its host die, writes host_killed, then leaves
            wait_until(lambda: is_gone(pid), "the watchdog left")  # noqa: B023
        for pid in held:  # the held copy would sleep on for a minute
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return trace_id


def _spawn_freeze_reported(logs: Path) -> bool:
    """Whether the watchdog reported the freeze of the held spawn: a loaded machine can stall the host's
    start-up past the threshold too, a freeze that thaws and is not the one the host is killed in."""
    if not logs.exists():
        return False
    lines = logs.read_text().splitlines(keepends=True)
    records = [record for line in lines if line.endswith("\n")  # a line being written is not read yet
               for request in [json.loads(line)] for resource in request["resourceLogs"]
               for scope in resource["scopeLogs"] for record in scope["logRecords"]]  # fmt: skip
    return any("freeze detected" in str(r["body"]) and "stallwatch.freeze.spawn" in attrs(r) for r in records)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _next_start(tmp_path, file_dir: str = "second"):
    proc = run_python(
        f"""
        import stallwatch
        stallwatch.setup(journal_dir={str(tmp_path / "journal")!r}, file_dir={str(tmp_path / file_dir)!r},
                         watchdog=False)
        stallwatch.shutdown(10)
        """
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_host_killed_while_frozen_mid_create_is_replayed_with_its_leak_candidate(tmp_path):
    trace_id = _kill_during_create(tmp_path, "freeze")
    proc = _next_start(tmp_path)
    second = tmp_path / "second"

    spans = {s["name"]: s for s in otlp_items(second / "traces.jsonl", "spans")}
    create = spans[f"{INSTANCE_SERVICE}/Create"]
    assert create["traceId"] == trace_id  # the original ids: it joins the trace the backend already has
    assert attrs(create)["stallwatch.interrupted"] is True
    assert attrs(create)["stallwatch.interrupted.reason"] == "host_killed"
    assert create["status"].get("code") in (2, "STATUS_CODE_ERROR")
    assert int(create["endTimeUnixNano"]) > int(create["startTimeUnixNano"])
    records = [r for r in otlp_items(second / "logs.jsonl", "logs") if "unconfirmed" in str(r["body"])]
    assert len(records) == 1 and records[0]["traceId"] == trace_id
    assert attrs(records[0])["stallwatch.cloud.resource.type"] == "compute.instance"
    assert "cloud resource create unconfirmed" in proc.stderr  # WARNING: also on the host's own stderr
    metrics = second / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.cloud.resources.unconfirmed", **{
        "stallwatch.cloud.resource.type": "compute.instance"}) == 1  # fmt: skip
    assert (tmp_path / "journal" / "archive").is_dir()
    # A third start finds nothing left to replay.
    again = run_python(
        f"""
        import stallwatch
        stallwatch.setup(journal_dir={str(tmp_path / "journal")!r}, file_dir={str(tmp_path / "third")!r},
                         watchdog=False)
        stallwatch.shutdown(10)
        """
    )
    assert "unconfirmed" not in again.stderr
    assert not (tmp_path / "third" / "traces.jsonl").exists() or not [
        s for s in otlp_items(tmp_path / "third" / "traces.jsonl", "spans") if attrs(s).get("stallwatch.interrupted")
    ]


def _leaks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stallwatch.cli", "leaks", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_a_leak_candidate_stays_open_across_restarts_until_someone_confirms_it(tmp_path):
    trace_id = _kill_during_create(tmp_path, "freeze")
    journal_dir = str(tmp_path / "journal")
    unconfirmed = {"stallwatch.cloud.resource.type": "compute.instance"}
    _next_start(tmp_path, "second")  # replays the killed host: one leak candidate
    assert latest_total(tmp_path / "second" / "metrics.jsonl", "stallwatch.cloud.resources.unconfirmed",
                        **unconfirmed) == 1  # fmt: skip

    listed = _leaks("--journal-dir", journal_dir)
    assert listed.returncode == 0, listed.stderr
    (line,) = listed.stdout.splitlines()
    assert f"trace {trace_id}" in line and "create compute.instance" in line
    key = line.split()[0]
    third = _next_start(tmp_path, "third")  # nothing left to replay, and the candidate is still open
    assert "unconfirmed" not in third.stderr
    assert latest_total(tmp_path / "third" / "metrics.jsonl", "stallwatch.cloud.resources.unconfirmed",
                        **unconfirmed) == 1  # fmt: skip

    confirmed = _leaks("--journal-dir", journal_dir, "--confirm", key)
    assert (confirmed.returncode, confirmed.stdout) == (0, f"confirmed {key}\n"), confirmed.stderr
    again = _leaks("--journal-dir", journal_dir, "--confirm", key)
    assert again.returncode == 2 and key in again.stderr
    _next_start(tmp_path, "fourth")
    assert latest_total(tmp_path / "fourth" / "metrics.jsonl", "stallwatch.cloud.resources.unconfirmed",
                        **unconfirmed) == 0  # fmt: skip
    assert _leaks("--journal-dir", journal_dir).stdout.startswith("no leak candidates")


def test_a_host_killed_without_a_freeze_is_replayed_as_process_died(tmp_path):
    trace_id = _kill_during_create(tmp_path, "nofreeze")
    _next_start(tmp_path)
    spans = [s for s in otlp_items(tmp_path / "second" / "traces.jsonl", "spans") if s["traceId"] == trace_id]
    (create,) = [s for s in spans if s["name"] == f"{INSTANCE_SERVICE}/Create"]
    assert attrs(create)["stallwatch.interrupted.reason"] == "process_died"


def test_postmortem_reads_the_journal_of_the_killed_host_before_any_restart(tmp_path):
    trace_id = _kill_during_create(tmp_path, "freeze")
    proc = subprocess.run(
        [sys.executable, "-m", "stallwatch.cli", "postmortem", "--journal", str(tmp_path / "journal"), "--format",
         "json"], capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    kinds = [(e["kind"], e["lane"]) for e in report["events"]]
    assert ("freeze", "freeze") in kinds and ("interrupted", "nebius") in kinds
    interrupted = next(e for e in report["events"] if e["kind"] == "interrupted")
    assert "host_killed" in interrupted["summary"] and "InstanceService/Create" in interrupted["summary"]
    (candidate,) = report["leak_candidates"]
    assert candidate["trace_id"] == trace_id and candidate["stallwatch.cloud.resource.type"] == "compute.instance"
    assert list((tmp_path / "journal").glob("*.journal"))  # read, not replayed: nothing archived
