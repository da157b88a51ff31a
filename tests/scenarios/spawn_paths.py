"""Scenario: spawn children on every path a server uses, and report what the host observed.

Usage: python spawn_paths.py {on|off} {asyncio|uvloop} [FILE_DIR]
`on` runs stallwatch.setup() (file exporter into FILE_DIR, settings from the environment); `off`
imports nothing of stallwatch. Prints one JSON line: for each case, what the host got back (return
codes, output, exception types, pid relations), so the test can compare on and off.
"""

import json
import os
import signal
import subprocess
import sys

mode, loop_name = sys.argv[1], sys.argv[2]
if mode == "on":
    import stallwatch

    stallwatch.setup(file_dir=sys.argv[3], metric_export_interval_ms=3600000, watchdog=False)

import asyncio

import uvloop

observed: dict[str, object] = {}


def outcome(name, call):
    try:
        observed[name] = ["ok", call()]
    except Exception as exc:
        observed[name] = ["raised", type(exc).__name__, exc.errno if isinstance(exc, OSError) else None]


def sync_cases():
    outcome("run_true", lambda: subprocess.run(["/bin/true"]).returncode)
    outcome("run_exit3", lambda: subprocess.run(["sh", "-c", "exit 3"]).returncode)
    outcome("check_output", lambda: subprocess.check_output(["echo", "hi"]).decode())
    outcome("check_call_fails", lambda: subprocess.check_call(["sh", "-c", "exit 4"]))
    outcome("run_shell", lambda: subprocess.run("echo shell; exit 2", shell=True, capture_output=True).returncode)
    outcome("missing", lambda: subprocess.run(["/nonexistent/prog"]).returncode)
    outcome("bad_cwd", lambda: subprocess.run(["/bin/true"], cwd="/nonexistent").returncode)

    def popen_killed():
        proc = subprocess.Popen(["sleep", "30"])
        proc.send_signal(signal.SIGSEGV)
        return [proc.wait(), proc.pid > 0]

    outcome("popen_killed", popen_killed)

    def communicate():
        proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out, _ = proc.communicate(b"x" * 100000)
        return [len(out), proc.returncode]

    outcome("communicate", communicate)

    def posix_spawn():
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 5"], os.environ)
        waited, status = os.waitpid(pid, 0)
        return [waited == pid, os.waitstatus_to_exitcode(status)]

    outcome("posix_spawn", posix_spawn)

    def posix_spawnp():
        pid = os.posix_spawnp("true", ["true"], dict(os.environ))
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    outcome("posix_spawnp", posix_spawnp)
    outcome("env_seen", lambda: subprocess.run(["sh", "-c", "echo ${TRACEPARENT:-none}"], capture_output=True,
                                               text=True).stdout.strip() != "none")  # fmt: skip


async def async_cases():
    async def exec_echo():
        proc = await asyncio.create_subprocess_exec("/bin/echo", "x", stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        return [out.decode(), proc.returncode, proc.pid > 0]

    async def exec_segv():  # the incident's signature: a child killed by SIGSEGV right after the spawn
        proc = await asyncio.subprocess.create_subprocess_exec("sh", "-c", "kill -SEGV $$")
        return await proc.wait()

    async def shell_exit():
        proc = await asyncio.create_subprocess_shell("exit 7")
        return await proc.wait()

    async def missing():
        proc = await asyncio.create_subprocess_exec("/nonexistent/prog")
        return await proc.wait()

    async def stdin_pipe():
        proc = await asyncio.create_subprocess_exec(
            "cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate(b"y" * 200000)
        return [len(out), proc.returncode]

    async def terminated():
        proc = await asyncio.create_subprocess_exec("sleep", "30")
        proc.terminate()
        return await proc.wait()

    async def env_seen():
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", "echo ${TRACEPARENT:-none}", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        return out.decode().strip() != "none"

    for name, case in (("exec_echo", exec_echo), ("exec_segv", exec_segv), ("shell_exit", shell_exit),
                       ("async_missing", missing), ("stdin_pipe", stdin_pipe), ("terminated", terminated),
                       ("async_env_seen", env_seen)):  # fmt: skip
        try:
            observed[name] = ["ok", await case()]
        except Exception as exc:
            observed[name] = ["raised", type(exc).__name__, exc.errno if isinstance(exc, OSError) else None]


sync_cases()
if loop_name == "uvloop":
    loop = uvloop.new_event_loop()
    loop.run_until_complete(async_cases())
    loop.close()
else:
    asyncio.run(async_cases())
observed["environ_untouched"] = "TRACEPARENT" not in os.environ
if mode == "on":
    stallwatch.shutdown(10)
print(json.dumps(observed))
