"""The benchmark's training state: a GPT-like model and its Adam state after one step.

24 transformer blocks (LN, attention qkv/proj, MLP fc/proj, weights and biases) plus
token and position embeddings and a final LN: 292 parameter tensors, float32. The width
is chosen so the model has about `params` parameters; with Adam's exp_avg and
exp_avg_sq the state is about 12 bytes per parameter (250e6 params: ~3 GB).

The state is a plain nested dict, the same object for every library under test:

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
                                       "param_groups": [...]}}

(the FQN-keyed layout torch.distributed.checkpoint.state_dict.get_state_dict returns).
At world size > 1 every tensor but the scalar `step` is a DTensor Shard(0) on a 1-D CPU
mesh, as FSDP2 holds it, so the total bytes stay the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch

VOCAB = 50304
CONTEXT = 1024
LAYERS = 24


def width_for(params: float) -> int:
    """Model width (multiple of 64) giving about `params` parameters with 24 blocks."""
    # 12 d^2 + 13 d per block, (VOCAB + CONTEXT + 2) d outside the blocks
    a, b = 12 * LAYERS, 13 * LAYERS + VOCAB + CONTEXT + 2
    d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return max(64, int(round(d / 64)) * 64)


def shapes(params: float) -> dict[str, tuple[int, ...]]:
    d = width_for(params)
    out: dict[str, tuple[int, ...]] = {"wte.weight": (VOCAB, d), "wpe.weight": (CONTEXT, d)}
    for i in range(LAYERS):
        p = f"h.{i}."
        out[p + "ln_1.weight"] = (d,)
        out[p + "ln_1.bias"] = (d,)
        out[p + "attn.c_attn.weight"] = (3 * d, d)
        out[p + "attn.c_attn.bias"] = (3 * d,)
        out[p + "attn.c_proj.weight"] = (d, d)
        out[p + "attn.c_proj.bias"] = (d,)
        out[p + "ln_2.weight"] = (d,)
        out[p + "ln_2.bias"] = (d,)
        out[p + "mlp.c_fc.weight"] = (4 * d, d)
        out[p + "mlp.c_fc.bias"] = (4 * d,)
        out[p + "mlp.c_proj.weight"] = (d, 4 * d)
        out[p + "mlp.c_proj.bias"] = (d,)
    out["ln_f.weight"] = (d,)
    out["ln_f.bias"] = (d,)
    return out


def _shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """DTensor's Shard(0) split: ceil-sized pieces, the last ones shorter or empty."""
    size = -(-rows // world)
    lo = min(rows, rank * size)
    return lo, min(rows, lo + size)


def param_groups(names: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(names),
        }
    ]


_POOL: torch.Tensor | None = None


def _pool() -> torch.Tensor:
    """16M random float32 values, generated once; tensors are filled from it (memcpy speed)."""
    global _POOL
    if _POOL is None:
        _POOL = torch.empty(1 << 24).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    return _POOL


def _fill(out: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """out.flat[k] = scale * pool[(start + k) % len(pool)]: deterministic, any slice of a tensor."""
    pool, flat = _pool(), out.view(-1)
    n, done = pool.numel(), 0
    while done < flat.numel():
        pos = (start + done) % n
        take = min(n - pos, flat.numel() - done)
        torch.mul(pool[pos : pos + take], scale, out=flat[done : done + take])
        done += take
    return out


def build_state(params: float, rank: int = 0, world: int = 1, mesh: Any = None) -> dict[str, Any]:
    """The state after one Adam step, this rank's shard of it (identical values at any world size).

    Every element's value depends only on its tensor and global position, so the bytes do
    not depend on the world size; the Adam step is run on the local pieces (elementwise).
    """
    names = list(shapes(params))
    local_params: list[torch.Tensor] = []
    for i, shape in enumerate(shapes(params).values()):
        lo, hi = _shard_rows(shape[0], rank, world)
        row = math.prod(shape[1:])
        p = torch.empty((hi - lo, *shape[1:]))
        if len(shape) > 1:
            _fill(p, 7919 * i + lo * row, 0.02)
        else:
            p.fill_(0.5)
        p.grad = _fill(torch.empty_like(p), 104729 * i + lo * row, 1e-3)
        local_params.append(p)
    opt = torch.optim.Adam(local_params, lr=1e-3, foreach=True)
    opt.step()
    optim_state: dict[str, Any] = {}
    for name, p in zip(names, local_params):
        st = opt.state[p]
        optim_state[name] = {"step": st["step"], "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        p.grad = None
    del opt
    if world > 1:
        model, optim_state = _as_dtensors(names, local_params, optim_state, params, mesh)
    else:
        model = dict(zip(names, local_params))
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups(names)}}


def _as_dtensors(
    names: list[str], local: list[torch.Tensor], optim_state: dict[str, Any], params: float, mesh: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Shard

    shp = shapes(params)

    def wrap(t: torch.Tensor, name: str) -> Any:
        shape = torch.Size(shp[name])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    model = {n: wrap(t, n) for n, t in zip(names, local)}
    state = {
        n: {"step": s["step"], "exp_avg": wrap(s["exp_avg"], n), "exp_avg_sq": wrap(s["exp_avg_sq"], n)}
        for n, s in optim_state.items()
    }
    return model, state


def empty_state(params: float, rank: int = 0, world: int = 1, mesh: Any = None) -> dict[str, Any]:
    """The same structure filled with zeros (memory touched): a restore target."""
    names = list(shapes(params))
    local = []
    for shape in shapes(params).values():
        lo, hi = _shard_rows(shape[0], rank, world)
        local.append(torch.zeros((hi - lo, *shape[1:])))
    optim_state = {
        n: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
        for n, t in zip(names, local)
    }
    if world > 1:
        model, optim_state = _as_dtensors(names, local, optim_state, params, mesh)
    else:
        model = dict(zip(names, local))
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups(names)}}


def local_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of the state as a plain local tensor, in a fixed order."""
    out = []
    for t in state["model"].values():
        out.append(t.to_local() if hasattr(t, "to_local") else t)
    for s in state["optim"]["state"].values():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            t = s[k]
            out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def fingerprint(state: dict[str, Any]) -> list[float]:
    """A cheap content check: sums of a few local tensors (the same on every rank count only for world 1)."""
    ts = local_tensors(state)
    picks = [ts[0], ts[len(ts) // 3], ts[-2], ts[-1]]
    return [float(t.double().sum()) for t in picks]


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state))
