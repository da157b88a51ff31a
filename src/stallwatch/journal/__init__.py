"""The crash-safe journal: a local, append-only, per-process record of operations in flight.

OpenTelemetry exports a span only when it ends, so the operations a killed process had in flight
(incidents/000_…: a frozen server killed by its health check while it created Nebius instances)
leave no trace at all. The journal writes them to a local file as they start and end, with the
cloud ledger's create/delete intents and outcomes and the watchdog's freeze records, and the next
start (`replay()`) turns what never ended into spans with the original ids and reports the cloud
resources whose creation was asked for but never confirmed.

Storage: a framed append-only file per process (length + CRC32 per record, JSON payload,
preallocated with zeros), not SQLite. Measured on this machine (ext4 on a virtio disk, 2 cores,
`tests/bench/bench_journal.py`, results in `tests/bench/results/journal.md`): a durable record
costs 93 µs at the median (p99 165 µs) as `pwrite` into preallocated blocks + `fdatasync`, 127 to
154 µs as `write` to a growing file + `fdatasync` (the size change is committed too), and 150 to
220 µs as an SQLite WAL insert with `synchronous=FULL`. SQLite would also need a connection per
fork child and a `sqlite3` import in every host; the framed file needs `os` and `zlib`, a reader
of 60 lines, and tolerates a torn tail by construction (the reader skips any frame whose CRC
fails). A buffered record costs the hot path a dict and a deque append (no disk, no lock).

Wiring (see `writer` and `replay` for details)::

    result = replay(journal_dir, tracer_provider=provider, on_error=report)   # at setup, first
    journal = Journal(journal_dir, on_error=report)
    activate(journal)                      # span_started()/span_ended() now write to it
    install_recorder(journal)              # ledger intents/outcomes: durable, then logged as before
    ...
    journal.close()                        # at shutdown
"""

from __future__ import annotations

from .frames import Corruption, Segment, read_segment
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
    "Corruption",
    "InterruptedOperation",
    "Journal",
    "JournalRecorder",
    "ProcessJournal",
    "ReplayResult",
    "Segment",
    "UnconfirmedResource",
    "activate",
    "active",
    "install_recorder",
    "read_segment",
    "replay",
    "scan",
    "span_ended",
    "span_started",
    "to_span",
]
