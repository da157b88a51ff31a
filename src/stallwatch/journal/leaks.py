"""Leak candidates: creates a dead process asked the cloud for and never saw answered, kept until
someone confirms them.

`replay()` writes each unconfirmed create it finds to `<journal dir>/unconfirmed/<key>.json` (files
0600 in a 0700 directory; written under another name, then renamed, so no reader sees half a file).
The file outlives the archived journal and every restart, until an operator has reconciled the
resource against the cloud (adopted or deleted what was created, or made sure nothing was) and runs
`stallwatch leaks --confirm KEY`, which removes it.

`Reporter.observe` is the callback of `stallwatch.cloud.resources.unconfirmed`: the open candidates
per resource type, and 0 for a type whose candidates were all confirmed. Every process that journals
registers one, and one process per directory reports: the one holding a POSIX lock on
`unconfirmed/reporter.lock`. Such a lock is the process's own (a fork child does not inherit it) and
goes with it, so when the reporter dies another process's next collection takes over.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from .. import telemetry
from .._private import make_directories, opener
from .names import UNCONFIRMED

_LOCK = "reporter.lock"
_KEY = re.compile(r"\d+-\d+-\d+")


@dataclass(frozen=True)
class Candidate:
    """One open leak candidate: the create's intent as the dead process's journal held it."""

    key: str  # `<pid>-<start ticks>-<intent number>`: what `stallwatch leaks --confirm` takes
    resource_type: str
    rpc: str
    trace_id: str
    span_id: str
    resource_id: str | None
    pid: int
    intent_ns: int


def record(journal_dir: Path, start_ticks: int, resources: Iterable[Any]) -> None:
    """Keep each unconfirmed create of `resources` (`replaying.UnconfirmedResource`s of one process,
    whose start time is `start_ticks`) as an open candidate; writing one again changes nothing."""
    directory = journal_dir / UNCONFIRMED
    creates = [resource for resource in resources if resource.action == "create"]
    if creates:
        make_directories(directory)
    for resource in creates:
        candidate = Candidate(
            f"{resource.pid}-{start_ticks}-{resource.number}", resource.resource_type, resource.rpc,
            resource.trace_id, resource.span_id, resource.resource_id, resource.pid, resource.intent_ns,
        )  # fmt: skip
        path = directory / f"{candidate.key}.json"
        partial = path.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8", opener=opener) as out:
            json.dump(asdict(candidate), out)
        os.replace(partial, path)


def candidates(journal_dir: Path) -> list[Candidate]:
    """The open candidates, oldest intent first (a file that is not a candidate is skipped)."""
    found = []
    for path in _files(journal_dir / UNCONFIRMED):
        candidate = _read(path)
        if candidate is not None:
            found.append(candidate)
    return sorted(found, key=lambda candidate: candidate.intent_ns)


def confirm(journal_dir: Path, key: str) -> bool:
    """Close the candidate `key` (it was reconciled against the cloud); False if there is none."""
    if not _KEY.fullmatch(key):
        return False
    try:
        (journal_dir / UNCONFIRMED / f"{key}.json").unlink()
    except FileNotFoundError:
        return False
    return True


def _files(directory: Path) -> list[Path]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [directory / name for name in names if name.endswith(".json")]


def _read(path: Path) -> Candidate | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return Candidate(**json.load(handle))
    except (OSError, ValueError, TypeError):
        return None


class Reporter:
    """`stallwatch.cloud.resources.unconfirmed` for one journal directory (see the module docstring).

    `on_error` is called inside an `except` block when the directory cannot be read; the collection
    goes on without this metric."""

    def __init__(self, journal_dir: Path, on_error: Callable[[], None]) -> None:
        self._directory = journal_dir / UNCONFIRMED
        self._on_error = on_error
        self._lock_fd: int | None = None
        self._types: dict[str, str] = {}  # file name -> resource type: a candidate's file never changes
        self._reported: set[str] = set()  # resource types reported so far

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        try:
            if not self._reporting():
                return []
            counts = dict.fromkeys(self._reported, 0)
            for path in _files(self._directory):
                kind = self._types.get(path.name)
                if kind is None:
                    candidate = _read(path)
                    if candidate is None:
                        continue
                    kind = self._types[path.name] = candidate.resource_type
                counts[kind] = counts.get(kind, 0) + 1
        except Exception:
            self._on_error()
            return []
        self._reported.update(counts)
        return [Observation(count, {telemetry.CLOUD_RESOURCE_TYPE.name: kind}) for kind, count in counts.items()]

    def _reporting(self) -> bool:
        """Whether this process holds the directory's reporter lock (taking it if it is free)."""
        if self._lock_fd is None:
            if not self._directory.is_dir():
                return False  # no candidate was ever recorded here
            self._lock_fd = os.open(self._directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held already: granted again
        except OSError:
            return False
        return True
