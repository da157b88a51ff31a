"""`stallwatch postmortem` on telemetry left by real freezes and a host killed mid-create."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import clean_env, run_scenario

STALLWATCH = [sys.executable, "-m", "stallwatch.cli", "postmortem"]


def postmortem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*STALLWATCH, *args], capture_output=True, text=True, timeout=60, env=clean_env())


def test_a_freeze_is_on_the_timeline_with_its_cause_and_the_frozen_spawn(tmp_path):
    run_scenario("freeze_probe.py", str(tmp_path), "2", timeout=120)

    proc = postmortem("--dir", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    events = json.loads(proc.stdout)["events"]
    kinds = [e["kind"] for e in events]
    assert kinds.index("freeze") < kinds.index("freeze_detected")  # the freeze began before it was detected
    freeze = next(e for e in events if e["kind"] == "freeze")
    assert "gil_held" in freeze["summary"] and "child_before_exec" in freeze["summary"]
    assert "spawning true (1 args)" in freeze["summary"]
    assert freeze["end_ns"] - freeze["start_ns"] >= 1.9e9
    spawn = next(e for e in events if e["kind"] == "spawn")  # the frozen spawn, by its blocked time
    assert spawn["attributes"]["stallwatch.spawn.loop"] == "uvloop"
    assert spawn["attributes"]["stallwatch.spawn.blocked_seconds"] >= 1.9

    text = postmortem("--dir", str(tmp_path)).stdout
    assert "!! " in text and "cause child_before_exec" in text
    html = postmortem("--dir", str(tmp_path), "--format", "html", "--out", str(tmp_path / "report.html"))
    assert html.returncode == 0 and "report written to" in html.stdout
    page = (tmp_path / "report.html").read_text()
    assert page.count("<svg") == 1 and "child_before_exec" in page
    # The window excludes it all when it ends before the freeze.
    early = postmortem("--dir", str(tmp_path), "--until", "2000-01-01T00:00:00Z", "--format", "json")
    assert json.loads(early.stdout)["events"] == []


def test_a_host_killed_during_a_create_leaves_a_leak_candidate(tmp_path):
    host = subprocess.Popen(
        [sys.executable, "-c", f"""
import asyncio, time
import stallwatch
stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
from stallwatch.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for

async def main(fake):
    async with sdk_for(fake.address) as sdk:
        fake.delay_next(INSTANCE_SERVICE + "/Create", 60)
        print("creating", flush=True)
        await InstanceServiceClient(sdk).create(
            CreateInstanceRequest(metadata=ResourceMetadata(name="h200", parent_id="p")), timeout=120)

with FakeNebius() as fake:
    asyncio.run(main(fake))
"""],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert host.stdout.readline().strip() == "creating"
    time.sleep(3)  # the intent record is exported (logs batch every second); the create is still in flight
    host.send_signal(signal.SIGKILL)  # the health check
    host.wait(10)

    proc = postmortem("--dir", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    (candidate,) = report["leak_candidates"]
    assert candidate["stallwatch.cloud.rpc"] == "nebius.compute.v1.InstanceService/Create"
    assert candidate["stallwatch.cloud.resource.type"] == "compute.instance"
    assert (
        "Leak candidates (cloud resources asked for with no recorded outcome): 1"
        in postmortem("--dir", str(tmp_path)).stdout
    )


def test_user_mistakes_get_one_line_and_status_2_never_a_traceback(tmp_path):
    for args, message in (
        (["--dir", str(tmp_path / "missing")], "is not a directory"),
        (["--dir", str(tmp_path)], "no traces.jsonl, logs.jsonl or metrics.jsonl"),
        (["--file", str(tmp_path / "nope.json")], "does not exist"),
        (["--dir", str(tmp_path), "--since", "last tuesday"], "cannot read the time"),
    ):
        proc = postmortem(*args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    (tmp_path / "junk.json").write_text("not json at all\n")
    proc = postmortem("--file", str(tmp_path / "junk.json"))
    assert proc.returncode == 2 and "no OTLP/JSON spans, logs or metrics" in proc.stderr


def test_backend_exports_and_torn_lines_are_read(tmp_path):
    span = {
        "name": "stallwatch.freeze",
        "startTimeUnixNano": "1764669600000000000", "endTimeUnixNano": "1764669603000000000",
        "attributes": [{"key": "stallwatch.freeze.kind", "value": {"stringValue": "gil_held"}},
                       {"key": "stallwatch.freeze.cause", "value": {"stringValue": "child_core_dump"}}],
    }  # fmt: skip
    tempo = {"batches": [{"resource": {}, "scopeSpans": [{"spans": [span]}]}]}  # Tempo's trace-by-id shape
    (tmp_path / "tempo.json").write_text(json.dumps(tempo, indent=2))
    lines = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}) + "\n" + '{"resourceSpans": [{"sc'
    (tmp_path / "traces.jsonl").write_text(lines)  # a torn last line, as a killed process leaves it

    proc = postmortem("--file", str(tmp_path / "tempo.json"), "--file", str(tmp_path / "traces.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("gil_held freeze, 3.0 s, cause child_core_dump") == 4  # in the headline and timeline
    assert "1 unreadable lines skipped" in proc.stdout


def test_postmortem_is_reachable_from_the_installed_command():
    script = Path(sys.executable).parent / "stallwatch"  # the console script, next to the venv's interpreter
    proc = subprocess.run([str(script), "postmortem", "--help"], capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 0 and "--since" in proc.stdout, proc.stderr
