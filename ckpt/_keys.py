"""A leaf's key path in the user's state, as error messages name it."""

from __future__ import annotations

from typing import Any

__all__ = ["KeyPath"]


class KeyPath(tuple[Any, ...]):
    """The keys from the state's top to a leaf; str() renders them as `state['model']['w']`.

    Rendered only when a message needs it: save() makes one per tensor, and formatting
    thousands of reprs cost the stall ~1 us each.
    """

    __slots__ = ()

    def __str__(self) -> str:
        return "state" + "".join(f"[{k!r}]" for k in self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
