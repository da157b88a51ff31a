"""The freeze watchdog's process (`detect.watchdog`), whose own telemetry pipeline is a `session.setup_or_raise()`.

`setup()` starts it as `python -S -c BOOTSTRAP HANDED... --pid HOST --heartbeat FILE`
(`detect.heartbeat.watchdog_command`), which imports this module without `site` and without running the
package's `__init__`: while the host beats on time the watchdog loads nothing but a few modules of the
standard library and `detect.heartbeat_file`. The pipeline's modules are imported only when
`detect.watchdog` asks for them (`_prepare`), at the first late heartbeat.
"""

from __future__ import annotations

import sys

from stallwatch.detect import watchdog

TYPE_CHECKING = False  # `typing` stays out of the idle watchdog
if TYPE_CHECKING:
    from typing import Any


def _prepare() -> None:
    # footprint: the pipeline is loaded at the first late heartbeat, never by an idle watchdog
    from stallwatch import forksafe, pipeline, session  # noqa: F401


def _setup(**overrides: Any) -> Any:
    from stallwatch import forksafe, session  # footprint: as in _prepare

    return session.setup_or_raise(forksafe.install(), **overrides)


def _shutdown() -> None:
    from stallwatch import session  # footprint: as in _prepare

    session.shutdown()


def main() -> int:
    return watchdog.main(_setup, _shutdown, _prepare)


if __name__ == "__main__":
    sys.exit(main())
