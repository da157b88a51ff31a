"""``import stallwatch.auto`` as the first import of a server: ``setup()`` from the environment.

Never raises: a bad setting is logged once (naming the variable) and falls back to its default,
every other setting keeps its effect, and the fork guard installed by ``import stallwatch`` keeps
protecting the process. Set ``STALLWATCH_STRICT=true`` to make a bad setting fail the import instead.
"""

from __future__ import annotations

import logging
import os

import stallwatch

try:
    SESSION: stallwatch.Session | None = stallwatch.setup()
except Exception:
    if os.environ.get("STALLWATCH_STRICT", "").strip().lower() in ("1", "true", "yes", "on"):
        raise
    logging.getLogger("stallwatch").exception("stallwatch: setup failed; telemetry is off, the host keeps running.")
    SESSION = None
