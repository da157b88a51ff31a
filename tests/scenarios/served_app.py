"""An ASGI app as a new user writes it: `import stallwatch.auto` first, one span per request, and a
child process spawned and awaited in each request (as a control plane runs `ssh` or `docker`).
`/block/SECONDS` instead blocks the worker's loop (sync code in a handler) and answers its pid.

SERVED_APP_STALLWATCH=0 runs the same app without stallwatch (for byte-for-byte comparisons).
"""

import os

if os.environ.get("SERVED_APP_STALLWATCH", "1") == "1":
    import stallwatch.auto

import asyncio
import logging
import time

from opentelemetry import trace

tracer = trace.get_tracer("served-app")
log = logging.getLogger("served_app")


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                log.warning("served app started")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                log.warning("served app stopping")
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"].startswith("/block/"):
        time.sleep(float(scope["path"].rsplit("/", 1)[1]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
        return
    with tracer.start_as_current_span(f"GET {scope['path']}"):
        process = await asyncio.create_subprocess_exec("true")
        code = await process.wait()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(code).encode()})
