"""incident 002 replayed end to end: an asyncio actor, a real runner process on a Unix socket,
a 1 s execution timeout, NDIF's interrupt (stop the runner, then inject SystemExit with ctypes),
and the next request. Runs on every CPython of the version matrix (tests/run.sh)."""

from __future__ import annotations

import pytest

from conftest import clean_env, latest_total, otlp_items, run_scenario

pytestmark = pytest.mark.matrix


def replay(*args: str, **env: str) -> dict:
    return run_scenario("incident002.py", "--wait", "2", *args, env=clean_env(**env), timeout=60)


def outcomes(result: dict) -> list[str]:
    return [request["outcome"] for request in result["requests"]]


def test_without_stallwatch_the_next_request_hangs_forever():
    result = replay()

    assert outcomes(result) == ["timeout_error", "hung"]
    assert result["requests"][1]["timeout_armed"] is False  # its own timeout never started
    assert result["executor"]["threads"] == [{"name": "asyncio_0", "alive": False}]
    assert "Exception in worker" in result["worker_log"]


@pytest.mark.parametrize("mode", ["eof", "rst"])
def test_with_stallwatch_defaults_the_stale_exception_never_lands(mode, tmp_path):
    result = replay("--import-stallwatch", "--mode", mode, "--requests", "3", "--telemetry-dir", str(tmp_path))

    assert outcomes(result) == ["timeout_error", "ok", "ok"]
    assert result["wedged"] is False
    # The worker is idle by the time NDIF injects (refused), or still closing item 1 (scheduled
    # into it, then revoked when it ended): either way the exception never reaches request 2.
    metrics = tmp_path / "metrics.jsonl"
    neutralised = sum(
        latest_total(metrics, f"stallwatch.async_exception.{what}") for what in ("refused", "revoked", "delivered")
    )
    assert neutralised == 1


def test_with_the_guard_off_the_wedge_is_detected_with_thread_and_kind(tmp_path):
    result = replay("--import-stallwatch", "--telemetry-dir", str(tmp_path), STALLWATCH_GUARD_ASYNC_EXC="false")

    assert outcomes(result) == ["timeout_error", "hung"]
    records = [record["body"]["stringValue"] for record in otlp_items(tmp_path / "logs.jsonl", "logs")]
    assert any("wedge worker_died: executor worker asyncio_0 died (SystemExit" in r for r in records)
    assert any("wedge orphaned_item" in r and "asyncio-default" in r and "asyncio_0" in r for r in records)


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_with_heal_the_lost_request_fails_fast_and_the_next_succeeds():
    result = replay(
        "--import-stallwatch", "--requests", "3",
        STALLWATCH_GUARD_ASYNC_EXC="false", STALLWATCH_EXECUTOR_HEAL="true",
    )  # fmt: skip

    assert outcomes(result) == ["timeout_error", "error:WorkerDied", "ok"]
    # Detection takes two 0.5 s checks; unhealed, the request never completes at all.
    assert result["requests"][1]["elapsed_s"] < 10.0
