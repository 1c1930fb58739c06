"""Restoring onto another layout, in real gloo jobs, checked bitwise against the sources.

Every tensor of the saved state is a deterministic function of its name (`source`), so a
job of any world size can rebuild the exact global tensor and compare its restored piece
with the matching slice, bit for bit (NaN payloads, -0.0 and inf included). Restore
targets start as the bitwise complement of the source, so any element that restore does
not write is caught.

Launches are the cost (~3-5 s each on a small machine), so each one covers many cases:

    save1   world 1: save
    save2   world 2: save
    job4    world 4: restore 1->4, then save (1-D and 2x2-mesh DTensors, per-node roots too)
    job3    world 3: restore 2->3 and 4->3, then save
    job2    world 2: restore 3->2 and 4->2
    job1    world 1: restore 4->1

Each restore case runs twice, with verify_on_restore on (whole checksummed blocks) and off
(exact row ranges, per-row spans for a column split). Each checks: every tensor variant
(`VARIANTS`: uneven `ckpt.Shard` row/column splits changing, sharded->replicated,
replicated->sharded, DTensor Shard(0)<->Shard(1), Shard<->Replicate, 2-D meshes, a
multi-block 8 MiB array), an FSDP2-like module with Adam (its state must follow the new
param placements), the sampler's unconsumed samples, per-rank trees and RNG streams.

Workers record failed checks per section ("<old>to<new>:<aspect>:<mode>", see
tests/_dist.py); the parent turns each section into one test, and also requires that the
section ran checks on every rank.
"""

from __future__ import annotations

import collections
import datetime
import os
import random
import traceback
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.store import versions
from ckpt.store.rank_file import RankFiles
from ckpt.store.tier import open_tier
from tests._dist import launch
from tests._states import bitwise_diff, draw_rng

THIS = os.path.abspath(__file__)
STEP = 5
SPLIT_BYTES = 512  # replicated arrays are split over the saving ranks
TIMEOUT = datetime.timedelta(seconds=60)
N_SAMPLES, SAMPLER_SEED, SAMPLER_EPOCH, CONSUMED = 25, 7, 1, 3
SAVE_LRS, FRESH_LRS = (0.01, 0.02), (0.5, 0.6)
DATASET: Any = list(range(N_SAMPLES))

# Uneven splits per world size: rank r holds table[W][r] along the dimension.
ROWS8 = {1: [8], 2: [3, 5], 3: [2, 2, 4], 4: [1, 2, 3, 2]}
COLS9 = {1: [9], 2: [4, 5], 3: [2, 3, 4], 4: [3, 1, 3, 2]}
ROWS64 = {1: [64], 2: [30, 34], 3: [21, 13, 30], 4: [5, 27, 16, 16]}
VEC11 = {1: [11], 2: [6, 5], 3: [4, 4, 3], 4: [0, 5, 3, 3]}  # an empty piece on 4 ranks
# "big" is 2100 x 1024 float32 (8.4 MiB), saved replicated: one chunk per saving rank, so
# chunks of 2100 (world 1) and 1050 (world 2) rows hold several 1024-row checksummed blocks.
BIG = {1: [2100], 2: [1000, 1100], 3: [1000, 100, 1000], 4: [1030, 10, 1000, 60]}

Layout = tuple[Any, ...]


def _shard(dim: int, table: dict[int, list[int]]) -> Any:
    return lambda w: ("shard", dim, table)


def _dt(*placements: str, on4: tuple[str, ...] | None = None) -> Any:
    """A DTensor on the 1-D mesh of all ranks; with on4, on the 2x2 mesh when there are 4 ranks."""
    return lambda w: ("dt", "2d", on4) if (w == 4 and on4) else ("dt", "1d", placements)


def _plain(w: int) -> Layout:
    return ("plain",)


def _halves(w: int) -> Layout:
    return ("halves",)


