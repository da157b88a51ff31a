"""The active journal, what instrumentations call on every operation, and the journal `setup()` makes
at its first use (`FirstUse`); none of it loads the journal's other modules before they are needed."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

from .names import SEGMENT_SUFFIX, UNCONFIRMED

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation

    from . import ledger
    from .leaks import Reporter
    from .writer import Journal


def has_segments(journal_dir: Path) -> bool:
    """Whether `journal_dir` holds a segment of any process, so that `replay()` may find one to replay
    (True also when the directory cannot be read, for `replay()` to report)."""
    try:
        with os.scandir(journal_dir) as entries:
            return any(entry.name.endswith(SEGMENT_SUFFIX) for entry in entries)
    except FileNotFoundError:
        return False
    except OSError:  # `replay()` reports it
        return True


class FirstUse:
    """The host's journal in `directory`, made at the first journaled operation (a span started, or a
    ledger intent or outcome) rather than at `setup()`; made, it is the active journal. From `setup()`
    on, the ledger's recorder journals each record in it, then passes it on to the recorder in place
    before (as `install_recorder`'s does); the ledger module, which a host that records no intent
    never loads, is given that recorder when it loads.

    Making it opens no file (a segment opens at its first record). Threads that need it at once wait
    for the one making it; a fork child that finds it unmade makes its own, never waiting on a lock
    its parent held at the fork. After `close()` it is never made."""

    def __init__(self, directory: Path, on_error: Callable[[], None]) -> None:
        self._directory = directory
        self._on_error = on_error
        self._locks: dict[int, threading.Lock] = {}
        self._closed = False
        self.journal: Journal | None = None
        # footprint: the ledger loads when the host first records to it; runs now if it is loaded already
        wrapt.register_post_import_hook(self._chain_ledger, f"{__package__}.ledger")

    def _chain_ledger(self, ledger: ModuleType) -> None:
        ledger.set_recorder(_FirstUseRecorder(self, ledger.recorder()))

    def get(self) -> Journal | None:
        """The journal, made now if this is its first use; None once closed."""
        journal = self.journal
        if journal is not None or self._closed:
            return journal
        with self._locks.setdefault(os.getpid(), threading.Lock()):  # a fork child's own lock
            if self.journal is None and not self._closed:
                # footprint: the writer loads at the first journaled operation
                from .writer import Journal

                self.journal = Journal(self._directory, on_error=self._on_error)
            return self.journal

    def close(self, timeout: float = 1.0) -> None:
        """Close the journal if it was made (`Journal.close`); it is never made afterwards."""
        with self._locks.setdefault(os.getpid(), threading.Lock()):
            self._closed = True
            journal = self.journal
        if journal is not None:
            journal.close(timeout)


class _FirstUseRecorder:
    """The ledger's recorder for a `FirstUse` journal: writes each record in the journal (made at the
    first), then passes it on to `chain`, as `writer.JournalRecorder` does."""

    def __init__(self, first_use: FirstUse, chain: ledger.Recorder) -> None:
        self._first_use = first_use
        self.chain = chain

    def intent(self, intent: ledger.Intent) -> None:
        journal = self._first_use.get()
        if journal is not None:
            journal.cloud_intent(intent)
        self.chain.intent(intent)

    def outcome(self, intent: ledger.Intent, outcome: ledger.Outcome) -> None:
        journal = self._first_use.get()
        if journal is not None:
            journal.cloud_outcome(intent, outcome)
        self.chain.outcome(intent, outcome)


class UnconfirmedObserver:
    """`stallwatch.cloud.resources.unconfirmed` for `journal_dir` (`leaks.Reporter`), loading the leaks
    module only once the directory holds leak candidates: none ever recorded, nothing to report."""

    def __init__(self, journal_dir: Path, on_error: Callable[[], None]) -> None:
        self._journal_dir = journal_dir
        self._on_error = on_error
        self._reporter: Reporter | None = None

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        reporter = self._reporter
        if reporter is None:
            if not (self._journal_dir / UNCONFIRMED).is_dir():
                return []
            # footprint: the leaks module loads once there are leak candidates
            from .leaks import Reporter

            reporter = self._reporter = Reporter(self._journal_dir, self._on_error)
        return reporter.observe(options)


_active: Journal | FirstUse | None = None


def activate(journal: Journal | FirstUse | None) -> Journal | FirstUse | None:
    """Make `journal` the one `span_started`/`span_ended` write to (None: none); returns the previous."""
    global _active
    previous, _active = _active, journal
    return previous


def active() -> Journal | None:
    """The journal instrumentations write to, if any (made now if it waited for its first use)."""
    journal = _active
    if isinstance(journal, FirstUse):
        return _made(journal)
    return journal


def _made(first_use: FirstUse) -> Journal | None:
    """`first_use`'s journal, which from now on stands in its place as the active one."""
    global _active
    journal = first_use.get()
    if journal is not None and _active is first_use:
        _active = journal
    return journal


def span_started(span: Any, component: str, *, durable: bool = False) -> dict[str, Any] | None:
    """For instrumentations: record a started span in the active journal, if there is one; returns
    the token to pass to `span_ended` (None when nothing was recorded)."""
    journal = _active
    if isinstance(journal, FirstUse):
        journal = _made(journal)
    if journal is not None:
        return journal.span_started(span, component, durable=durable)
    return None


def span_ended(span: Any, *, durable: bool = False, started: dict[str, Any] | None = None) -> None:
    """For instrumentations: record an ended span in the active journal, if there is one (see
    `Journal.span_ended` for `started`)."""
    journal = _active
    if isinstance(journal, FirstUse):
        journal = _made(journal)
    if journal is not None:
        journal.span_ended(span, durable=durable, started=started)
