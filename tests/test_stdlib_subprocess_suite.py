"""CPython's own asyncio subprocess tests, on uvloop with its own spawn and with stallwatch's.

`tests/support/stdlib_subprocess_suite.py` runs `test.test_asyncio.test_subprocess.SubprocessMixin`
(shipped with the interpreter under test) unchanged, in three fresh interpreters: uvloop's own
spawn (`native`), uvloop after `import stallwatch` (`vfork`, the default spawn) and the standard loop
(`asyncio`, the reference). No test that passes on `native` may fail or hang on `vfork`, and the
tests `vfork` fails are exactly the differences from the standard loop that docs/uvloop.md lists.
A test that runs past `PER_TEST` seconds is a hang: its process is ended there, the test counts as
failed, and the run goes on from the next test. Each runner leads a session of its own: what its tests
leave running (an orphan keeps the session) is killed when it ends, and checked gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import clean_env
from support.processes import command_line, session_members
from support.waiting import wait_until

pytestmark = pytest.mark.matrix  # each interpreter ships its own version of the tests

pytest.importorskip("uvloop")
pytest.importorskip(
    "test.test_asyncio.test_subprocess", reason="this interpreter ships without its `test` package (Debian strips it)"
)

RUNNER = Path(__file__).parent / "support" / "stdlib_subprocess_suite.py"
PER_TEST = 30.0

# Tests that fail on uvloop whichever spawns, each with its cause; docs/uvloop.md lists the same.
DIFFERENCES = {
    "test_pause_reading": "the test replaces `pause_reading` on the pipe transport: uvloop's are read-only",
}


@dataclass
class Run:
    spawn: str
    outcomes: dict[str, str]
    details: dict[str, str]
    left: list[str]  # the command lines of the processes the suite's tests left running, killed since

    def failed(self) -> set[str]:
        return {name for name, outcome in self.outcomes.items() if outcome not in ("pass", "skip")}


def run_in_own_session(command: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `command` as the leader of a new session; once it has ended (or at the timeout, ended then),
    kill what it left in that session and wait until none of it is left. Returns the run and the
    command lines of what was left."""
    left: list[str] = []
    with subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as runner:
        try:
            stdout, stderr = runner.communicate(timeout=timeout)
        finally:
            runner.kill()  # a no-op once it has exited
            runner.wait()
            left += end_session(runner.pid)
    return subprocess.CompletedProcess(command, runner.returncode, stdout, stderr), left


def end_session(session: int) -> list[str]:
    """Kill every process left in `session`, wait until they are gone; their command lines."""
    pids = session_members(session)
    commands = [command_line(pid) for pid in pids]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not session_members(session), f"the processes the runner left are gone: {commands}")
    return commands


def run_suite(mode: str) -> Run:
    """Every test of the suite in `mode`, going on after a hang from the test after it."""
    spawn, outcomes, details = "", {}, {}
    names: list[str] = []
    todo: list[str] = []
    left: list[str] = []
    while True:
        proc, orphans = run_in_own_session(
            [sys.executable, str(RUNNER), mode, str(PER_TEST), *todo], timeout=PER_TEST * (len(todo) or 60) + 60
        )
        left += orphans
        started = None
        for line in proc.stdout.splitlines():
            fields = json.loads(line)
            if "tests" in fields:
                names = names or fields["tests"]
            elif "spawn" in fields:
                spawn = fields["spawn"]
            elif "start" in fields:
                started = fields["start"]
            else:
                outcomes[fields["result"]], details[fields["result"]] = fields["outcome"], fields["detail"]
                started = None
        if started is None:
            assert proc.returncode == 0, proc.stderr
            return Run(spawn, outcomes, details, left)
        outcomes[started], details[started] = "hang", proc.stderr[-3000:]
        todo = names[names.index(started) + 1 :]
        if not todo:
            return Run(spawn, outcomes, details, left)


def test_cpythons_asyncio_subprocess_tests_that_pass_with_uvloops_own_spawn_pass_with_stallwatchs():
    with ThreadPoolExecutor(3) as pool:
        native, vfork, reference = pool.map(run_suite, ["native", "vfork", "asyncio"])

    assert (native.spawn, vfork.spawn, reference.spawn) == (
        "UVProcessTransport", "_PidfdSubprocessTransport", "_UnixSubprocessTransport",
    )  # fmt: skip
    assert native.outcomes.keys() == vfork.outcomes.keys() == reference.outcomes.keys()
    assert len(native.outcomes) >= 25
    assert reference.failed() == set(), reference.details
    regressions = {name: vfork.details[name] for name in vfork.failed() if native.outcomes[name] == "pass"}
    assert regressions == {}
    assert {name: vfork.outcomes[name] for name in vfork.failed()} == dict.fromkeys(DIFFERENCES, "error"), {
        name: vfork.details[name] for name in vfork.failed()
    }
    assert native.failed() >= set(DIFFERENCES)
    # What a test leaves running is killed after each run; stallwatch's spawn, like the standard loop's,
    # leaves nothing (uvloop's own leaves two of its tests' children sleeping).
    assert (vfork.left, reference.left) == ([], []), (vfork.left, reference.left)
