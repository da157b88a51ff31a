"""The crash-safe journal: a local, append-only, per-process record of operations in flight.

A killed process exports nothing it held, so operations, the cloud ledger's intents and outcomes and
the watchdog's freeze records go to a local file as they happen. The next start (`replay()`) turns
what never ended into spans with their original ids and keeps unconfirmed creates as leak candidates
(`leaks`). Records are framed (length + CRC32, JSON payload), so a torn tail costs only its bytes;
docs/journal.md says why not SQLite, and what a record costs. Wiring: `replay(journal_dir, ...)` at
setup, first; then `journal = Journal(journal_dir, ...)`, `activate(journal)` (`span_started` and
`span_ended` write to it), `install_recorder(journal)` (ledger records are journaled, then logged);
`journal.close()` at shutdown. `setup()` replays only when the directory holds a segment
(`has_segments`) and makes its journal at the first journaled operation (`FirstUse`). This module
loads only what instrumentations call on every operation; its other names (`Journal`, `replay`, ...)
load their submodule when first looked up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .current import FirstUse, UnconfirmedObserver, activate, active, has_segments, span_ended, span_started
from .names import LOGGER_NAME, SEGMENT_SUFFIX, UNCONFIRMED

if TYPE_CHECKING:
    from .frames import Corruption, Segment, read_segment
    from .leaks import Candidate, Reporter, candidates, confirm
    from .replaying import (
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
    from .writer import Journal, JournalRecorder, install_recorder

_NAMES_OF = {
    "frames": ("Corruption", "Segment", "read_segment"),
    "leaks": ("Candidate", "Reporter", "candidates", "confirm"),
    "replaying": ("INTERRUPTED", "INTERRUPTED_REASON", "InterruptedOperation", "ProcessJournal", "ReplayResult",
                  "UnconfirmedResource", "replay", "scan", "to_span"),
    "writer": ("Journal", "JournalRecorder", "install_recorder"),
}  # fmt: skip
_SUBMODULE_OF = {name: submodule for submodule, names in _NAMES_OF.items() for name in names}


def __getattr__(name: str) -> Any:
    """The package's names that live in a submodule, loading it on first lookup and binding all of its
    names at once. No submodule is named like one of the package's names: loading a submodule sets the
    package's attribute of that name to the module, which would hide the name (tests/test_footprint.py)."""
    submodule = _SUBMODULE_OF.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # footprint: a submodule loads when one of its names is first looked up
    module = importlib.import_module(f"{__name__}.{submodule}")
    globals().update({each: getattr(module, each) for each in _NAMES_OF[submodule]})
    return globals()[name]


__all__ = [
    "INTERRUPTED",
    "INTERRUPTED_REASON",
    "LOGGER_NAME",
    "SEGMENT_SUFFIX",
    "UNCONFIRMED",
    "Candidate",
    "Corruption",
    "FirstUse",
    "InterruptedOperation",
    "Journal",
    "JournalRecorder",
    "ProcessJournal",
    "ReplayResult",
    "Reporter",
    "Segment",
    "UnconfirmedObserver",
    "UnconfirmedResource",
    "activate",
    "active",
    "candidates",
    "confirm",
    "has_segments",
    "install_recorder",
    "read_segment",
    "replay",
    "scan",
    "span_ended",
    "span_started",
    "to_span",
]
