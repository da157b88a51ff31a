"""`python -m stallwatch._watchdog --pid HOST --heartbeat FILE`: the freeze watchdog's process
(`detect.watchdog`), whose own telemetry pipeline is a `stallwatch.setup()`. `setup()` starts it."""

from __future__ import annotations

import sys

import stallwatch
from stallwatch.detect import watchdog

if __name__ == "__main__":
    sys.exit(watchdog.main(stallwatch.setup, stallwatch.shutdown))