# name: (dtype, global shape, layout at save, layout at restore); layouts are functions of the world size.
VARIANTS: dict[str, tuple[torch.dtype, tuple[int, ...], Any, Any]] = {
    "rows": (torch.float32, (8, 6), _shard(0, ROWS8), _shard(0, ROWS8)),
    "cols": (torch.bfloat16, (5, 9), _shard(1, COLS9), _shard(1, COLS9)),
    "cols3d": (torch.float64, (4, 9, 3), _shard(1, COLS9), _shard(1, COLS9)),
    "rows2cols": (torch.float32, (8, 9), _shard(0, ROWS8), _shard(1, COLS9)),
    "cols2rows": (torch.float16, (8, 9), _shard(1, COLS9), _shard(0, ROWS8)),
    "vec": (torch.int32, (11,), _shard(0, VEC11), _shard(0, VEC11)),
    "shard2rep": (torch.int64, (8, 6), _shard(0, ROWS8), _plain),
    "rep2rows": (torch.float32, (64, 9), _plain, _shard(0, ROWS64)),
    "rep2cols": (torch.float32, (64, 9), _plain, _shard(1, COLS9)),
    "rep2rep": (torch.float64, (64, 5), _plain, _plain),
    "big": (torch.float32, (2100, 1024), _plain, _shard(0, BIG)),
    "scalar": (torch.float64, (), _plain, _plain),
    "scalar_bf16": (torch.bfloat16, (), _plain, _plain),
    "dptp": (torch.float16, (8, 4), _halves, _shard(0, ROWS8)),  # row halves 3/5, each held by replicas
    "dt_s0_s1": (torch.float32, (7, 5), _dt("S0"), _dt("S1", on4=("S1", "S0"))),
    "dt_s1_s0": (torch.float64, (7, 5), _dt("S1"), _dt("S0")),
    "dt_s0_rep": (torch.float32, (7, 5), _dt("S0"), _dt("R")),
    "dt_rep_s0": (torch.bfloat16, (7, 5), _dt("R"), _dt("S0", on4=("S0", "S1"))),
    "dt_s0_s0": (torch.float32, (9, 3), _dt("S0"), _dt("S0", on4=("S0", "S0"))),
    "dt2shard": (torch.float32, (7, 9), _dt("S0"), _shard(1, COLS9)),
    "shard2dt": (torch.float32, (8, 5), _shard(0, ROWS8), _dt("S1")),
}
# Saved on a 2x2 mesh (only by the world-4 job), restored on 1-D meshes, a plain tensor or another 2-D layout.
VARIANTS_2D: dict[str, tuple[torch.dtype, tuple[int, ...], Any, Any]] = {
    "dt2d_s0s1": (
        torch.float32,
        (5, 7),
        lambda w: ("dt", "2d", ("S0", "S1")),
        lambda w: {1: ("plain",), 2: ("dt", "1d", ("S1",)), 3: ("dt", "1d", ("S0",)), 4: ("dt", "2d", ("S1", "S0"))}[w],
    ),
    "dt2d_rs1": (
        torch.float64,
        (6, 5),
        lambda w: ("dt", "2d", ("R", "S1")),
        lambda w: {
            1: ("dt", "1d", ("S0",)),
            2: ("dt", "1d", ("S0",)),
            3: ("dt", "1d", ("R",)),
            4: ("dt", "2d", ("S0", "R")),
        }[w],
    ),
}

# FSDP2 shards every parameter on dim 0; the restoring job uses other placements for some.
OPT_SAVE: dict[str, tuple[str, ...]] = {
    "l1.weight": ("S0",),
    "l1.bias": ("S0",),
    "l2.weight": ("S0",),
    "l2.bias": ("S0",),
}
OPT_RESTORE: dict[str, tuple[str, ...]] = {
    "l1.weight": ("S0",),
    "l1.bias": ("S0",),
    "l2.weight": ("S1",),
    "l2.bias": ("R",),
}


def variants(saved_world: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], Any, Any]]:
    return {**VARIANTS, **(VARIANTS_2D if saved_world == 4 else {})}


# ---------------------------------------------------------------------------------------
# Helpers used by the workers
# ---------------------------------------------------------------------------------------

COUNTS: collections.Counter[str] = collections.Counter()  # checks run per section, reported to the parent
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NAN_PAYLOAD = {
    torch.float16: 0x7E01,
    torch.bfloat16: 0x7FC1,
    torch.float32: 0x7FC00123,
    torch.float64: 0x7FF8000000000123,
}
_SOURCES: dict[str, torch.Tensor] = {}


def chk(ctx: Any, cond: Any, msg: str) -> bool:
    COUNTS[ctx.section] += 1
    return bool(ctx.check(cond, msg))


