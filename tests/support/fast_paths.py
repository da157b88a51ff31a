"""The fast-path mode the tests run in (`STALLWATCH_FAST_PATHS`, set per CI environment by tests/run.sh)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from stallwatch import sdk_compat

# What a process started from the tests (inheriting their environment) takes.
FAST_PATHS = os.environ.get("STALLWATCH_FAST_PATHS", "true").strip().lower() not in ("false", "0", "no", "off")


@pytest.fixture
def fast_paths_on() -> Iterator[None]:
    """The fast paths taken in this process whatever the environment says: for the tests that hold a
    fast path against the public SDK objects it replaces."""
    was = sdk_compat.fast_paths()
    sdk_compat.use_fast_paths(True)
    yield
    sdk_compat.use_fast_paths(was)


@pytest.fixture
def fast_paths_off() -> Iterator[None]:
    """The fast paths not taken in this process whatever the environment says: only public SDK objects."""
    was = sdk_compat.fast_paths()
    sdk_compat.use_fast_paths(False)
    yield
    sdk_compat.use_fast_paths(was)
