"""Files and directories stallwatch creates: files 0600, in directories created 0700.

Journals, heartbeat files, Sentry handovers and telemetry files hold names, ids, stacks and DSNs that
are no one else's business on a shared machine. The standard library falls short twice: `Path.mkdir(parents=True,
mode=...)` gives the parents it creates the default mode (0777 & ~umask), and `open()` creates files
0666 & ~umask; hence these two helpers. Also what the host and the freeze watchdog both read of a
child in `/proc` (`never_execed`): the standard library alone, as everything here, since the
watchdog imports nothing else while it idles.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def make_directories(directory: Path) -> None:
    """Create `directory` and every missing parent, each 0700; existing ones are left as they are."""
    missing = [directory, *(parent for parent in directory.parents if not parent.exists())]
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process (the watchdog) was first
            path.mkdir(mode=0o700)


def opener(path: str | os.PathLike[str], flags: int) -> int:
    """An `opener` for `open()`: a file it creates is 0600 (and never inherited by a child)."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


PF_FORKNOEXEC = 0x40  # include/linux/sched.h: set by fork, cleared by exec


def never_execed(pid: int) -> bool | None:
    """Whether process `pid` has not exec'd since it was forked (`PF_FORKNOEXEC`); None when its
    `/proc/PID/stat` cannot be read (gone, or reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return bool(int(fields[6]) & PF_FORKNOEXEC)
    except (OSError, IndexError, ValueError):
        return None
