"""torchao's float8 training under FSDP2 (as torchtitan runs it): each weight is a DTensor
whose local shard is a WeightWithDynamicFloat8CastTensor, a subclass wrapping the weight
(its `_tensor`) with no memory of its own. ckpt saves and restores that weight in its
place, bitwise, onto the same layout and onto a plain model at another world size. (This
worked before through the wrapper's dispatch, whose view ops return the weight's own
views; ckpt now takes the weight itself, and refuses wrappers whose value is not one of
their tensors: tests/ckpt/test_careless_use.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt import Checkpointer
from tests._dist import launch
from tests._states import assert_bitwise

THIS = os.path.abspath(__file__)


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 640), nn.Linear(640, 48))  # 0.weight: 80 KiB a rank


def _float8(model: nn.Sequential) -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local values (a float8 weight's `_tensor`, a DTensor's local shard)."""
    out = {}
    for name, p in model.named_parameters():
        local = getattr(p.data, "_local_tensor", p.data)
        out[name] = getattr(local, "_tensor", local).detach().clone()
    return out


def fsdp_float8(ctx: Any, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world,))
    saved = fully_shard(_float8(_model(0)), mesh=mesh)
    kinds = {type(p.data._local_tensor).__name__ for p in saved.parameters() if p.dim() == 2}
    ctx.check(kinds == {"WeightWithDynamicFloat8CastTensor"}, f"the weights' local shards are {kinds}")
    with Checkpointer(root) as ck:
        ck.save(1, {"model": saved.state_dict()})
        ck.wait()
        fresh = fully_shard(_float8(_model(1)), mesh=mesh)
        ck.restore({"model": fresh})
    want, got = _weights(saved), _weights(fresh)
    for name in want:
        ctx.check(torch.equal(want[name].view(torch.int32), got[name].view(torch.int32)), f"{name} differs")
    return {}


def test_fsdp2_float8_weights_round_trip_and_reshard_onto_a_plain_model(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    _, failures = launch(THIS, "fsdp_float8", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    plain = _model(7)
    with Checkpointer(root) as ck:
        assert ck.restore({"model": plain}) == 1
    assert_bitwise(plain.state_dict(), _model(0).state_dict())


def test_a_float8_weight_alone_round_trips_bitwise(tmp_path: Path) -> None:
    """One process, no FSDP: the weight itself is the wrapper."""
    saved, fresh = _float8(_model(0)), _float8(_model(1))
    assert type(fresh[0].weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"
    with Checkpointer(tmp_path / "root") as ck:
        ck.save(1, {"model": saved})
        ck.wait()
        ck.restore({"model": fresh})
    assert_bitwise(_weights(fresh), _weights(saved))


def test_float8_weights_with_their_optimizer_and_deferred_staging(tmp_path: Path) -> None:
    """Deferred staging finds the storages the optimizers own: a float8 weight's is its
    `_tensor`'s. Before, asking a wrapper for its storage failed every such save with
    RuntimeError."""
    model = _float8(_model(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    fresh = _float8(_model(1))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    with Checkpointer(tmp_path / "root", deferred_staging=True) as ck:
        for step in (1, 2):
            ck.save(step, {"model": model, "opt": opt})
            opt.step()  # (no gradients: the weights stay; the step waits for the deferred copy)
        ck.wait()
        assert ck.restore({"model": fresh, "opt": fresh_opt}) == 2
    assert_bitwise(_weights(fresh), _weights(model))
