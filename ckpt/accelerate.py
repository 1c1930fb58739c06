"""Hugging Face Accelerate onto ckpt: what `accelerator.save_state` saves, as a ckpt version.

    import ckpt.accelerate
    ck = Checkpointer("/nvme/run1")                                   # every rank
    start = ckpt.accelerate.load_state(accelerator, ck)               # newest intact; None: none
    ...
    ckpt.accelerate.save_state(accelerator, ck, step)                 # async, like ck.save

After `accelerator.prepare(...)` and `accelerator.register_for_checkpointing(...)`, a
version holds what `Accelerator.save_state` writes, and what it leaves out:

- `models`: every prepared model, unwrapped (DDP, torch.compile), so the keys are the
  model's own and a version loads on another world size;
- `optimizers`, `schedulers`: the optimizers and LR schedulers inside accelerate's
  wrappers;
- `custom_objects`: the objects of `register_for_checkpointing`, through their
  `state_dict()` (which must hold tensors, dicts, lists and JSON scalars: nothing is
  pickled);
- `scaler`: the gradient scaler (None without mixed precision that needs one);
- `dataloaders`: per prepared loader and per rank, its epoch counter (`iteration`, which
  accelerate does not save although a seedable sampler is seeded with it), the seedable
  sampler's epoch and seed, the loader's own generator, and with `use_stateful_dataloader=True` the
  StatefulDataLoader's state_dict (the position in the epoch), as JSON: a loader's state
  is the rank's own, and ckpt stores a plain tensor once, as replicated across ranks; with
  the world size, since on another one the shards differ and the epoch starts again;
- `accelerator`: the gradient-accumulation counter `accelerator.step`, whether the save
  was at a window's end (`sync_gradients`: gradients are in no version, so a save inside a
  window is named at save and load), and per rank the RNG states of devices ckpt itself
  does not capture (XPU, MLU, SDAA, MUSA, HPU, Neuron).

Models, optimizers, schedulers, registered objects and loaders are dicts by index ("0",
"1", ...), so that restoring into an accelerator holding another number of them fails
before anything is loaded. Python, NumPy, torch CPU and CUDA RNG states are captured per
rank by the Checkpointer itself (`capture_rng=True`).

Exact mid-epoch resume of a shuffled loader needs a permutation the resumed run can draw
again: `DataLoaderConfiguration(use_seedable_sampler=True)` (epoch e's permutation comes
from seed + e; a plain RandomSampler's comes from a generator state that no longer exists
mid-epoch), and a DataLoader with its own `generator` (otherwise each `iter()` draws a
seed from the global torch RNG, which the resumed run then draws at another point);
save_state logs a warning otherwise. With `use_stateful_dataloader=True` the prepared
loader goes on at the next batch by itself; without it, go on with
`accelerator.skip_first_batches(loader, k)` for the rest of the epoch, calling
`loader.set_epoch(epoch)` at the start of each epoch. A version saved at the last batch of
an epoch goes on at the start of the next one; so the epoch and the batch to go on from
are `divmod(step, len(loader))` when each step consumes one batch, as in accelerate's
examples.

A loader with workers (`num_workers > 0`) seeds them at each `iter()` from its own
generator, whose state is in the version: a dataset that draws random numbers in the
workers (augmentation) draws, in a run resumed at an epoch's end, what this run would
have; in one resumed inside an epoch, other numbers for the rest of that epoch (no state
says how far each worker's RNG had drawn), and the same from the next epoch on.

FSDP, DeepSpeed, Megatron-LM and XLA are not handled here (FSDP: save through DCP with
`ckpt.dcp`); save_state raises NotImplementedError for them.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckpt.store.errors import StateMismatchError

if TYPE_CHECKING:
    from accelerate import Accelerator  # type: ignore[import-untyped]

    from ckpt.checkpointer import Checkpointer

__all__ = ["save_state", "load_state", "accelerator_state"]

log = logging.getLogger("ckpt")

KEYS = ("models", "optimizers", "schedulers", "custom_objects", "scaler", "dataloaders", "accelerator")

# A per-rank tensor in JSON: {"ckpt.accelerate.tensor": {"dtype", "shape", "b64"}}.
_TENSOR = "ckpt.accelerate.tensor"
_ARRAY = "ckpt.accelerate.ndarray"

# RNG of devices ckpt.rng does not capture (it does Python, NumPy, torch CPU and CUDA):
# accelerate's save_accelerator_state saves these too.
_DEVICE_RNG = ("xpu", "mlu", "sdaa", "musa", "hpu", "neuron")

_warned: set[str] = set()

# Gradients are not part of what accelerate (or ckpt) saves.
_MID_ACCUMULATION = (
    "ckpt.accelerate: step %d %s inside a gradient accumulation window (accelerator.sync_gradients is "
    "False): the gradients accumulated since the last optimizer step are not in the version, so %s "
    "optimizer step applies only the rest of the window's; save where accelerator.sync_gradients is True"
)


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# -- JSON encoding of per-rank tensors --------------------------------------------------


def _b64(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def _unb64(d: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(d["dtype"]))
    raw = bytearray(base64.b64decode(str(d["b64"])))
    if not raw:
        return torch.empty([int(s) for s in d["shape"]], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape([int(s) for s in d["shape"]]).clone()


def _to_json(v: Any) -> Any:
    """`v` with every tensor and NumPy array turned into base64 JSON: a loader's state is the
    rank's own, and ckpt stores a plain tensor once, as replicated across ranks."""
    if isinstance(v, torch.Tensor):
        return {_TENSOR: _b64(v)}
    if isinstance(v, np.ndarray):
        return {_ARRAY: {"dtype": v.dtype.str, "shape": list(v.shape), "b64": base64.b64encode(v.tobytes()).decode()}}
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Mapping):
        return {k: _to_json(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_to_json(x) for x in v)
    if isinstance(v, list):
        return [_to_json(x) for x in v]
    return v


def _from_json(v: Any) -> Any:
    if isinstance(v, Mapping):
        if set(v) == {_TENSOR}:
            return _unb64(v[_TENSOR])
        if set(v) == {_ARRAY}:
            a = v[_ARRAY]
            raw = base64.b64decode(str(a["b64"]))
            return np.frombuffer(raw, dtype=np.dtype(a["dtype"])).reshape([int(s) for s in a["shape"]]).copy()
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_from_json(x) for x in v)
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


