"""Deferred staging (CheckpointerConfig.deferred_staging): save() returns before the copy.

The commit thread copies the tensors into the staging buffer ahead of the writes, while
the training loop goes on with its forward and backward passes, which only read them.
Until the copy ends the saved tensors must not change in place, and three things hold
that line:

- every torch.optim.Optimizer in the state (or passed to Checkpointer.guard) gets a step
  pre-hook that waits for the copy, so optimizer.step() cannot update under it;
- Checkpointer.wait_staged(), for any other in-place change (an EMA, a manual update);
- each tensor's version counter, read in save() and again after the copy: a tensor changed
  in place in between fails the save with StagingRaceError, so a torn copy never commits.

Module buffers (forward changes them: BatchNorm statistics) are still copied before save()
returns, as are NumPy arrays and inference tensors, whose changes no counter records.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from store.errors import StagingRaceError

__all__ = ["StagingGate", "find_objects", "buffer_storages", "can_defer", "Versions"]


class StagingGate:
    """Closed from a deferred save() until its copy has ended; optimizer steps wait on it."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()
        self.waited_s = 0.0  # total time training spent waiting here

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
        waited = time.perf_counter() - t
        self.waited_s += waited
        return waited

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make each optimizer's step() wait for the copy (one hook per optimizer)."""
        def before_step(*_: Any) -> None:
            self.wait()

        for opt in optimizers:
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(before_step)

    def remove_hooks(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()


def find_objects(state: Mapping[str, Any]) -> tuple[list[torch.optim.Optimizer], list[torch.nn.Module]]:
    """The optimizers and modules held anywhere in the state's dicts, lists and tuples."""
    optimizers: list[torch.optim.Optimizer] = []
    modules: list[torch.nn.Module] = []
    stack: list[Any] = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.optim.Optimizer):
            optimizers.append(v)
        elif isinstance(v, torch.nn.Module):
            modules.append(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return optimizers, modules


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def buffer_storages(modules: Sequence[torch.nn.Module]) -> set[tuple[str, int]]:
    """Storages of the modules' buffers: tensors forward may change in place."""
    out = set()
    for m in modules:
        for b in m.buffers():
            local = getattr(b, "_local_tensor", b)  # a DTensor buffer: its local storage
            out.add(_storage_key(local))
    return out


def can_defer(value: Any, data: torch.Tensor, buffers: set[tuple[str, int]]) -> bool:
    """Whether a leaf may be copied after save() returns: a change to it is detectable and
    not made by forward."""
    if isinstance(value, np.ndarray) or data.is_inference():
        return False
    return _storage_key(data) not in buffers


class Versions:
    """The version counters of the deferred tensors as save() saw them."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._seen = [(key, t, t._version) for key, t in named]

    def check(self) -> None:
        changed = [key for key, t, v in self._seen if t._version != v]
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise StagingRaceError(
                f"{shown} changed in place while a deferred save copied it; call "
                "Checkpointer.wait_staged() (or guard the optimizer) before changing saved tensors"
            )
