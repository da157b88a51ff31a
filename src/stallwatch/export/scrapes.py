"""Counts the scrapes the Prometheus endpoint answers, so a process about to exit can wait for one.

The freeze watchdog whose host died frozen has one last thing to say (`stallwatch.freeze.host_killed`),
and Prometheus only learns it from a scrape that starts after it is said. `ScrapeCounter` wraps the
endpoint's WSGI application: it counts requests as they begin and as their answer has been written
(the server calls the body's `close()` after its last write): `wait(mark(), timeout)` returns once a
request that began after `mark()` has been answered in full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

FAVICON = "/favicon.ico"  # the one path prometheus_client answers without metrics


class ScrapeCounter:
    """A WSGI application that serves `app` and counts the metrics requests it answered."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self._app = app
        self._changed = threading.Condition()
        self._begun = 0
        self._answered = 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == FAVICON:
            return self._app(environ, start_response)
        with self._changed:
            self._begun += 1
        return _Answer(self._app(environ, start_response), self._answer)

    def _answer(self) -> None:
        with self._changed:
            self._answered += 1
            self._changed.notify_all()

    def mark(self) -> int:
        """Now, for `wait()`: how many scrapes have begun."""
        with self._changed:
            return self._begun

    def wait(self, mark: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds until a scrape that began after `mark` has been answered.

        True then; False when the time is up first. `mark` requests had begun, so once more than
        `mark` are answered, at least one of them began after it, whatever their order."""
        with self._changed:
            return self._changed.wait_for(lambda: self._answered > mark, timeout)


class _Answer:
    """A response body that reports, when the server closes it after writing all of it, that it was answered."""

    def __init__(self, body: Iterable[bytes], answered: Callable[[], None]) -> None:
        self._body = body
        self._answered = answered
        self._written = False

    def __len__(self) -> int:
        return len(self._body)  # type: ignore[arg-type]  # a TypeError makes wsgiref skip Content-Length

    def __iter__(self) -> Iterator[bytes]:
        yield from self._body
        self._written = True  # the server asks for the next block only after writing the last one

    def close(self) -> None:
        close = getattr(self._body, "close", None)
        if close is not None:
            close()
        if self._written:
            self._answered()
