"""For host scripts the tests run: a uvicorn server started in the host and stopped as uvicorn stops
itself (`should_exit`), for what the host records around that stop. Import it before `stallwatch.setup()`
when the host should have uvicorn loaded first, as a server's own module does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import uvicorn


async def _app(scope: dict, receive: Callable, send: Callable) -> None:
    pass


def serve_then_stop(before_stop: Callable[[], None] = lambda: None, timeout: float = 30) -> None:
    """Serve an empty app on a free loopback port under `asyncio.run` until uvicorn has started, call
    `before_stop()` there, then stop the server and wait for its graceful shutdown."""

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(_app, port=0, lifespan="off", log_level="warning"))
        serving = asyncio.create_task(server.serve())
        deadline = time.monotonic() + timeout
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.05)
        before_stop()
        server.should_exit = True
        await serving

    asyncio.run(main())
