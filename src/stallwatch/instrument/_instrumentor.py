"""`InstallationInstrumentor`: the `BaseInstrumentor` of an instrumentation whose switching is all in
its `Installation` (subprocess, executor, SSH tunnels); a subclass states its dependencies and names
its installation: `class X(InstallationInstrumentor, installation=INSTALLATION)`.

This module loads `BaseInstrumentor` (and with it `packaging` and the semantic conventions): only the
instrumentor modules import it, each loaded when asked for; `setup()` switches the installations
without it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from .. import sdk_compat
from ._lifecycle import Installation


class InstallationInstrumentor(BaseInstrumentor):
    """`instrument()` switches the class's `installation` on and `uninstrument()` off, each with its
    keyword arguments; neither installs a second time nor uninstalls what is not installed, whoever
    switched it (`Installation`). With the fast paths on, the instrumentor is instrumented exactly while
    the installation is on (`sdk_compat.mirror_installation`, fixed when the subclass is defined)."""

    installation: ClassVar[Installation]

    def __init_subclass__(cls, /, installation: Installation, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.installation = installation
        sdk_compat.mirror_installation(cls, installation)

    def _instrument(self, **kwargs: Any) -> None:
        self.installation.switch_on(**kwargs)

    def _uninstrument(self, **kwargs: Any) -> None:
        self.installation.switch_off(**kwargs)
