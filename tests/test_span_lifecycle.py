"""A span ends when its operation does: read right after the call returns (or after the tracer provider's
`force_flush()`), it is there, ended, with its final attributes and status.

Each scenario (tests/scenarios/span_lifecycle.py) is a host that reads an in-memory span exporter right
after each call, with a SimpleSpanProcessor (a span is exported as it ends) or a BatchSpanProcessor that
exports only when flushed (`force_flush()` right after the call), on stallwatch's tracer provider or on
one the host built itself (STALLWATCH_PROVIDERS=host).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from conftest import clean_env, run_scenario

PROCESSORS = ["simple", "batch"]
LOOPS = {  # the standard loop, and uvloop with each spawn route (its own fork, or stallwatch's vfork)
    "asyncio": ("asyncio", {}),
    "uvloop-fork": ("uvloop", {"STALLWATCH_UVLOOP_SPAWN": "fork"}),
    "uvloop-vfork": ("uvloop", {"STALLWATCH_UVLOOP_SPAWN": "vfork"}),
}
INSTANCES = "nebius.compute.v1.InstanceService"


def ended(found: dict[str, Any], case: str, name: str, status: str = "UNSET", **attributes: Any) -> dict[str, Any]:
    """The one span `name` made by `case`'s call: ended before the call returned, with `status` and
    `attributes` (among others)."""
    assert case in found, f"{case}: the call did not complete"
    spans = [s for s in found[case]["spans"] if s["name"] == name and s["parent"] == case]
    assert len(spans) == 1, f"{case}: expected one ended span {name!r}, the exporter has {found[case]['spans']}"
    (span,) = spans
    assert span["ended"] and span["start_ns"] <= span["end_ns"] <= found[case]["returned_ns"], span
    assert span["status"] == status, span
    assert {key: span["attributes"].get(key) for key in attributes} == attributes, span
    return span


def child_span(found: dict[str, Any], case: str, name: str, exit_code: int, **attributes: Any) -> None:
    status = "ERROR" if exit_code else "UNSET"
    span = ended(found, case, name, status, **{"process.exit.code": exit_code}, **attributes)
    for key in ("process.pid", "stallwatch.spawn.method", "stallwatch.spawn.blocked_seconds"):
        assert key in span["attributes"], span


@pytest.mark.parametrize("processor", PROCESSORS)
def test_a_childs_span_is_ended_when_run_wait_poll_communicate_or_waitpid_returns(processor):
    found = run_scenario("span_lifecycle.py", "stallwatch", processor, "subprocess")

    child_span(found, "run", "sh", 3, **{"error.type": "3"})
    child_span(found, "check_output", "echo", 0)
    child_span(found, "popen_wait", "true", 0)
    child_span(found, "popen_poll", "true", 0)
    child_span(found, "communicate", "cat", 0)
    child_span(found, "killed", "sleep", -9, **{"stallwatch.exit.signal": "SIGKILL", "error.type": "SIGKILL"})
    child_span(found, "posix_spawn", "sh", 5, **{"stallwatch.spawn.method": "posix_spawn"})
    # A spawn that raised: its span ended before the error reached the host.
    failed = ended(found, "spawn_failed", "stallwatch-missing", "ERROR", **{"error.type": "FileNotFoundError"})
    assert failed["events"] == ["exception"]


@pytest.mark.parametrize("processor", PROCESSORS)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_loop_spawns_span_is_ended_when_wait_or_communicate_returns(loop, processor):
    loop_name, extra = LOOPS[loop]
    found = run_scenario("span_lifecycle.py", "stallwatch", processor, "loop", loop_name, env=clean_env(**extra))

    kind = {"stallwatch.spawn.loop": loop_name}
    child_span(found, "exec_wait", "sh", 4, **kind)
    child_span(found, "exec_communicate", "cat", 0, **kind)
    child_span(found, "shell_wait", "exit", 6, **kind)
    # The host saw the exit before the loop called the protocol's process_exited (uvloop's own fork: its
    # waiters and `returncode` have it a loop turn earlier).
    child_span(found, "wait_after_exit", "sh", 7, **kind)
    child_span(found, "returncode_read", "sh", 8, **kind)
    # A child nobody waits for: its span ends when the loop learns of the exit (`returncode` set).
    child_span(found, "never_waited", "true", 0, **kind)


@pytest.mark.parametrize("processor", PROCESSORS)
def test_a_nebius_calls_span_is_ended_with_its_status_and_ids_when_the_awaited_call_returns(processor):
    found = run_scenario("span_lifecycle.py", "stallwatch", processor, "nebius", timeout=180)

    ok = {"rpc.grpc.status_code": 0, "stallwatch.nebius.attempts": 1}
    create = ended(found, "create", f"{INSTANCES}/Create", **ok)
    assert create["attributes"]["stallwatch.cloud.operation.id"].startswith("computeoperation-")
    resource_id = create["attributes"]["stallwatch.cloud.resource.id"]
    assert resource_id.startswith("computeinstance-")
    # The operation's polls: the last one too is ended when `wait()` returns.
    polls = [s for s in found["operation_wait"]["spans"] if s["name"] == "nebius.common.v1.OperationService/Get"]
    assert polls and all(s["ended"] and s["end_ns"] <= found["operation_wait"]["returned_ns"] for s in polls)
    ended(found, "get", f"{INSTANCES}/Get", **ok)
    ended(found, "get_missing", f"{INSTANCES}/Get", "ERROR", **{"rpc.grpc.status_code": 5, "error.type": "NOT_FOUND"})
    ended(found, "delete", f"{INSTANCES}/Delete", **ok, **{"stallwatch.cloud.resource.id": resource_id})


@pytest.mark.parametrize("processor", PROCESSORS)
def test_an_executor_items_span_is_ended_when_its_result_is_returned(processor):
    found = run_scenario("span_lifecycle.py", "stallwatch", processor, "executor")

    for case, name in (("submit", "pool"), ("run_in_executor", "pool"), ("to_thread", "asyncio-default")):
        span = ended(found, case, f"{name} work item")
        assert {"stallwatch.executor.queue_seconds", "stallwatch.executor.run_seconds"} <= set(span["attributes"])


def test_an_ssh_tunnels_spans_and_its_ssh_childrens_are_ended_when_open_and_close_return(sshd, http_server):
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        found = run_scenario(
            "span_lifecycle.py", "stallwatch", "batch", "ssh", sshd.user, sshd.host, str(sshd.port),
            str(sshd.identity), str(http_server), sock_dir, timeout=180,
        )  # fmt: skip

    for case, phase in (("aopen", "open"), ("aclose", "close"), ("open", "open"), ("close", "close")):
        tunnel = ended(found, case, f"ssh.tunnel.{phase}", **{"stallwatch.ssh.exit.status": 0})
        children = [s for s in found[case]["spans"] if s["name"] == "ssh" and s["parent"] == tunnel["name"]]
        assert children, f"{case}: no ssh child span ended by the time the call returned: {found[case]}"
        for child in children:
            assert child["ended"] and child["end_ns"] <= tunnel["end_ns"], child
            assert child["attributes"]["process.exit.code"] == 0, child


@pytest.mark.parametrize("group", ["subprocess", "nebius"])
def test_spans_recorded_through_a_host_built_tracer_provider_are_there_after_its_force_flush(group):
    """STALLWATCH_PROVIDERS=host: the host's own TracerProvider and BatchSpanProcessor, flushed by the host."""
    found = run_scenario("span_lifecycle.py", "host", "batch", group, timeout=180)

    if group == "subprocess":
        child_span(found, "run", "sh", 3)
        child_span(found, "communicate", "cat", 0)
        child_span(found, "posix_spawn", "sh", 5)
    else:
        ended(found, "create", f"{INSTANCES}/Create", **{"rpc.grpc.status_code": 0})
        ended(found, "get_missing", f"{INSTANCES}/Get", "ERROR", **{"error.type": "NOT_FOUND"})


@pytest.mark.parametrize("owner", ["stallwatch", "host"])
def test_a_meter_providers_force_flush_exports_every_spawn_and_nebius_call_made_so_far(owner, tmp_path):
    """Two spawns (one still running) and one Nebius call, then the meter provider's `force_flush()`:
    stallwatch's duration histograms hold all three (its own provider and file exporter, or the host's
    provider and in-memory reader). The scenario's temporary file directory is gone when it exits."""
    found = run_scenario(
        "span_lifecycle.py", owner, "batch", "metrics", env=clean_env(TMPDIR=str(tmp_path)), timeout=180
    )
    assert list(tmp_path.iterdir()) == []

    counts = found["histogram_counts"]
    assert counts.get("stallwatch.subprocess.spawn.duration") == 2, counts
    assert counts.get("stallwatch.nebius.call.duration") == 1, counts
