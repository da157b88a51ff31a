"""Which event loop spawns our subprocesses, and what uvicorn would pick.

uvloop starts every subprocess with a real `fork()` and holds the GIL until the child execs; the
standard asyncio loop uses vfork/posix_spawn and runs no at-fork handlers (incident 000 in docs/incidents.md).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util

from .._record import Record

_KINDS: dict[type, str] = {}  # loop class -> kind: a process has a few loop classes, read once per spawn


def loop_kind(loop: asyncio.AbstractEventLoop | None) -> str:
    """`uvloop`, `asyncio` or `none` for a loop object (or no loop)."""
    if loop is None:
        return "none"
    cls = type(loop)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = "uvloop" if any(base.__module__.startswith("uvloop") for base in cls.__mro__) else "asyncio"
        if len(_KINDS) < 64:
            _KINDS[cls] = kind
    return kind


def running_loop_kind() -> str:
    """Kind of the loop running in the calling thread (cheap: no loop is created)."""
    return loop_kind(asyncio._get_running_loop())


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class LoopReport(Record):
    """Event-loop facts for `doctor`."""

    __slots__ = ("libuv_version", "running", "uvicorn_auto_picks", "uvicorn_version", "uvloop_version")
    uvloop_version: str | None
    libuv_version: str | None
    uvicorn_version: str | None
    uvicorn_auto_picks: str | None
    running: str

    def __init__(self, uvloop_version: str | None, libuv_version: str | None, uvicorn_version: str | None,
                 uvicorn_auto_picks: str | None, running: str) -> None:  # fmt: skip
        self._set(uvloop_version=uvloop_version, libuv_version=libuv_version, uvicorn_version=uvicorn_version,
                  uvicorn_auto_picks=uvicorn_auto_picks, running=running)  # fmt: skip


def loop_report() -> LoopReport:
    """Versions and the loop uvicorn's `loop="auto"` would choose (uvloop whenever importable)."""
    uvloop_version = package_version("uvloop")
    libuv = None
    if uvloop_version is not None:
        try:
            # optional: the uvloop extra
            import uvloop.loop

            major, minor, patch = uvloop.loop.libuv_get_version().to_bytes(3, "big")  # type: ignore[attr-defined]
            libuv = f"{major}.{minor}.{patch}"
        except (ImportError, AttributeError, OverflowError):
            libuv = None
    uvicorn_version = package_version("uvicorn")
    auto = None
    if uvicorn_version is not None:
        auto = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return LoopReport(uvloop_version, libuv, uvicorn_version, auto, running_loop_kind())


def uvicorn_loop() -> str:
    """The `loop=` value to pass to `uvicorn.run()` (or `--loop`) so subprocess spawns never fork.

    Returns ``"asyncio"``: the standard loop spawns with vfork/posix_spawn, which runs no at-fork
    handlers and does not hold the GIL while the child execs (incident 000 in docs/incidents.md). Use it as
    ``uvicorn.run(app, loop=stallwatch.uvicorn_loop())``. uvloop spawns the same way from
    ``import stallwatch`` on, unless ``STALLWATCH_UVLOOP_SPAWN=fork``.
    """
    return "asyncio"
