"""ckpt.lightning.CkptCallback with the real Lightning Trainer: a run stopped mid-epoch and
resumed by a fresh Trainer, model and callback goes on at exactly the next batch, with
every loss and, at the end, every parameter bit for bit those of the uninterrupted run.

Dropout is on and the resumed process is seeded differently, so the RNG must come back;
the LR scheduler steps every batch; the loader shuffles (torchdata's StatefulDataLoader,
whose position Lightning keeps with its fit loop). Single device in this process (the
interruption is an exception from a callback after a save); DDP on 2 gloo processes
(Lightning's DDPStrategy joins the process group tests/_dist.py made; the interruption is
a SIGKILL of both ranks after a committed save, so the restore also takes over the
lock of a root nobody closed).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckpt
from ckpt.cli import main as cli
from ckpt.lightning import KEY, CkptCallback
from tests._dist import REPO, launch
from tests._states import assert_bitwise

THIS = os.path.abspath(__file__)
Loss = tuple[int, int, int, float]  # global_step before the step, epoch, batch_idx, loss


def _quiet() -> None:
    warnings.filterwarnings("ignore", module=r"lightning(\..*)?$")
    warnings.filterwarnings("ignore", module=r"torchdata(\..*)?$")
    warnings.filterwarnings("ignore", message=".*(litlogger|LeafSpec|set_vital|does not have many workers).*")


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))


class Net(pl.LightningModule):
    """A small regression with dropout and a per-step LR schedule; records every loss."""

    def __init__(self, samples: int = 40, sampler: str = "shuffle", validate: bool = False, workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
        self.losses: list[Loss] = []
        self.validations: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append((self.trainer.global_step, self.current_epoch, batch_idx, loss.item()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.validations.append(self.trainer.global_step)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        ds = _dataset(self.hparams["samples"])
        if self.hparams["sampler"] == "ckpt":  # DDP: Lightning keeps a DistributedSampler it is given
            return StatefulDataLoader(ds, batch_size=4, sampler=ckpt.DistributedSampler(ds, seed=0))
        # shuffle=True and no generator=: the loader's RandomSampler seeds a generator of its
        # own, and its state is in the loader's state_dict.
        return StatefulDataLoader(ds, batch_size=4, shuffle=True, num_workers=self.hparams["workers"])

    def val_dataloader(self) -> Any:
        if not self.hparams["validate"]:
            return []
        return DataLoader(_dataset(8), batch_size=4)


def _trainer(callbacks: list[pl.Callback], max_steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


class Interrupt(Exception):
    pass


class InterruptAt(pl.Callback):
    """Raise from on_train_batch_end at `step` (after CkptCallback, listed before it, saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise Interrupt(f"interrupted at step {self.step}")


def _fit(root: Path | None, seed: int, max_steps: int, *, every: int = 5, stop: int | None = None, **opts: Any) -> Net:
    _quiet()
    opts = dict(opts)
    model_opts = {k: opts.pop(k) for k in ("validate", "workers") if k in opts}
    torch.manual_seed(seed)  # a resumed run starts from other weights and another RNG
    model = Net(**model_opts)
    callbacks: list[pl.Callback] = []
    if root is not None:
        callbacks.append(CkptCallback(str(root), every_n_steps=every))
    if stop is not None:
        callbacks.append(InterruptAt(stop))
    trainer = _trainer(callbacks, max_steps, **opts)
    if stop is None:
        trainer.fit(model)
    else:
        with pytest.raises(Interrupt):
            trainer.fit(model)
    return model


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v*") if (p / "manifest.json").exists())


@pytest.mark.parametrize(
    ("case", "every", "stop", "opts", "saved", "resume_at"),
    [
        # 10 batches an epoch. Saves every 5 steps; the ones due on an epoch's last batch
        # (10, 20) wait for the next step. Stopped at 18: resumes after step 15 (batch 4 of
        # epoch 1) and crosses two epoch boundaries.
        ("mid_epoch", 5, 18, {}, [5, 11, 15], 15),
        # The save due on the last batch of epoch 0 (step 10) is made after step 11: Lightning
        # would resume a state saved there with an empty epoch (its loader exhausted).
        ("epoch_end", 10, 12, {}, [11], 11),
        # Two loader worker processes prefetching: the loader's state counts what it yielded.
        ("workers", 5, 18, {"workers": 2}, [5, 11, 15], 15),
        # Two batches per optimizer step (5 steps an epoch) and validation after every 4th
        # batch (after steps 2, 4, 7, 9, 12, ...): the save due at step 9 waits past the
        # validation and the epoch's end (step 10) for step 11 (batch 1 of epoch 2).
        (
            "accumulate_validate",
            3,
            12,
            {"accumulate_grad_batches": 2, "val_check_interval": 4, "validate": True},
            [3, 6, 11],
            11,
        ),
    ],
)
def test_single_device_resumes_mid_epoch_bitwise(
    tmp_path: Path, case: str, every: int, stop: int, opts: dict[str, Any], saved: list[int], resume_at: int
) -> None:
    steps = 35
    ref = _fit(None, seed=0, max_steps=steps, **opts)
    root = tmp_path / "root"
    first = _fit(root, seed=0, max_steps=steps, every=every, stop=stop, **opts)
    assert _steps(root) == saved
    assert first.losses == ref.losses[: len(first.losses)]  # saving changes nothing in the run

    resumed = _fit(root, seed=1234, max_steps=steps, every=every, **opts)
    want = [r for r in ref.losses if r[0] >= resume_at]
    assert resumed.losses[0][0] == resume_at and resumed.losses[0][2] > 0  # mid-epoch: not batch 0
    assert len(resumed.losses) == len(want)
    for got, exp in zip(resumed.losses, want):
        assert got == exp, f"{case}: {got} != {exp}"  # step, epoch, batch index and the float loss
    assert resumed.validations == [v for v in ref.validations if v >= resume_at]  # none skipped
    assert_bitwise(_params(resumed), _params(ref), "params")
    assert resumed.trainer.global_step == ref.trainer.global_step == steps
    assert resumed.trainer.current_epoch == ref.trainer.current_epoch
    cb = next(c for c in resumed.trainer.callbacks if isinstance(c, CkptCallback))
    assert cb.restored_step == resume_at and cb.checkpointer is None  # closed at the end of fit
    out = CliRunner().invoke(cli, ["verify", str(root)])
    assert out.exit_code == 0, out.output


class AwaitSigterm(pl.Callback):
    """In the batch of global_step `step`: say so in `ready` and wait for the SIGTERM the test sends."""

    def __init__(self, step: int, ready: Path) -> None:
        self.step, self.ready = step, ready

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step or self.ready.exists():
            return
        self.ready.write_text(str(os.getpid()))
        cb = next(c for c in trainer.callbacks if isinstance(c, CkptCallback))
        watch = cb.checkpointer._preemption if cb.checkpointer is not None else None
        assert watch is not None
        deadline = time.monotonic() + 60
        while watch.noticed_at is None:  # ckpt's handler, which keeps the signal from Lightning's
            assert time.monotonic() < deadline, "no SIGTERM"
            time.sleep(0.01)


def preempted_fit(root: str, step: int, ready: str, out: str, accumulate: int) -> None:
    """A Trainer process (the test's child) that gets a SIGTERM in the first batch of `step`."""
    _quiet()
    torch.manual_seed(0)
    model = Net()
    callbacks = [
        CkptCallback(root, every_n_steps=4, preemption_signals=(signal.SIGTERM,)),
        AwaitSigterm(step, Path(ready)),
    ]
    try:
        _trainer(callbacks, 35, accumulate_grad_batches=accumulate).fit(model)
    finally:
        Path(out).write_text(json.dumps(model.losses))


@pytest.mark.parametrize(
    ("signalled", "accumulate", "saved"),
    [
        # Batch 2 of epoch 1: the step it ends (13) is saved, beside the periodic saves.
        (12, 1, [4, 8, 12, 13]),
        # The last batch of epoch 0: Lightning resumes a state saved there with an empty
        # epoch, so the save waits for the next step (11, batch 0 of epoch 1).
        (9, 1, [4, 8, 11]),
        # Two batches a step (5 an epoch): signalled in the first batch of step 6 (batch 2
        # of epoch 1), which accumulates gradients no version holds, the save waits for step 7.
        (6, 2, [4, 7]),
    ],
    ids=["mid_epoch", "epoch_end", "accumulating"],
)
def test_a_sigterm_to_the_trainer_process_saves_and_the_resume_is_bitwise(
    tmp_path: Path, signalled: int, accumulate: int, saved: list[int]
) -> None:
    """CkptCallback(preemption_signals=(SIGTERM,)): a real SIGTERM sent to a Trainer process
    mid-epoch ends fit with the state of the step the ranks agreed on committed (not just the
    last periodic save's), and a fresh run resumes it bit for bit."""
    root, ready, out = tmp_path / "root", tmp_path / "ready", tmp_path / "losses.json"
    args = (str(root), signalled, str(ready), str(out), accumulate)
    code = f"from tests.ckpt.test_lightning import preempted_fit; preempted_fit(*{args!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()[0][-4000:]
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGTERM)
        output = child.communicate(timeout=120)[0]
    finally:
        child.kill()
    assert child.returncode == 0, output[-4000:]
    assert _steps(root) == saved, output[-4000:]
    ref = _fit(None, seed=0, max_steps=35, accumulate_grad_batches=accumulate)
    first = [tuple(r) for r in json.loads(out.read_text())]
    assert first == ref.losses[: len(first)] and first[-1][0] == saved[-1] - 1  # stopped right after the save

    resumed = _fit(root, seed=1234, max_steps=35, every=4, accumulate_grad_batches=accumulate)
    assert resumed.losses == [r for r in ref.losses if r[0] >= saved[-1]]
    assert_bitwise(_params(resumed), _params(ref), "params")
    assert CliRunner().invoke(cli, ["verify", str(root)]).exit_code == 0


