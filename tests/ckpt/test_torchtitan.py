"""torchtitan's checkpoint manager on ckpt (ckpt.torchtitan.CheckpointManager): 2 gloo ranks
train with torchtitan's real optimizer and LR-scheduler containers, save every 2 steps
through torchtitan's own save path (synchronous and async), stop, and resume from the
newest ckpt version with losses bitwise equal to an uninterrupted run's; the checkpoints
are ordinary committed ckpt versions (`ckpt verify`)."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpt.cli import main as ckpt_cli
from tests._dist import REPO, launch

THIS = os.path.abspath(__file__)


class _Loader:
    """A data position torchtitan saves and restores (Stateful, as its dataloader is)."""

    def __init__(self) -> None:
        self.pos = 0

    def batch(self) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(self.pos)
        self.pos += 1
        x = torch.randn(16, 8, generator=g)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def train(
    ctx: Any,
    folder: str,
    mode: str,
    until: int,
    manager_kind: str = "ckpt",
    load_only: bool = False,
    find_only: bool = False,
) -> dict[str, Any]:
    """Train to step `until` (every rank the same batches, so the replicas stay equal),
    resuming from the newest checkpoint in `folder` if there is one; the loss of each step.
    `manager_kind="torchtitan"`: torchtitan's own manager (step-N directories); `load_only`:
    load, and report the step loaded, without training; `find_only`: the step the manager
    would load, not loaded."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    import ckpt.torchtitan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt_config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    )
    optimizers = opt_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=8)
    loader, train_state = _Loader(), _TrainState()
    from torchtitan.components.checkpointer.dcp import CheckpointManager as TorchtitanManager

    kind = ckpt.torchtitan.CheckpointManager if manager_kind == "ckpt" else TorchtitanManager
    config = kind.Config(
        enable=True,
        folder="ckpt",
        interval=2,
        async_mode=mode,
        keep_latest_k=0,
        last_save_model_only=False,
        load_only=load_only,
    )
    manager = config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    ctx.check(isinstance(manager, kind), "torchtitan built the manager its config names")
    if find_only:
        found = manager._find_load_step()
        manager.close()
        return {"found": found}
    resumed = manager.load()
    if load_only:
        manager.close()
        return {"resumed": resumed, "step": train_state.step}
    losses = {}
    while train_state.step < until:
        train_state.step += 1
        x, y = loader.batch()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        losses[train_state.step] = loss.item().hex()
        manager.save(train_state.step, last_step=train_state.step == until)
    manager.maybe_wait_for_saving()
    manager.close()
    return {"resumed": resumed, "losses": losses}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_torchtitan_resumes_from_ckpt_versions_bitwise(tmp_path: Path, mode: str) -> None:
    whole, failures = launch(THIS, "train", 2, tmp_path / "whole", folder=str(tmp_path / "whole"), mode=mode, until=6)
    assert not failures, failures
    first, failures = launch(THIS, "train", 2, tmp_path / "cut", folder=str(tmp_path / "cut"), mode=mode, until=3)
    assert not failures, failures
    again, failures = launch(THIS, "train", 2, tmp_path / "cut", folder=str(tmp_path / "cut"), mode=mode, until=6)
    assert not failures, failures
    assert not first[0]["resumed"] and again[0]["resumed"]
    for r in range(2):
        # steps 1-3, then the newest version (the last-step save of step 3), then 4-6
        assert sorted(again[r]["losses"]) == ["4", "5", "6"], again[r]["losses"]
        for step in ("4", "5", "6"):
            assert again[r]["losses"][step] == whole[r]["losses"][step], (r, step)
    root = tmp_path / "cut" / "ckpt"
    res = CliRunner().invoke(ckpt_cli, ["verify", str(root)])
    assert res.exit_code == 0, res.output
    assert [line.split(":")[0] for line in res.output.splitlines() if line.startswith("step")] == [
        "step 2", "step 3", "step 4", "step 6",
    ], res.output  # fmt: skip


