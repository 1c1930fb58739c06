"""CkptCallback in Lightning's order: the version restored as `fit(ckpt_path=...)`'s file is
(model and callbacks before every on_fit_start, the training state after them), saved after
every other callback's batch end, with the module state dict's `_metadata`; a second fit of
one Trainer goes on from its own state; an optimizer consolidated on one rank is refused.
Real Lightning on one CPU process."""

from __future__ import annotations

import os
import signal
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch import nn

import ckpt
from ckpt.lightning import KEY, CkptCallback
from tests._states import assert_bitwise
from tests.ckpt.test_lightning import Interrupt, InterruptAt, Net, _params, _quiet, _steps, _trainer


class Backbone(Net):
    """A backbone BackboneFinetuning keeps frozen for the first epoch (10 steps), then adds
    to the optimizer as a second param group."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(6, 16)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(torch.relu(self.backbone(x))), y)
        self.losses.append((self.trainer.global_step, self.current_epoch, batch_idx, loss.item()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


def _backbone_fit(
    root: Path | None, seed: int, *, ckpt_first: bool = True, stop: int | None = None, **fit: Any
) -> Backbone:
    """A fit with BackboneFinetuning and, given a root, CkptCallback (every 6 steps, listed
    before or after it); without one, Lightning's own ModelCheckpoint at step 12 when
    stopped, for a resume with `fit(ckpt_path=...)`."""
    _quiet()
    torch.manual_seed(seed)
    model = Backbone()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    callbacks: list[pl.Callback] = [finetuning]
    options: dict[str, Any] = {}
    if root is not None:
        mine = CkptCallback(str(root), every_n_steps=6)
        callbacks = [mine, finetuning] if ckpt_first else [finetuning, mine]
    elif stop is not None:
        callbacks.append(ModelCheckpoint(dirpath=fit.pop("dirpath"), every_n_train_steps=12, save_top_k=-1))
        options["enable_checkpointing"] = True
    if stop is not None:
        callbacks.append(InterruptAt(stop))
    trainer = pl.Trainer(
        max_steps=24,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=options.get("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    if stop is None:
        trainer.fit(model, **fit)
    else:
        with pytest.raises(Interrupt):
            trainer.fit(model, **fit)
    return model


@pytest.mark.parametrize("ckpt_first", [True, False], ids=["ckpt_first", "finetuning_first"])
def test_a_callback_that_rebuilds_the_optimizer_in_on_fit_start_resumes_as_lightning_does(
    tmp_path: Path, ckpt_first: bool
) -> None:
    """BackboneFinetuning adds the backbone's param group in on_fit_start, before Lightning
    loads the optimizer state. Before, the callback loaded it in its own on_fit_start:
    "loaded state dict has a different number of parameter groups". The resume matches
    Lightning's own from its checkpoint of the same step (neither matches the run never
    stopped: BackboneFinetuning's resumed param groups are not its own)."""
    files = tmp_path / "lightning"
    _backbone_fit(None, 0, stop=13, dirpath=str(files))
    (path,) = files.iterdir()
    ref = _backbone_fit(None, 1234, ckpt_path=str(path))
    root = tmp_path / "root"
    _backbone_fit(root, 0, ckpt_first=ckpt_first, stop=13)
    assert _steps(root) == [6, 12]
    resumed = _backbone_fit(root, 1234, ckpt_first=ckpt_first)
    assert len(resumed.trainer.optimizers[0].param_groups) == 2
    assert resumed.losses == ref.losses and resumed.losses[0][0] == 12
    assert_bitwise(_params(resumed), _params(ref), "params")


class Counter(pl.Callback):
    """State a callback changes at each batch end, listed after CkptCallback."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]


def test_what_later_callbacks_do_at_a_batch_end_is_in_the_version(tmp_path: Path) -> None:
    """Before, the callback saved in its own place in the list: a callback after it had not
    counted that batch yet, and the resumed count was one short."""
    _quiet()
    root = tmp_path / "root"
    torch.manual_seed(0)
    counter = Counter()
    trainer = _trainer([CkptCallback(str(root), every_n_steps=4), counter, InterruptAt(6)], max_steps=8)
    with pytest.raises(Interrupt):
        trainer.fit(Net())
    assert _steps(root) == [4]
    again = Counter()
    trainer = _trainer([CkptCallback(str(root), every_n_steps=4), again], max_steps=8)
    trainer.fit(Net())
    assert again.count == 8


class Scaled(nn.Module):
    """Version 2 stores the scale itself; version 1 stored its logarithm, which
    _load_from_state_dict converts, as torch's versioned modules do."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((32,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, metadata: Any, *args: Any) -> None:
        if (metadata.get("version") or 1) < 2 and prefix + "scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"].exp()
        super()._load_from_state_dict(state_dict, prefix, metadata, *args)


class WithScaled(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), Scaled(), nn.Linear(32, 1))


