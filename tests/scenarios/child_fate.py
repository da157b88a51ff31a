"""Scenario: children that die by a signal within a second of their spawn, each in one way.

Usage: python child_fate.py FILE_DIR {asyncio|uvloop}
The host kills some itself, right after the spawn, through every path Python offers (Popen,
os.kill, os.killpg as dstack closes a foreground tunnel, asyncio's Process, a loop's transport);
others crash by themselves after exec (`kill -SEGV $$`, `os.abort()`) or before it (in a
`preexec_fn`, and in a library's after-fork handler, which runs in the child of uvloop's own
fork). Core dumps are off. Prints one JSON line: each case's child pid and return code.
"""

import os
import resource
import signal
import subprocess
import sys

resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
CRASH = {"now": False}


def crash_before_exec() -> None:
    if CRASH["now"]:
        os.abort()  # in the forked copy of the host, before exec


os.register_at_fork(after_in_child=crash_before_exec)  # a library's handler, registered before stallwatch

import stallwatch

file_dir, loop_name = sys.argv[1], sys.argv[2]
stallwatch.setup(file_dir=file_dir, metric_export_interval_ms=3600000, watchdog=False)

import asyncio
import json

import uvloop

SLEEPER = ["sleep", "30"]
children: dict[str, list[int]] = {}


def popen(name, command, kill, **kwargs):
    child = subprocess.Popen(command, **kwargs)
    if kill is not None:
        kill(child)
    children[name] = [child.pid, child.wait()]


def refused_then_kill(child):
    try:
        os.kill(child.pid, 12345)  # no such signal: the kernel refuses, nothing is sent
    except OSError:
        child.kill()


def sync_cases():
    popen("popen_kill", SLEEPER, lambda c: c.kill())
    popen("popen_terminate", SLEEPER, lambda c: c.terminate())
    popen("popen_send_signal", SLEEPER, lambda c: c.send_signal(signal.SIGSEGV))  # a crash signal, from the host
    popen("os_kill", SLEEPER, lambda c: os.kill(c.pid, signal.SIGKILL))
    popen("os_killpg", SLEEPER, lambda c: os.killpg(c.pid, signal.SIGKILL), start_new_session=True)
    popen("refused_then_kill", SLEEPER, refused_then_kill)
    popen("exec_then_segv", ["sh", "-c", "kill -SEGV $$"], None)
    popen("exec_then_abort", [sys.executable, "-c", "import os; os.abort()"], None)
    popen("preexec_abort", ["true"], None, preexec_fn=os.abort)


class Protocol(asyncio.SubprocessProtocol):
    def __init__(self):
        self.exited = asyncio.get_running_loop().create_future()

    def process_exited(self):
        self.exited.set_result(None)


async def process(name, command, kill, **kwargs):
    child = await asyncio.create_subprocess_exec(*command, **kwargs)
    if kill is not None:
        kill(child)
    children[name] = [child.pid, await child.wait()]


async def async_cases():
    await process("process_kill", SLEEPER, lambda c: c.kill())
    await process("process_terminate", SLEEPER, lambda c: c.terminate())
    await process("process_send_signal", SLEEPER, lambda c: c.send_signal(signal.SIGABRT))
    await process("process_os_killpg", SLEEPER, lambda c: os.killpg(c.pid, signal.SIGKILL), start_new_session=True)
    await process("async_exec_then_segv", ["sh", "-c", "kill -SEGV $$"], None)

    transport, protocol = await asyncio.get_running_loop().subprocess_exec(Protocol, *SLEEPER)
    transport.kill()
    await protocol.exited
    children["transport_kill"] = [transport.get_pid(), transport.get_returncode()]
    transport.close()

    # The handler runs in the child of uvloop's own fork (incident 000), and in a fork for a preexec_fn
    # (the standard loop's Popen, and uvloop's own fork again under the default STALLWATCH_UVLOOP_SPAWN=vfork).
    native = loop_name == "uvloop" and os.environ.get("STALLWATCH_UVLOOP_SPAWN") == "fork"
    CRASH["now"] = True
    try:
        await process("async_before_exec", ["true"], None, **({} if native else {"preexec_fn": lambda: None}))
    finally:
        CRASH["now"] = False


sync_cases()
if loop_name == "uvloop":
    uvloop.run(async_cases())
else:
    asyncio.run(async_cases())
stallwatch.shutdown(10)
print(json.dumps(children))
