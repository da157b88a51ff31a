"""Series whose labels are known in advance exist at zero before their first event, so Prometheus's
`increase()` and `rate()` see that event (a series born with it has nothing to compare with).
A real host's own Prometheus endpoint, scraped before anything went wrong."""

from __future__ import annotations

import json
import re

from conftest import clean_env, run_python
from stallwatch import telemetry
from support.loopback import free_port, prometheus_env


def _series(scrape: str, name: str, **labels: str) -> dict[str, float]:
    """`{labels text: value}` of every sample of `name` whose labels include `labels`."""
    found = {}
    for line in scrape.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            found[match.group(1)] = float(match.group(2))
    return found


def test_a_new_pool_and_a_new_execution_timeout_have_their_event_series_at_zero_before_any_event():
    port = free_port()
    env = clean_env(**prometheus_env(port, OTEL_TRACES_EXPORTER="none", OTEL_LOGS_EXPORTER="none"))
    proc = run_python(
        f"""
        import asyncio, json, urllib.request
        import stallwatch
        stallwatch.setup(watchdog=False)
        from concurrent.futures import ThreadPoolExecutor

        async def guarded():
            async with stallwatch.execution_timeout(30, name="checkout"):
                await asyncio.sleep(0)

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool")
        pool.submit(lambda: None).result()
        asyncio.run(guarded())
        scrape = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        stallwatch.shutdown(5)
        print(json.dumps(scrape))
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    scrape = json.loads(proc.stdout.splitlines()[-1])
    pool = {"stallwatch_executor_name": "pool"}

    wedges = _series(scrape, telemetry.WEDGE_DETECTED.prometheus_name, **pool)
    assert sorted(re.search(r'stallwatch_wedge_kind="(\w+)"', key)[1] for key in wedges) == sorted(
        telemetry.WEDGE_KIND.values
    )
    assert set(wedges.values()) == {0.0}
    for metric in (
        telemetry.EXECUTOR_ORPHANED,
        telemetry.EXECUTOR_HEALED,
        telemetry.EXECUTOR_ORPHANED_OUTSTANDING,
        telemetry.ASYNC_EXC_INJECTED,
        telemetry.ASYNC_EXC_DELIVERED,
        telemetry.ASYNC_EXC_REVOKED,
        telemetry.ASYNC_EXC_REFUSED,
    ):
        assert list(_series(scrape, metric.prometheus_name, **pool).values()) == [0.0], metric.name
    checkout = {"stallwatch_execution_name": "checkout"}
    assert list(_series(scrape, telemetry.EXECUTION_TIMEOUTS.prometheus_name, **checkout).values()) == [0.0]
    overrun = telemetry.EXECUTION_OVERRUN_DURATION.prometheus_name
    assert list(_series(scrape, f"{overrun}_count", **checkout).values()) == [0.0]
    assert list(_series(scrape, telemetry.EXECUTION_OVERDUE.prometheus_name, **checkout).values()) == [0.0]
    dropped = _series(scrape, telemetry.TELEMETRY_DROPPED.prometheus_name)
    assert len(dropped) == len(telemetry.TELEMETRY_SIGNAL.values) * len(telemetry.DROP_REASON.values)
    forks = _series(scrape, telemetry.FORK_COUNT.prometheus_name)
    assert len(forks) == len(telemetry.FORK_KIND.values) * 2 * len(telemetry.SPAWN_LOOP.values)
