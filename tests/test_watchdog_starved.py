"""A host starved of CPU is not frozen: the freeze watchdog beside a CPU limit and CPU hogs (detect/watchdog.py).

Starved: the host's process is moved, after its set-up, into a cgroup with a CPU quota (a container's CPU limit)
together with a busy-looping process that uses up the quota at once: the host's threads then wait for a CPU for
most of each second, though no Python thread is held. Its watchdog, started before the move, is not limited.
Frozen: the host's threads run at nice 19 beside busy-looping processes at nice 0 while its main thread holds
the GIL in C. Marked serial: the hogs would slow every other test on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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

# A host that sets up stallwatch, renices each of its threads (not its watchdog, another process), then holds the
# GIL in its main thread in C (usleep through ctypes.PyDLL) for HELD_SECONDS.
_FROZEN_HOST = """
import ctypes, os, time
import stallwatch
session = stallwatch.setup(freeze_threshold={threshold})
assert session.wait_for_watchdog(60), "the freeze watchdog is not watching"
for tid in os.listdir("/proc/self/task"):
    os.setpriority(os.PRIO_PROCESS, int(tid), 19)
time.sleep(1)
ctypes.PyDLL(None).usleep(int({held} * 1e6))
time.sleep(1)
stallwatch.shutdown(timeout=10)
"""
STARVED_BEATS = 2  # a starved host runs until this many of its beats were seen older than the threshold
_DETECTED = re.compile(r"freeze detected: host \d+ frozen \((\w+)\) for ([0-9.]+)s")
_QUIET = {"OTEL_LOGS_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"}


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


QUOTA_US, PERIOD_US = 20_000, 1_000_000  # 20 ms of CPU a second for the group: a heartbeat waits up to ~1 s


@pytest.fixture
def cpu_limit() -> Iterator[Callable[[int], None]]:
    """A cgroup whose processes get `QUOTA_US` of CPU every `PERIOD_US` (cgroup v2's cpu.max, or v1's cpu
    controller), and a function that moves a process, every thread of it, into it; removed at the end."""
    name = f"stallwatch-test-{os.getpid()}"
    unified = Path("/sys/fs/cgroup")
    try:
        controllers = unified / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            group = unified / name
            group.mkdir()
            (group / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")
        else:
            group = unified / "cpu" / name
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
    except OSError as error:
        pytest.skip(f"no cgroup with a CPU quota can be made here (root and a cpu controller needed): {error}")

    def move(pid: int) -> None:
        (group / "cgroup.procs").write_text(str(pid))

    try:
        yield move
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # a failed test's processes
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


# A host that sets up stallwatch, prints its heartbeat file's path, and once a line on stdin says it was moved
# into the CPU-limited cgroup, idles its loop while a thread waits in wait4 for a shell that reads the next line.
_LIMITED_HOST = """
import asyncio, subprocess, sys
import stallwatch
from stallwatch.detect import heartbeat
session = stallwatch.setup(freeze_threshold={threshold})
assert session.wait_for_watchdog(60), "the freeze watchdog is not watching"
print(heartbeat.AREA.path, flush=True)
sys.stdin.readline()
async def main():
    await asyncio.to_thread(subprocess.run, ["sh", "-c", "read line"])
asyncio.run(main())
stallwatch.shutdown(timeout=10)
"""


def test_a_host_whose_heartbeats_wait_for_a_cpu_is_not_reported_frozen(cpu_limit):
    host = subprocess.Popen(
        [sys.executable, "-c", _LIMITED_HOST.format(threshold=THRESHOLD)],
        env=clean_env(**_QUIET), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert host.stdin is not None and host.stdout is not None and host.stderr is not None
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    late: set[int] = set()
    try:
        path = host.stdout.readline().strip()
        cpu_limit(hog.pid)
        cpu_limit(host.pid)  # its watchdog, another process started before, stays out
        host.stdin.write("moved\n")
        host.stdin.flush()
        deadline = time.monotonic() + 60
        while len(late) < STARVED_BEATS and time.monotonic() < deadline:
            now = time.monotonic_ns()  # before the read: a late read never ages the beat
            snapshot = heartbeat_file.read(path)
            if snapshot is not None and now - snapshot["interpreter_ns"] > THRESHOLD * 1e9:
                late.add(snapshot["interpreter_ns"])
            time.sleep(0.02)
    finally:
        hog.kill()
        hog.wait()
    host.stdin.close()  # the shell reads its end of file and exits
    host.wait(timeout=120)
    stderr = host.stderr.read()

    assert host.returncode == 0, stderr
    assert len(late) >= STARVED_BEATS, f"the CPU limit starved the host past the threshold {len(late)} times in 60 s"
    assert _DETECTED.findall(stderr) == []  # the watchdog took each of these, or most, for a freeze (gil_held)


def test_a_held_gil_beside_cpu_hogs_is_reported_while_it_lasts(cpu_hogs):
    host = subprocess.run(
        [sys.executable, "-c", _FROZEN_HOST.format(threshold=THRESHOLD, held=HELD_SECONDS)],
        env=clean_env(**_QUIET), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert host.returncode == 0, host.stderr
    detected = [(kind, float(seconds)) for kind, seconds in _DETECTED.findall(host.stderr)]

    assert [kind for kind, _ in detected] == ["gil_held"]
    assert detected[0][1] < HELD_SECONDS  # detected before the last beat's age could reach the held time
