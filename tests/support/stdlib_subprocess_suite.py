"""CPython's own asyncio subprocess tests (`test.test_asyncio.test_subprocess.SubprocessMixin`, shipped
with the interpreter) on one loop, in this process, one JSON line per test on stdout.

Usage: python stdlib_subprocess_suite.py {native|vfork|asyncio} SECONDS [TEST_NAME...]

`native`: uvloop as installed, spawning with its own fork (stallwatch not imported). `vfork`:
`import stallwatch` first, as a host does, with the default `STALLWATCH_UVLOOP_SPAWN`. `asyncio`:
the standard loop, the reference, under the same harness. Only the harness is adapted, never a
test: the mixin runs on a loop made per test, closed without the stdlib tear-down's reach into
`loop._default_executor` and the policy's child watcher, which uvloop does not have.

Each test gets SECONDS: past that, faulthandler prints every thread's stack on stderr and ends the
process, so a hang ends the run at that test (its `start` line has no `result` line) and the
caller goes on from the next one.

Lines, in order: ``{"tests": [NAME, ...]}``, the tests of this run; ``{"spawn": CLASS}``, the
transport class a plain spawn gets in this mode, so that the caller can check which spawn ran;
then per test ``{"start": NAME}`` and ``{"result": NAME, "outcome": OUTCOME, "detail": TEXT}``
with OUTCOME one of pass, fail, error, skip.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import sys
import unittest
from typing import Any

MODES = ("native", "vfork", "asyncio")


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _new_loop(mode: str) -> asyncio.AbstractEventLoop:
    if mode == "asyncio":
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


def _test_case(mode: str) -> type[unittest.TestCase]:
    from test.test_asyncio import test_subprocess
    from test.test_asyncio import utils as test_utils

    class LoopSubprocessTests(test_subprocess.SubprocessMixin, test_utils.TestCase):  # type: ignore[misc]
        def setUp(self) -> None:
            super().setUp()
            self.loop = _new_loop(mode)
            self.set_event_loop(self.loop)

        @staticmethod
        def close_loop(loop: asyncio.AbstractEventLoop) -> None:
            if not loop.is_closed():
                loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    return LoopSubprocessTests


def _spawn_transport(mode: str) -> str:
    async def spawn() -> str:
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
        return type(proc._transport).__name__  # type: ignore[attr-defined]

    loop = _new_loop(mode)
    try:
        return loop.run_until_complete(spawn())
    finally:
        loop.close()


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = ("pass", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self.outcome = ("fail", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self.outcome = ("error", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcome = ("skip", reason)

    def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase, err: Any) -> None:
        if err is not None and self.outcome[0] == "pass":
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self.outcome = (kind, f"{subtest}: {self._exc_info_to_string(err, test)}")


def main(argv: list[str]) -> None:
    mode, seconds, names = argv[0], float(argv[1]), argv[2:]
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}")
    if mode == "vfork":
        import stallwatch  # noqa: F401 (the import is what installs the spawn)
    case = _test_case(mode)
    names = names or list(unittest.TestLoader().getTestCaseNames(case))
    _emit(tests=names)
    _emit(spawn=_spawn_transport(mode))
    for name in names:
        _emit(start=name)
        result = _Result()
        faulthandler.dump_traceback_later(seconds, exit=True)
        case(name).run(result)
        faulthandler.cancel_dump_traceback_later()
        outcome, detail = result.outcome
        _emit(result=name, outcome=outcome, detail=detail)


if __name__ == "__main__":
    main(sys.argv[1:])
