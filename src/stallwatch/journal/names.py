"""Names the journal's modules share, in a module that loads nothing else."""

from __future__ import annotations

LOGGER_NAME = "stallwatch.cloud"  # the ledger's logger (`ledger`), exported whatever the log level
UNCONFIRMED = "unconfirmed"  # the leak candidates' directory in the journal directory (`leaks`)
SEGMENT_SUFFIX = ".journal"  # every segment's name ends so (`frames.segment_name`)