# -- what accelerate holds --------------------------------------------------------------


def _check_supported(accelerator: Accelerator) -> None:
    from accelerate.utils import DistributedType  # type: ignore[import-untyped]

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        raise NotImplementedError(
            "ckpt.accelerate does not save FSDP models: accelerate saves them through "
            "torch.distributed.checkpoint, which writes to ckpt with ckpt.dcp.StorageWriter"
        )
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise NotImplementedError(f"ckpt.accelerate does not handle {kind}")
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        _warn_once(
            "hooks",
            "ckpt.accelerate: the accelerator's save/load state pre-hooks are not called (they take a directory)",
        )


def _unwrap(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    unwrapped: torch.nn.Module = accelerator.unwrap_model(model, keep_torch_compile=False)
    return unwrapped


def _inner(obj: Any, attr: str) -> Any:
    """The optimizer (scheduler) inside accelerate's wrapper: restore fills the plain one."""
    return getattr(obj, attr, obj)


def _sampler(dl: Any) -> Any:
    get = getattr(dl, "get_sampler", None)
    return get() if callable(get) else None


def _loader_state(accelerator: Accelerator, dl: Any) -> dict[str, Any]:
    from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped]

    sampler = _sampler(dl)
    seedable = isinstance(sampler, SeedableRandomSampler)
    if isinstance(sampler, torch.utils.data.RandomSampler) and not seedable and _in_epoch(accelerator, dl):
        _warn_once(
            "sampler",
            "ckpt.accelerate: a prepared loader shuffles with a RandomSampler whose permutation a resumed run "
            "cannot draw again, so resuming mid-epoch will not be exact; pass "
            "DataLoaderConfiguration(use_seedable_sampler=True) to the Accelerator",
        )
    base = getattr(dl, "base_dataloader", dl)
    if (
        getattr(base, "generator", False) is None
        and _in_epoch(accelerator, dl)
        and not getattr(dl, "end_of_dataloader", False)
    ):
        _warn_once(
            "generator",
            "ckpt.accelerate: a prepared loader has no generator of its own: a resumed run draws its seed from the "
            "global torch RNG at another point than this run did, so resuming mid-epoch will not be exact; pass "
            "generator=torch.Generator().manual_seed(seed) to the DataLoader",
        )
    stateful = _stateful(dl)
    # At the last batch of an epoch (accelerate marks it end_of_dataloader; the loader's
    # state is then "finished"), the loop over the loader is over but for its return, which
    # counts the epoch: save the count it makes, so a resumed run starts the next epoch.
    iteration = int(getattr(dl, "iteration", 0))
    if getattr(dl, "end_of_dataloader", False) and _in_epoch(accelerator, dl):
        iteration += 1
    gen = _generator(dl)
    return {
        "iteration": iteration,
        "sampler": {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)} if seedable else None,
        # Each iter() draws the workers' base seed from it: a resumed run's epochs get the seeds
        # this run's would have (a seedable sampler reseeds it each epoch; the draw comes first).
        "generator": None if gen is None else _to_json(gen.get_state()),
        "state": _to_json(dl.state_dict()) if stateful else None,
        "world": int(accelerator.num_processes),  # the loader's shards: its state is a shard's position
        "mid_epoch": _mid_epoch(accelerator, dl),
    }


