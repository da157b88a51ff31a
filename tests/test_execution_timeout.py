"""`execution_timeout` arms before the first await (incident 002: request 2 hung at its first
`await asyncio.to_thread(...)`, before its timeout existed), keeps watching thread work it cannot
stop, and asyncio's own timeouts are counted by call site. Overlapping requests on one shared
actor never interrupt each other's work. Fresh interpreters, real threads."""

from __future__ import annotations

import json

import pytest

from conftest import attrs, latest_total, metric_points, run_python

pytestmark = pytest.mark.matrix

PRELUDE = """
import asyncio, json, os, sys, threading, time
import stallwatch
stallwatch.setup(file_dir=sys.argv[1] if len(sys.argv) > 1 else {dir!r}, metric_export_interval_ms=200)
from concurrent.futures import ThreadPoolExecutor
"""


def host(body: str, telemetry_dir) -> dict:
    proc = run_python(PRELUDE.format(dir=str(telemetry_dir)) + body)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_request_stuck_at_its_first_await_times_out(telemetry_dir):
    result = host(
        """
occupied, release = ThreadPoolExecutor(max_workers=1), threading.Event()
occupied.submit(release.wait)  # the only worker is busy: the next item just waits in the queue

@stallwatch.execution_timeout(0.3, name="trace")
async def request():
    await asyncio.get_running_loop().run_in_executor(occupied, time.sleep, 0)

async def main():
    started = time.monotonic()
    try:
        await request()
        return "finished"
    except TimeoutError:
        return round(time.monotonic() - started, 2)

timed_out_after = asyncio.run(main())
release.set()
print(json.dumps({"timed_out_after": timed_out_after, "shutdown": stallwatch.shutdown(timeout=3)}))
os._exit(0)
""",
        telemetry_dir,
    )

    assert 0.25 <= result["timed_out_after"] < 10.0  # at its deadline; without it, never
    assert latest_total(telemetry_dir / "metrics.jsonl", "stallwatch.execution.timeouts", **{
        "stallwatch.execution.name": "trace"}) == 1  # fmt: skip


def test_thread_work_that_ignores_the_timeout_is_watched_until_it_ends(telemetry_dir):
    result = host(
        """
finished = threading.Event()

def slow_work():
    time.sleep(1.0)  # ends 0.8 s after the deadline
    finished.set()

async def main():
    try:
        async with stallwatch.execution_timeout(0.2, name="slow"):
            await asyncio.to_thread(slow_work)
    except TimeoutError:
        pass
    deadline = time.monotonic() + 30
    while not finished.is_set():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    return "done"

print(json.dumps({"main": asyncio.run(main()), "shutdown": stallwatch.shutdown(timeout=3)}))
""",
        telemetry_dir,
    )

    assert result["main"] == "done"
    metrics = telemetry_dir / "metrics.jsonl"
    overrun = metric_points(metrics, "stallwatch.execution.overrun.duration")[-1]
    assert attrs(overrun) == {"stallwatch.execution.name": "slow"}
    assert int(overrun["count"]) == 1
    assert 0.6 <= float(overrun["sum"]) < 5.0  # 0.8 s, plus scheduling delay on a loaded machine
    overdue = [
        float(p.get("asInt", p.get("asDouble", 0))) for p in metric_points(metrics, "stallwatch.execution.overdue")
    ]
    assert 1 in overdue  # seen while it overran
    assert "wedge execution_overdue" in (telemetry_dir / "logs.jsonl").read_text()


def test_asyncio_timeouts_are_counted_by_call_site(telemetry_dir):
    result = host(
        """
import inspect
async def main():
    lines = {}
    try:
        lines["wait_for"] = inspect.currentframe().f_lineno + 1
        await asyncio.wait_for(asyncio.sleep(1), 0.01)
    except asyncio.TimeoutError:
        pass
    lines["wait"] = inspect.currentframe().f_lineno + 1
    await asyncio.wait({asyncio.ensure_future(asyncio.sleep(1))}, timeout=0.01)
    await asyncio.wait_for(asyncio.sleep(0), 1)  # does not expire: not counted
    if hasattr(asyncio, "timeouts"):
        try:
            lines["timeout"] = inspect.currentframe().f_lineno + 1
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        except TimeoutError:
            pass
    return lines

lines = asyncio.run(main())
print(json.dumps({"lines": lines, "shutdown": stallwatch.shutdown(timeout=3)}))
""",
        telemetry_dir,
    )

    counted = {
        attrs(p)["code.function.name"]: (attrs(p)["code.file.path"], int(attrs(p)["code.line.number"]))
        for p in metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.asyncio.timeouts")
    }
    expected = {f"asyncio.{name}": ("<string>", line) for name, line in result["lines"].items()}
    assert counted == expected


def test_overlapping_requests_on_one_actor_never_interrupt_each_others_work(telemetry_dir):
    result = host(
        """
class Actor:
    # Everything per request lives in the request's own dict, never in a slot on the actor.
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actor")

    def execute(self, request):
        request["work"] = stallwatch.current_work()
        request["started"].set()
        deadline = time.monotonic() + request["seconds"]
        while time.monotonic() < deadline:
            pass  # Python bytecode: an interruption can land here
        return request["name"] + " done"

    async def run(self, request):
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.pool, self.execute, request)
        try:
            return await asyncio.wait_for(asyncio.shield(job), request["timeout"])
        except asyncio.TimeoutError:
            await loop.run_in_executor(None, request["started"].wait)
            outcome = stallwatch.interrupt_thread(request["work"])
            try:
                await job
            except stallwatch.Interrupted:
                pass
            return request["name"] + " interrupted: " + outcome

async def main():
    actor = Actor()
    a = {"name": "A", "seconds": 5.0, "timeout": 0.2, "started": threading.Event()}
    b = {"name": "B", "seconds": 0.3, "timeout": 5.0, "started": threading.Event()}
    late = {"name": "late", "seconds": 0.0, "timeout": 1.0, "started": threading.Event()}
    results = await asyncio.gather(actor.run(a), actor.run(b))
    stale = stallwatch.interrupt_thread(a["work"])  # A's item is over: B ran on the same thread
    results.append(await actor.run(late))
    return results + [stale]

print(json.dumps({"results": asyncio.run(main())}))
""",
        telemetry_dir,
    )

    assert result["results"] == ["A interrupted: delivered", "B done", "late done", "refused_idle"]
