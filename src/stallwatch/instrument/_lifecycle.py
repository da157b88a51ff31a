"""What lets an instrumentor be instrumented and uninstrumented any number of times.

wrapt keeps every post-import hook registered and has no way to remove one, and an
`os.register_at_fork` handler stays for the life of the process. So each instrumentor registers
its hook for a module and its after-fork handler once, on its first `instrument()` (never at
import), and the hook patches only while the instrumentor is on: a module imported after
instrument → uninstrument → instrument is wrapped once, and one imported while it is off not at all.
Each `instrument()` also starts the same way: its settings and its meter, from `start_settings` and
`start_meter`.

`setup()` switches the instrumentations it installs at once (subprocess, executor, dstack's tunnels)
through their `Installation`, not their instrumentor: `BaseInstrumentor`'s module loads `packaging`
and the semantic conventions, which a host that never asks for an instrumentor does not need. The
instrumentor, loaded when asked for, reads and sets the same `Installation` (`InstalledFlag`), so it
says it is instrumented after `setup()` and its `uninstrument()` undoes what `setup()` installed.
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
    """Whether one instrumentation is on, and its `install(**kwargs)` and `uninstall(**kwargs)`: what its
    instrumentor's `_instrument` and `_uninstrument` run, with `instrument()`'s keyword arguments."""

    def __init__(self, install: Callable[..., None], uninstall: Callable[..., None]) -> None:
        self.install = install
        self.uninstall = uninstall
        self.on = False

    def instrument_once(self, **kwargs: Any) -> bool:
        """Install it as `instrument(**kwargs)` would, unless it is on (by its instrumentor or an earlier
        `setup()`); True when this call did."""
        if self.on:
            return False
        self.install(**kwargs)
        self.on = True
        return True


class InstalledFlag:
    """An instrumentor's `_is_instrumented_by_opentelemetry` (what `BaseInstrumentor` reads, and sets
    after `_instrument` and `_uninstrument`): its `Installation`'s `on`, which `setup()` sets too."""

    def __init__(self, installation: Installation) -> None:
        self._installation = installation

    def __get__(self, instance: object, owner: type | None = None) -> bool:
        return self._installation.on

    def __set__(self, instance: object, value: bool) -> None:
        self._installation.on = bool(value)


class ForkReset:
    """An after-fork-in-child handler registered on the first `register()`, never again."""

    def __init__(self, after_in_child: Callable[[], object]) -> None:
        self._after_in_child = after_in_child
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            self._registered = True
            os.register_at_fork(after_in_child=self._after_in_child)
