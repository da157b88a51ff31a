"""Counting the wrapt layers an instrumentor left on a function or method."""

from __future__ import annotations

import inspect

import wrapt


def wrapper_layers(owner: object, name: str, module_name: str) -> int:
    """How many wrapt layers around `owner.name` have their wrapper function defined in `module_name`
    (a module or a package: its submodules count too)."""
    target = inspect.getattr_static(owner, name)
    layers = 0
    while isinstance(target, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)):  # FunctionWrapper too
        wrapper = getattr(target, "_self_wrapper", None)
        defined_in = getattr(wrapper, "__module__", None) or ""
        layers += defined_in == module_name or defined_in.startswith(module_name + ".")
        target = target.__wrapped__
    return layers
