"""The crash-safe journal: a local, append-only, per-process record of operations in flight.

A killed process exports nothing it held, so operations, the cloud ledger's intents and outcomes and
the watchdog's freeze records go to a local file as they happen. The next start (`replay()`) turns
what never ended into spans with their original ids and keeps unconfirmed creates as leak candidates
(`leaks`). Records are framed (length + CRC32, JSON payload), so a torn tail costs only its bytes;
docs/journal.md says why not SQLite, and what a record costs.

Wiring (see `writer` and `replay` for details)::

    result = replay(journal_dir, tracer_provider=provider, on_error=report)   # at setup, first
    journal = Journal(journal_dir, on_error=report)
    activate(journal)                      # span_started()/span_ended() now write to it
    install_recorder(journal)              # ledger intents/outcomes: journaled, then logged
    journal.close()                        # at shutdown
"""

from __future__ import annotations

from .frames import Corruption, Segment, read_segment
from .leaks import Candidate, Reporter, candidates, confirm
from .replay import (
    INTERRUPTED,
    INTERRUPTED_REASON,
    InterruptedOperation,
    ProcessJournal,
    ReplayResult,
    UnconfirmedResource,
    replay,
    scan,
    to_span,
)
from .writer import Journal, JournalRecorder, activate, active, install_recorder, span_ended, span_started

__all__ = [
    "INTERRUPTED",
    "INTERRUPTED_REASON",
    "Candidate",
    "Corruption",
    "InterruptedOperation",
    "Journal",
    "JournalRecorder",
    "ProcessJournal",
    "ReplayResult",
    "Reporter",
    "Segment",
    "UnconfirmedResource",
    "activate",
    "active",
    "candidates",
    "confirm",
    "install_recorder",
    "read_segment",
    "replay",
    "scan",
    "span_ended",
    "span_started",
    "to_span",
]
