"""The one wrapper on uvloop's `Loop.subprocess_exec`/`subprocess_shell`: stallwatch's layers, composed
in the order below whatever order their parts were installed in and whether uvloop came before or after.

Outermost first:
1. `record` (`instrument.subprocess`): the spawn's span and blocked time cover the whole call the host
   made, and it sees what the layers inside did: the `Popen` the routing runs and `uvloop_spawn.FALLBACK`.
2. `guard` (`forksafe.guard`): marks the spawn exec-bound and tells the watchdog what is being spawned;
   outside the routing, so that every uvloop spawn, routed or not, is marked.
3. `route` (`forksafe.uvloop_spawn`): spawns through `Popen` instead of uvloop's fork; innermost, since a
   routed call never reaches uvloop's own method.

A part calls `add` when it is installed and `remove` when it is not; `remove` takes out that layer alone.
uvloop's two methods carry one wrapt layer each (one post-import hook for the process, registered on the
first `add`); each call composes the layers present when it starts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import wrapt

Layer = Callable[[Callable[..., Awaitable[Any]], Any, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
"""A wrapt-style wrapper, `layer(wrapped, instance, args, kwargs)`, of a uvloop spawn method."""

ORDER = ("record", "guard", "route")
"""The layers' names, outermost first."""

METHODS = ("subprocess_exec", "subprocess_shell")

# Process-wide, as uvloop's `Loop` class is: name -> (subprocess_exec layer, subprocess_shell layer).
_layers: dict[str, tuple[Layer, Layer]] = {}
# Per method, innermost first: what a call composes, replaced as a whole on each change (one read per call).
_stacks: dict[str, tuple[tuple[str, Layer], ...]] = dict.fromkeys(METHODS, ())
_hooked = False


def add(name: str, exec_layer: Layer, shell_layer: Layer) -> None:
    """Put layer `name` (one of `ORDER`) on both methods, in its place; replaces that layer if present."""
    global _hooked
    if name not in ORDER:
        raise ValueError(f"unknown uvloop spawn layer {name!r}; expected one of {ORDER}")
    _layers[name] = (exec_layer, shell_layer)
    _restack()
    if not _hooked:
        _hooked = True
        wrapt.register_post_import_hook(_wrap, "uvloop")  # runs now if uvloop is imported already


def remove(name: str) -> None:
    """Take layer `name` off both methods (nothing if it is not on); the others stay, in order."""
    if _layers.pop(name, None) is not None:
        _restack()


def layers(method: str) -> tuple[tuple[str, Layer], ...]:
    """The layers a call of `method` composes now, outermost first, with their names."""
    return _stacks[method][::-1]


def _restack() -> None:
    for index, method in enumerate(METHODS):
        _stacks[method] = tuple((name, _layers[name][index]) for name in reversed(ORDER) if name in _layers)


class _Bound:
    """A layer bound to what it wraps: called as the method itself, by the layer outside it."""

    __slots__ = ("_inner", "_instance", "_layer")

    def __init__(self, layer: Layer, inner: Callable[..., Awaitable[Any]], instance: Any) -> None:
        self._layer, self._inner, self._instance = layer, inner, instance

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._layer(self._inner, self._instance, args, kwargs)


def _composer(method: str) -> Layer:
    def composed(
        wrapped: Callable[..., Awaitable[Any]], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Awaitable[Any]:
        call = wrapped
        for _, layer in _stacks[method]:
            call = _Bound(layer, call, instance)
        return call(*args, **kwargs)  # the outermost layer's coroutine: no await frame of its own

    return composed


def _wrap(module: ModuleType) -> None:
    for method in METHODS:
        wrapt.wrap_function_wrapper(module, f"Loop.{method}", _composer(method))
