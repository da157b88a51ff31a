"""How Prometheus finds every scrape endpoint stallwatch serves: file-based service discovery.

Each endpoint (a host's, a freeze watchdog's) writes `host-<pid>-<port>.json` or
`watchdog-<pid>-<port>.json` into `STALLWATCH_PROMETHEUS_TARGETS_DIR` once it serves, in the shape
`file_sd_configs` reads; the two patterns keep the shipped jobs apart. No target labels: a
`service_instance_id` target label would rename the series' own to `exported_service_instance_id`.
A file is written under a temporary name, locked (`flock`, close-on-exec) and renamed into place:
Prometheus never reads half a file, and a file under its final name is locked while its process
lives (or a fork child of it that has not exec'd, as with the heartbeat files). `Target.remove()`
deletes it when the endpoint stops; `sweep()`, run before each registration, deletes the files
nobody locks. `shared_with_this_server(port, group)` decides whether a busy port is another process
of the same server's, which then justifies a free port instead of an error (`pipeline`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

KINDS = ("host", "watchdog")
_WILDCARDS = ("", "0.0.0.0", "::")  # addresses Prometheus cannot dial: the target names localhost
_TEMPORARY = ".writing-"  # matches no pattern Prometheus reads
UNFINISHED_SECONDS = 10.0  # a temporary file younger than this may be one a process is writing now


class Target:
    """One registered endpoint: its file, held locked until `remove()`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._owner = os.getpid()

    def remove(self) -> None:
        """Delete the file (Prometheus drops the target) and release its lock. Does nothing in a fork
        child, whose parent's endpoint is not its to withdraw, and a second time. Never raises."""
        if self._owner != os.getpid() or self._fd < 0:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1


def target_address(bound_host: str, port: int) -> str:
    """The `host:port` Prometheus dials for an endpoint bound to `bound_host` (as configured)."""
    host = "localhost" if bound_host in _WILDCARDS else bound_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def register(directory: Path, kind: str, address: str, port: int) -> Target:
    """Write the target file of this process's `kind` endpoint at `address` (`target_address`),
    after sweeping the files of dead processes. Raises OSError when the directory is unusable."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # Prometheus, often another user, reads it
    sweep(directory)
    name = f"{kind}-{os.getpid()}-{port}.json"
    temporary = directory / f"{_TEMPORARY}{name}"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps([{"targets": [address], "labels": {}}]).encode())
        os.replace(temporary, directory / name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    return Target(directory / name, fd)


def sweep(directory: Path) -> int:
    """Delete the target files in `directory` that no process locks, and the temporary ones left
    unlocked for `UNFINISHED_SECONDS`; return how many. Never raises."""
    removed = 0
    try:
        candidates = [path for path in directory.iterdir() if _is_target(path.name)]
    except OSError:
        return 0
    for path in candidates:
        if path.name.startswith(_TEMPORARY) and _younger_than(path, UNFINISHED_SECONDS):
            continue  # maybe being written: opened, not locked yet
        if not _locked(path):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def _younger_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:  # gone meanwhile
        return True


def _is_target(name: str) -> bool:
    """Whether `name` is a target file's (`<kind>-<pid>-<port>.json`), maybe temporary."""
    parts = name.removeprefix(_TEMPORARY).split("-")
    return len(parts) == 3 and parts[0] in KINDS and parts[1].isdigit() and parts[2].removesuffix(".json").isdigit()


def _locked(path: Path) -> bool:
    """Whether a process holds the lock of `path`; True when it cannot be told (no access, gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the shared lock just taken


def shared_with_this_server(port: int, group: int) -> bool:
    """Whether the TCP `port` is held by another process of the server whose processes form process
    group `group`: a process of that group (the server's supervisor or a fellow worker: uvicorn's and
    gunicorn's workers stay in their master's group, as a shell keeps one command line's processes in
    one), or the freeze watchdog of one (which runs in a session of its own, `--pid` naming its host).
    Such a conflict is the server's own making: every worker inherits one configured port, and only
    one process can bind it. Anything else on the port (another program, another server, the
    watchdog of a host that is gone) is a misconfiguration to report, or a port to wait for.

    Read from /proc: the sockets bound to `port` (tcp and tcp6), then the descriptors of those
    processes. Processes of other users cannot be read, and so never count.
    """
    sockets = _sockets_on(port)
    if not sockets:
        return False
    processes = _processes()
    members = {pid for pid, pgrp in processes if pgrp == group}
    watchdogs = {pid for pid, _ in processes if pid not in members and _watched_host(pid) in members}
    return any(_holds(pid, sockets) for pid in members | watchdogs if pid != os.getpid())


def _watched_host(pid: int) -> int | None:
    """The host pid a freeze watchdog process watches (its `--pid`), None for any other process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().split(b"\0")
    except OSError:
        return None
    if not any(b"stallwatch._watchdog" in argument for argument in arguments[:4]) or b"--pid" not in arguments:
        return None
    watched = arguments[arguments.index(b"--pid") + 1 :][:1]
    return int(watched[0]) if watched and watched[0].isdigit() else None


def _sockets_on(port: int) -> set[str]:
    """`socket:[inode]` of every TCP socket bound to local `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and int(fields[1].rpartition(":")[2], 16) == port and fields[9] != "0":
                        found.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    return found


def _processes() -> list[tuple[int, int]]:
    """(pid, process group) of every process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()  # after the command, which may hold spaces
        except OSError:
            continue
        found.append((int(entry), int(fields[2])))
    return found


def _holds(pid: int, sockets: set[str]) -> bool:
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for descriptor in descriptors:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{descriptor}") in sockets:
                return True
    return False
