"""`Record`: an immutable value class for the definitions `import stallwatch` makes by the hundred.

A frozen dataclass compiles its `__init__`, `__eq__`, `__hash__`, `__repr__`, `__setattr__` and
`__delattr__` from source when its class is defined, at every start of every host; a `Record`
subclass defines only its `__slots__` and an `__init__` that calls `_set`, and shares these methods.
"""

from __future__ import annotations

from typing import Any


class Record:
    """Immutable: equal to (and hashing as) a record of the same class with equal fields, shown as
    `Class(field=value, ...)`, copied and pickled by its fields. The fields are the subclass's
    `__slots__`, each also a keyword parameter of its `__init__`, which sets them with `_set`."""

    __slots__: tuple[str, ...] = ()

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, Record):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__qualname__}({fields})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuilt, (type(self), {name: getattr(self, name) for name in self.__slots__})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of an immutable {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of an immutable {type(self).__name__}")


def _rebuilt(cls: type[Record], fields: dict[str, Any]) -> Record:
    """A copied or unpickled record (`Record.__reduce__`)."""
    return cls(**fields)
