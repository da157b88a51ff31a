"""stallwatch: an async server never freezes silently and never wedges unseen.

Import it first thing at startup (or ``import stallwatch.auto``). The import alone makes forks safe
(docs/usage.md says how): at-fork handlers are skipped in children that only exec, the
OpenTelemetry SDK starts no thread in a fork child's handlers, and gRPC's fork support is off
before gRPC loads. The public surface:

- ``setup(**overrides)`` / ``shutdown(timeout=None)``: start the pipeline from ``OTEL_*`` and
  ``STALLWATCH_*`` (keywords win) and return the ``Session``; stop it within a bounded time;
- ``doctor()``: the fork hazards that remain in this process; ``uvicorn_loop()``: the ``loop=``
  value that makes uvicorn spawn without fork;
- ``interrupt_thread()``, ``execution_timeout(seconds, name=...)``: stop one executor item or one
  request, and keep watching the thread work a timeout could not stop;
- ``instrument_tunnel(cls, ...)``: SSH tunnel spans for a tunnel class of your own (``setup()``
  instruments dstack's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import forksafe as _forksafe
from . import session as _session
from ._version import __version__
from .config import ConfigError, Settings
from .forksafe.loop import uvicorn_loop
from .instrument.tunnels import instrument_tunnel
from .instrument.work_item import WorkerDied
from .interrupt import Interrupted, Work, current_work, interrupt_thread
from .session import Session, shutdown
from .timeout import execution_timeout

if TYPE_CHECKING:
    from .checkup import Report

FORK_SAFETY = _forksafe.install()


def setup(**overrides: Any) -> Session:
    """Start stallwatch: build the telemetry pipeline and register its instruments.

    Settings come from the environment (``OTEL_*`` and ``STALLWATCH_*``, see docs/configuration.md) and from
    keyword overrides named like ``Settings`` fields, e.g. ``setup(traces_exporter="console",
    file_dir="/var/lib/app/telemetry")``. Idempotent: a second call returns the running session.

    A bad setting costs only itself: it is logged once at WARNING naming the variable or keyword,
    falls back to its default and is listed in ``Session.config_problems``; an unknown keyword is
    reported the same way and ignored. With ``strict=True`` (or ``STALLWATCH_STRICT=true``) it
    raises ``ConfigError`` naming every bad setting. A failure to build the telemetry pipeline is
    logged with its traceback and turns telemetry off (``strict`` raises it); the fork guard stays
    on either way.
    """
    return _session.setup(FORK_SAFETY, **overrides)


def doctor(probe: bool = True, journal: dict[str, Any] | None = None) -> Report:
    """Report the fork hazards left in this process (`stallwatch.checkup.doctor`); `probe=False` skips the
    test fork."""
    # footprint: the checkup loads when a report is asked for, not at every start
    from .checkup import doctor as checkup

    return checkup(probe=probe, journal=journal)


def audit() -> Report:
    """Same as `doctor()`: the structured fork-hazard report of this process."""
    return doctor()


def __getattr__(name: str) -> Any:
    """`Report`, the class of `doctor()`'s result, loading its module at first lookup."""
    if name != "Report":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # footprint: the checkup loads when a report is asked for, not at every start
    from .checkup import Report

    globals()["Report"] = Report
    return Report


__all__ = [
    "FORK_SAFETY",
    "ConfigError",
    "Interrupted",
    "Report",
    "Session",
    "Settings",
    "Work",
    "WorkerDied",
    "__version__",
    "audit",
    "current_work",
    "doctor",
    "execution_timeout",
    "instrument_tunnel",
    "interrupt_thread",
    "setup",
    "shutdown",
    "uvicorn_loop",
]