def _generator(dl: Any) -> torch.Generator | None:
    """The loader's own CPU generator (DataLoader(generator=...)), if it has one."""
    gen = getattr(getattr(dl, "base_dataloader", dl), "generator", None)
    return gen if isinstance(gen, torch.Generator) and gen.device.type == "cpu" else None


def _spent(state: Any) -> bool:
    """Whether a StatefulDataLoader's saved state is of an epoch's last batch (accelerate
    marks it `_iterator_finished`): the next epoch starts afresh."""
    return isinstance(state, Mapping) and state.get("_iterator_finished") is True


def _stateful(dl: Any) -> bool:
    """Whether a prepared loader saves and loads its own state (use_stateful_dataloader=True)."""
    return bool(getattr(dl, "use_stateful_dataloader", False)) and callable(getattr(dl, "state_dict", None))


def _mid_epoch(accelerator: Accelerator, dl: Any) -> bool:
    """Whether `dl`, or a loader over its dataset made from it (accelerator.skip_first_batches,
    as a resumed epoch iterates), is being iterated short of its last batch."""
    data = getattr(dl, "dataset", None)
    refs = getattr(accelerator.gradient_state, "dataloader_references", [])
    return any(
        (r is dl or (data is not None and getattr(r, "dataset", None) is data))
        and not getattr(r, "end_of_dataloader", False)
        for r in refs
    )


def _in_epoch(accelerator: Accelerator, dl: Any) -> bool:
    """Whether `dl` is being iterated (accelerate's GradientState tracks active loaders)."""
    refs = getattr(accelerator.gradient_state, "dataloader_references", [])
    return any(r is dl for r in refs)


