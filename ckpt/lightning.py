"""ckpt for PyTorch Lightning: one callback saves the whole training state and resumes it.

    trainer = L.Trainer(..., callbacks=[CkptCallback("/nvme/ckpt/run1", every_n_steps=100)])
    trainer.fit(model)  # resumes from the newest intact version under the root, if any

What is saved is Lightning's own checkpoint, the dict `Trainer.save_checkpoint` would
write (`_CheckpointConnector.dump_checkpoint()`: the module's state dict, optimizers, LR
schedulers, the precision plugin, loop progress, callback states, the datamodule's state,
hyperparameters and whatever `on_save_checkpoint` hooks add), under the single top-level
key "lightning" of a ckpt version, with the RNG of every rank (ckpt captures it). Nothing
is pickled: a value that is not a tensor, NumPy array, dict, list, tuple or JSON scalar
raises `UnsupportedStateError` naming its place in the checkpoint. NumPy scalars become
Python scalars.

The data position is the loop's own: Lightning stores the `state_dict()` of every train
loader that has one (torchdata's `StatefulDataLoader`) with its fit loop, so a run
restored mid-epoch goes on at the very next batch. A plain `DataLoader` has none, and a
resumed run would start that epoch's data over (Lightning warns then, and so does this
callback when it saves). Give the StatefulDataLoader `shuffle=True` but no `generator=`
(its RandomSampler then seeds a generator of its own, whose state the loader saves): a
loader's generator also draws the loader's base seed, which the saved state misses, so a
resumed run would draw another order from the next epoch on. For a seeded order pass
`sampler=torchdata.stateful_dataloader.sampler.RandomSampler(ds, generator=g)`.

The version is read in `setup` and handed to Lightning as the checkpoint `fit(ckpt_path=...)`
would have loaded, so Lightning restores it in its own order: the model, datamodule and
callbacks before any `on_fit_start` hook, the training state (loops, optimizers,
schedulers, precision plugin) after them, as callbacks that rebuild the optimizer in
`on_fit_start` (`BackboneFinetuning`) need. The newest ckpt version takes precedence over a
`ckpt_path`. The module's state dict keeps its `_metadata` (each module's `_version`, for
its `_load_from_state_dict`), saved with the version. The RNG state restored with the
version is set again in `on_train_start`, after the loader was built (building it may draw
from the global RNG, as `DataLoader.__iter__` does), so the first batch after the restore
draws what the uninterrupted run drew. A second `fit` of the same Trainer goes on from the
Trainer's own state, as Lightning's does, and restores nothing.

Saving happens in `on_train_batch_end` right after an optimizer step, once `global_step`
has reached a multiple of `every_n_steps`; the version's step is `global_step`. The callback
runs that hook after every other callback's (it moves itself to the end of the Trainer's
list in `setup`, as Lightning does with its own checkpoint callbacks), so what they do at
that batch's end is in the version; the LightningModule's own `on_train_batch_end` runs
after every callback's, so state it changes there (an EMA of the weights) is saved one step
behind, as with Lightning's `ModelCheckpoint`: update it in `on_before_zero_grad` or
`optimizer_step` instead. A save due
on a batch after which the epoch ends or validation runs waits for the next optimizer
step: Lightning resumes a loop saved there by skipping that validation, or (at an epoch's
end) by running one more epoch without data, since the loader's restored iterator is
exhausted. The Checkpointer is opened in `on_fit_start` (on every rank: it is collective)
and closed at the end of fit, which waits for the last save; on an exception it is closed
too, and an error of the pending save is logged rather than raised over the exception.

With `preemption_signals` among the Checkpointer options, `on_train_batch_end` asks
`reached_preemption()` after every batch (on every rank: it is collective); once the ranks
agree, the callback saves the first state Lightning resumes exactly (the rule above, and
right after an optimizer step), waits for the commit and sets `trainer.should_stop`: fit
returns. From on_train_start, ckpt's handler keeps the signal from Lightning's, which
under DDP broadcasts from inside the handler, so that a notice reaching some ranks only
leaves the ranks' collectives mismatched (with Lightning alone too: DDP's next gradient
all-reduce waits for the group's timeout).

Strategies: single-device and DDP (`SingleDeviceStrategy`, `DDPStrategy`), whose module and
optimizer states are whole tensors, alike on every rank: ckpt writes each once (a tensor
elsewhere in the checkpoint is taken to be alike on every rank too, as Lightning, which
saves rank 0's checkpoint, takes it; other values are saved and restored per rank). Under
DDP, give the StatefulDataLoader a `ckpt.DistributedSampler`: the DistributedSampler
Lightning puts in keeps no state, and the loader's restored iterator is built before
Lightning sets the sampler's epoch. On another world size (pass the sampler
`even_after_reshard=True`: DDP steps are collective), the resumed epoch's batch count
(`batch_idx`) starts over from 0, since the saved one counts batches of the old world size.
Other strategies (FSDP, DeepSpeed, ModelParallel) are refused in `setup`; for FSDP, save
through DCP with `ckpt.dcp`. So is an optimizer whose state_dict() is consolidated on one
rank (`ZeroRedundancyOptimizer`, in `on_fit_start`): the other ranks' would be empty.
"""