def test_a_fresh_root_starts_fresh_and_saves_lightnings_checkpoint(tmp_path: Path) -> None:
    """No version: nothing restored. Each version holds Lightning's checkpoint dict under
    "lightning", restorable with ckpt alone (no Lightning, no pickle)."""
    root = tmp_path / "root"
    model = _fit(root, seed=0, max_steps=7, every=3)
    cb = next(c for c in model.trainer.callbacks if isinstance(c, CkptCallback))
    assert cb.restored_step is None
    assert _steps(root) == [3, 6]
    with ckpt.Checkpointer(str(root)) as ck:
        state: dict[str, Any] = {KEY: None}
        assert ck.restore(state) == 6
    got = state[KEY]
    assert got["global_step"] == 6 and got["hyper_parameters"]["sampler"] == "shuffle"
    assert set(got["state_dict"]) == set(model.state_dict())
    assert got["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert got["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_num_yielded"] == 6


class Opaque:
    pass


class WithObjectHparam(Net):
    def __init__(self) -> None:
        super().__init__()
        self.hparams["tokenizer"] = Opaque()


def test_a_value_ckpt_cannot_save_is_refused_by_name(tmp_path: Path) -> None:
    _quiet()
    trainer = _trainer([CkptCallback(str(tmp_path / "root"), every_n_steps=2)], max_steps=4)
    with pytest.raises(ckpt.UnsupportedStateError, match=r"\['hyper_parameters'\]\['tokenizer'\].*Opaque.*ignore="):
        trainer.fit(WithObjectHparam())
    assert _steps(tmp_path / "root") == []


class AnotherCkptCallback(CkptCallback):
    pass


def test_a_second_ckpt_callback_is_refused(tmp_path: Path) -> None:
    """Two in one Trainer: each setup hands Lightning its own version, the last one's wins,
    and one whose root is empty would start fresh over the other's versions. Lightning
    refuses two of one class (their state_key); a subclass passes that, and setup refuses."""
    _quiet()
    with pytest.raises(RuntimeError, match="more than one stateful callback"):
        _trainer(
            [CkptCallback(str(tmp_path / "a"), every_n_steps=2), CkptCallback(str(tmp_path / "b"), every_n_steps=3)],
            max_steps=4,
        )
    _fit(tmp_path / "a", seed=0, max_steps=4, every=2)
    trainer = _trainer(
        [CkptCallback(str(tmp_path / "a"), every_n_steps=2), AnotherCkptCallback(str(tmp_path / "b"), every_n_steps=3)],
        max_steps=6,
    )
    with pytest.raises(ValueError, match="one CkptCallback"):
        trainer.fit(Net())
    assert _steps(tmp_path / "a") == [2, 4] and _steps(tmp_path / "b") == []


def test_every_n_steps_is_checked() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            CkptCallback("/nowhere", every_n_steps=bad)  # type: ignore[arg-type]


# -- DDP: 2 gloo processes -------------------------------------------------------------

DDP_STEPS, DDP_EVERY, DDP_KILL, DDP_RESUME = 24, 4, 14, 12  # 5 batches per rank and epoch
DDP_SIGTERM = 6  # the global_step in whose first batch the preemption notice comes


def _ddp_fit(ctx: Any, root: str | None, seed: int, callbacks: list[pl.Callback], preemption: bool = False) -> Net:
    _quiet()
    # Processes launched from outside (LOCAL_RANK set): Lightning starts none and joins the
    # process group that exists.
    os.environ.update(LOCAL_RANK=str(ctx.rank), RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), NODE_RANK="0")
    torch.manual_seed(seed)
    model = Net(sampler="ckpt")
    torch.manual_seed(seed * 100 + ctx.rank)  # each rank its own dropout
    signals = (signal.SIGTERM,) if preemption else ()
    cbs: list[pl.Callback] = (
        [CkptCallback(root, every_n_steps=DDP_EVERY, preemption_signals=signals)] if root is not None else []
    )
    trainer = _trainer(
        cbs + callbacks,
        DDP_STEPS,
        strategy=DDPStrategy(process_group_backend="gloo"),
        devices=ctx.world,
        num_nodes=1,
    )
    trainer.fit(model)
    return model


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class KillAt(pl.Callback):
    """Once the save before `step` is committed on every rank: SIGKILL this process."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        cb = next(c for c in trainer.callbacks if isinstance(c, CkptCallback))
        assert cb.checkpointer is not None
        cb.checkpointer.wait()
        assert isinstance(pl_module, Net)
        self.out.write_text(json.dumps(pl_module.losses))
        torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


def ddp_reference_then_killed(ctx: Any, root: str) -> None:
    ref = _ddp_fit(ctx, None, 0, [])
    (ctx.workdir / f"ref.rank{ctx.rank}.json").write_text(json.dumps({"losses": ref.losses, "params": _digest(ref)}))
    _ddp_fit(ctx, root, 0, [KillAt(DDP_KILL, ctx.workdir / f"killed.rank{ctx.rank}.json")])
    raise AssertionError("not killed")


def ddp_resumed(ctx: Any, root: str) -> dict[str, Any]:
    model = _ddp_fit(ctx, root, 7, [])
    cb = next(c for c in model.trainer.callbacks if isinstance(c, CkptCallback))
    return {"losses": model.losses, "params": _digest(model), "restored": cb.restored_step}


def test_ddp_two_ranks_killed_and_resumed_bitwise(tmp_path: Path) -> None:
    """Lightning DDP on 2 gloo ranks, each rank shuffling its own half through a
    ckpt.DistributedSampler in a StatefulDataLoader. Both ranks are SIGKILLed at step 14,
    after the save of step 12 (after batch 1 of epoch 2) committed; fresh processes resume at
    step 13 and every rank's losses and the final parameters equal the reference's."""
    root = str(tmp_path / "root")
    job = tmp_path / "job"
    launch(THIS, "ddp_reference_then_killed", 2, job, timeout=120, killed=frozenset({0, 1}), root=root)
    results, failures = launch(THIS, "ddp_resumed", 2, job, timeout=120, root=root)
    assert not failures, failures
    for rank, got in enumerate(results):
        ref = json.loads((job / f"ref.rank{rank}.json").read_text())
        killed = json.loads((job / f"killed.rank{rank}.json").read_text())
        assert killed == ref["losses"][: len(killed)] and killed[-1][0] == DDP_KILL - 1
        assert got["restored"] == DDP_RESUME
        want = [r for r in ref["losses"] if r[0] >= DDP_RESUME]
        assert got["losses"][0][:3] == [DDP_RESUME, 2, 2]  # mid-epoch: epoch 2, batch 2
        assert got["losses"] == want, f"rank {rank}"  # JSON floats round-trip exactly
        assert got["params"] == ref["params"], f"rank {rank}"
    assert results[0]["losses"] != results[1]["losses"]  # the ranks saw different data and dropout


class SigtermAt(pl.Callback):
    """A real SIGTERM to this process in the first batch of global_step `step` (as a
    scheduler's preemption notice), on the ranks named."""

    def __init__(self, step: int, ranks: frozenset[int]) -> None:
        self.step, self.ranks, self.sent = step, ranks, False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank in self.ranks and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def ddp_preempted(ctx: Any, root: str, signalled: list[int]) -> dict[str, Any]:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    ref = _ddp_fit(ctx, None, 0, [])
    ended = "returned"
    holder: list[Net] = []
    try:
        _ddp_fit(ctx, root, 0, [SigtermAt(DDP_SIGTERM, frozenset(signalled)), Keep(holder)], preemption=True)
    except SIGTERMException:  # Lightning's end of fit on SIGTERM (a SystemExit: exit status 0)
        ended = "SIGTERMException"
    model = holder[0]
    return {
        "ref": ref.losses,
        "ref_params": _digest(ref),
        "losses": model.losses,
        "step": model.trainer.global_step,
        "ended": ended,
    }


class Keep(pl.Callback):
    """Keeps the module of the fit, which may end in an exception."""

    def __init__(self, into: list[Net]) -> None:
        self.into = into

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, Net)
        self.into.append(pl_module)