def _load_loader(dl: Any, saved: Mapping[str, Any], world: int, step: int, index: int, *, say: bool) -> None:
    """A loader's saved epoch counter, sampler seed, generator and (saved on `world` ranks:
    each rank's shard is the one it had) its position in the epoch; `say`: log what is not
    carried over."""
    if hasattr(dl, "iteration"):
        dl.iteration = int(saved["iteration"])
    sampler = _sampler(dl)
    if saved.get("sampler") is not None and sampler is not None and hasattr(sampler, "initial_seed"):
        sampler.epoch = int(saved["sampler"]["epoch"])
        sampler.initial_seed = int(saved["sampler"]["initial_seed"])
    gen = _generator(dl)
    if saved.get("generator") is not None and gen is not None:
        gen.set_state(_from_json(saved["generator"]))
    state = saved.get("state")
    if state is None and _stateful(dl) and saved.get("mid_epoch") is not False and say:
        log.warning(
            "ckpt.accelerate: step %d: dataloader %d was saved as a plain loader%s, which keeps no position in "
            "the epoch: this stateful one starts the epoch again from its first batch (its batches so far are "
            "seen again; accelerator.skip_first_batches skips them)",
            step,
            index,
            " inside an epoch" if saved.get("mid_epoch") else "",
        )
    was = saved.get("world")
    if state is not None and isinstance(was, int) and was != world:
        if say:
            log.warning(
                "ckpt.accelerate: step %d: dataloader %d was saved on %d ranks and is loaded on %d, whose shards "
                "differ: its position in the epoch is not carried over, and the epoch starts again from its "
                "first batch (its batches so far are seen again)",
                step,
                index,
                was,
                world,
            )
        state = None
    if _spent(state):
        # Saved at an epoch's last batch: a fresh iterator starts the next epoch as this run's
        # would have. torchdata's resume of a spent epoch makes an iterator for it first, and
        # draws one more base seed from the generator restored above.
        state = None
    if state is not None:
        loaded = _from_json(state)
        dl.load_state_dict(loaded)
        if hasattr(dl, "dl_state_dict"):
            dl.dl_state_dict = loaded  # what state_dict() answers until the loader yields again
    elif _stateful(dl):
        # accelerate made the StatefulDataLoader's first iterator when it prepared the loader
        # (its state_dict() does), with a base seed drawn from the generator as it was then:
        # drop it, so the next iter() makes one from the generator as restored, after
        # set_epoch (a loader with workers draws its first indices when it makes one).
        dl.load_state_dict({})
        base = getattr(dl, "base_dataloader", dl)
        if getattr(base, "next_iter_state", None) is not None:
            base.next_iter_state = None  # (a state loaded before, not yet iterated: {} keeps it)
        if hasattr(dl, "dl_state_dict"):
            dl.dl_state_dict = {}  # (a save before the next batch: a fresh iterator, loaded as such)


def _device_module(name: str) -> Any:
    """torch.<name> (torch.xpu, or a plugin's torch.mlu...) when it has a device; else None."""
    mod = getattr(torch, name, None)
    try:
        return mod if mod is not None and mod.is_available() else None
    except Exception:  # noqa: BLE001 - a backend that cannot answer has no RNG to save
        return None


def _device_rng() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _DEVICE_RNG:
        mod = _device_module(name)
        if mod is not None:
            out[name] = [_b64(s) for s in mod.get_rng_state_all()]
    return out


def _load_device_rng(saved: Mapping[str, Any]) -> None:
    for name, states in saved.items():
        mod = _device_module(name)
        if mod is None:
            log.warning("ckpt.accelerate: the checkpoint has %s RNG state, this process has no %s device", name, name)
            continue
        mod.set_rng_state_all([_unb64(s) for s in states])


def _indexed(items: Any) -> dict[str, Any]:
    """{"0": first, "1": second, ...}: a dict, so that restore checks the count (strict keys)
    before it loads anything, where a list of another length would be passed over."""
    return {str(i): x for i, x in enumerate(items)}


def _objects(accelerator: Accelerator) -> dict[str, Any]:
    """The part of the state restore loads in place, through state_dict()/load_state_dict()."""
    return {
        "models": _indexed(_unwrap(accelerator, m) for m in accelerator._models),
        "optimizers": _indexed(_inner(o, "optimizer") for o in accelerator._optimizers),
        "schedulers": _indexed(_inner(s, "scheduler") for s in accelerator._schedulers),
        "custom_objects": _indexed(accelerator._custom_objects),
        "scaler": accelerator.scaler,
    }


