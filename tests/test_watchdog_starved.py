"""A host starved of CPU is not frozen: the freeze watchdog beside CPU hogs (detect/watchdog.py `Writer`).

The host's threads run at nice 19 beside busy-looping processes at nice 0 in the test's session (so in one
autogroup, or cgroup, with them): its heartbeats' threads then wait for a CPU for seconds, as on an overloaded
machine, though no Python thread is held. Its watchdog, started before the renice, keeps its own nice and polls
on time. Marked serial: the hogs would slow every other test on the machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from conftest import clean_env
from stallwatch.detect import heartbeat_file

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)"),
]

THRESHOLD = 0.5
HOGS = 4 * len(os.sched_getaffinity(0))  # 8 on 2 cores: the heartbeats measured up to 3.4 s late
HELD_SECONDS = 6.0  # longer than the 3.4 s the heartbeat thread was seen to wait for a CPU

# A host that sets up stallwatch, renices each of its threads (not its watchdog, another process) and prints
# its heartbeat file's path; then, `starved`: its loop idles while a thread waits in wait4 for a shell that reads
# one line of the host's stdin, the GIL free all along; `frozen`: its main thread holds the GIL in C (usleep
# through ctypes.PyDLL) for HELD_SECONDS.
_HOST = """
import asyncio, ctypes, os, subprocess, sys, time
import stallwatch
from stallwatch.detect import heartbeat
session = stallwatch.setup(freeze_threshold={threshold})
assert session.wait_for_watchdog(60), "the freeze watchdog is not watching"
for tid in os.listdir("/proc/self/task"):
    os.setpriority(os.PRIO_PROCESS, int(tid), 19)
print(heartbeat.AREA.path, flush=True)
if sys.argv[1] == "starved":
    async def main():
        await asyncio.to_thread(subprocess.run, ["sh", "-c", "read line"])
    asyncio.run(main())
else:
    time.sleep(1)
    ctypes.PyDLL(None).usleep(int({held} * 1e6))
    time.sleep(1)
stallwatch.shutdown(timeout=10)
"""
STARVED_BEATS = 2  # a starved host runs until this many of its beats were seen older than the threshold
_DETECTED = re.compile(r"freeze detected: host \d+ frozen \((\w+)\) for ([0-9.]+)s")


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def _run_host(how: str) -> tuple[list[tuple[str, float]], int]:
    """Run the host `how`; return the freezes its watchdog detected (kind, seconds frozen at the detection) and
    how many of its interpreter heartbeats were seen from here older than the threshold (this process competes
    with the hogs, not niced). A `starved` host runs until STARVED_BEATS were, or 90 s."""
    env = clean_env(OTEL_LOGS_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_TRACES_EXPORTER="none")
    code = _HOST.format(threshold=THRESHOLD, held=HELD_SECONDS)
    host = subprocess.Popen(
        [sys.executable, "-c", code, how],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert host.stdin is not None and host.stdout is not None and host.stderr is not None
    stderr: list[str] = []
    errors = host.stderr
    reader = threading.Thread(target=lambda: stderr.append(errors.read()), daemon=True)  # the watchdog's lines
    reader.start()
    late: set[int] = set()
    try:
        path = host.stdout.readline().strip()
        deadline = time.monotonic() + 90
        while host.poll() is None:
            now = time.monotonic_ns()  # before the read: a late read never ages the beat
            snapshot = heartbeat_file.read(path)
            if snapshot is not None and now - snapshot["interpreter_ns"] > THRESHOLD * 1e9:
                late.add(snapshot["interpreter_ns"])
            if not host.stdin.closed and (len(late) >= STARVED_BEATS or time.monotonic() > deadline):
                host.stdin.close()  # the shell reads its end of file and exits
            time.sleep(0.02)
        host.wait(timeout=120)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    reader.join(timeout=60)
    assert host.returncode == 0, stderr
    return [(kind, float(seconds)) for kind, seconds in _DETECTED.findall(stderr[0])], len(late)


def test_a_host_whose_heartbeats_wait_for_a_cpu_is_not_reported_frozen(cpu_hogs):
    detected, late = _run_host("starved")

    assert late >= STARVED_BEATS, f"the hogs starved the host past the threshold {late} times in 90 s"
    assert detected == []  # the watchdog took each of these, or most, for a freeze (gil_held, loop_blocked)


def test_a_held_gil_beside_the_same_hogs_is_reported_while_it_lasts(cpu_hogs):
    detected, _ = _run_host("frozen")

    assert [kind for kind, _ in detected] == ["gil_held"]
    assert detected[0][1] < HELD_SECONDS  # detected before the last beat's age could reach the held time