@pytest.mark.parametrize("signalled", [[0, 1], [1]], ids=["every_rank", "rank_1_only"])
def test_ddp_a_sigterm_saves_on_every_rank_and_the_resume_is_bitwise(tmp_path: Path, signalled: list[int]) -> None:
    """Lightning DDP on 2 gloo ranks with preemption_signals=(SIGTERM,): a real SIGTERM in
    the first batch of step 7 (batch 1 of epoch 1), to every rank or to rank 1 alone. The
    ranks agree on it, save step 7 together and end fit; fresh processes resume it, and every
    rank's losses and the final parameters equal an uninterrupted run's."""
    root = str(tmp_path / "root")
    job = tmp_path / "job"
    results, failures = launch(THIS, "ddp_preempted", 2, job, timeout=180, root=root, signalled=signalled)
    assert not failures, failures
    assert _steps(Path(root)) == [4, DDP_SIGTERM + 1]
    for got in results:
        assert got["step"] == DDP_SIGTERM + 1 and got["losses"] == got["ref"][: DDP_SIGTERM + 1]
    assert [got["ended"] for got in results] == ["returned"] * 2  # fit stopped; no SIGTERMException
    resumed, failures = launch(THIS, "ddp_resumed", 2, job, timeout=180, root=root)
    assert not failures, failures
    for rank, got in enumerate(resumed):
        assert got["restored"] == DDP_SIGTERM + 1
        assert got["losses"] == [r for r in results[rank]["ref"] if r[0] >= DDP_SIGTERM + 1], f"rank {rank}"
        assert got["params"] == results[rank]["ref_params"], f"rank {rank}"