def accelerator_state(accelerator: Accelerator) -> dict[str, Any]:
    """The state save_state() saves (its top-level keys are `KEYS`): live objects for
    models, optimizers, schedulers, registered objects and the scaler (each a dict by
    index: "0", "1", ...), JSON for the rest."""
    _check_supported(accelerator)
    return {
        **_objects(accelerator),
        "dataloaders": _indexed(_loader_state(accelerator, dl) for dl in accelerator._dataloaders),
        "accelerator": {
            "step": int(accelerator.step),
            "device_rng": _device_rng(),
            "synced": bool(accelerator.sync_gradients),  # False: inside a gradient accumulation window
        },
    }


def save_state(accelerator: Accelerator, checkpointer: Checkpointer, step: int, **save_kwargs: Any) -> bool:
    """Save what `accelerator.save_state()` would as version `step` of `checkpointer`.

    Call it on every rank, as `Checkpointer.save` (it is that, on `accelerator_state()`):
    it returns once the state is staged and the version commits in the background;
    `save_kwargs` (overwrite, milestone, only) go to `Checkpointer.save`. Returns its result.
    """
    state = accelerator_state(accelerator)
    if not state["accelerator"]["synced"] and checkpointer.rank == 0:
        log.warning(_MID_ACCUMULATION, step, "is saved", "a resumed run's next")
    return checkpointer.save(step, state, **save_kwargs)


def load_state(
    accelerator: Accelerator, checkpointer: Checkpointer, step: int | None = None, **restore_kwargs: Any
) -> int | None:
    """Load the newest intact version (or `step`) saved by save_state() into the prepared
    objects of `accelerator`, in place, on every rank; returns the step, or None (and
    changes nothing) when nothing is committed.

    The accelerator must hold what it held when saving: as many prepared models,
    optimizers, schedulers and loaders, the same registered objects. `restore_kwargs`
    (strict, if_incomplete) go to `Checkpointer.restore`. A loader saved as a stateful one
    (use_stateful_dataloader=True) that this accelerator's cannot take is
    StateMismatchError, raised before any loader or accelerator.step changes.
    """
    _check_supported(accelerator)
    loaders = accelerator._dataloaders
    state: dict[str, Any] = {
        **_objects(accelerator),
        # JSON of another shape than a fresh loader's: taken as saved (None takes anything), applied below
        "dataloaders": _indexed(None for _ in loaders),
        "accelerator": None,
    }
    found = checkpointer.restore(state, step, **restore_kwargs)
    if found is None:
        return None
    # strict=False: a slot the version does not hold (a loader added since; a params-only
    # version's loaders and accelerator) stays None, and its object as it is.
    held = state["dataloaders"] if isinstance(state["dataloaders"], dict) else {}
    saved = [held.get(str(i)) for i in range(len(loaders))]
    for i, (dl, mine) in enumerate(zip(loaders, saved)):  # every loader checked before any is changed
        if mine is not None and mine.get("state") is not None and not _spent(mine["state"]) and not _stateful(dl):
            raise StateMismatchError(
                f"step {found}: dataloader {i} was saved as a stateful loader (accelerate's "
                "DataLoaderConfiguration(use_stateful_dataloader=True)), and this accelerator's cannot "
                "take its state; prepare it with use_stateful_dataloader=True (the models, optimizers "
                "and schedulers are loaded, the loaders and accelerator.step are not)"
            )
    for i, (dl, mine) in enumerate(zip(loaders, saved)):
        if mine is not None:
            _load_loader(dl, mine, int(accelerator.num_processes), found, i, say=checkpointer.rank == 0)
    extra = state["accelerator"]
    if extra is not None:
        accelerator.step = int(extra["step"])
        _load_device_rng(extra.get("device_rng") or {})
        if extra.get("synced") is False and checkpointer.rank == 0:
            log.warning(_MID_ACCUMULATION, found, "was saved", "the resumed run's next")
    return found
