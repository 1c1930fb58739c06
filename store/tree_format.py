"""The JSON tree a rank's state is saved as (ckpt._tree writes and binds it): its markers and
the check a reader makes of a tree before acting on it.

A node is a JSON scalar (finite numbers), a list of nodes, an object of string keys to
nodes, or one of the marked objects: {"__tensor__": name} and {"__ndarray__": name} (an
array of the version), {"__object__": node} (an object's state_dict()), {"__tuple__":
[nodes]}, {"__dict__": [[key, node], ...]} (keys that are no strings: int, bool, None, or
strings that are markers) and {"__float__": "nan" | "inf" | "-inf"}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckpt.store.dtypes import is_native

__all__ = [
    "TENSOR",
    "OBJECT",
    "TUPLE",
    "DICT",
    "FLOAT",
    "NDARRAY",
    "MARKERS",
    "MAX_SAVED_DEPTH",
    "MAX_TREE_DEPTH",
    "tree_problem",
]

TENSOR, OBJECT, TUPLE, DICT, FLOAT, NDARRAY = (
    "__tensor__",
    "__object__",
    "__tuple__",
    "__dict__",
    "__float__",
    "__ndarray__",
)
MARKERS = frozenset({TENSOR, OBJECT, TUPLE, DICT, FLOAT, NDARRAY})
_KEY_TYPES = (str, int, bool, type(None))
# A save refuses a state nested deeper than MAX_SAVED_DEPTH levels (keys, and objects whose
# state_dict() holds the next level); a reader refuses trees deeper than MAX_TREE_DEPTH, which
# leaves room for what saves before that bound wrote (up to Python's recursion limit, ~450
# levels): binding a tree takes up to two Python frames a level.
MAX_SAVED_DEPTH = 200
MAX_TREE_DEPTH = 400


def _float_ok(v: Any) -> bool:
    try:
        return isinstance(v, str) and not math.isfinite(float(v))
    except ValueError:
        return False


def tree_problem(tree: Any, arrays: Mapping[str, str] | None = None) -> str | None:
    """What makes `tree` no tree ckpt writes (None: nothing), found without recursion. With
    `arrays` (each array name of the version and its data type), every array it names must
    be one of them, and an ndarray's of a type NumPy has."""
    todo: list[tuple[Any, int]] = [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_TREE_DEPTH:
            return f"values nested deeper than {MAX_TREE_DEPTH} levels"
        below = depth + 1
        if isinstance(node, list):
            todo.extend((x, below) for x in node)
            continue
        if not isinstance(node, dict):
            if isinstance(node, float) and not math.isfinite(node):
                return "a number that is not finite"
            continue  # (JSON gives only scalars besides lists and objects)
        marked = MARKERS & node.keys()
        if not marked:
            todo.extend((x, below) for x in node.values())
            continue
        if len(node) != 1:
            return f"an object with {sorted(marked)[0]} and other keys"
        ((marker, value),) = node.items()
        if marker in (TENSOR, NDARRAY):
            if not isinstance(value, str):
                return f"a {marker} that is not an array name"
            if arrays is not None:
                data_type = arrays.get(value)
                if data_type is None:
                    return f"a {marker} naming {value[:80]!r}, which the manifest lacks"
                if marker == NDARRAY and not is_native(data_type):  # (not np.dtype(): ml_dtypes adds names)
                    return f"a {NDARRAY} of {data_type}, which NumPy has no type for"
        if marker == FLOAT and not _float_ok(value):
            return f"a {FLOAT} that is not nan or an infinity"
        if marker == TUPLE:
            if not isinstance(value, list):
                return f"a {TUPLE} that is not a list"
            todo.extend((x, below) for x in value)
        if marker == DICT:
            if not isinstance(value, list):
                return f"a {DICT} that is not a list of pairs"
            for pair in value:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], _KEY_TYPES):
                    return f"a {DICT} entry that is not a [key, value] pair"
                todo.append((pair[1], below))
        if marker == OBJECT:
            todo.append((value, below))
    return None
