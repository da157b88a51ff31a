"""Fork safety, installed at `import stallwatch`: the at-fork handler guard, fork-aware
OpenTelemetry SDK classes, the gRPC fork guard and uvloop's spawns without fork. See `guard`,
`otel_compat`, `grpc_guard`, `uvloop_spawn`."""

from __future__ import annotations

import logging

from .._record import Record
from ..config import IMPORT_PROBLEMS, SDK_LOADED_BEFORE_STALLWATCH, env_flag, load_opentelemetry, uvloop_spawn_at_import
from . import grpc_guard, guard, otel_compat, uvloop_spawn

_log = logging.getLogger("stallwatch.forksafe")
# The OpenTelemetry modules that read variables when imported, so that a bad value cannot fail
# the imports of the stallwatch modules after this package (see `config.load_opentelemetry`).
load_opentelemetry()


class ForkSafety(Record):
    """What `import stallwatch` did to make forks safe, for `doctor` and `setup()`: `preexisting` counts
    the OpenTelemetry objects built before it, by class; `error` names a bad `STALLWATCH_FORK_GUARD` or
    `STALLWATCH_GRPC_FORK_GUARD` (then at its default); `uvloop_spawn` is `STALLWATCH_UVLOOP_SPAWN` as
    read at import."""

    __slots__ = ("error", "grpc", "guard_enabled", "patched", "preexisting", "sdk_loaded_before", "uvloop_spawn")
    guard_enabled: bool
    grpc: grpc_guard.GrpcGuardState
    sdk_loaded_before: bool
    patched: tuple[str, ...]
    preexisting: dict[str, int]
    error: str | None
    uvloop_spawn: str

    def __init__(self, guard_enabled: bool, grpc: grpc_guard.GrpcGuardState, sdk_loaded_before: bool,
                 patched: tuple[str, ...] = (), preexisting: dict[str, int] | None = None, error: str | None = None,
                 uvloop_spawn: str = "vfork") -> None:  # fmt: skip
        self._set(
            guard_enabled=guard_enabled,
            grpc=grpc,
            sdk_loaded_before=sdk_loaded_before,
            patched=patched,
            preexisting={} if preexisting is None else preexisting,
            error=error,
            uvloop_spawn=uvloop_spawn,
        )


INSTALLED: ForkSafety | None = None  # what `install()` did (`import stallwatch` calls it)


def install() -> ForkSafety:
    """Install every fork protection that the environment allows; never raises. The result is
    also kept as `INSTALLED`, for the fork-hazard report (`doctor`)."""
    global INSTALLED
    INSTALLED = _install()
    return INSTALLED


def _install() -> ForkSafety:
    sdk_loaded_before = SDK_LOADED_BEFORE_STALLWATCH
    guard_enabled = env_flag("STALLWATCH_FORK_GUARD", True)
    grpc_enabled = env_flag("STALLWATCH_GRPC_FORK_GUARD", True)
    flags = [str(IMPORT_PROBLEMS[name]) for name in ("STALLWATCH_FORK_GUARD", "STALLWATCH_GRPC_FORK_GUARD")
             if name in IMPORT_PROBLEMS]  # fmt: skip
    error = "; ".join(flags) or None
    grpc_state = grpc_guard.install(grpc_enabled)
    spawn = uvloop_spawn_at_import()
    # Installed either way, so that setup() can switch it; `uvloop_layers` puts it inside the guard's layer.
    uvloop_spawn.install()
    if spawn == "fork":
        uvloop_spawn.disable()
    if not guard_enabled:
        _log.warning(
            "stallwatch: STALLWATCH_FORK_GUARD=false: at-fork handlers run in every child and the "
            "OpenTelemetry SDK starts threads there."
        )
        return ForkSafety(False, grpc_state, sdk_loaded_before, error=error, uvloop_spawn=spawn)
    guard.install()
    patched = tuple(otel_compat.install())
    preexisting = otel_compat.preexisting_objects(sdk_loaded_before)
    if preexisting:
        names = ", ".join(f"{count} {name}" for name, count in sorted(preexisting.items()))
        _log.warning(
            "stallwatch: %s were built before `import stallwatch`; their fork handlers still start "
            "threads in fork children. Import stallwatch (or stallwatch.auto) first.",
            names,
        )
    return ForkSafety(True, grpc_state, sdk_loaded_before, patched, preexisting, error, spawn)
