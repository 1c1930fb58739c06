"""State <-> JSON tree. Tensors become references to arrays; everything else is JSON.

Encoding walks the user's state: objects with `state_dict()` are expanded, tensors are
collected as leaves named by their key path, scalars stay JSON. Anything else is
refused with the key that holds it. Nothing is pickled.

Decoding (`bind`) pairs the saved tree with the live state in one pass and returns a
`finish()` closure: tensor leaves are filled in place by the caller in between, then
`finish()` rebuilds containers and calls `load_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckpt._keys import KeyPath
from ckpt._tensors import ARRAY_TYPES, TENSOR_LIKE, is_tensor_like
from ckpt.store.errors import StateMismatchError, UnsupportedStateError
from ckpt.store.manifest import MAX_NAME_BYTES, escape_component
from ckpt.store.tree_format import DICT, FLOAT, MARKERS, MAX_SAVED_DEPTH, NDARRAY, OBJECT, TENSOR, TUPLE

__all__ = ["Leaf", "Leaves", "EncodeMemo", "encode_state", "bind", "Bound"]

_MARKERS = MARKERS
_KEY_TYPES = (str, int, bool, type(None))
_INT_BITS = 14_000  # ~4,200 digits: under the 4,300 Python turns into text by default (sys.int_info)
_is_str = str.__instancecheck__  # isinstance(k, str) without a Python frame, for all(map(...))


@dataclass(slots=True)
class Leaf:
    name: str  # the array name: escaped key path
    key: KeyPath  # the leaf's key path, rendered in errors
    value: Any  # tensor, DTensor, Shard or ndarray (None when restoring into nothing)


@dataclass(slots=True)
class Leaves:
    """encode_state's tensors in the state's order, as two aligned containers rather than
    an object per tensor (save() encodes thousands of them, every save): each one's array
    name and key path (`paths`, whose keys prove the names unique), and its value."""

    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    values: list[Any] = field(default_factory=list)


def _key_str(path: tuple[Any, ...]) -> str:
    return str(KeyPath(path))


def _has_state_dict(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def encode_state(state: Mapping[str, Any], memo: EncodeMemo | None = None) -> tuple[Any, Leaves]:
    """The state's JSON tree and its tensor leaves. With a `memo` (a Saver's), mappings the
    last save encoded are taken from it where their keys are the same, and the memo then
    holds this save's."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    odd = [k for k in state if not isinstance(k, str) or k in _MARKERS]
    if odd:  # (below the top, such keys are encoded with their types; here they name what a restore loads)
        raise UnsupportedStateError(
            f"top-level state key {odd[0]!r}: top-level keys are strings other than {sorted(_MARKERS)}"
        )
    enc = _Encoder(memo)
    try:
        tree = {k: enc.enc(v, (k,), escape_component(str(k))) for k, v in state.items()}
    except RecursionError:
        raise UnsupportedStateError("the state is nested too deeply to save (Python's recursion limit)") from None
    except UnicodeEncodeError as e:  # a lone surrogate ('\udcff', as os.fsdecode makes of bad bytes)
        raise UnsupportedStateError(
            f"state key {e.object!r} is not valid Unicode text: no file name holds it"
        ) from None
    if memo is not None:
        memo.last = enc.seen
    return tree, enc.leaves


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A mapping as a save encoded it: one of plain tensors with string keys, or one whose
    values are all such mappings (`children`: an optimizer's state, by parameter)."""

    path: tuple[Any, ...]
    keys: tuple[Any, ...]
    key_types: tuple[type, ...]  # (1 == True: equal keys of other types make other names)
    paths: dict[str, tuple[Any, ...]]  # its leaves' array names -> key paths, in its order
    node: dict[str, Any]  # its JSON node: shared by the saves that find it again, never changed
    children: tuple[tuple[str, _Encoded], ...] | None = None  # by array name, in its order


class EncodeMemo:
    """What a Saver's next encoding reuses: the JSON nodes and array names of the last
    save's mappings of plain tensors or DTensors (a state_dict(), an optimizer's state of
    one parameter, and the mapping of those by parameter). Found again by array name, path and
    keys, such a mapping costs a few C loops over its values instead of a name, a key path
    and a node per tensor. Holds no tensor: only names, keys and nodes."""

    def __init__(self) -> None:
        self.last: dict[str, _Encoded] = {}


class _Encoder:
    """encode_state's walk. A method, not a nested function: a recursive closure is a
    reference cycle, which would keep every leaf (and its tensor) alive until the cyclic
    collector runs, and make the collector's next full pass longer."""

    def __init__(self, memo: EncodeMemo | None = None) -> None:
        self.leaves = Leaves()
        self.last = memo.last if memo is not None else None
        self.seen: dict[str, _Encoded] = {}  # this encoding's, for the memo
        self.objects = 0  # objects above the node being encoded: each nests the tree a level

    # `name` is the escaped path so far, extended per level rather than joined per leaf.
    def enc(self, v: Any, path: tuple[Any, ...], name: str) -> Any:
        if isinstance(v, TENSOR_LIKE):  # (is_tensor_like, inlined: this runs per node of every save)
            paths = self.leaves.paths
            if name in paths:
                raise UnsupportedStateError(
                    f"{KeyPath(path)} and {KeyPath(paths[name])} map to the same array name {name!r}"
                )
            if len(name) > MAX_NAME_BYTES:  # (ASCII: escape_component quotes every other character)
                raise UnsupportedStateError(
                    f"{KeyPath(path)}: its array name of {len(name)} bytes is too long for a file path "
                    f"(at most {MAX_NAME_BYTES}); shorten or flatten its keys"
                )
            if isinstance(v, np.ma.MaskedArray):  # (its values would come back, its mask not)
                raise UnsupportedStateError(
                    f"{KeyPath(path)}: a masked array's mask is not stored; save np.asarray(x) and x.mask as arrays "
                    "of their own"
                )
            paths[name] = path
            self.leaves.values.append(v)
            return {NDARRAY if isinstance(v, np.ndarray) else TENSOR: name}
        enc = self.enc
        if len(path) + self.objects > MAX_SAVED_DEPTH:  # (readers refuse deeper trees: store.tree_format)
            raise UnsupportedStateError(
                f"{_key_str(path[:3])}...: the state is nested deeper than {MAX_SAVED_DEPTH} levels "
                "(keys, and objects with state_dict() inside objects); flatten it"
            )
        plain = type(v) is dict  # the common case; a plain dict has no state_dict()
        if not plain and _has_state_dict(v):
            self.objects += 1
            try:
                return {OBJECT: enc(v.state_dict(), path, name)}
            finally:
                self.objects -= 1
        if plain or isinstance(v, Mapping):
            if _MARKERS.isdisjoint(v) and all(map(_is_str, v)):
                return self.enc_str_keyed(v, path, name)
            for k in v:
                if not isinstance(k, _KEY_TYPES):
                    raise UnsupportedStateError(f"{_key_str(path)}: dict key {k!r} of type {type(k).__name__}")
                if type(k) is int and k.bit_length() > _INT_BITS:
                    raise UnsupportedStateError(
                        f"{_key_str(path)}: a dict key of {k.bit_length()} bits (ints: {_INT_BITS})"
                    )
            return self.enc_keyed(v, path, name)
        if isinstance(v, tuple):
            return {TUPLE: [enc(x, path + (i,), f"{name}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, path + (i,), f"{name}/{i}") for i, x in enumerate(v)]
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            if v.bit_length() > _INT_BITS:  # beyond Python's int-to-text limit: the JSON would fail
                raise UnsupportedStateError(
                    f"{_key_str(path)}: an int of {v.bit_length()} bits; ints up to {_INT_BITS} bits are saved "
                    "(store a larger one as a tensor of its bytes)"
                )
            return int(v)
        if isinstance(v, float):
            return float(v) if math.isfinite(v) else {FLOAT: repr(float(v))}
        raise UnsupportedStateError(
            f"{_key_str(path)}: cannot checkpoint a {type(v).__module__}.{type(v).__qualname__}; "
            "use tensors, objects with state_dict()/load_state_dict(), dicts, lists and JSON scalars"
        )

    def enc_str_keyed(self, v: Mapping[str, Any], path: tuple[Any, ...], name: str) -> dict[str, Any]:
        """A mapping with string keys as a JSON object. Plain tensors, most leaves of a
        state_dict(), and DTensors are taken here without a call of enc() each."""
        paths, values = self.leaves.paths, self.leaves.values
        last = self.last
        if last is not None:
            known = last.get(name)
            if (
                known is not None
                and known.children is None
                and known.path == path
                and known.keys == tuple(v)
                and set(map(type, v.values())) <= ARRAY_TYPES
                and paths.keys().isdisjoint(known.paths)
            ):
                paths.update(known.paths)
                values.extend(v.values())
                self.seen[name] = known
                return known.node
        out = {}
        mine: dict[str, tuple[Any, ...]] | None = {} if last is not None else None
        for k, x in v.items():
            child = f"{name}/{escape_component(k)}"
            if type(x) in ARRAY_TYPES and child not in paths and len(child) <= MAX_NAME_BYTES:  # else enc() refuses
                paths[child] = key = path + (k,)
                values.append(x)
                out[k] = {TENSOR: child}
                if mine is not None:
                    mine[child] = key
            else:
                out[k] = self.enc(x, path + (k,), child)
                mine = None
        if mine:
            keys = tuple(out)
            self.seen[name] = _Encoded(path, keys, tuple(map(type, keys)), mine, out)
        return out

    def enc_keyed(self, v: Mapping[Any, Any], path: tuple[Any, ...], name: str) -> dict[str, Any]:
        """A mapping with other keys (an optimizer's state: parameter ids) as [key, value]
        pairs. Where its values are all plain dicts of tensors or DTensors, as the last save's
        were, with the same keys, it is taken as a whole."""
        paths, values, seen = self.leaves.paths, self.leaves.values, self.seen
        last = self.last
        if last is not None:
            known = last.get(name)
            if (
                known is not None
                and known.children is not None
                and known.path == path
                and known.keys == tuple(v)
                and known.key_types == tuple(map(type, v))
            ):
                xs = list(v.values())
                if all(
                    type(x) is dict and c.keys == tuple(x) and set(map(type, x.values())) <= ARRAY_TYPES
                    for x, (_, c) in zip(xs, known.children)
                ) and paths.keys().isdisjoint(known.paths):
                    paths.update(known.paths)
                    for x in xs:
                        values.extend(x.values())
                    seen[name] = known
                    seen.update(known.children)
                    return known.node
        pairs = []
        children: list[tuple[str, _Encoded]] | None = [] if last is not None else None
        for k, x in v.items():
            child = f"{name}/{escape_component(str(k))}"
            node = self.enc(x, path + (k,), child)
            pairs.append([k, node])
            if children is not None:
                found = seen.get(child)
                if found is None or found.node is not node or found.children is not None or type(x) is not dict:
                    children = None
                else:
                    children.append((child, found))
        out = {DICT: pairs}
        if children:
            keys = tuple(k for k, _ in pairs)
            leaves = {n: p for _, c in children for n, p in c.paths.items()}
            seen[name] = _Encoded(path, keys, tuple(map(type, keys)), leaves, out, tuple(children))
        return out


@dataclass
class Bound:
    """The result of binding: leaves to fill, then finish() to rebuild the state."""

    leaves: list[Leaf] = field(default_factory=list)
    results: dict[str, torch.Tensor] = field(default_factory=dict)
    finish: Callable[[], Any] = lambda: None
    # fresh optimizers given state tensors to fill (_init_optimizer_state)
    initialized: list[torch.optim.Optimizer] = field(default_factory=list)

    def undo(self) -> None:
        """A restore refused before anything was read leaves the state as it found it: the
        optimizers given state to fill are fresh again."""
        for opt in self.initialized:
            opt.state.clear()


def _init_optimizer_state(opt: torch.optim.Optimizer, saved_state: Any) -> None:
    """Give a fresh optimizer its state tensors (as DCP does), so restore fills them in place
    with the parameters' own placement. Only parameters that have state in the checkpoint
    keep any; their gradients are left as they were. The step runs at lr 0 on zero
    gradients with no weight decay, so it adds exactly -0.0 to each parameter, which leaves
    every value bitwise (weight decay would add lr x (decay x p) = 0 x inf = NaN to an
    infinite one, and +0.0 to a -0.0)."""
    if opt.state:
        return
    saved_keys = {k for k, _ in saved_state[DICT]} if isinstance(saved_state, dict) and DICT in saved_state else set()
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    saved_lr = []
    saved_decay = []
    for group in opt.param_groups:
        saved_lr.append(group["lr"])
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        saved_decay.append(group.get("weight_decay"))
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        try:
            opt.step()
        except TypeError:  # optimizers that need a closure (LBFGS)
            opt.step(lambda: torch.zeros(()))  # type: ignore[arg-type,return-value]
    except Exception as e:
        raise StateMismatchError(
            f"cannot create the state of {type(opt).__name__} to restore into ({type(e).__name__}: {e}); "
            "take one optimizer step before restore()"
        ) from e
    finally:
        for group, lr, decay in zip(opt.param_groups, saved_lr, saved_decay):
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = decay
        for p, g in zip(params, grads):
            p.grad = g
    for i, p in enumerate(params):
        if i not in saved_keys:
            opt.state.pop(p, None)


def _kind(v: Any) -> str:
    """What a slot of the live state holds, for the rule that a restore fills a slot only with
    its own kind: a tensor, a dict, a list or a scalar (None takes any saved value)."""
    if is_tensor_like(v):
        return "a tensor"
    if isinstance(v, Mapping) or _has_state_dict(v):
        return "a dict"
    if isinstance(v, (list, tuple)):
        return "a list"
    return "a scalar"


def _saved_kind(s: Any) -> str:
    if isinstance(s, dict) and (TENSOR in s or NDARRAY in s):
        return "a tensor"
    if isinstance(s, dict) and TUPLE in s or isinstance(s, list):
        return "a list"
    if isinstance(s, dict) and FLOAT not in s:
        return "a dict"
    return "a scalar"


def bind(saved: Any, target: Mapping[str, Any], *, strict: bool = True) -> Bound:
    """Pair the saved tree with the live state; raise StateMismatchError on structural differences.

    A slot of the live state takes only a saved value of its kind (a tensor, a dict, a
    list, a scalar; None takes anything). The state's top-level keys choose what is
    restored (saved keys beyond them are not loaded); with `strict`, each of them must be
    saved, and every dict below has exactly the saved keys; without it, keys on one side
    only are left alone: a state key the checkpoint lacks keeps its value, a saved key the
    state lacks is not loaded. Inside an object's state_dict() the object's
    load_state_dict judges the keys.
    """
    out = Bound()
    if not isinstance(saved, dict):
        raise StateMismatchError(f"the checkpoint's state is {_saved_kind(saved)}, not a dict")
    try:
        out.finish = _Binder(out, strict).b(saved, target, (), False)
    except RecursionError:  # a tree an older save nested deeper than this stack takes
        out.undo()
        raise UnsupportedStateError(
            "the saved state is nested too deeply to restore on this call stack (Python's recursion limit; "
            "sys.setrecursionlimit raises it)"
        ) from None
    except BaseException:
        out.undo()
        raise
    return out


class _Binder:
    """bind's walk. A method, not a nested function, and closures that hold `results`, not
    the Bound: either cycle would keep the state's tensors alive until the cyclic collector
    runs."""

    def __init__(self, bound: Bound, strict: bool) -> None:
        self.leaves, self.results, self.strict = bound.leaves, bound.results, strict
        self.initialized = bound.initialized

    def b(self, s: Any, t: Any, path: tuple[Any, ...], in_object: bool) -> Callable[[], Any]:
        key = KeyPath(path)  # rendered only in an error: a restore binds every node of the tree
        if t is not None and _kind(t) != _saved_kind(s):
            raise StateMismatchError(f"{key}: the checkpoint has {_saved_kind(s)} here, the state has {_what(t)}")
        if isinstance(s, dict) and (TENSOR in s or NDARRAY in s):
            name = str(s.get(TENSOR, s.get(NDARRAY)))
            is_array = NDARRAY in s
            self.leaves.append(Leaf(name, key, t))
            results = self.results  # (the closures hold the dict, not the binder)
            if isinstance(t, np.ndarray):  # filled in place (through a copy where it is not contiguous)
                return lambda: _into_ndarray(results[name], t)
            if is_array and t is None:
                return lambda: _as_ndarray(results[name])
            return lambda: results[name]  # the state's own tensor, filled in place
        plain = isinstance(s, dict) and (DICT in s or not (_MARKERS & s.keys()))
        if plain and _has_state_dict(t) and not isinstance(t, Mapping):
            s = {OBJECT: s}  # a saved state_dict() restores into the live object, through load_state_dict
        if isinstance(s, dict) and OBJECT in s and isinstance(t, Mapping) and not _has_state_dict(t):
            return self.b(s[OBJECT], t, path, in_object)  # a saved object restores into a plain state dict, in place
        if isinstance(s, dict) and OBJECT in s:
            if not _has_state_dict(t):
                raise StateMismatchError(
                    f"{key}: the checkpoint has an object with state here, the state has {t!r:.60}"
                )
            if isinstance(t, torch.optim.Optimizer) and _tree_has_tensor(s[OBJECT]) and not t.state:
                self.initialized.append(t)
                _init_optimizer_state(t, s[OBJECT].get("state") if isinstance(s[OBJECT], dict) else None)
            sd = t.state_dict()
            sub = self.b(s[OBJECT], sd, path, True)

            def finish_object() -> Any:
                # Always through load_state_dict: extra state, hooks, strict key checks and
                # state dicts that hold copies all need it.
                t.load_state_dict(sub())
                return t

            return finish_object
        if isinstance(s, dict) and (DICT in s or not (_MARKERS & s.keys())):
            items = [(k, v) for k, v in s[DICT]] if DICT in s else list(s.items())
            t_map: Mapping[Any, Any] = t if isinstance(t, Mapping) else {}
            saved_keys = {k for k, _ in items}
            if isinstance(t, Mapping) and not in_object:
                only_state = [k for k in t_map if k not in saved_keys]
                # At the top, the state's keys choose what is restored: {"model": m} loads
                # the model of a version that holds more. Below, the shapes must match.
                only_saved = [k for k, _ in items if k not in t_map] if path else []
                if self.strict and (only_state or only_saved):
                    raise StateMismatchError(_key_mismatch(key, only_state, only_saved))
                items = [(k, v) for k, v in items if k in t_map]
            elif isinstance(t, Mapping):
                missing = [k for k in t_map if k not in saved_keys]
                tensor_missing = [k for k in missing if is_tensor_like(t_map[k]) or _has_state_dict(t_map[k])]
                if tensor_missing:
                    raise StateMismatchError(f"{key}: {tensor_missing[:5]} are in the state but not in the checkpoint")
            subs = [(k, self.b(v, t_map.get(k), path + (k,), in_object)) for k, v in items]

            def finish_dict() -> Any:
                if isinstance(t, dict):
                    for k, f in subs:
                        t[k] = f()
                    return t
                return {k: f() for k, f in subs}

            return finish_dict
        if isinstance(s, list) or (isinstance(s, dict) and TUPLE in s):
            items_l: list[Any] = s if isinstance(s, list) else s[TUPLE]
            t_seq: Sequence[Any] | None = t if isinstance(t, (tuple, list)) else None
            if t_seq is not None and len(t_seq) != len(items_l):
                # A list of values takes the saved one whole; one of tensors or objects, filled
                # in place, cannot (inside an object's state_dict(), its load_state_dict judges).
                if not in_object and any(map(_filled_in_place, t_seq)):
                    raise StateMismatchError(
                        f"{key}: the checkpoint has a list of {len(items_l)} here, the state has one of "
                        f"{len(t_seq)} holding tensors or objects"
                    )
                t_seq = None
            subs_l = [
                self.b(v, None if t_seq is None else t_seq[i], path + (i,), in_object) for i, v in enumerate(items_l)
            ]
            as_tuple = isinstance(t, tuple) or (not isinstance(t, list) and not isinstance(s, list))

            def finish_list() -> Any:
                values = [f() for f in subs_l]
                if isinstance(t, list) and t_seq is not None:
                    t[:] = values  # the state's own list, in place
                    return t
                return tuple(values) if as_tuple else values

            return finish_list
        if isinstance(s, dict) and FLOAT in s:
            value = float(s[FLOAT])
            return lambda: value
        return lambda: s


def _key_mismatch(key: KeyPath, only_state: list[Any], only_saved: list[Any]) -> str:
    parts = []
    if only_state:
        parts.append(f"{only_state[:5]} are in the state but not in the checkpoint")
    if only_saved:
        parts.append(f"{only_saved[:5]} are in the checkpoint but not in the state")
    return f"{key}: " + "; ".join(parts) + " (restore(..., strict=False) loads only the keys both have)"


def _what(v: Any) -> str:
    return f"{_kind(v)} ({type(v).__name__})"


def _filled_in_place(v: Any) -> bool:
    """Whether a restore fills `v` (or something in it) in place: a tensor, an object with state."""
    if is_tensor_like(v) or _has_state_dict(v):
        return True
    if isinstance(v, Mapping):
        return any(map(_filled_in_place, v.values()))
    return isinstance(v, (list, tuple)) and any(map(_filled_in_place, v))


def _as_ndarray(filled: Any) -> Any:
    """A saved NumPy array read into a slot that held None: an array again."""
    return filled.numpy() if isinstance(filled, torch.Tensor) else filled


def _into_ndarray(filled: Any, target: np.ndarray) -> np.ndarray:
    """The state's array, read into a tensor view of it, or into a copy (an array that is not
    contiguous) whose values go back into it here."""
    if isinstance(filled, torch.Tensor) and not np.shares_memory(filled.numpy(), target):
        np.copyto(target, filled.numpy().reshape(target.shape))
    return target


def _tree_has_tensor(node: Any) -> bool:
    if isinstance(node, dict):
        return TENSOR in node or any(_tree_has_tensor(v) for v in node.values())
    if isinstance(node, list):
        return any(_tree_has_tensor(v) for v in node)
    return False
