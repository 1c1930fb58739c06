"""Pipeline stages that share a name: a plain tensor is taken to be replicated and written
once, so two stages' different tensors under one name (an optimizer's state, keyed 0, 1,
... on every stage) would keep one stage's values alone. A save compares such tensors
across the ranks' groups and refuses different values; data-parallel replicas within a
group (BatchNorm statistics under DDP differ there) are left as they were. Real gloo
jobs of 3 ranks: ranks 0 and 1 are one stage's replicas, rank 2 the next stage."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _stage(rank: int) -> tuple[int, torch.nn.Module, torch.optim.Optimizer]:
    """This rank's stage: its own layer names, and an Adam stepped once with that stage's
    gradients (the replicas of a stage alike, as DDP keeps them)."""
    stage = 0 if rank < 2 else 1
    torch.manual_seed(100 + stage)
    model = torch.nn.ModuleDict({f"layer{stage}": torch.nn.Linear(16, 16)})
    # A buffer the replicas of a stage hold with different values, as BatchNorm's running
    # statistics under DDP: taken to be a copy, as before.
    model[f"layer{stage}"].register_buffer("running_mean", torch.full((16,), float(rank)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return stage, model, opt


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().contiguous().reshape(-1).view(torch.int32).tolist()


def stages_job(ctx: Any, root: str) -> dict[str, Any]:
    import ckpt

    stage, model, opt = _stage(ctx.rank)
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        try:
            ck.save(1, {"model": model, "opt": opt})
            ck.wait()
            out["shared"] = "saved"
        except ckpt.StateMismatchError as e:
            out["shared"] = str(e)
        out["steps"] = ck.steps()
        # Each stage's optimizer under a key of its own: saved, and restored stage by stage.
        # The step tensors, equal on every stage, also sit under one shared name.
        steps = torch.tensor([float(opt.state[p]["step"]) for p in model.parameters()])
        ck.save(2, {"model": model, "opt": {f"stage{stage}": opt}, "steps": steps})
        ck.wait()
        want = {k: _bits(v) for k, v in opt.state[next(iter(model.parameters()))].items()}
        fresh_stage, fresh_model, fresh_opt = _stage(ctx.rank)
        with torch.no_grad():
            for p in fresh_model.parameters():
                p.zero_()
        fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
        step = ck.restore({"model": fresh_model, "opt": {f"stage{fresh_stage}": fresh_opt}})
        got = {k: _bits(v) for k, v in fresh_opt.state[next(iter(fresh_model.parameters()))].items()}
        out["restored"] = step
        out["opt_bitwise"] = got == want
        out["model_bitwise"] = all(
            _bits(a) == _bits(b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True)
        )
    return out


def test_pipeline_stages_sharing_a_name_with_different_values_are_refused(tmp_path: Path) -> None:
    results, failures = launch(THIS, "stages_job", 3, tmp_path, timeout=180, root=str(tmp_path / "root"))
    assert not failures, failures
    for r in results:
        assert "opt/state/0/exp_avg" in r["shared"] and "ranks 0 and 2" in r["shared"], results
        assert r["steps"] == [], results  # nothing committed from the refused save
        assert r["restored"] == 2 and r["opt_bitwise"] and r["model_bitwise"], results


def replicas_with_extras_job(ctx: Any, root: str) -> dict[str, Any]:
    """Data-parallel replicas (the same model and optimizer state), whose BatchNorm-like
    buffer differs per rank; rank 0 also holds a tensor of its own, which puts it in a group
    of its own."""
    import ckpt

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.register_buffer("running_mean", torch.full((8,), float(ctx.rank)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state: dict[str, Any] = {"model": model, "opt": opt}
    if ctx.rank == 0:
        state["best_metric"] = torch.tensor(0.5)
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        try:
            ck.save(1, state)
            ck.wait()
        except ckpt.CkptError as e:
            return {"saved": str(e)}
        return {"saved": ck.steps()}


def test_replicas_one_of_which_holds_a_tensor_more_are_not_taken_for_stages(tmp_path: Path) -> None:
    """The first version of the check compared every name groups share, so a metric on rank 0
    made the replicas' BatchNorm statistics a StateMismatchError. Names under string keys
    are not compared; the optimizer's positional state is, and is alike."""
    results, failures = launch(THIS, "replicas_with_extras_job", 3, tmp_path, timeout=180, root=str(tmp_path / "root"))
    assert not failures, failures
    assert [r["saved"] for r in results] == [[1]] * 3, results


def replicated_dtensor_per_stage_job(ctx: Any, root: str) -> dict[str, Any]:
    """2 pipeline stages x 2 tensor-parallel ranks: each stage's norm weight a DTensor
    replicated over its tp mesh; plain tensors per tp rank (ranks 0 and 2 hold "tp0/x",
    1 and 3 "tp1/x"), so the groups' lowest ranks (0, 1) hold no piece of stage 1's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import ckpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage, tp = divmod(ctx.rank, 2)
    norm = distribute_tensor(torch.full((4,), float(stage)), mesh["tp"], [Replicate()], src_data_rank=None)
    state = {f"stage{stage}": {"norm": norm}, f"tp{tp}": {"x": torch.zeros(2)}}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        try:
            ck.save(1, state)
            ck.wait()
        except Exception as e:  # noqa: BLE001 - what each rank saw
            return {"saved": f"{type(e).__name__}: {e}"}
        return {"saved": ck.steps()}


def test_a_replicated_dtensor_no_group_s_lowest_rank_holds_saves(tmp_path: Path) -> None:
    """The first version of the check counted such an array as differing (no rank had
    digested it) and failed every save with ValueError."""
    results, failures = launch(
        THIS, "replicated_dtensor_per_stage_job", 4, tmp_path, timeout=180, root=str(tmp_path / "root")
    )
    assert not failures, failures
    assert [r["saved"] for r in results] == [[1]] * 4, results