from __future__ import annotations

import logging
import signal
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
from lightning.pytorch.utilities.types import STEP_OUTPUT

from ckpt._roots import RootSpec
from ckpt.checkpointer import Checkpointer
from ckpt.rng import capture_rng, restore_rng
from ckpt.store.errors import CkptError, UnsupportedStateError

__all__ = ["CkptCallback", "KEY"]

log = logging.getLogger("ckpt")

KEY = "lightning"
"""The top-level key of a ckpt version under which the Lightning checkpoint is saved."""

_KEY_TYPES = (str, int, bool, type(None))


class CkptCallback(Callback):
    """Save the whole Lightning training state with ckpt every `every_n_steps` optimizer
    steps, and restore the newest intact version at the start of `fit`.

    `root` and `checkpointer_options` go to `ckpt.Checkpointer` (`keep_last=3`,
    `replicate_to="s3://..."`, `tiers=[...]`, ...). After `fit` started, `checkpointer`
    is the open Checkpointer and `restored_step` the step restored (None: a fresh start).
    A strategy that spawns its processes (`ddp_spawn`) trains with copies of the callback:
    these attributes are set on the copies, in the processes that train, not on this one.
    """

    def __init__(self, root: RootSpec, *, every_n_steps: int, **checkpointer_options: Any) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, not {every_n_steps!r}")
        self.root = root
        self.every_n_steps = every_n_steps
        self.checkpointer_options = dict(checkpointer_options)
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self._last_saved: int | None = None  # the global_step of the last save (or the restore)
        self._seen_step = 0  # global_step at the last on_train_batch_end
        self._due = False  # a save is due (every_n_steps passed since the last one)
        self._postponed = 0  # steps the due save has waited (the batch ended an epoch or validated)
        self._rng_after_restore: dict[str, Any] | None = None
        self._warned_loader = False
        self._world_size = 0  # the trainer's, saved with each version (state_dict)
        self._saved_world_size: int | None = None  # that of the version restored, if it says

    # -- the hooks, in the order fit calls them --------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        # DeepSpeed derives from DDPStrategy; it and FSDP restore only after their own setup.
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.restore_checkpoint_after_setup:
            raise TypeError(
                f"CkptCallback supports the single-device and DDP strategies, not {type(strategy).__name__}: "
                "it saves whole state dicts; for FSDP, save through DCP with ckpt.dcp.StorageWriter"
            )
        others = [c for c in trainer.callbacks if isinstance(c, CkptCallback) and c is not self]  # type: ignore[attr-defined]
        if others:
            # Each would hand Lightning its own version to restore, and the last one's setup
            # would win (no version there: a fresh start over the other's versions).
            raise ValueError(
                f"a Trainer takes one CkptCallback; this one has {len(others) + 1} (roots "
                f"{[str(c.root) for c in [*others, self]]}): give one callback more places with "
                "replicate_to=, tiers= or peer_copies="
            )
        # Last in the list, as Lightning puts its own Checkpoint callbacks: the others'
        # on_train_batch_end changes are then in the version. (A new list: the list of this
        # setup call goes on as it was.)
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]  # type: ignore[attr-defined]
        _unhook(trainer)
        self._close()  # a Trainer that fits again opens a fresh one
        self.restored_step = None
        self._last_saved = None
        self._rng_after_restore = None
        self._due, self._postponed = False, 0
        self._world_size, self._saved_world_size = trainer.world_size, None
        self.checkpointer = ck = Checkpointer(self.root, **self.checkpointer_options)
        if trainer.global_step:  # the same Trainer fits again: it goes on from its own state
            log.info("rank %d: the Trainer is at global_step %d: nothing restored", ck.rank, trainer.global_step)
            return
        state: dict[str, Any] = {KEY: None}  # None takes whatever the version holds there
        step = ck.restore(state)
        if step is None:
            return
        if ck.config.capture_rng:
            self._rng_after_restore = capture_rng()  # what restore() set: set again in on_train_start
        checkpoint = state[KEY]
        if not isinstance(checkpoint, dict):
            raise UnsupportedStateError(f"step {step} under {ck.root}: {KEY!r} is not a Lightning checkpoint")
        checkpoint = _pl_migrate_checkpoint(checkpoint)
        _with_metadata(checkpoint, pl_module)
        _hook(trainer, checkpoint, step)
        self.restored_step = self._last_saved = step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _unhook(trainer) and self.restored_step is not None:
            # Lightning calls resume_start before the strategy's setup; a Lightning that no
            # longer does would otherwise start from scratch with the version read.
            raise CkptError(
                f"CkptCallback: Lightning {getattr(pl, '__version__', '')} did not call its checkpoint connector's "
                f"resume_start after the setup hooks, so step {self.restored_step} read from {self.root} "
                "could not be handed to it: this Lightning version is not supported"
            )
        for opt in trainer.optimizers:
            if callable(getattr(opt, "consolidate_state_dict", None)):
                raise TypeError(
                    f"CkptCallback saves each rank's optimizer state_dict(); that of {type(opt).__name__} is "
                    "consolidated on one rank (empty on the others), so a resume would lose it"
                )

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self._world_size} if self._world_size else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_world_size = state_dict.get("world_size")

    def _resharded(self, trainer: pl.Trainer) -> bool:
        """Whether the version restored was saved at another world size (versions saved
        before the callback's state held it do not say)."""
        return self._saved_world_size is not None and self._saved_world_size != trainer.world_size

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored the training state (ours, or fit(ckpt_path=...)'s).
        self._seen_step = trainer.global_step
        if self.restored_step is not None:
            if self._resharded(trainer):
                _count_epoch_from_restore(trainer)
            rank = self.checkpointer.rank if self.checkpointer is not None else 0
            log.info("rank %d: resumed from step %d (global_step %d)", rank, self.restored_step, trainer.global_step)
        if self.checkpointer is not None:
            # Lightning installed its SIGTERM handler after on_fit_start, over ckpt's. Under
            # DDP that handler broadcasts on the default group from inside the handler, so a
            # notice reaching some ranks only leaves the ranks' collectives mismatched (DDP's
            # gradient all-reduce waits until its timeout). ckpt's handler goes back on top
            # and keeps the notice: the ranks agree on it in on_train_batch_end.
            self.checkpointer.take_over_signal(signal.SIGTERM)  # not SIGUSR1: Lightning's requeues a SLURM job
        if self._rng_after_restore is not None:
            restore_rng(self._rng_after_restore)
            self._rng_after_restore = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        before, self._seen_step = self._seen_step, step
        if self.checkpointer is not None and self.checkpointer.reached_preemption():  # every rank, every batch
            self._save_on_preemption(trainer, stepped=step != before)
            return
        if step == before:  # accumulating gradients: only the state right after an optimizer step is saved
            return
        if step // self.every_n_steps > before // self.every_n_steps:  # a multiple passed (several optimizers)
            self._due = True
        if not self._due or step == self._last_saved:
            return
        if _loop_goes_on_after_batch(trainer):
            # Lightning resumes a state saved here without what follows this batch: it skips
            # the validation due now and runs the next epoch without data (the loader's
            # restored iterator is exhausted). So this save waits for the next optimizer step.
            self._postponed += 1
            if self._postponed == self.every_n_steps:
                rank_zero_warn(
                    f"CkptCallback: no save for {self._postponed} steps: every step ended an epoch or validated"
                )
            return
        self.save(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.close()  # waits for the last save and raises its error

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        _unhook(trainer)
        self._close()

    # -- saving ----------------------------------------------------------------------

    def save(self, trainer: pl.Trainer) -> bool:
        """Save the trainer's state now, as version `trainer.global_step` (on every rank, together);
        False when skipped (`if_busy="skip"` and a save in flight)."""
        ck = self.checkpointer
        if ck is None:
            raise RuntimeError("CkptCallback.save() outside fit: the Checkpointer opens in on_fit_start")
        step = trainer.global_step
        self._check_loaders(trainer)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        problems: list[str] = []
        plain = _plain(checkpoint, (), problems)
        versions = _module_versions(checkpoint.get("state_dict"))
        if versions is not None:
            plain[_METADATA] = versions
        # Every rank learns whether one failed before any raises: ck.save() is collective.
        if trainer.strategy.reduce_boolean_decision(bool(problems), all=False):
            raise UnsupportedStateError(
                "CkptCallback: the Lightning checkpoint holds values ckpt cannot save without pickling: "
                + ("; ".join(problems) if problems else "on another rank (see its error)")
            )
        # A run that went back to an older version (a newer one damaged) saves that step anew.
        saved = ck.save(step, {KEY: plain}, overwrite=True)
        if saved:  # else skipped (if_busy="skip"): still due
            self._last_saved, self._due, self._postponed = step, False, 0
        return saved

    def _save_on_preemption(self, trainer: pl.Trainer, *, stepped: bool) -> None:
        """The ranks agreed on a preemption notice (`preemption_signals`): save the first state
        Lightning resumes exactly (right after an optimizer step, with neither an epoch's end
        nor validation due), wait for its commit and stop fit. Until then Lightning's own stop
        on SIGTERM, due right after this batch, is held off."""
        ck = self.checkpointer
        assert ck is not None
        try:
            ck.wait()  # whether the last save committed: if it failed, its step is saved again
        except Exception:  # logged: the state now is what must be committed
            log.exception("rank %d: the save in flight failed; the save on preemption goes on", ck.rank)
            self._last_saved = None
        if trainer.global_step != self._last_saved:
            if not stepped or _loop_goes_on_after_batch(trainer):
                trainer._signal_connector.received_sigterm = False
                return
            self.save(trainer)  # after the save in flight, even a failed one (Checkpointer._final_save)
        ck.wait()
        trainer.should_stop = True

    def _check_loaders(self, trainer: pl.Trainer) -> None:
        """Warn once (rank 0) about train loaders whose position a resumed run cannot find again."""
        if self._warned_loader:
            return
        self._warned_loader = True
        combined = trainer.fit_loop._combined_loader
        for dl in [] if combined is None else combined.flattened:
            sampler = getattr(dl, "sampler", None)
            if not _stateful(dl):
                rank_zero_warn(
                    f"CkptCallback: the train loader ({type(dl).__name__}) has no state_dict(): a run resumed "
                    "mid-epoch starts the epoch's data over; use torchdata.stateful_dataloader.StatefulDataLoader"
                )
            elif trainer.world_size > 1 and sampler is not None and not _stateful(sampler):
                # Lightning's DistributedSampler(Wrapper) keeps no state, and the loader's restored
                # iterator is built before Lightning sets the sampler's epoch.
                rank_zero_warn(
                    f"CkptCallback: the train loader's sampler ({type(sampler).__name__}) has no state_dict(): a "
                    "run resumed mid-epoch may draw another order; give the loader a ckpt.DistributedSampler"
                )

    def _close(self) -> None:
        ck, self.checkpointer = self.checkpointer, None
        if ck is None:
            return
        try:
            ck.close()
        except Exception:
            log.exception("rank %d: a pending ckpt save failed while fit was interrupted", ck.rank)


_METADATA = "ckpt_state_dict_metadata"  # the module state dict's _metadata, in the saved checkpoint


def _module_versions(state_dict: Any) -> dict[str, dict[str, Any]] | None:
    """The `_metadata` of a module's state dict (each submodule's `_version`, which its
    `_load_from_state_dict` reads to convert older layouts), as plain values."""
    meta = getattr(state_dict, "_metadata", None)
    if not isinstance(meta, Mapping):
        return None
    return {
        str(prefix): {str(k): v for k, v in entry.items() if isinstance(v, (bool, int, float, str, type(None)))}
        for prefix, entry in meta.items()
        if isinstance(entry, Mapping)
    }


def _with_metadata(checkpoint: dict[str, Any], pl_module: pl.LightningModule) -> None:
    """Give the restored state dict its `_metadata` again: without it every module reads its
    version as None and converts the current layout as an old one. Versions saved before it
    was kept take the live module's (the code resuming is the code that saved)."""
    versions = checkpoint.pop(_METADATA, None)
    state_dict = checkpoint.get("state_dict")
    if not isinstance(state_dict, dict):
        return
    if not isinstance(versions, dict):
        versions = _module_versions(pl_module.state_dict(keep_vars=True))
    restored = OrderedDict(state_dict)
    restored._metadata = OrderedDict(versions or {})  # type: ignore[attr-defined]
    checkpoint["state_dict"] = restored


def _hook(trainer: pl.Trainer, checkpoint: dict[str, Any], step: int) -> None:
    """Make the restore Lightning runs after the setup hooks (`resume_start`, for a
    `fit(ckpt_path=...)` the file's) take this checkpoint: Lightning then restores the
    model, datamodule and callbacks, and after every on_fit_start hook the training state,
    in its own order. Called once, it is taken off again."""
    connector = trainer._checkpoint_connector

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        _unhook(trainer)
        if checkpoint_path:
            rank_zero_warn(f"CkptCallback: ckpt step {step} is restored instead of fit(ckpt_path={checkpoint_path!r})")
        connector._ckpt_path = None  # (resume_end would say the file was restored)
        connector._loaded_checkpoint = checkpoint

    connector.resume_start = resume_start  # type: ignore[method-assign]


def _unhook(trainer: pl.Trainer) -> bool:
    """Whether the hook was still there (Lightning never called it)."""
    return trainer._checkpoint_connector.__dict__.pop("resume_start", None) is not None


def _count_epoch_from_restore(trainer: pl.Trainer) -> None:
    """Count the current epoch's batches from the restore on, as Lightning counts a new epoch's.

    The restored count is in batches of the world size that saved; the loader (its
    ckpt.DistributedSampler) yields the rest of the epoch split over this world size, and
    its len() is an epoch at this one. Lightning ends an epoch once its count reaches len():
    with the old count that would cut the rest short (on more ranks) or, at an old count
    beyond len(), start the epoch's count over anyway. The version was saved in
    on_train_batch_end, where completed is one behind the others: Lightning completes it on
    the restart."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    done = current.ready
    for counter in ("ready", "started", "processed", "completed"):
        setattr(current, counter, getattr(current, counter) - done)


def _loop_goes_on_after_batch(trainer: pl.Trainer) -> bool:
    """Whether the training epoch ends or validation runs after the current batch (on_train_batch_end)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if epoch_loop._num_ready_batches_reached():
        return True
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and epoch_loop._should_check_val_fx(fetcher)


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _where(path: tuple[Any, ...]) -> str:
    return "checkpoint" + "".join(f"[{k!r}]" for k in path)


def _hint(path: tuple[Any, ...]) -> str:
    top = path[0] if path else None
    if top in ("hyper_parameters", "datamodule_hyper_parameters", "hparams_type", "datamodule_hparams_type"):
        return (
            "pass plain values to save_hyperparameters(), or leave this one out with save_hyperparameters(ignore=...)"
        )
    if top == "callbacks":
        return "make the callback's state_dict() return tensors, dicts, lists and JSON scalars"
    if top in ("state_dict", "optimizer_states", "lr_schedulers", "loops"):
        return "ckpt saves tensors, NumPy arrays, dicts, lists, tuples and JSON scalars"
    return "store it from on_save_checkpoint as tensors, dicts, lists and JSON scalars"


def _plain(value: Any, path: tuple[Any, ...], problems: list[str]) -> Any:
    """The checkpoint as ckpt saves it without pickling: tensors, NumPy arrays, dicts with
    str/int/bool/None keys, lists, tuples and JSON scalars (NumPy scalars become Python
    ones). Each other value is named in `problems` (and left in place)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if not isinstance(k, _KEY_TYPES):
                problems.append(f"{_where(path)}: a key of type {type(k).__qualname__} ({k!r:.60}); {_hint(path)}")
                continue
            out[k] = _plain(v, (*path, k), problems)
        return out
    if isinstance(value, tuple):
        return tuple(_plain(v, (*path, i), problems) for i, v in enumerate(value))
    if isinstance(value, list):
        return [_plain(v, (*path, i), problems) for i, v in enumerate(value)]
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    problems.append(f"{_where(path)}: a {kind}; {_hint(path)}")
    return value
