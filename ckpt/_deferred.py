"""Deferred staging (CheckpointerConfig.deferred_staging): save() returns before the copy.

Only tensors that a guarded optimizer owns are deferred: the parameters and the state
(moments, step counts) of every torch.optim.Optimizer in the state or passed to
Checkpointer.guard. Between two steps nothing else changes them, and each such optimizer
gets a step pre-hook that waits for the copy. The commit thread makes that copy ahead of
the writes while the training loop runs its forward and backward passes. Everything else
(buffers, which forward changes; NumPy arrays; tensors of unguarded optimizers, whose
fused kernels bump no version counter) is copied before save() returns.

As a backstop, the version counters of the deferred tensors (and of their DTensor
wrappers, which in-place DTensor ops bump instead) are read in save() and again after the
copy: a change in between that did not wait, e.g. in place by hand, fails the save with
StagingRaceError rather than commit a torn copy. Checkpointer.wait_staged() is the wait.
Writes that bump no counter (through `.data`, NumPy views, collectives) are not caught:
the README says so.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from ckpt._keys import KeyPath
from ckpt._tensors import _value_of
from ckpt.store.errors import StagingRaceError

__all__ = ["StagingGate", "StorageKey", "find_optimizers", "deferrable_leaves", "Versions"]


class StagingGate:
    """Closed from a deferred save() until its copy has ended; optimizer steps wait on it."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()
        self._guarded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # by Checkpointer.guard

    def close(self) -> None:
        self._idle.clear()

    def open(self) -> None:
        self._idle.set()

    def wait(self) -> float:
        """Block until no copy is in flight; the seconds waited."""
        if self._idle.is_set():
            return 0.0
        t = time.perf_counter()
        self._idle.wait()
        return time.perf_counter() - t

    def hook(self, optimizers: Iterable[Any]) -> list[torch.optim.Optimizer]:
        """Make each optimizer's step() wait for the copy (one hook per optimizer); the ones
        hooked. A wrapper is unwrapped to the optimizer that steps (`.optimizer`, `.optim`);
        one with no hookable optimizer inside is left alone, so its tensors are not deferred."""

        def before_step(*_: Any) -> None:
            self.wait()

        out = []
        for opt in filter(None, map(_hookable, optimizers)):
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(before_step)
            out.append(opt)
        return out

    def guard(self, optimizers: Iterable[Any]) -> None:
        """Checkpointer.guard: hooked now, and owners of what they hold at every later save."""
        self._guarded.update(self.hook(optimizers))

    def owned_storages(self, in_state: Iterable[Any]) -> set[StorageKey]:
        """Storages of the parameters and state tensors of the optimizers in this save's state
        and of those passed to guard(): what may be deferred. Not of an optimizer merely
        hooked by an earlier save: the training loop may have replaced it since. Found again
        at every save: a parameter's storage may have been swapped (`p.data = ...`)."""
        out: set[StorageKey] = set()
        for opt in [*self.hook(in_state), *self._guarded]:
            tensors = [p for group in opt.param_groups for p in group["params"]]
            tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            local = [getattr(t, "_local_tensor", t) for t in tensors if t.numel()]
            if not set(map(type, local)) <= _PLAIN:  # a wrapper's value is saved in its place
                local = [_value_of(t) for t in local]
            out.update(_storage_keys(local))
        return out

    def remove_hooks(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()
        self._guarded.clear()


def _hookable(opt: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose step() runs the step pre-hooks: `opt`, or the one it wraps.

    Wrappers that subclass Optimizer without calling its __init__ (accelerate's
    AcceleratedOptimizer, torch's PostLocalSGDOptimizer) have no hooks of their own."""
    for _ in range(8):  # wrappers of wrappers, not a cycle
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks"):
            return opt
        opt = getattr(opt, "optimizer", None) or getattr(opt, "optim", None)
        if opt is None:
            return None
    return None


def find_optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers held anywhere in the state's dicts, lists and tuples."""
    found: list[torch.optim.Optimizer] = []
    stack: list[Any] = [state]
    while stack:
        v = stack.pop()
        if type(v) is dict:  # the common nodes first: this walks every leaf at every save
            stack.extend(v.values())
        elif isinstance(v, torch.Tensor):
            continue
        elif isinstance(v, torch.optim.Optimizer):
            found.append(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return found


StorageKey = tuple[torch.device, int]  # a storage's device and address

_DEVICE = operator.attrgetter("device")  # (the device itself: str() costs ~0.5 us)


_STORAGE = operator.methodcaller("untyped_storage")  # (a method call: a subclass's override counts)
_ADDRESS = operator.methodcaller("data_ptr")


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _storage_keys(tensors: Sequence[torch.Tensor]) -> Iterator[StorageKey]:
    """Each tensor's StorageKey, in C loops (thousands of tensors at every save); none for a
    subclass wrapping other tensors with no memory of its own (saved as what it wraps, or
    refused: ckpt._tensors), whose storage cannot be asked for."""
    if not set(map(type, tensors)) <= _PLAIN:
        tensors = [t for t in tensors if type(t) in _PLAIN or t.data_ptr()]
    return zip(map(_DEVICE, tensors), map(_ADDRESS, map(_STORAGE, tensors)))


def deferrable_leaves(values: Sequence[Any], data: Sequence[torch.Tensor], owned: set[StorageKey]) -> tuple[int, ...]:
    """The places of the leaves (`values`, each with its local tensor in `data`) whose copy
    may come after save() returns: a guarded optimizer owns their storage (`owned`), and
    they are neither NumPy arrays nor inference tensors."""
    if not owned:
        return ()
    hits = [i for i, key in enumerate(_storage_keys(data)) if key in owned]
    return tuple(i for i in hits if not isinstance(values[i], np.ndarray) and not data[i].is_inference())


_VERSION = operator.attrgetter("_version")


class Versions:
    """The version counters of the deferred tensors (and of the objects they were taken
    from: a DTensor's in-place ops bump its own counter, not its local tensor's), each with
    its leaf's key path (a tuple, rendered only in the error)."""

    def __init__(self, paths: Sequence[tuple[Any, ...]], tensors: Sequence[torch.Tensor]) -> None:
        self._paths, self._tensors = paths, tensors
        self._seen = list(map(_VERSION, tensors))

    def check(self) -> None:
        now = list(map(_VERSION, self._tensors))
        if now == self._seen:
            return
        changed = list(dict.fromkeys(p for p, v, was in zip(self._paths, now, self._seen) if v != was))
        shown = ", ".join(str(KeyPath(p)) for p in changed[:3])
        shown += f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise StagingRaceError(
            f"{shown} changed in place while a deferred save copied it; call "
            "Checkpointer.wait_staged() (or guard the optimizer) before changing saved tensors"
        )