def test_torchtitan_passes_over_a_damaged_newest_version(tmp_path: Path) -> None:
    """A resume without load_step loads the newest intact version: with a chunk of the newest
    (step 3) failing its checksum and no other copy, the job resumes from step 2 and goes on
    bitwise as the uninterrupted run. Before, every restart raised CorruptVersionError."""
    whole, failures = launch(
        THIS, "train", 2, tmp_path / "whole", folder=str(tmp_path / "whole"), mode="disabled", until=6
    )
    assert not failures, failures
    cut = str(tmp_path / "cut")
    _, failures = launch(THIS, "train", 2, tmp_path / "cut", folder=cut, mode="disabled", until=3)
    assert not failures, failures
    chunks = glob.glob(os.path.join(cut, "ckpt", "v000000000003", "state", "tensors", "**", "c*"), recursive=True)
    largest = Path(max(chunks, key=os.path.getsize))  # a weight of the model or its optimizer state
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    largest.write_bytes(bytes(raw))
    again, failures = launch(THIS, "train", 2, tmp_path / "cut", folder=cut, mode="disabled", until=6)
    assert not failures, failures
    for r in range(2):
        assert again[r]["resumed"] and sorted(again[r]["losses"]) == ["3", "4", "5", "6"], again[r]
        for step in ("3", "4", "5", "6"):
            assert again[r]["losses"][step] == whole[r]["losses"][step], (r, step)


def test_a_folder_of_torchtitan_s_own_checkpoints_is_resumed(tmp_path: Path) -> None:
    """A job that moves to ckpt's manager: its folder holds torchtitan's step-N checkpoints
    and no ckpt version. Before, they were ignored and training started over at step 1."""
    whole, failures = launch(
        THIS, "train", 2, tmp_path / "whole", folder=str(tmp_path / "whole"), mode="disabled", until=6
    )
    assert not failures, failures
    cut = str(tmp_path / "cut")
    _, failures = launch(
        THIS, "train", 2, tmp_path / "cut", folder=cut, mode="disabled", until=3, manager_kind="torchtitan"
    )
    assert not failures, failures
    assert sorted(os.listdir(os.path.join(cut, "ckpt"))) == ["step-2", "step-3"]
    again, failures = launch(THIS, "train", 2, tmp_path / "cut", folder=cut, mode="disabled", until=6)
    assert not failures, failures
    for r in range(2):
        assert again[r]["resumed"] and sorted(again[r]["losses"]) == ["4", "5", "6"], again[r]
        for step in ("4", "5", "6"):
            assert again[r]["losses"][step] == whole[r]["losses"][step], (r, step)
    assert "v000000000004" in os.listdir(os.path.join(cut, "ckpt"))  # from then on, ckpt versions


def test_a_load_only_manager_reads_beside_the_training_job(tmp_path: Path) -> None:
    """An evaluation job (load_only) while the training job holds the root. Before, its
    manager opened a Checkpointer, which takes the root's writer lock: RootLockedError."""
    from ckpt import Checkpointer

    folder = str(tmp_path / "run")
    _, failures = launch(THIS, "train", 2, tmp_path / "train", folder=folder, mode="disabled", until=4)
    assert not failures, failures
    with Checkpointer(os.path.join(folder, "ckpt")):  # the training job, still running
        loaded, failures = launch(
            THIS, "train", 2, tmp_path / "eval", folder=folder, mode="disabled", until=4, load_only=True
        )
    assert not failures, failures
    assert [(r["resumed"], r["step"]) for r in loaded] == [(True, 4), (True, 4)], loaded


def test_a_load_only_manager_agrees_on_the_step_where_the_default_group_has_no_cpu_backend(tmp_path: Path) -> None:
    """torchtitan's trainer makes the default group NCCL alone; the manager's agreement on the
    step went through it with a CPU tensor: "No backend type associated with device type
    cpu". It goes through a gloo group of its own now. (One process; "cuda:gloo" is a group
    without a CPU backend that needs no GPU.)"""
    import json
    import subprocess
    import sys

    folder = str(tmp_path / "run")
    _, failures = launch(THIS, "train", 1, tmp_path / "train", folder=folder, mode="disabled", until=4)
    assert not failures, failures
    script = f"""
import json, torch.distributed as dist
from pathlib import Path
from tests._dist import Ctx
from tests.ckpt.test_torchtitan import train
dist.init_process_group("cuda:gloo", rank=0, world_size=1, store=dist.HashStore())
ctx = Ctx(0, 1, Path({str(tmp_path)!r}))
print(json.dumps(train(ctx, {folder!r}, "disabled", 4, load_only=True, find_only=True)))
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"found": 4}
