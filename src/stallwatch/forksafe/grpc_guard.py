"""gRPC fork guard: keep gRPC's C-core from starting threads in fork children.

grpcio's Linux wheels enable core fork support by default; its `pthread_atfork` child handler
restarts the `event_engine`/`lifeguard` threads in every child, including children forked only to
exec (uvloop spawns, incident 000 in docs/incidents.md). gRPC's own advice for fork+exec is
`GRPC_ENABLE_FORK_SUPPORT=false`, read by the core when it first initialises, so it must be in the
environment before the first channel exists. This module sets it, and tells whether gRPC threads
are running (the `stallwatch.grpc.active` attribute) without importing grpc.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from .._record import Record

VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_THREAD_NAMES = frozenset({"event_engine", "lifeguard", "grpc_global_tim"})
_CYGRPC = "grpc._cython.cygrpc"
_ACTIVE_CACHE_SECONDS = 1.0
_ABSL_TRUE = ("1", "true", "t", "yes", "y")

_log = logging.getLogger("stallwatch.forksafe")


class GrpcGuardState(Record):
    """What the guard found and did at import time."""

    __slots__ = ("enabled", "grpc_loaded_before", "grpc_running_before", "user_value")
    enabled: bool
    grpc_loaded_before: bool
    grpc_running_before: bool
    user_value: str | None

    def __init__(self, enabled: bool, grpc_loaded_before: bool, grpc_running_before: bool,
                 user_value: str | None) -> None:  # fmt: skip
        self._set(enabled=enabled, grpc_loaded_before=grpc_loaded_before, grpc_running_before=grpc_running_before,
                  user_value=user_value)  # fmt: skip

    @property
    def hazard(self) -> str | None:
        """A sentence describing the remaining gRPC fork hazard, or None."""
        if not self.enabled:
            return None
        if self.user_value is not None and self.user_value.strip().lower() in _ABSL_TRUE:
            return (
                f"{VARIABLE}={self.user_value} makes gRPC restart its threads in every fork child, "
                "including children created only to exec; unset it or set it to false"
            )
        if self.grpc_loaded_before and self.user_value is None:
            too_late = (
                "gRPC threads were already running, so it cannot take effect"
                if (self.grpc_running_before)
                else "it takes effect only if no gRPC channel existed yet"
            )
            return (
                f"grpc was imported before stallwatch; {VARIABLE}=false was set at import but {too_late}. "
                f"Import stallwatch first, or set {VARIABLE}=false in the environment"
            )
        return None


def install(enabled: bool) -> GrpcGuardState:
    """Set `GRPC_ENABLE_FORK_SUPPORT=false` unless the user chose a value; warn on a hazard."""
    loaded = "grpc" in sys.modules or _CYGRPC in sys.modules
    user_value = os.environ.get(VARIABLE)
    if enabled and user_value is None:
        os.environ[VARIABLE] = "false"
    state = GrpcGuardState(enabled, loaded, loaded and bool(grpc_threads()), user_value)
    if state.hazard:
        _log.warning("stallwatch: %s (to silence: STALLWATCH_GRPC_FORK_GUARD=false).", state.hazard)
    return state


class GrpcActivity:
    """Answers "are gRPC core threads running?" cheaply enough to ask on every fork."""

    def __init__(self) -> None:
        self._checked_at = -_ACTIVE_CACHE_SECONDS
        self._active = False

    def active(self) -> bool:
        if _CYGRPC not in sys.modules:
            return False
        now = time.monotonic()
        if now - self._checked_at >= _ACTIVE_CACHE_SECONDS:
            self._active = bool(grpc_threads())
            self._checked_at = now
        return self._active


def grpc_threads() -> list[str]:
    """Names of gRPC core threads in this process, from `/proc/self/task/*/comm`."""
    found: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        if name in GRPC_THREAD_NAMES:
            found.append(name)
    return found
