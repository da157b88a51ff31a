"""What lets an instrumentor be instrumented and uninstrumented any number of times.

wrapt keeps every post-import hook registered and has no way to remove one, and an
`os.register_at_fork` handler stays for the life of the process. So each instrumentor registers
its hook for a module and its after-fork handler once, on its first `instrument()` (never at
import), and the hook patches only while the instrumentor is on: a module imported after
instrument → uninstrument → instrument is wrapped once, and one imported while it is off not at all.
Each `instrument()` also starts the same way: its settings and its meter, from `start_settings` and
`start_meter`.

`setup()` switches the subprocess, executor and tunnel instrumentations through their `Installation`,
without `BaseInstrumentor` (whose module loads `packaging` and the semantic conventions); their
instrumentors (`_instrumentor.InstallationInstrumentor`) switch the same one and, behind the SDK door
(`sdk_compat.mirror_installation`), say they are instrumented while it is on. With
`STALLWATCH_FAST_PATHS=false` `setup()` uses `instrument()`. `unwrap` takes a wrapper off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import wrapt
from opentelemetry.metrics import Meter

from ..config import ConfigError, Settings
from ..core.faults import FAULTS, meter

_log = logging.getLogger("stallwatch")

Patch = Callable[[ModuleType], None]
# Every wrapt proxy, FunctionWrapper included: wrapt 2's `ObjectProxy` is a subclass beside FunctionWrapper.
_PROXY: type = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def unwrap(owner: object, name: str) -> None:
    """`opentelemetry.instrumentation.utils.unwrap(owner, name)`: puts back what a wrapt wrapper wraps.

    Footprint: that module loads the propagators when imported; only an uninstall needs it."""
    from opentelemetry.instrumentation.utils import unwrap as unwrapped

    unwrapped(owner, name)


def start_settings(kwargs: Mapping[str, Any], part: str) -> Settings | None:
    """`instrument()`'s `settings` argument, else the settings read from the environment; None when a
    setting is invalid, logged as an error saying that the `part` instrumentation stays off."""
    try:
        return kwargs.get("settings") or Settings.load()
    except ConfigError as error:
        _log.error("stallwatch: %s; %s instrumentation stays off.", error, part)
        return None


def start_meter(kwargs: Mapping[str, Any]) -> Meter:
    """stallwatch's meter from `instrument()`'s `meter_provider` (default: the global one), the
    provider the fault counter counts on from now on."""
    meter_ = meter(kwargs.get("meter_provider"))
    FAULTS.bind(kwargs.get("meter_provider"))
    return meter_


def is_wrapper(value: object) -> bool:
    """True for any wrapt wrapper or proxy, with wrapt 1.x and 2.x."""
    return isinstance(value, _PROXY)


class ImportHooks:
    """One instrumentor's post-import hooks, one registration per module name for the process."""

    @staticmethod
    def of(instrumentor: object) -> ImportHooks:
        """The hooks of `instrumentor` (a `BaseInstrumentor`, one instance per class), made on first use."""
        hooks: ImportHooks | None = vars(instrumentor).get("_import_hooks")
        if hooks is None:
            hooks = vars(instrumentor)["_import_hooks"] = ImportHooks()
        return hooks

    def __init__(self) -> None:
        self._registered: set[str] = set()
        self._patches: dict[str, Patch] = {}

    def on_import(self, module_name: str, patch: Patch) -> None:
        """Run `patch(module)` when `module_name` is imported, or now if it already is; until `clear()`."""
        self._patches[module_name] = patch
        if module_name not in self._registered:
            self._registered.add(module_name)
            wrapt.register_post_import_hook(self._imported, module_name)  # runs now if already imported
        elif module_name in sys.modules:
            patch(sys.modules[module_name])

    def clear(self) -> None:
        """No patch runs on a later import (the registered hooks stay, and do nothing)."""
        self._patches.clear()

    def _imported(self, module: ModuleType) -> None:
        patch = self._patches.get(module.__name__)
        if patch is not None:
            patch(module)


class Installation:
    """Whether one instrumentation is on, and the `install(**kwargs)` and `uninstall(**kwargs)` that
    switch it (with `instrument()`'s keyword arguments). `on` is true exactly while it is installed,
    whoever switched it: `setup()` or its instrumentor."""

    def __init__(self, install: Callable[..., None], uninstall: Callable[..., None]) -> None:
        self._install = install
        self._uninstall = uninstall
        self.on = False

    def switch_on(self, **kwargs: Any) -> bool:
        """Install it unless it is on; True when this call did."""
        if self.on:
            return False
        self._install(**kwargs)
        self.on = True
        return True

    def switch_off(self, **kwargs: Any) -> bool:
        """Uninstall it if it is on; True when this call did."""
        if not self.on:
            return False
        self._uninstall(**kwargs)
        self.on = False
        return True


class ForkReset:
    """An after-fork-in-child handler registered on the first `register()`, never again."""

    def __init__(self, after_in_child: Callable[[], object]) -> None:
        self._after_in_child = after_in_child
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            self._registered = True
            os.register_at_fork(after_in_child=self._after_in_child)
