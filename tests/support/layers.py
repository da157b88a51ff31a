"""Counting the wrapt layers an instrumentor left on a function or method."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

import wrapt

from stallwatch.forksafe import uvloop_layers


def _defined_in(function: object, module_name: str) -> bool:
    """Whether `function` is defined in `module_name` (a module or a package: its submodules count too)."""
    defined_in = getattr(function, "__module__", None) or ""
    return defined_in == module_name or defined_in.startswith(module_name + ".")


def wrapper_layers(owner: object, name: str, module_name: str) -> int:
    """How many wrapt layers around `owner.name` have their wrapper function defined in `module_name`,
    counting the layers composed inside uvloop's spawn wrapper (`forksafe.uvloop_layers`) as layers."""
    target = inspect.getattr_static(owner, name)
    layers = 0
    while isinstance(target, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)):  # FunctionWrapper too
        wrapper = getattr(target, "_self_wrapper", None)
        if _defined_in(wrapper, uvloop_layers.__name__):
            layers += sum(_defined_in(layer, module_name) for _, layer in uvloop_layers.layers(name))
        layers += _defined_in(wrapper, module_name)
        target = target.__wrapped__
    return layers


def wrapper_layers_at(targets: Iterable[tuple[str, str]], module_name: str) -> list[int]:
    """`wrapper_layers` of each (owner, name) in `targets`, the owner by its dotted path: a module's
    attribute (a class), or a module itself."""
    return [wrapper_layers(_owner(path), name, module_name) for path, name in targets]


def _owner(path: str) -> object:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        return importlib.import_module(path)


def spawn_layer_modules(loop_class: type, name: str) -> list[str]:
    """The modules of the wrapper layers on `loop_class.name` (uvloop's spawn method), outermost first,
    with the layers composed inside `forksafe.uvloop_layers`'s wrapper in their place."""
    target = inspect.getattr_static(loop_class, name)
    modules: list[str] = []
    while isinstance(target, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)):
        wrapper = getattr(target, "_self_wrapper", None)
        if _defined_in(wrapper, uvloop_layers.__name__):
            modules.extend(layer.__module__ for _, layer in uvloop_layers.layers(name))
        else:
            modules.append(getattr(wrapper, "__module__", "?"))
        target = target.__wrapped__
    return modules
