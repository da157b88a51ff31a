"""A child's fate stays true: one the host killed, or one that crashed in its own program, is never
labelled as dying before exec; one that really died before exec is. Real children, real signals,
dstack's real foreground SSH tunnel against a loopback sshd."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest

from conftest import attrs, clean_env, latest_total, otlp_items, run_scenario
from sshd_fixture import HTTP_BODY

pytestmark = pytest.mark.matrix  # Popen, asyncio and uvloop internals differ across versions

LOOPS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("uvloop", {"STALLWATCH_UVLOOP_SPAWN": "fork"}),  # uvloop's own fork, the opt-out
    "uvloop-vfork": ("uvloop", {}),  # the default
}
# case -> the signal the host sent, within a second of the spawn
HOST_KILLS = {
    "popen_kill": "SIGKILL",
    "popen_terminate": "SIGTERM",
    "popen_send_signal": "SIGSEGV",
    "os_kill": "SIGKILL",
    "os_killpg": "SIGKILL",
    "refused_then_kill": "SIGKILL",  # a signal the kernel refused is not recorded
    "process_kill": "SIGKILL",
    "process_terminate": "SIGTERM",
    "process_send_signal": "SIGABRT",
    "process_os_killpg": "SIGKILL",
    "transport_kill": "SIGKILL",
}
CRASHES_AFTER_EXEC = {"exec_then_segv": "SIGSEGV", "exec_then_abort": "SIGABRT", "async_exec_then_segv": "SIGSEGV"}
CRASHES_BEFORE_EXEC = {"preexec_abort": "SIGABRT", "async_before_exec": "SIGABRT"}


@pytest.fixture(scope="module", params=sorted(LOOPS))
def fates(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    """The scenario's children on one loop: (loop, {case: [pid, returncode]}, telemetry directory)."""
    loop_name, extra = LOOPS[request.param]
    directory = tmp_path_factory.mktemp(f"fates-{request.param}")
    children = run_scenario("child_fate.py", str(directory), loop_name, env=clean_env(**extra))
    return request.param, children, directory


def spans_by_pid(directory: Path) -> dict[int, dict]:
    spans = otlp_items(directory / "traces.jsonl", "spans")
    return {int(attrs(s)["process.pid"]): s for s in spans if "process.pid" in attrs(s)}


def events(span: dict) -> list[tuple[str, dict]]:
    return [(event["name"], attrs(event)) for event in span.get("events", [])]


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_a_child_the_host_kills_within_a_second_says_so_and_never_that_it_died_before_exec(fates):
    loop, children, directory = fates
    spans = spans_by_pid(directory)
    observed = 0
    for case, signal in HOST_KILLS.items():
        pid, returncode = children[case]
        span = spans[pid]
        a = attrs(span)
        assert a["stallwatch.exit.signal"] == signal and returncode < 0, case
        assert "early_signal" not in str(events(span)) and "before exec" not in span["status"]["message"], case
        assert a["stallwatch.subprocess.exec"] == "done", case
        if case == "transport_kill" and loop == "uvloop":
            # uvloop's own transport kills in C: not seen, and still not "before exec".
            assert "stallwatch.subprocess.signalled_by_host" not in a and events(span) == []
            continue
        observed += 1
        assert a["stallwatch.subprocess.signalled_by_host"] is True, case
        ((name, event),) = events(span)
        assert name == "stallwatch.subprocess.host_signal" and event["signal"] == signal, case
        assert 0 <= event["seconds"] < 1.0, case
        assert span["status"]["message"] == f"killed by {signal}, which the host sent", case

    metrics = directory / "metrics.jsonl"
    host_signalled = latest_total(
        metrics, "stallwatch.subprocess.exits", **{"stallwatch.subprocess.signalled_by_host": True}
    )
    assert host_signalled == observed


def test_a_child_that_crashes_in_its_own_program_has_exec_done_and_no_early_signal(fates):
    _, children, directory = fates
    spans = spans_by_pid(directory)
    for case, signal in CRASHES_AFTER_EXEC.items():
        span = spans[children[case][0]]
        a = attrs(span)
        assert a["stallwatch.exit.signal"] == signal, case
        assert events(span) == [], case
        assert a["stallwatch.subprocess.exec"] == "done" and "stallwatch.subprocess.signalled_by_host" not in a, case
        assert span["status"]["message"] == f"killed by {signal}", case


def test_a_child_that_dies_before_exec_is_labelled_so_from_the_kernels_flag(fates):
    _, children, directory = fates
    spans = spans_by_pid(directory)
    for case, signal in CRASHES_BEFORE_EXEC.items():
        pid, returncode = children[case]
        span = spans[pid]
        a = attrs(span)
        assert returncode == -6 and a["stallwatch.exit.signal"] == signal, case
        assert a["stallwatch.subprocess.exec"] == "not_done", case
        ((name, event),) = events(span)
        assert name == "stallwatch.subprocess.early_signal", case
        assert event["stallwatch.exit.signal"] == signal and event["stallwatch.subprocess.exec"] == "not_done"
        assert span["status"]["message"] == f"killed by {signal} before exec", case
    native = attrs(spans[children["async_before_exec"][0]])
    assert native["stallwatch.spawn.method"] == "fork"  # a copy of the host, as in incident 000


@pytest.mark.skipif(importlib.util.find_spec("dstack") is None, reason="dstack (the test extras) is not installed")
@pytest.mark.parametrize("loop", LOOPS)
def test_closing_a_dstack_foreground_tunnel_kills_its_ssh_and_the_span_says_the_host_did(
    sshd, http_server, tmp_path, loop
):
    loop_name, extra = LOOPS[loop]
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        result = run_scenario(
            "ssh_foreground.py", str(tmp_path), loop_name, sshd.user, sshd.host, str(sshd.port), str(sshd.identity),
            str(http_server), sock_dir, env=clean_env(**extra), timeout=180,
        )  # fmt: skip
    assert result["body"] == HTTP_BODY.decode() and result["returncode"] == -9

    span = spans_by_pid(tmp_path)[result["ssh_pid"]]
    a = attrs(span)
    assert span["name"] == "ssh" and a["stallwatch.exit.signal"] == "SIGKILL"
    assert a["stallwatch.subprocess.exec"] == "done" and a["stallwatch.subprocess.signalled_by_host"] is True
    assert [name for name, _ in events(span)] == ["stallwatch.subprocess.host_signal"]
    assert span["status"]["message"] == "killed by SIGKILL, which the host sent"
    metrics = tmp_path / "metrics.jsonl"
    killed = {"process.executable.name": "ssh", "stallwatch.exit.signal": "SIGKILL"}
    assert latest_total(metrics, "stallwatch.subprocess.exits", **killed) == 1
    assert (
        latest_total(
            metrics, "stallwatch.subprocess.exits", **killed, **{"stallwatch.subprocess.signalled_by_host": True}
        )
        == 1
    )
