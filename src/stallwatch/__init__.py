"""stallwatch: an async server never freezes silently and never wedges unseen.

Import it first thing at startup (or ``import stallwatch.auto``). The import alone makes forks
safe: at-fork handlers are skipped in children created only to exec, the OpenTelemetry SDK starts
no thread in a fork child's handlers (workers restart on first use in a child that lives on), and
``GRPC_ENABLE_FORK_SUPPORT=false`` is set before gRPC loads. Then:

- ``setup(**overrides)`` builds and installs the telemetry pipeline from ``OTEL_*``/``STALLWATCH_*``
  variables (keyword overrides win) and returns the running ``Session``;
- ``shutdown(timeout=None)`` flushes and stops it within a bounded time;
- ``doctor()`` reports the fork hazards that remain in this process;
- ``uvicorn_loop()`` is the ``loop=`` value that makes uvicorn spawn without fork;
- ``interrupt_thread()`` interrupts the work item an executor worker runs now, and only that item
  (``Interrupted``); ``WorkerDied`` is what a healed orphaned item's future raises;
- ``execution_timeout(seconds, name=...)`` times a request out from its first line, and keeps
  watching the thread work it could not stop;
- ``instrument_tunnel(cls, ...)`` records SSH tunnel open/close spans for a tunnel class of your own
  (dstack's ``SSHTunnel`` is instrumented by ``setup()`` without it).

Sentry users: ``stallwatch.sentry.StallwatchIntegration`` sends freezes, wedges, stale async
exceptions and leak candidates as Sentry events; it is enabled automatically once sentry-sdk is.
"""

from __future__ import annotations

from typing import Any

from . import forksafe as _forksafe
from . import session as _session
from ._version import __version__
from .config import ConfigError, Settings
from .doctor import Report, doctor
from .forksafe.loop import uvicorn_loop
from .instrument.ssh import instrument_tunnel
from .instrument.work_item import WorkerDied
from .interrupt import Interrupted, Work, current_work, interrupt_thread
from .session import Session, shutdown
from .timeout import execution_timeout

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


def audit() -> Report:
    """Same as `doctor()`: the structured fork-hazard report of this process."""
    return doctor()


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
