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
