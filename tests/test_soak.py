"""A bounded soak: uvloop spawns with gRPC busy, executor items and tunnel open/close pairs, every
instrumentation on. Nothing fails, nothing leaks.

The test suite runs it at scale 0.1 (2,000 spawns, 10,000 items, 100 tunnel pairs): a leak of one
thread or file descriptor per operation shows at any scale. The full soak (20,000 spawns, 100,000
items, 1,000 pairs) is `STALLWATCH_SOAK_SCALE=1 pytest tests/test_soak.py`; larger scales run longer.
"""

from __future__ import annotations

import os
from collections import Counter

from conftest import latest_total, run_scenario

SCALE = float(os.environ.get("STALLWATCH_SOAK_SCALE", "0.1"))
GRPC_SERVER_WORKERS = 4  # the scenario's grpc.server(ThreadPoolExecutor(max_workers=4))
RSS_GROWTH_BOUND_MB = 40  # measured: ~10 MB at 2,000 spawns and at 6,000 (flat: buffers and caches fill once)


def test_soak_has_no_host_errors_and_no_growth_in_memory_threads_fds_or_shared_memory(tmp_path):
    spawns, items, tunnels = int(20_000 * SCALE), int(100_000 * SCALE), int(1_000 * SCALE)
    result = run_scenario(
        "soak.py", str(tmp_path), str(spawns), str(items), str(tunnels), timeout=900 * max(SCALE, 0.5)
    )

    assert result["errors"] == []
    baseline, end = result["baseline"], result["end"]
    assert end["rss_mb"] - baseline["rss_mb"] < RSS_GROWTH_BOUND_MB, (baseline, end)
    # The standard library's pools start a worker at a submit that finds none idle, up to max_workers (more
    # often on a loaded machine): those may appear; any other new thread is a leak.
    grown = Counter(end["threads"]) - Counter(baseline["threads"])
    assert all(name.startswith("ThreadPoolExecutor-") for name in grown), (baseline, end)
    pools = sum(name.startswith("ThreadPoolExecutor-") for name in end["threads"])
    assert pools <= GRPC_SERVER_WORKERS + min(32, (os.cpu_count() or 1) + 4), end  # + the loop's default executor
    assert end["fds"] <= baseline["fds"] + 2, (baseline, end)
    # One heartbeat file for the whole run, not one per spawn or fork; beside it only its own
    # companions: the watchdog's freeze reports (CI's runner once blocked the loop past the 1 s
    # threshold) and the faulthandler stacks. Shutdown removes them all.
    before = result["shm_before_shutdown"]
    heartbeats = [name for name in before if name.endswith(".hb")]
    assert len(heartbeats) == 1, before
    stem = heartbeats[0].removesuffix(".hb")
    assert set(before) <= {f"{stem}.hb", f"{stem}.freezes", f"{stem}.stacks"}, (before, result["freezes_reported"])
    assert result["shm_after_shutdown"] == []
    metrics = tmp_path / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.instrumentation.errors") == 0
    children = latest_total(metrics, "stallwatch.subprocess.exits")
    assert children >= spawns + 2 * tunnels  # every child was seen and reaped (warm-up ones too)
    assert latest_total(metrics, "stallwatch.ssh.tunnel.failures") == 0
