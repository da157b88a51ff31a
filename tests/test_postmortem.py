"""`stallwatch postmortem` on telemetry left by real freezes and a host killed mid-create."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_scenario
from support.chromium import CHROMIUM, MISSING, measure
from support.waiting import wait_until

STALLWATCH = [sys.executable, "-m", "stallwatch.cli", "postmortem"]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """One directory, two hosts with their watchdogs: first 20 healthy spawns then a spawn frozen 2 s
    before exec (service unknown_service:python), then a loop blocked 1.5 s (service `other`)."""
    directory = tmp_path_factory.mktemp("shared")
    first = run_scenario("freeze_probe.py", str(directory), "2", "--healthy=20", timeout=120)
    env = clean_env() | {"OTEL_SERVICE_NAME": "other"}
    second = run_scenario("freeze_probe.py", str(directory), "1.5", "--block-loop", env=env, timeout=120)
    return directory, first, second


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
    assert postmortem(str(tmp_path)).stdout == text  # a directory given as it is reads as --dir
    assert postmortem(str(tmp_path / "traces.jsonl"), str(tmp_path / "logs.jsonl")).stdout.count("child_before_exec")
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
from support.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for

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
    logs = tmp_path / "logs.jsonl"  # the intent record exported (logs batch every second); the create is in flight
    wait_until(lambda: logs.exists() and "create requested" in logs.read_text(), "the create's intent is exported")
    host.send_signal(signal.SIGKILL)  # the health check
    host.wait(10)

    proc = postmortem("--dir", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    (candidate,) = report["leak_candidates"]
    assert candidate["stallwatch.cloud.rpc"] == "nebius.compute.v1.InstanceService/Create"
    assert candidate["stallwatch.cloud.resource.type"] == "compute.instance"
    text = postmortem("--dir", str(tmp_path)).stdout
    assert "Leak candidates (cloud resources asked for with no recorded outcome): 1" in text
    assert "   type | id | operation | time | pid | trace\n" in text  # a table, not a raw dict
    assert f"   compute.instance | - | nebius.compute.v1.InstanceService/Create | {candidate['time']} | " in text


def test_user_mistakes_get_one_line_and_status_2_never_a_traceback(tmp_path):
    for args, message in (
        (["--dir", str(tmp_path / "missing")], "is not a directory"),
        (["--dir", str(tmp_path)], "no traces.jsonl, logs.jsonl or metrics.jsonl"),
        (["--file", str(tmp_path / "nope.json")], "does not exist"),
        (["--dir", str(tmp_path), "--since", "last tuesday"], "cannot read the time"),
        ([str(tmp_path / "nope.json")], "does not exist"),
        ([str(tmp_path), "--dir", str(tmp_path.parent)], "one telemetry directory at a time"),
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


def test_the_report_leads_with_the_freeze_collapses_healthy_spawns_and_names_every_trace(two_hosts):
    directory, first, _ = two_hosts
    report = json.loads(postmortem("--dir", str(directory), "--pid", str(first["pid"]), "--format", "json").stdout)

    headline = report["headline"][0]
    assert headline["kind"] == "freeze" and "cause child_before_exec" in headline["summary"]
    assert first["trace_id"] in headline["links"]  # the freeze leads to the host's trace
    # The 20 healthy spawns collapse into one line; on a loaded machine one of them may be blocked long
    # enough to be notable itself, and then it stands on its own line between two collapsed runs.
    runs = [e for e in report["events"] if e["kind"] == "spawns"]
    *slowed, frozen = [e for e in report["events"] if e["kind"] == "spawn"]  # the frozen spawn comes last
    assert sum(run["attributes"]["count"] for run in runs) + len(slowed) == 20
    assert runs and all(s["attributes"]["stallwatch.spawn.blocked_seconds"] < 1.9 for s in slowed)
    for run in runs:
        count = run["attributes"]["count"]
        assert run["summary"].startswith(f"{count} spawns, blocked p50 ")
        assert len(run["attributes"]["trace_ids"]) == count
    assert frozen["trace_id"] == first["trace_id"] and frozen["attributes"]["stallwatch.spawn.blocked_seconds"] >= 1.9
    assert all(e["trace_id"] for e in report["events"] if e["span_id"] and e["kind"] != "spawns")
    tree = report["traces"][first["trace_id"]]  # the host's span tree, as a waterfall
    assert [(row["name"], row["depth"]) for row in tree] == [("probe /healthcheck", 0), ("true", 1)]
    (host,) = [p for p in report["processes"] if p["role"] == "host"]
    assert report["counters"][host["key"]]["stallwatch.subprocess.exits"] == 21  # its own, not the last exporter's


def test_one_host_and_its_watchdog_per_report_chosen_by_service_or_pid(two_hosts, tmp_path):
    directory, first, second = two_hosts

    def report(*args: str) -> dict:
        proc = postmortem("--dir", str(directory), "--format", "json", *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def hosts(found: dict) -> set[tuple[str, int]]:
        return {(p["role"], p["pid"]) for p in found["processes"]}

    newest = report()
    assert hosts(newest) == {("host", second["pid"]), ("watchdog", second["pid"])}
    assert {p["pid"] for p in newest["other_processes"]} == {first["pid"]}
    assert [e["kind"] for e in newest["headline"]][:1] == ["freeze"]
    assert "loop_blocked" in newest["headline"][0]["summary"] and not any(
        e["lane"] == "spawn" for e in newest["events"]
    )
    assert report("--service", "other") == newest
    by_pid = report("--pid", str(first["pid"]))
    assert hosts(by_pid) == {("host", first["pid"]), ("watchdog", first["pid"])}
    assert report("--service", "unknown_service:python") == by_pid
    every = report("--all-processes")
    assert len(every["processes"]) == 4 and every["other_processes"] == []
    assert {e["summary"].split(",")[0] for e in every["headline"] if e["kind"] == "freeze"} == {
        "gil_held freeze", "loop_blocked freeze"
    }  # fmt: skip
    missing = postmortem("--dir", str(directory), "--pid", "1")
    assert missing.returncode == 2 and "no process with pid 1" in missing.stderr, missing.stderr

    out = tmp_path / "report.html"
    old = os.umask(0o022)
    try:
        assert postmortem("--dir", str(directory), "--format", "html", "--out", str(out)).returncode == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o600


def test_text_and_json_carry_the_same_events_trace_ids_and_totals(two_hosts):
    directory, _, _ = two_hosts
    text = postmortem("--dir", str(directory), "--all-processes").stdout
    report = json.loads(postmortem("--dir", str(directory), "--all-processes", "--format", "json").stdout)

    timeline = text[text.index("\nTimeline (") : text.index("\nTraces involved")]
    rows = [line for line in timeline.splitlines() if line.strip()][1:]  # below its heading
    assert len(rows) == len(report["events"])
    for row, event in zip(rows, report["events"], strict=True):
        assert event["start"] in row and event["summary"] in row
        for trace_id in [event["trace_id"], *event["links"], *event["attributes"].get("trace_ids", [])]:
            assert trace_id in row, (trace_id, row)
    for trace_id, tree in report["traces"].items():
        assert f"trace {trace_id}" in text and all(f"(span {r['span_id']})" in text for r in tree)
    totals = text[text.index("Totals per process") :]
    for process in report["processes"]:
        if process["key"] in report["counters"]:
            block = totals[totals.index(process["label"]) :]
            for name, value in report["counters"][process["key"]].items():
                assert f"{name}: {value:g}" in block.split("\n   host")[0].split("\n   watchdog")[0]


@pytest.mark.skipif(CHROMIUM is None, reason=MISSING)
@pytest.mark.parametrize("width", [800, 1400])
def test_the_html_report_fits_the_window_and_shows_the_freeze_before_the_healthy_spawns(two_hosts, tmp_path, width):
    directory, first, _ = two_hosts
    page = tmp_path / "report.html"
    proc = postmortem("--dir", str(directory), "--pid", str(first["pid"]), "--format", "html", "--out", str(page))
    assert proc.returncode == 0, proc.stderr

    found = measure(page, width)
    assert found["innerWidth"] == width
    assert found["scrollWidth"] <= found["innerWidth"], found["scrollWidth"]  # no horizontal scrolling
    assert found["rows"][0] == "freeze" and found["rows"].index("freeze") < found["rows"].index("spawns")
    assert first["trace_id"] in found["text"]  # the frozen spawn's trace, in its row and its waterfall
    report = json.loads(postmortem("--dir", str(directory), "--pid", str(first["pid"]), "--format", "json").stdout)
    assert all(e["trace_id"] in found["text"] for e in report["events"] if e["trace_id"])


def _otlp_line(resource: dict[str, str], name: str, start_s: int, end_s: int) -> str:
    span = {"name": name, "traceId": os.urandom(16).hex(), "spanId": os.urandom(8).hex(),
            "startTimeUnixNano": str(start_s * 10**9), "endTimeUnixNano": str(end_s * 10**9)}  # fmt: skip
    attributes = [{"key": key, "value": {"stringValue": value}} for key, value in resource.items()]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": attributes}, "scopeSpans": [{"spans": [span]}]}]})


def test_workers_started_together_are_each_reported_with_the_watchdog_that_carries_their_instance_id(tmp_path):
    # Worker a's watchdog outlived it (it was still starting); by time in common it would join worker b.
    base = 1764669600

    def watchdog(instance: str, pid: str) -> dict[str, str]:
        return {"service.instance.id": instance, "stallwatch.process.role": "watchdog", "stallwatch.watched.pid": pid}

    lines = [
        _otlp_line({"service.instance.id": "a"}, "GET /a", base, base + 10),
        _otlp_line({"service.instance.id": "b"}, "GET /b", base, base + 20),
        _otlp_line(watchdog("a", "101"), "watchdog a", base, base + 20),
        _otlp_line(watchdog("b", "202"), "watchdog b", base + 1, base + 20),
    ]
    (tmp_path / "traces.jsonl").write_text("\n".join(lines) + "\n")

    proc = postmortem("--dir", str(tmp_path), "--all-processes", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    hosts = {p["key"]: p["pid"] for p in json.loads(proc.stdout)["processes"] if p["role"] == "host"}
    assert hosts == {"a": 101, "b": 202}