def _dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def source(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor `name`: the same in every process; floats carry -0.0, inf and a NaN payload."""
    key = f"{name}:{dtype}:{shape}"
    if key not in _SOURCES:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if dtype.is_floating_point:
            t = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
            flat = t.view(-1)
            if flat.numel() >= 3:
                n = flat.numel()
                flat[0] = -0.0
                flat[n // 2] = float("-inf")
                flat.view(_INT_OF_SIZE[t.element_size()])[n - 1] = _NAN_PAYLOAD[dtype]
        else:
            bound = 1 << (62 if dtype == torch.int64 else 30)
            t = torch.randint(-bound, bound, shape, generator=g, dtype=dtype)
        _SOURCES[key] = t
    return _SOURCES[key]


def garbage(src: torch.Tensor) -> torch.Tensor:
    """Differs from `src` in every element's bits: what a restore target holds before restoring."""
    as_int = _INT_OF_SIZE[src.element_size()]
    return torch.bitwise_not(src.view(as_int)).view(src.dtype)


def _placements(names: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    return [Replicate() if p == "R" else DShard(int(p[1:])) for p in names]


def make_meshes(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return meshes


def make_leaf(layout: Layout, fill: torch.Tensor, world: int, rank: int, meshes: dict[str, Any]) -> Any:
    """This rank's piece of `fill` in the given layout."""
    from torch.distributed.tensor import distribute_tensor

    import ckpt

    kind = layout[0]
    if kind == "plain":
        return fill.clone()
    if kind == "dt":
        return distribute_tensor(fill.clone(), meshes[layout[1]], _placements(layout[2]), src_data_rank=None)
    if kind == "halves":
        dim, sizes, part = 0, ([fill.shape[0]] if world == 1 else [3, fill.shape[0] - 3]), 0 if world == 1 else rank % 2
    else:
        dim, table = layout[1], layout[2]
        sizes, part = table[world], rank
    start = sum(sizes[:part])
    index = [slice(None)] * fill.dim()
    index[dim] = slice(start, start + sizes[part])
    offsets = [0] * fill.dim()
    offsets[dim] = start
    return ckpt.Shard(fill[tuple(index)].clone(), tuple(fill.shape), tuple(offsets))


def build_tensors(ctx: Any, meshes: dict[str, Any], saved_world: int, role: str) -> dict[str, Any]:
    """role "save": the saving job's pieces of the sources; "restore": target pieces holding garbage."""
    out = {}
    for name, (dtype, shape, save_layout, restore_layout) in variants(saved_world).items():
        src = source(name, dtype, shape)
        if role == "save":
            out[name] = make_leaf(save_layout(ctx.world), src, ctx.world, ctx.rank, meshes)
        else:
            out[name] = make_leaf(restore_layout(ctx.world), garbage(src), ctx.world, ctx.rank, meshes)
    return out


def local_piece(leaf: Any) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local data, where it starts in the global tensor), computed without the library."""
    import ckpt

    if isinstance(leaf, ckpt.Shard):
        return leaf.local_tensor, tuple(leaf.offsets)
    if _dtensor(leaf):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(leaf.shape, leaf.device_mesh, leaf.placements)
        return leaf.to_local(), tuple(int(o) for o in offsets)
    return leaf, (0,) * leaf.dim()


def expected_slice(full: torch.Tensor, local: torch.Tensor, offsets: tuple[int, ...]) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))]


def check_tensor(ctx: Any, name: str, got: Any, target: Any, full: torch.Tensor, mode: str) -> None:
    """`got` (what the state holds after restore) is `target` (the object before), filled with `full`'s bits."""
    import ckpt

    tag = f"[{mode}] {name}"
    chk(ctx, got is target, f"{tag}: the state no longer holds the target object ({type(got).__name__})")
    local, offsets = local_piece(target)
    chk(
        ctx,
        not bitwise_diff(local, expected_slice(full, local, offsets)),
        f"{tag}: local piece at {offsets} {tuple(local.shape)} differs from the source "
        f"({local.reshape(-1)[:4].tolist()} vs {expected_slice(full, local, offsets).reshape(-1)[:4].tolist()})",
    )
    if isinstance(target, ckpt.Shard):
        chk(ctx, tuple(target.global_shape) == tuple(full.shape), f"{tag}: Shard global shape changed")
    if _dtensor(target):
        chk(ctx, not bitwise_diff(target.full_tensor(), full), f"{tag}: full_tensor() differs from the source")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(6, 7)
        self.l2 = torch.nn.Linear(7, 3)


def make_fsdp(
    meshes: dict[str, Any],
    placements: dict[str, tuple[str, ...]] | None,
    seed: int,
    lrs: tuple[float, float],
    init: dict[str, torch.Tensor] | None = None,
) -> tuple[Net, torch.optim.Optimizer]:
    """A module whose parameters are DTensors (plain tensors when placements is None), and Adam over them."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    net = Net()
    for mod_name in ("l1", "l2"):
        mod = getattr(net, mod_name)
        for pn in ("weight", "bias"):
            name = f"{mod_name}.{pn}"
            value = (init[name] if init is not None else getattr(mod, pn)).detach().clone()
            if placements is not None:
                value = distribute_tensor(value, meshes["1d"], _placements(placements[name]), src_data_rank=None)
            setattr(mod, pn, torch.nn.Parameter(value))
    opt = torch.optim.Adam(
        [{"params": list(net.l1.parameters()), "lr": lrs[0]}, {"params": list(net.l2.parameters()), "lr": lrs[1]}],
        betas=(0.8, 0.95),
        weight_decay=0.01,
    )
    return net, opt


def fsdp_step(net: Net, opt: torch.optim.Optimizer, seed: int) -> None:
    """One Adam step with the same global gradients whatever the layout."""
    from torch.distributed.tensor import distribute_tensor

    params: dict[str, Any] = dict(net.named_parameters())
    for name, p in params.items():
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + zlib.crc32(name.encode())))
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if _dtensor(p) else g
    opt.step()
    opt.zero_grad()


def _full(t: Any) -> torch.Tensor:
    out: torch.Tensor = (t.full_tensor() if _dtensor(t) else t).detach().clone()
    return out


def torch_sampler_list(world: int, rank: int, epoch: int) -> list[int]:
    """torch's own DistributedSampler: the reference order."""
    from torch.utils.data import DistributedSampler

    s: Any = DistributedSampler(DATASET, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED)
    s.set_epoch(epoch)
    return list(s)


def meta_of(rank: int, world: int) -> dict[str, Any]:
    return {"rank": rank, "world": world, "tag": f"rank{rank}", "nested": [rank, (rank, "x")], "inf": float("inf")}


# ---------------------------------------------------------------------------------------
# Scenarios (run inside the workers)
# ---------------------------------------------------------------------------------------


def save_job(ctx: Any, base: str, meshes: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import ckpt

    W, r = ctx.world, ctx.rank
    ctx.section = f"save{W}"
    tensors = build_tensors(ctx, meshes, W, "save")
    net, opt = make_fsdp(meshes, OPT_SAVE, seed=5, lrs=SAVE_LRS)
    fsdp_step(net, opt, seed=1)
    chk(ctx, all(_dtensor(opt.state[p]["exp_avg"]) for p in net.parameters()), "Adam state is not DTensor")
    sampler = ckpt.DistributedSampler(DATASET, num_replicas=W, rank=r, seed=SAMPLER_SEED)
    sampler.set_epoch(SAMPLER_EPOCH)
    it = iter(sampler)
    consumed = [next(it) for _ in range(CONSUMED)]
    chk(ctx, consumed == torch_sampler_list(W, r, SAMPLER_EPOCH)[:CONSUMED], "sampler order differs from torch's")
    # Per-rank RNG streams, with cached Gaussians pending in Python and NumPy.
    random.seed(1000 + r)
    np.random.seed(2000 + r)
    torch.manual_seed(3000 + r)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    torch.rand(3)
    state = {"t": tensors, "fsdp": {"model": net, "optim": opt}, "sampler": sampler, "meta": meta_of(r, W)}
    with ckpt.Checkpointer(f"{base}/w{W}", split_bytes=SPLIT_BYTES, timeout=TIMEOUT) as ck:
        ck.save(STEP, state)
        draws = draw_rng()
        ck.wait()
    if W == 4:  # again on two "nodes" (separate roots): a reader must get the other node's chunks by broadcast
        with ckpt.Checkpointer(f"{base}/w4nodes/node{r // 2}", split_bytes=SPLIT_BYTES, timeout=TIMEOUT) as ck:
            ck.save(STEP, {"t": tensors})
    # The optimizer's full tensors, as saved: the reference of the restoring jobs.
    ref: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for name, p in net.named_parameters():
        ref["param"][name] = _full(p)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            ref[k][name] = _full(opt.state[p][k])
    if r == 0:
        torch.save(ref, f"{base}/w{W}.optref.pt")
    dist.barrier()
    return {"draws": draws, "consumed": consumed}


def guarded(ctx: Any, section: str, fn: Any, *args: Any) -> None:
    """Run a group of checks; an exception in them is a failed check of its section, not a dead rank."""
    ctx.section = section
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        chk(ctx, False, f"the checks raised:\n{traceback.format_exc()}")


def check_optim(ctx: Any, mode: str, meshes: dict[str, Any], net: Net, opt: torch.optim.Optimizer, ref: Any) -> None:
    """Adam's state is restored bitwise and follows the new param placements; it trains on like torch's own load."""
    from torch.distributed.tensor import distribute_tensor

    W = ctx.world
    params: dict[str, Any] = dict(net.named_parameters())
    chk(ctx, [g["lr"] for g in opt.param_groups] == list(SAVE_LRS), f"lrs {[g['lr'] for g in opt.param_groups]}")
    chk(
        ctx,
        [list(g["params"]) for g in opt.param_groups] == [list(net.l1.parameters()), list(net.l2.parameters())],
        "the optimizer no longer holds the module's parameters",
    )
    chk(ctx, set(opt.state) == set(params.values()), "optimizer state is not keyed by the module's parameters")
    for name, p in params.items():
        want_pl = tuple(_placements(OPT_RESTORE[name])) if W > 1 else None
        chk(ctx, (tuple(p.placements) if _dtensor(p) else None) == want_pl, f"{name}: param placement changed")
        check_tensor(ctx, f"param {name}", p, p, ref["param"][name], mode)
        st = opt.state.get(p, {})
        chk(ctx, not bitwise_diff(st.get("step"), ref["step"][name]), f"{name}: step {st.get('step')!r}")
        for k in ("exp_avg", "exp_avg_sq"):
            v = st.get(k)
            if not chk(ctx, isinstance(v, torch.Tensor), f"{name}: no {k}"):
                continue
            if W > 1:
                chk(
                    ctx,
                    _dtensor(v) and tuple(v.placements) == want_pl and v.device_mesh == p.device_mesh,
                    f"{name}: {k} does not follow the param placement {want_pl}: "
                    f"{getattr(v, 'placements', 'plain tensor')}",
                )
            else:
                chk(ctx, not _dtensor(v), f"{name}: {k} is a DTensor, the param is not")
            check_tensor(ctx, f"{name} {k}", v, v, ref[k][name], mode)
    # The restored module trains exactly like one loaded with torch's load_state_dict on this layout.
    ref_net, ref_opt = make_fsdp(meshes, OPT_RESTORE if W > 1 else None, seed=78, lrs=SAVE_LRS, init=ref["param"])

    def like(t: torch.Tensor, p: Any) -> torch.Tensor:
        t = t.clone()  # load_state_dict keeps a plain tensor as it is: the step must not change `ref`
        return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None) if _dtensor(p) else t

    ref_opt.load_state_dict(
        {
            "state": {
                i: {
                    "step": ref["step"][name].clone(),
                    "exp_avg": like(ref["exp_avg"][name], p),
                    "exp_avg_sq": like(ref["exp_avg_sq"][name], p),
                }
                for i, (name, p) in enumerate(ref_net.named_parameters())
            },
            "param_groups": ref_opt.state_dict()["param_groups"],
        }
    )
    fsdp_step(net, opt, seed=2)
    fsdp_step(ref_net, ref_opt, seed=2)
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        for a, b, what in [(p, q, "param")] + [
            (opt.state[p][k], ref_opt.state[q][k], k) for k in ("exp_avg", "exp_avg_sq")
        ]:
            chk(
                ctx,
                not bitwise_diff(local_piece(a)[0], local_piece(b)[0]),
                f"[{mode}] after a step: {name} {what} differs",
            )


def check_sampler(ctx: Any, mode: str, old: int, sampler: Any) -> None:
    """The new ranks split exactly the unconsumed part of the epoch: none repeated, none skipped."""
    import torch.distributed as dist

    W, r = ctx.world, ctx.rank
    chk(ctx, (sampler.epoch, sampler.seed) == (SAMPLER_EPOCH, SAMPLER_SEED), f"epoch/seed {sampler.state_dict()}")
    sampler.set_epoch(SAMPLER_EPOCH)  # what a loader loop does first: keeps the resumed position
    n = len(sampler)  # an epoch at this world size, also while this one yields its rest (loops size epochs by it)
    mine = list(sampler)
    everyone: list[Any] = [None] * W
    dist.all_gather_object(everyone, mine)
    rest = collections.Counter(i for o in range(old) for i in torch_sampler_list(old, o, SAMPLER_EPOCH)[CONSUMED:])
    got_all = collections.Counter(i for lst in everyone for i in lst)
    chk(
        ctx,
        got_all == rest,
        f"[{mode}] the new ranks' samples are not the unconsumed part: "
        f"repeated/extra {sorted((got_all - rest).elements())}, skipped {sorted((rest - got_all).elements())}",
    )
    sizes = [len(lst) for lst in everyone]
    chk(ctx, max(sizes) - min(sizes) <= 1, f"unbalanced split {sizes}")
    sampler.set_epoch(SAMPLER_EPOCH + 1)  # the next epoch is torch's order for the new world size
    nxt = list(sampler)
    chk(ctx, nxt == torch_sampler_list(W, r, SAMPLER_EPOCH + 1), "next epoch differs from torch's")
    chk(ctx, n == len(nxt) == len(sampler), f"len(sampler) {n} in the resumed epoch, the next yields {len(nxt)}")


def restore_pair(ctx: Any, base: str, old: int, saved: list[dict[str, Any]], meshes: dict[str, Any]) -> None:
    """Restore the world-`old` checkpoint into this job, with and without verification; check everything."""
    import torch.distributed as dist

    import ckpt

    W, r = ctx.world, ctx.rank
    pair = f"{old}to{W}"
    root = f"{base}/w{old}"
    ref = torch.load(f"{base}/w{old}.optref.pt")
    draws: dict[str, list[Any]] = {}
    for verify in (True, False):
        mode = "verified" if verify else "unverified"
        tensors = build_tensors(ctx, meshes, old, "restore")
        targets = dict(tensors)
        net, opt = make_fsdp(meshes, OPT_RESTORE if W > 1 else None, seed=77, lrs=FRESH_LRS)
        sampler = ckpt.DistributedSampler(DATASET, num_replicas=W, rank=r, seed=99)
        meta: dict[str, Any] = {"rank": -1, "world": None, "tag": None, "nested": None, "inf": None}
        state = {"t": tensors, "fsdp": {"model": net, "optim": opt}, "sampler": sampler, "meta": meta}
        error = None
        try:
            with ckpt.Checkpointer(root, verify_on_restore=verify, timeout=TIMEOUT) as ck:
                got = ck.restore(state)
                draws[mode] = draw_rng()
            if got != STEP:
                error = f"restore returned {got}"
        except Exception as e:  # noqa: BLE001 - reported in every section of this case
            error = f"restore raised {type(e).__name__}: {e}"
        oks = [None] * W
        dist.all_gather_object(oks, error)
        if any(oks):
            for aspect in ("tensors", "mesh2d", "optim", "sampler", "tree", "rng"):
                ctx.section = f"{pair}:{aspect}:{mode}" if aspect != "rng" else f"{pair}:rng"
                chk(ctx, False, f"[{mode}] {error or 'another rank failed: ' + str(oks)}")
            continue

        for name, (dtype, shape, _, _) in variants(old).items():  # mesh2d: the variants saved on the 2x2 mesh
            section = f"{pair}:{'mesh2d' if name.startswith('dt2d') else 'tensors'}:{mode}"
            guarded(
                ctx, section, check_tensor, ctx, name, tensors[name], targets[name], source(name, dtype, shape), mode
            )
        guarded(ctx, f"{pair}:optim:{mode}", check_optim, ctx, mode, meshes, net, opt, ref)
        guarded(ctx, f"{pair}:sampler:{mode}", check_sampler, ctx, mode, old, sampler)
        ctx.section = f"{pair}:tree:{mode}"  # per-rank trees come from old rank r % old
        chk(ctx, meta == meta_of(r % old, old), f"meta {meta} (expected old rank {r % old}'s)")
        chk(ctx, type(meta.get("nested", [None, None])[1]) is tuple, "a tuple came back as a list")

    if len(draws) == 2:
        guarded(ctx, f"{pair}:rng", check_rng, ctx, old, root, saved, draws)


def check_rng(ctx: Any, old: int, root: str, saved: list[dict[str, Any]], draws: dict[str, list[Any]]) -> None:
    """Old ranks' streams continue; new ranks are seeded the same on every restore, differently per rank."""
    import torch.distributed as dist
    import xxhash

    from ckpt.store import versions

    W, r = ctx.world, ctx.rank
    d1, d2 = draws["verified"], draws["unverified"]
    if r < old:
        chk(ctx, d1 == saved[r]["draws"], "rank's RNG draws differ from the old rank's after save")
        chk(ctx, d2 == saved[r]["draws"], "second restore: RNG draws differ from the old rank's")
    else:
        chk(ctx, d1 == d2, "a new rank drew differently after restoring the same checkpoint twice")
        chk(ctx, all(d1 != s["draws"] for s in saved), "a new rank continued an old rank's RNG stream")
        save_id = versions.read_manifest(root, STEP).save_id
        random.seed(xxhash.xxh3_64_intdigest(f"{save_id}:{r}".encode()))
        chk(ctx, d1[:2] == [random.random(), random.gauss(0.0, 1.0)], "Python RNG not seeded by xxh3(save_id:rank)")
    all_draws: list[Any] = [None] * W
    dist.all_gather_object(all_draws, d1)
    chk(ctx, all(all_draws[i] != all_draws[j] for i in range(W) for j in range(i)), "two ranks draw the same numbers")


def restore_nodes(ctx: Any, base: str, meshes: dict[str, Any]) -> None:
    """The 4-rank save on two node roots, restored where each new rank reaches one node's chunks only."""
    import torch.distributed as dist

    import ckpt

    W, r = ctx.world, ctx.rank
    node = {2: [0, 1], 3: [0, 0, 1]}[W][r]
    for verify in (True, False):
        mode = "verified" if verify else "unverified"
        ctx.section = f"4to{W}:nodes:{mode}"
        tensors = build_tensors(ctx, meshes, 4, "restore")
        targets = dict(tensors)
        error = None
        try:
            with ckpt.Checkpointer(f"{base}/w4nodes/node{node}", verify_on_restore=verify, timeout=TIMEOUT) as ck:
                got = ck.restore({"t": tensors})
            if got != STEP:
                error = f"restore returned {got}"
        except Exception as e:  # noqa: BLE001
            error = f"restore raised {type(e).__name__}: {e}"
        errors: list[Any] = [None] * W
        dist.all_gather_object(errors, error)
        if not chk(ctx, not any(errors), f"[{mode}] {errors}"):
            continue
        for name, (dtype, shape, _, _) in variants(4).items():
            src = source(name, dtype, shape)
            guarded(ctx, ctx.section, check_tensor, ctx, name, tensors[name], targets[name], src, mode)


def job(ctx: Any, base: str, restore_from: dict[str, list[dict[str, Any]]], save: bool) -> dict[str, Any]:
    meshes = make_meshes(ctx.world)
    for old, saved in restore_from.items():
        restore_pair(ctx, base, int(old), saved, meshes)
        if int(old) == 4 and ctx.world in (2, 3):
            restore_nodes(ctx, base, meshes)
    out: dict[str, Any] = {}
    if save:
        out["save"] = save_job(ctx, base, meshes)
    out["counts"] = dict(COUNTS)
    return out


# ---------------------------------------------------------------------------------------
# Launches (module-scoped, chained by what each restores) and the tests
# ---------------------------------------------------------------------------------------


def _launch(base: Path, world: int, name: str, restore_from: dict[int, Any], save: bool) -> dict[str, Any]:
    results, failures = launch(
        THIS,
        "job",
        world,
        base / name,
        timeout=240,
        base=str(base),
        restore_from={str(k): [r["save"] for r in v["results"]] for k, v in restore_from.items()},
        save=save,
    )
    return {"results": results, "failures": failures, "world": world}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def save1(base: Path) -> dict[str, Any]:
    return _launch(base, 1, "save1", {}, True)


@pytest.fixture(scope="module")
def save2(base: Path) -> dict[str, Any]:
    return _launch(base, 2, "save2", {}, True)


@pytest.fixture(scope="module")
def job4(base: Path, save1: dict[str, Any]) -> dict[str, Any]:
    return _launch(base, 4, "job4", {1: save1}, True)


@pytest.fixture(scope="module")
def job3(base: Path, save2: dict[str, Any], job4: dict[str, Any]) -> dict[str, Any]:
    return _launch(base, 3, "job3", {2: save2, 4: job4}, True)


@pytest.fixture(scope="module")
def job2(base: Path, job3: dict[str, Any], job4: dict[str, Any]) -> dict[str, Any]:
    return _launch(base, 2, "job2", {3: job3, 4: job4}, False)


@pytest.fixture(scope="module")
def job1(base: Path, job4: dict[str, Any]) -> dict[str, Any]:
    return _launch(base, 1, "job1", {4: job4}, False)


RESTORING_JOB = {4: "job4", 3: "job3", 2: "job2", 1: "job1"}
PAIRS = [(2, 3), (4, 1), (1, 4), (3, 2), (4, 2), (4, 3)]
MODES = ["verified", "unverified"]


def _ids(pair: tuple[int, int]) -> str:
    return f"{pair[0]}to{pair[1]}"


def assert_section(run: dict[str, Any], section: str) -> None:
    failures = [f for f in run["failures"] if f.startswith(f"[{section}]")]
    assert not failures, "\n".join(failures)
    for rank, res in enumerate(run["results"]):
        assert res["counts"].get(section, 0) > 0, f"rank {rank} ran no check of {section}"


def _run(request: pytest.FixtureRequest, pair: tuple[int, int]) -> dict[str, Any]:
    run: dict[str, Any] = request.getfixturevalue(RESTORING_JOB[pair[1]])
    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_tensors(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    """Every variant: uneven Shard splits, sharded<->replicated, DTensor placements, multi-block reads."""
    assert_section(_run(request, pair), f"{_ids(pair)}:tensors:{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", [(4, 1), (4, 2), (4, 3)], ids=_ids)
def test_2d_mesh(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    """Saved on a 2x2 mesh ([Shard(0), Shard(1)] and [Replicate(), Shard(1)]), restored on other meshes."""
    assert_section(_run(request, pair), f"{_ids(pair)}:mesh2d:{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", [(4, 2), (4, 3)], ids=_ids)
def test_per_node_roots(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    """Chunks of the other node's root arrive by broadcast, and are resharded like local ones."""
    assert_section(_run(request, pair), f"{_ids(pair)}:nodes:{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_optimizer_follows_params(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    assert_section(_run(request, pair), f"{_ids(pair)}:optim:{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_sampler_new_world(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    assert_section(_run(request, pair), f"{_ids(pair)}:sampler:{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_trees_from_old_rank(request: pytest.FixtureRequest, pair: tuple[int, int], mode: str) -> None:
    assert_section(_run(request, pair), f"{_ids(pair)}:tree:{mode}")


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_rng(request: pytest.FixtureRequest, pair: tuple[int, int]) -> None:
    """Old ranks continue their stream; new ranks are seeded the same on every restore, differently per rank."""
    assert_section(_run(request, pair), f"{_ids(pair)}:rng")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_saves(request: pytest.FixtureRequest, base: Path, world: int) -> None:
    """The saving jobs ran cleanly, and the layouts the restores start from are the intended ones."""

    run = request.getfixturevalue({1: "save1", 2: "save2", 3: "job3", 4: "job4"}[world])
    assert_section(run, f"save{world}")
    m = versions.read_manifest(str(base / f"w{world}"), STEP)
    assert m.world_size == world
    assert set(variants(world)) <= {n.split("/", 1)[1] for n in m.arrays if n.startswith("t/")}
    big = m.arrays["t/big"]
    assert big.chunk_count == world and {c.writer for c in big.iter_chunks()} == set(range(world))
    if world <= 2:  # chunks of 2100 and 1050 rows: several checksummed blocks each
        book = RankFiles(open_tier(str(base / f"w{world}")))
        blocks = [len(book.resolve(STEP, m, big, c).blocks) for c in big.iter_chunks()]
        assert all(n >= 2 for n in blocks), blocks
    assert m.arrays["t/rep2rows"].replicated
    if world > 1:
        assert not m.arrays["t/rows"].replicated
        assert m.arrays["t/cols"].chunk_count > 1 and m.arrays["t/cols"].chunk_shape[0] == 5


def test_empty_piece_plans_no_chunk() -> None:
    """DTensor places an empty shard at offset = the dim's size (5 columns on 4 ranks: 2, 2, 1, 0 at 5):
    it holds nothing, so it must neither get a chunk (that one would overlap rank 2's) nor shape the grid."""
    from ckpt.store.layout import ArraySpec, HeldRegion, plan_arrays

    held = [((0, 0), (7, 2)), ((0, 2), (7, 2)), ((0, 4), (7, 1)), ((0, 5), (7, 0))]
    spec = ArraySpec("w", "float32", (7, 5), tuple(HeldRegion(r, o, s) for r, (o, s) in enumerate(held)))
    (plan,) = plan_arrays([spec])
    assert plan.chunk_shape == (7, 2)
    assert [(c.offsets, c.shape, c.writer) for c in plan.chunks] == [
        ((0, 0), (7, 2), 0),
        ((0, 2), (7, 2), 1),
        ((0, 4), (7, 1), 2),
    ]
    # An empty piece elsewhere (offset 3) leaves the grid of the others alone.
    odd = ArraySpec(
        "v", "int32", (8,), (HeldRegion(0, (0,), (4,)), HeldRegion(1, (4,), (4,)), HeldRegion(2, (3,), (0,)))
    )
    (plan,) = plan_arrays([odd])
    assert plan.chunk_shape == (4,) and [c.writer for c in plan.chunks] == [0, 1]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int64,
        torch.complex64,
        torch.complex128,
    ],
)
def test_placing_a_piece_copies_exactly_what_torch_would(dtype: torch.dtype) -> None:
    """restore.execute._copy_into (numpy's single-threaded copy) against torch's copy_, on
    row ranges, column ranges (strided) and transposed views, bitwise."""
    from ckpt.restore.execute import _copy_into

    g = torch.Generator().manual_seed(3)
    raw = torch.randint(
        0, 256, (40 * 24 * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8
    )
    src = (raw % 2 if dtype == torch.bool else raw).view(dtype).reshape(40, 24)  # bools as torch stores them: 0, 1
    for pick in ((slice(3, 17), slice(None)), (slice(None), slice(5, 19)), (slice(2, 30), slice(1, 23, 2))):
        part = src[pick]
        for dst_full in (torch.zeros(40, 24, dtype=dtype), torch.zeros(24, 40, dtype=dtype).t()):
            want = dst_full.clone()
            want[pick].copy_(part)
            _copy_into(dst_full[pick], part)
            assert torch.equal(dst_full.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_a_block_by_its_index_is_the_one_blocks_lists() -> None:
    """restore.reshard.block_at(i) (a peer's round reads runs of blocks by index) equals
    blocks()[i] for chunks with block digests, unresolved ones (schema 3), a last short
    block and a chunk checksummed whole; past the last block it raises IndexError."""
    from ckpt.restore.reshard import block_at, blocks
    from ckpt.store.manifest import ArrayEntry, ChunkEntry

    array = ArrayEntry("w", "float32", (10, 3), (10, 3), False, {}, block_rows=4)
    whole = ArrayEntry("v", "float32", (10, 3), (10, 3), False, {})
    cases = [
        (array, ChunkEntry((0, 0), 0, (0, 0), (10, 3), 120, "c0", blocks=("b0", "b1", "b2"))),
        (array, ChunkEntry((0, 0), 0, (0, 0), (10, 3), 120, "")),  # digests in a rank file, not yet read
        (whole, ChunkEntry((0, 0), 0, (0, 0), (10, 3), 120, "c1")),
    ]
    for arr, chunk in cases:
        listed = blocks(arr, chunk)
        assert [block_at(arr, chunk, i) for i in range(len(listed))] == listed
        with pytest.raises(IndexError):
            block_at(arr, chunk, len(listed))
    assert blocks(array, cases[0][1])[2].rows == (8, 10)
