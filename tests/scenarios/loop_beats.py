"""A host whose event loop only waits on thread work: does stallwatch's loop heartbeat keep beating
without putting a timer on the loop? Prints the loop's scheduled timers seen while it waits, the
loop heartbeats written meanwhile, and what the lag histogram counted.

Usage: loop_beats.py TELEMETRY_DIR asyncio|uvloop
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import stallwatch
from stallwatch.detect import heartbeat


async def main() -> dict:
    loop = asyncio.get_running_loop()
    timers, beats = [], []
    for _ in range(6):
        await loop.run_in_executor(None, time.sleep, 0.1)  # a wait with no timer of the host's own
        timers.append(len(getattr(loop, "_scheduled", ())))  # uvloop keeps timers in libuv: not listed
        snapshot = heartbeat.read(heartbeat.AREA.path)
        beats.append(snapshot["loop_ns"])
    return {"timers": timers, "loop_beats": len(set(beats)), "kind": heartbeat.read(heartbeat.AREA.path)["loop_kind"]}


def run() -> None:
    directory, loop_kind = Path(sys.argv[1]), sys.argv[2]
    stallwatch.setup(traces_exporter="none", metrics_exporter="file", logs_exporter="none", file_dir=directory)
    if loop_kind == "uvloop":
        import uvloop

        result = uvloop.run(main())
    else:
        result = asyncio.run(main())
    stallwatch.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    run()