# -- another world size: 2 gloo ranks save, 1 or 3 resume --------------------------------

SEEN_SAMPLES, SEEN_EVERY = 24, 3  # batches of 2: 6 per rank and epoch on 2 ranks, 12 on 1, 4 on 3


class Seen(pl.LightningModule):
    """Records (epoch, batch_idx, global_step, sample indices) of each batch."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.lin = nn.Linear(1, 1)
        self.seen: list[tuple[int, int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.seen.append((self.current_epoch, batch_idx, self.trainer.global_step, x.view(-1).long().tolist()))
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        ds = TensorDataset(torch.arange(SEEN_SAMPLES, dtype=torch.float32).unsqueeze(1))
        sampler = ckpt.DistributedSampler(ds, seed=3, even_after_reshard=True)  # DDP steps are collective
        # Workers from a fork server: forking this process, whose gloo threads run, can copy a
        # lock one of them holds into the child (pytorch#130610), and a worker stuck at its
        # start leaves the rank waiting for it (twice in CI: rank 1 missed the next collective).
        context = "forkserver" if self.workers else None
        return StatefulDataLoader(
            ds, batch_size=2, sampler=sampler, num_workers=self.workers, multiprocessing_context=context
        )


def seen_fit(ctx: Any, root: str, max_steps: int, workers: int) -> dict[str, Any]:
    _quiet()
    os.environ.update(LOCAL_RANK=str(ctx.rank), RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), NODE_RANK="0")
    model = Seen(workers)
    cb = CkptCallback(root, every_n_steps=SEEN_EVERY)
    trainer = _trainer(
        [cb],
        max_steps,
        max_epochs=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        devices=ctx.world,
        num_nodes=1,
    )
    trainer.fit(model)
    return {
        "seen": model.seen,
        "restored": cb.restored_step,
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


@pytest.mark.parametrize("world,workers", [(1, 2), (3, 0)])
def test_ddp_resumed_on_another_world_size_sees_every_sample_once_per_epoch(
    tmp_path: Path, world: int, workers: int
) -> None:
    """2 DDP ranks stop after the save of step 3 (3 of the 6 batches of epoch 0 each, 12
    samples); 1 or 3 ranks resume: the rest of epoch 0 and all of epoch 1 see every sample
    exactly once. Lightning counts the epoch's batches with len(loader), read once: the
    sampler's len() is an epoch at the new world size, and the resumed epoch's batch count
    starts over, so neither epoch ends early (on 1 rank epoch 0 ended after 3 of the 6
    batches left, on 3 ranks epoch 1 after the 2 batches epoch 0 had left)."""
    root = str(tmp_path / "root")
    first, failures = launch(THIS, "seen_fit", 2, tmp_path / "saved", root=root, max_steps=SEEN_EVERY, workers=workers)
    assert not failures, failures
    results, failures = launch(THIS, "seen_fit", world, tmp_path / "resumed", root=root, max_steps=-1, workers=workers)
    assert not failures, failures
    assert [r["restored"] for r in results] == [SEEN_EVERY] * world
    epochs: dict[int, list[int]] = {0: [], 1: []}
    for r in first + results:
        for epoch, _, _, samples in r["seen"]:
            epochs[epoch] += samples
    for epoch, samples in epochs.items():
        assert sorted(samples) == list(range(SEEN_SAMPLES)), f"epoch {epoch}: repeated or skipped"
    left = (SEEN_SAMPLES - 2 * 2 * SEEN_EVERY) // world // 2  # batches of epoch 0 left per rank
    full = SEEN_SAMPLES // world // 2
    for r in results:
        got = [(epoch, batch_idx, step) for epoch, batch_idx, step, _ in r["seen"]]
        want = [(0, i, SEEN_EVERY + i) for i in range(left)]
        want += [(1, i, SEEN_EVERY + left + i) for i in range(full)]
        assert got == want
        assert (r["step"], r["epoch"]) == (SEEN_EVERY + left + full, 2)


def test_after_fit_sigterm_is_handled_as_before_fit(tmp_path: Path) -> None:
    """After a fit with preemption_signals=(SIGTERM,), the SIGTERM handler is the one
    installed before fit (here SIG_DFL: the process dies of a SIGTERM). Before, close()
    put back the Lightning handler take_over had covered, after Lightning's teardown had
    put back ckpt's: the finished trainer's handler then swallowed every SIGTERM."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from tests.ckpt.test_lightning import Net, _trainer, _quiet
from ckpt.lightning import CkptCallback
_quiet()
before = signal.getsignal(signal.SIGTERM)
trainer = _trainer([CkptCallback({str(tmp_path / "root")!r}, every_n_steps=2, preemption_signals=(signal.SIGTERM,))], 3)
trainer.fit(Net())
after = signal.getsignal(signal.SIGTERM)
print("handler", before, after, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("survived SIGTERM", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])
