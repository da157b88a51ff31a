"""Entry points for `opentelemetry-instrument`: a distro and a configurator.

`opentelemetry-instrument python app.py` loads the distro first (which imports stallwatch, so
the fork guard is in place before any provider, instrumentor or grpc loads), then the
configurator, which calls `stallwatch.setup()` instead of the SDK's own pipeline. If other
distros or configurators are installed, select ours with `OTEL_PYTHON_DISTRO=stallwatch` and
`OTEL_PYTHON_CONFIGURATOR=stallwatch`.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]  # the module opts out of typing

import stallwatch
from stallwatch.sdk_compat import base_configurator


class StallwatchDistro(BaseDistro):
    """Installs the fork guard (by importing stallwatch) before anything else is configured."""

    def _configure(self, **kwargs: Any) -> None:
        return None

    def load_instrumentor(self, entry_point: Any, **kwargs: Any) -> None:
        """Skip instrumentors that `setup()` (our configurator) has already installed."""
        if getattr(entry_point.load()(), "is_instrumented_by_opentelemetry", False):
            return
        super().load_instrumentor(entry_point, **kwargs)


class StallwatchConfigurator(base_configurator()):  # type: ignore[misc]
    """Builds the fork-aware pipeline from the environment: `stallwatch.setup()`."""

    def _configure(self, **kwargs: Any) -> None:
        stallwatch.setup()
