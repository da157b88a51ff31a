"""Scenario: a GIL-held freeze as in incident 000, made on purpose.

Usage: python freeze_probe.py DIR [SECONDS] [--block-loop | --spin-loop | --read-child] [--sentry=DSN]
       [--args | --shell]
A library registered an after-fork handler before stallwatch was imported (so the exec-bound guard
cannot skip it); in the child of one uvloop spawn it sleeps SECONDS (default 3) before exec, so the
host's main thread waits in read() on libuv's pipe holding the GIL. Prints one JSON line: the
spawn's wall-clock start and end, the child's pid and the probe span's ids. With --block-loop
the loop thread sleeps SECONDS in plain sync code instead (other threads keep running), with
--spin-loop it runs Python for SECONDS; with
--read-child it reads, in plain sync code, the output of a child running this same interpreter,
which sleeps SECONDS before it writes nothing and exits. The first line printed is the watchdog's
pid, once the watchdog watches (the freeze starts 0.5 s later), so a test can watch it. With
--sentry=DSN, sentry-sdk is initialised with that DSN (a loopback sink) before stallwatch.setup().
The held spawn is `/bin/true`; with --args `/bin/true one two`, with --shell the shell command
`true one two`. With --healthy=N, N healthy `/bin/true` spawns (each its own trace) run first.
With --linger=S the host lives S seconds more once its watchdog has exported the freeze, so that the
watchdog, which leaves with it, can be scraped after the thaw.
"""

import os
import subprocess
import sys
import time

HANG = {"seconds": 0.0}


def slow_library_child_handler() -> None:
    if HANG["seconds"]:
        time.sleep(HANG["seconds"])  # a copy of the host, before exec: the host is frozen meanwhile


os.register_at_fork(after_in_child=slow_library_child_handler)

import json

import stallwatch

out, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
for argument in sys.argv:
    if argument.startswith("--sentry="):
        import sentry_sdk

        sentry_sdk.init(dsn=argument.removeprefix("--sentry="), release="probe@1", environment="test")
# uvloop's own fork (the opt-out of the default vfork spawn): the library's handler runs in its child.
session = stallwatch.setup(file_dir=out, freeze_threshold=1.0, uvloop_spawn="fork")
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"
print(json.dumps({"watchdog_pid": session.watchdog_pid}), flush=True)

import asyncio
from pathlib import Path

import uvloop
from opentelemetry import trace

from stallwatch.detect import heartbeat


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def loop_beat_since(began_ns: int) -> bool:
    state = heartbeat.read(heartbeat.AREA.path)
    return state is not None and state["loop_tracked"] and state["loop_ns"] > began_ns


def freeze_spans() -> int:
    """Freeze spans exported to the directory so far (another host may share it)."""
    traces = Path(out) / "traces.jsonl"
    return traces.read_bytes().count(b'"stallwatch.freeze"') if traces.exists() else 0


async def main() -> dict:
    # Loop heartbeats flow (and the interpreter heartbeat re-arms faulthandler's timer: STALLWATCH_FAULTHANDLER).
    began, exported = time.monotonic_ns(), freeze_spans()
    await until(lambda: loop_beat_since(began), "the loop heartbeat beats")
    for argument in sys.argv:
        for _ in range(int(argument.removeprefix("--healthy=")) if argument.startswith("--healthy=") else 0):
            await (await asyncio.create_subprocess_exec("/bin/true")).wait()
    with trace.get_tracer("probe").start_as_current_span("probe /healthcheck") as span:
        if "--block-loop" in sys.argv:
            started = time.time_ns()
            time.sleep(seconds)  # sync code on the loop thread: the loop stalls, the GIL does not
            ended = time.time_ns()
        elif "--spin-loop" in sys.argv:
            started = time.time_ns()
            while time.time_ns() - started < seconds * 1e9:  # Python on the loop thread, never yielding to the loop
                pass
            ended = time.time_ns()
        elif "--read-child" in sys.argv:
            started = time.time_ns()
            command = [sys.executable, "-c", f"import time; time.sleep({seconds})"]
            child = subprocess.Popen(command, stdout=subprocess.PIPE)  # exec'd: the host's own executable
            child.stdout.read()  # sync code on the loop thread, waiting on the child's pipe
            ended = time.time_ns()
            child.wait()
        else:
            HANG["seconds"] = seconds
            started = time.time_ns()
            if "--shell" in sys.argv:
                child = await asyncio.create_subprocess_shell("true one two")
            else:
                child = await asyncio.create_subprocess_exec(
                    "/bin/true", *(("one", "two") if "--args" in sys.argv else ())
                )
            ended = time.time_ns()
            HANG["seconds"] = 0.0
            await child.wait()
    await until(lambda: freeze_spans() > exported, "the watchdog exported the freeze at its thaw")
    linger = [float(a.removeprefix("--linger=")) for a in sys.argv if a.startswith("--linger=")]
    if linger:
        await asyncio.sleep(linger[-1])  # the workload: the host (and its watchdog) stays up to be scraped
    context = span.get_span_context()
    return {
        "spawn_started_ns": started,
        "spawn_ended_ns": ended,
        "child_pid": None if {"--block-loop", "--spin-loop"} & set(sys.argv) else child.pid,
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "watchdog_pid": session.watchdog_pid,
        "pid": os.getpid(),
    }


result = uvloop.run(main())
stallwatch.shutdown(timeout=5)
print(json.dumps(result))