class SeeRestored(pl.Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = _params(pl_module)
        raise Interrupt("seen")


def test_a_versioned_module_is_restored_as_saved(tmp_path: Path) -> None:
    """Before, the restored state dict had no _metadata: Scaled read its version as None and
    took the saved scale for a logarithm (exp() of it)."""
    _quiet()
    root = tmp_path / "root"
    torch.manual_seed(0)
    trainer = _trainer([CkptCallback(str(root), every_n_steps=2), InterruptAt(3)], max_steps=4)
    with pytest.raises(Interrupt):
        trainer.fit(WithScaled())
    with ckpt.Checkpointer(str(root)) as ck:
        state: dict[str, Any] = {KEY: None}
        assert ck.restore(state) == 2
    saved = state[KEY]["state_dict"]
    seen = SeeRestored()
    with pytest.raises(Interrupt):
        _trainer([CkptCallback(str(root), every_n_steps=2), seen], max_steps=4).fit(WithScaled())
    assert_bitwise(seen.params, saved, "state_dict")


def test_fit_from_a_ckpt_path_into_an_empty_root_saves_on_schedule(tmp_path: Path) -> None:
    """Lightning restores a ckpt_path's training state after on_fit_start: the callback took
    the step before it for the last one seen, and saved at the next batch, off schedule."""
    _quiet()
    torch.manual_seed(0)
    first = _trainer([], max_steps=6)
    first.fit(Net())
    path = str(tmp_path / "six.ckpt")
    first.save_checkpoint(path)
    root = tmp_path / "root"
    _trainer([CkptCallback(str(root), every_n_steps=4)], max_steps=12).fit(Net(), ckpt_path=path)
    assert _steps(root) == [8, 12]


def test_a_second_fit_of_one_trainer_goes_on_from_its_own_state(tmp_path: Path) -> None:
    """Before, the second fit restored the newest version (step 5), older than the Trainer's
    step 7, and trained steps 5 and 6 again."""
    _quiet()
    root = tmp_path / "root"
    torch.manual_seed(0)
    model = Net()
    cb = CkptCallback(str(root), every_n_steps=5)
    trainer = _trainer([cb], max_steps=7)
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(model)
    assert cb.restored_step is None and trainer.global_step == 10
    steps = [r[0] for r in model.losses]
    assert steps == list(range(10)), steps


def test_a_lightning_that_never_takes_the_version_read_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version read in setup reaches Lightning only through the override of its
    connector's resume_start. A Lightning that renames it or calls it otherwise (here: a
    class property that bypasses the instance's override) must not train from scratch as
    though nothing was saved."""
    _quiet()
    root = tmp_path / "root"
    torch.manual_seed(0)
    _trainer([CkptCallback(str(root), every_n_steps=4)], max_steps=4).fit(Net())
    own = _CheckpointConnector.resume_start
    bypass = property(
        lambda self: types.MethodType(own, self), lambda self, value: self.__dict__.__setitem__("resume_start", value)
    )
    monkeypatch.setattr(_CheckpointConnector, "resume_start", bypass)
    model = Net()
    with pytest.raises(ckpt.CkptError, match="did not call its checkpoint connector's resume_start"):
        _trainer([CkptCallback(str(root), every_n_steps=4)], max_steps=8).fit(model)
    assert model.losses == []


def test_an_optimizer_consolidated_on_one_rank_is_refused(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer's state_dict() is rank 0's consolidated state, empty on the
    other ranks: saved per rank, a resume would fail on them (KeyError 'state')."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Zero(Net):
        def configure_optimizers(self) -> Any:
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)

    _quiet()
    trainer = _trainer([CkptCallback(str(tmp_path / "root"), every_n_steps=2)], max_steps=4, strategy="ddp", devices=1)
    with pytest.raises(TypeError, match="ZeroRedundancyOptimizer"):
        trainer.fit(Zero())
    assert _steps(tmp_path / "root") == []


class PoisonStep2(pl.Callback):
    """A buffer NaN at the end of step 2 (the save of step 2 then fails in the background,
    check_finite), clean again at the next batch; SIGUSR1 in batch 5, the first micro-batch
    of step 3 (2 batches a step)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            pl_module.flag.fill_(float("nan"))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        pl_module.flag.fill_(0.0)
        if idx == 4:
            os.kill(os.getpid(), signal.SIGUSR1)


class Flagged(Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("flag", torch.zeros(1))


def test_a_failed_save_in_flight_does_not_stop_the_save_on_preemption(tmp_path: Path) -> None:
    """The ranks agree in a micro-batch after step 2, whose save failed in the background.
    Before, the callback took step 2 for saved, and its wait() raised the old error out of
    fit with nothing newer than step 1 committed; now it saves step 3, and fit returns."""
    _quiet()
    root = tmp_path / "root"
    torch.manual_seed(0)
    cb = CkptCallback(str(root), every_n_steps=1, preemption_signals=(signal.SIGUSR1,), check_finite=True)
    trainer = _trainer([PoisonStep2(), cb], max_steps=8, accumulate_grad_batches=2)
    trainer.fit(Flagged())
    assert trainer.global_step == 3 and _steps(root) == [1, 3]
