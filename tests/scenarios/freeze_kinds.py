"""Scenario: the other freezes of incident 000: a child that dumps core before exec, and a
standard-loop spawn whose preexec_fn hangs.

Usage: python freeze_kinds.py {core_dump|preexec} DIR [BALLAST_MB [DELAY]]
core_dump: uvloop; the child of one spawn segfaults before exec while the host holds BALLAST_MB
(default 512) of touched memory (the freeze threshold is 0.25 s in this mode), DELAY seconds (default
0) into its after-fork handler, and the kernel writes its core to DIR (core_pattern must be a file
name; the caller has checked).
preexec: the standard asyncio loop; one spawn's preexec_fn sleeps 2 s, so the loop thread waits
for the forked child to exec (the GIL is released).
Prints one JSON line: spawn start/end wall times and the spawn's return code.
"""

import ctypes
import os
import resource
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
CRASH = {"now": False}


def crash_before_exec() -> None:
    if CRASH["now"]:
        time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)  # the handler's work before it crashes
        ctypes.string_at(0)  # SIGSEGV in the forked copy, before exec


if mode == "core_dump":
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.register_at_fork(after_in_child=crash_before_exec)  # a library's handler, registered first

import stallwatch

os.chdir(out)  # core_pattern "core": the dump lands here
# Touched before setup(): touching it holds the GIL, a freeze of its own once the heartbeats run.
ballast = bytearray((int(sys.argv[3]) if len(sys.argv) > 3 else 512) << 20 if mode == "core_dump" else 0)
ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))
# The child's core dump must outlast the threshold and a watchdog poll (0.1 s) to be seen: with the
# page cache free, 512 MB dump in 0.3 s here, 1 GB in 0.6-3 s. A lower threshold for that mode.
# uvloop's own fork (the opt-out of the default vfork spawn): the library's handler runs in its child.
session = stallwatch.setup(
    file_dir=os.path.join(out, "telemetry"), freeze_threshold=0.25 if mode == "core_dump" else 0.5, uvloop_spawn="fork"
)
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"

import asyncio
import json


def freeze_spans() -> int:
    traces = os.path.join(out, "telemetry", "traces.jsonl")
    if not os.path.exists(traces):
        return 0
    with open(traces, "rb") as file:
        return file.read().count(b'"stallwatch.freeze"')


async def main() -> dict:
    exported = freeze_spans()
    started = time.time_ns()
    if mode == "core_dump":
        CRASH["now"] = True
        child = await asyncio.create_subprocess_exec("/bin/true")
        CRASH["now"] = False
    else:
        child = await asyncio.create_subprocess_exec("/bin/true", preexec_fn=lambda: time.sleep(2))
    ended = time.time_ns()
    code = await child.wait()
    deadline = time.monotonic() + 30
    while freeze_spans() == exported:  # until the watchdog has seen the thaw and exported the freeze
        assert time.monotonic() < deadline, "the watchdog exported no freeze"
        await asyncio.sleep(0.01)
    return {"spawn_started_ns": started, "spawn_ended_ns": ended, "returncode": code, "child_pid": child.pid}


if mode == "core_dump":
    import uvloop

    result = uvloop.run(main())
else:
    result = asyncio.run(main())
stallwatch.shutdown(timeout=5)
print(json.dumps(result))
