"""A server process as users run it (uvicorn, gunicorn, a plain script), watched through its stderr."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"

# An ASGI app whose every request spawns `true` through the loop and answers with the worker's pid.
SPAWNING_APP = """\
import asyncio, os

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    child = await asyncio.create_subprocess_exec("true")
    await child.wait()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
"""


class Served:
    """A process whose stderr is collected line by line while it runs, for `wait_for` to match."""

    def __init__(
        self, command: Sequence[str], env: dict[str, str], cwd: Path | None = None, own_group: bool = False
    ) -> None:
        """`own_group`: in a session (and process group) of its own, as a shell runs a foreground job, so
        that a signal to its group (Ctrl-C) reaches it and its children but not the test."""
        self.process = subprocess.Popen(
            list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=own_group,
        )  # fmt: skip
        self._lines: list[bytes] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stderr, self._lines), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stdout, []), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, into: list[bytes]) -> None:
        for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
            with self._changed:
                into.append(line)
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60, count: int = 1) -> re.Match[str]:
        """The `count`th stderr line matching `pattern` (the first by default), waiting up to
        `timeout` seconds for it."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    if (match := compiled.search(line.decode(errors="replace"))) and (count := count - 1) == 0:
                        return match
                seen = len(self._lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._more_to_read()):
                    raise AssertionError(f"no stderr line matches {pattern!r}:\n{self.stderr()}")
                self._changed.wait(min(left, 0.5))

    def _more_to_read(self) -> bool:
        return any(reader.is_alive() for reader in self._readers)

    def finish(self, timeout: float = 60) -> int:
        """Wait for the process to end; its return code (-N: killed by signal N)."""
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code

    def stderr(self) -> str:
        with self._changed:
            return b"".join(self._lines).decode(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.finish()
