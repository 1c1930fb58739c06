"""Real multi-process tests: gloo process groups of 2 and 4 ranks on this machine.

Process launches are the cost here, so each launch tests several things:

- `world2` (2 ranks): the full-state round trip on one shared root, then the first half
  of the deterministic training run (reference run, and a run that saves and stops).
- `world4` (4 ranks): the round trip on one shared root, then again on two simulated
  nodes of two ranks each with separate roots.
- the resume launch (2 fresh ranks): restores the training run and finishes it.

Workers record failed checks per section instead of raising (see tests/_dist.py), so a
failure on one rank never leaves the others hanging in a collective; the parent turns
each section's failures into that test's assertion.
"""

from __future__ import annotations

import datetime
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import ckpt
from ckpt.store import versions
from ckpt.store.manifest import STATE_PREFIX
from tests._dist import launch
from tests._states import assert_bitwise, bitwise_diff, draw_rng

THIS = os.path.abspath(__file__)
SPLIT_BYTES = 2048  # small, so the 16 KiB replicated "big" tensor is split over the ranks
ROUNDTRIP_STEP = 7
TRAIN_TOTAL, TRAIN_FIRST_SAVE, TRAIN_SAVE_AT, TRAIN_STOP_AT = 15, 4, 8, 10


# ---------------------------------------------------------------------------------------
# Helpers used by the workers
# ---------------------------------------------------------------------------------------


def _dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(clone_tree(v) for v in x)
    return x


def row_split(world: int) -> list[int]:
    return [3, 5] if world == 2 else [1, 2, 3, 4]


def col_split(world: int) -> list[int]:
    return [2, 5] if world == 2 else [4, 1, 3, 2]


def tp_split() -> list[int]:
    return [3, 5]


def build_state(ctx: Any, *, fresh: bool) -> dict[str, Any]:
    """The state every rank saves; with fresh=True the same structure, other values."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    import ckpt

    W, r = ctx.world, ctx.rank
    torch.manual_seed(11 if fresh else 0)  # identical on every rank, as under DDP
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if not fresh else 0.5, betas=(0.8, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = ckpt.DistributedSampler(list(range(23)), num_replicas=W, rank=r, shuffle=True, seed=0 if fresh else 7)

    g = torch.Generator().manual_seed(123)  # global arrays: the same on every rank
    rows, cols = row_split(W), col_split(W)
    full_rows = torch.randn(sum(rows), 6, generator=g)
    full_ids = torch.arange(sum(rows) * 2, dtype=torch.int64).reshape(sum(rows), 2) * 7919
    full_cols = torch.randn(3, sum(cols), generator=g).to(torch.bfloat16)
    full_s0 = torch.randn(2 * W + 1, 5, generator=g)  # uneven; on 4 ranks the last shard is empty
    full_s1 = torch.randn(3, 2 * W + 3, generator=g, dtype=torch.float64)
    full_rep = torch.randn(6, 7, generator=g)
    big = torch.randn(64, 64, generator=g)  # 16 KiB replicated: split over the ranks
    r0, c0 = sum(rows[:r]), sum(cols[:r])

    def piece(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if fresh else t.clone()

    mesh = init_device_mesh("cpu", (W,))
    # DP x TP: tensor-parallel halves (rows 3/5), each held by W/2 data-parallel replicas.
    tp_rank = r % len(tp_split())
    full_dptp = torch.randn(sum(tp_split()), 4, generator=g, dtype=torch.float16)
    t0 = sum(tp_split()[:tp_rank])
    # An FSDP2-style module: DTensor parameters (Shard(0) weight, Replicate bias) and Adam over them.
    torch.manual_seed(12 if fresh else 1)
    lin = nn.Linear(6, 2 * W + 1)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [DShard(0)], src_data_rank=None))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Replicate()], src_data_rank=None))
    lin_opt = torch.optim.Adam(lin.parameters(), lr=0.02)
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "sampler": sampler,
        "shard": {
            "rows": ckpt.Shard(piece(full_rows[r0 : r0 + rows[r]]), full_rows.shape, (r0, 0)),
            "ids": ckpt.Shard(piece(full_ids[r0 : r0 + rows[r]]), full_ids.shape, (r0, 0)),
            "cols": ckpt.Shard(piece(full_cols[:, c0 : c0 + cols[r]]), full_cols.shape, (0, c0)),
            "dptp": ckpt.Shard(piece(full_dptp[t0 : t0 + tp_split()[tp_rank]]), full_dptp.shape, (t0, 0)),
        },
        "fsdp": {"model": lin, "optim": lin_opt},
        "dt": {
            "s0": distribute_tensor(piece(full_s0), mesh, [DShard(0)], src_data_rank=None),
            "s1": distribute_tensor(piece(full_s1), mesh, [DShard(1)], src_data_rank=None),
            "rep": distribute_tensor(piece(full_rep), mesh, [Replicate()], src_data_rank=None),
        },
        "big": piece(big),
        "meta": {"epoch": 0, "name": "", "frac": None, "nested": None}
        if fresh
        else {"epoch": 3, "name": "run", "frac": 0.1, "nested": [1, (2, "x")]},
    }
    full = {"s0": full_s0, "s1": full_s1, "rep": full_rep}
    if W == 4:  # a 2-D (dp, tp) mesh too
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full["2d_rep_s0"] = torch.randn(5, 7, generator=g)
        full["2d_s0_s1"] = torch.randn(5, 7, generator=g)
        state["dt"]["2d_rep_s0"] = distribute_tensor(
            piece(full["2d_rep_s0"]), mesh2, [Replicate(), DShard(0)], src_data_rank=None
        )
        state["dt"]["2d_s0_s1"] = distribute_tensor(
            piece(full["2d_s0_s1"]), mesh2, [DShard(0), DShard(1)], src_data_rank=None
        )
    state["_full"] = full  # for checks; not saved
    return state


def fsdp_step(st: dict[str, Any], seed: int) -> None:
    """An optimizer step on the DTensor parameters, with gradients that are DTensors too."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    lin, opt = st["fsdp"]["model"], st["fsdp"]["optim"]
    for p in lin.parameters():
        grad = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
    opt.step()
    opt.zero_grad()


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


# ---------------------------------------------------------------------------------------
# Scenarios (run inside the workers)
# ---------------------------------------------------------------------------------------


def roundtrip(ctx: Any, base: str, per_node: int | None, section: str) -> dict[str, Any]:
    """Save a full training state, restore it into fresh objects, compare bitwise."""
    import torch.distributed as dist

    import ckpt

    ctx.section = section
    W, r = ctx.world, ctx.rank
    root = (lambda rank: f"{base}/node{rank // per_node}") if per_node else base
    cfg = {"split_bytes": SPLIT_BYTES, "timeout": datetime.timedelta(seconds=60)}

    st = build_state(ctx, fresh=False)
    model, opt, sched, sampler = st["model"], st["optim"], st["sched"], st["sampler"]
    one_step(model, opt, seed=5)
    sched.step()
    fsdp_step(st, seed=6)
    sampler.set_epoch(2)
    it = iter(sampler)
    consumed = [next(it) for _ in range(3)]
    # Per-rank RNG streams, with cached Gaussians pending in Python and NumPy.
    random.seed(1000 + r)
    np.random.seed(2000 + r)
    torch.manual_seed(3000 + r)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    torch.rand(5)

    full = st.pop("_full")
    expected = {
        "model": clone_tree(model.state_dict()),
        "optim": clone_tree(opt.state_dict()),
        "sched": clone_tree(sched.state_dict()),
        "sampler": sampler.state_dict(),
        "shard": {k: v.local_tensor.clone() for k, v in st["shard"].items()},
        "dt": {k: v.to_local().clone() for k, v in st["dt"].items()},
        "big": st["big"].clone(),
        "meta": clone_tree(st["meta"]),
        "fsdp_model": clone_tree(st["fsdp"]["model"].state_dict()),
        "fsdp_optim": clone_tree(st["fsdp"]["optim"].state_dict()),
    }
    ctx.check(expected["optim"]["state"], "Adam has no state after one step")
    ctx.check(_dtensor(expected["fsdp_optim"]["state"][0]["exp_avg"]), "Adam state of a DTensor parameter")

    with ckpt.Checkpointer(root, **cfg) as ck:
        ck.save(ROUNDTRIP_STEP, st)
        rng_after_save = draw_rng()
        # save() returned: the state is staged; training may modify it while the commit runs.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            st["big"].mul_(-2.0)
            for v in st["shard"].values():
                v.local_tensor.add_(1)
            st["dt"]["s0"].to_local().add_(1.0)
        rest = list(it)
        ck.wait()
        bytes_written = ck.stats()[-1].bytes_written
        ctx.check(ck.steps() == [ROUNDTRIP_STEP], f"steps() is {ck.steps()}")
        my_root = ck.root
    ctx.check(sampler.state_dict()["position"] == len(consumed) + len(rest), "sampler position after the epoch")

    # Other RNG states, and fresh objects (other init, empty optimizer state).
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    fresh = build_state(ctx, fresh=True)
    fresh.pop("_full")
    ctx.check(
        not fresh["optim"].state and not fresh["fsdp"]["optim"].state, "the fresh optimizers should have no state"
    )
    ctx.check(
        any(bitwise_diff(a, b) for a, b in zip(fresh["model"].state_dict().values(), expected["model"].values())),
        "the fresh model should differ from the saved one before restoring",
    )
    with ckpt.Checkpointer(root, **cfg) as ck:
        got = ck.restore(fresh)
        rng_after_restore = draw_rng()
    ctx.check(got == ROUNDTRIP_STEP, f"restore returned {got}")
    ctx.check(rng_after_restore == rng_after_save, "RNG draws after restore differ from the draws after save")
    everyone = [None] * W
    dist.all_gather_object(everyone, rng_after_save)
    ctx.check(all(everyone[i] != everyone[j] for i in range(W) for j in range(i)), "ranks' RNG streams should differ")

    m, o = fresh["model"], fresh["optim"]
    for d in bitwise_diff(clone_tree(m.state_dict()), expected["model"], "model"):
        ctx.check(False, d)
    for d in bitwise_diff(clone_tree(o.state_dict()), expected["optim"], "optim"):
        ctx.check(False, d)
    for d in bitwise_diff(clone_tree(fresh["sched"].state_dict()), expected["sched"], "sched"):
        ctx.check(False, d)
    ctx.check(o.param_groups[0]["lr"] == expected["optim"]["param_groups"][0]["lr"], "optimizer lr")
    params = list(m.parameters())
    ctx.check(
        all(a is b for a, b in zip(o.param_groups[0]["params"], params))
        and len(o.param_groups[0]["params"]) == len(params),
        "the optimizer no longer holds the model's parameters",
    )
    ctx.check(set(o.state) == set(params), "optimizer state is not keyed by the model's parameters")
    for d in bitwise_diff(fresh["sampler"].state_dict(), expected["sampler"], "sampler"):
        ctx.check(False, d)
    fresh["sampler"].set_epoch(2)  # what a loader loop does first; keeps the resumed position
    ctx.check(list(fresh["sampler"]) == rest, f"sampler resumed {list(fresh['sampler'])}, expected {rest}")
    for k, v in fresh["shard"].items():
        ctx.check(
            isinstance(v, ckpt.Shard) and not bitwise_diff(v.local_tensor, expected["shard"][k]), f"shard/{k} differs"
        )
    for k, v in fresh["dt"].items():
        ctx.check(not bitwise_diff(v.to_local(), expected["dt"][k]), f"dt/{k}: local piece differs")
        ctx.check(not bitwise_diff(v.full_tensor(), full[k]), f"dt/{k}: full tensor differs")
    ctx.check(not bitwise_diff(fresh["big"], expected["big"]), "big differs")
    for d in bitwise_diff(fresh["meta"], expected["meta"], "meta"):
        ctx.check(False, d)
    fm, fo = fresh["fsdp"]["model"], fresh["fsdp"]["optim"]
    for d in bitwise_diff(clone_tree(fm.state_dict()), expected["fsdp_model"], "fsdp model"):
        ctx.check(False, d)
    for d in bitwise_diff(clone_tree(fo.state_dict()), expected["fsdp_optim"], "fsdp optim"):
        ctx.check(False, d)
    ctx.check(all(a is b for a, b in zip(fo.param_groups[0]["params"], fm.parameters())), "fsdp optimizer params")
    ctx.check(_dtensor(fm.weight) and _dtensor(fo.state[fm.weight]["exp_avg"]), "fsdp state is no longer DTensor")

    # The restored objects train exactly like ones loaded with torch's own load_state_dict.
    ref = build_state(ctx, fresh=True)
    ref["model"].load_state_dict(expected["model"])
    ref["optim"].load_state_dict(clone_tree(expected["optim"]))
    for model_, opt_ in ((m, o), (ref["model"], ref["optim"])):
        one_step(model_, opt_, seed=99)
    for d in bitwise_diff(clone_tree(m.state_dict()), clone_tree(ref["model"].state_dict()), "after-step model"):
        ctx.check(False, d)
    for d in bitwise_diff(clone_tree(o.state_dict()), clone_tree(ref["optim"].state_dict()), "after-step optim"):
        ctx.check(False, d)
    ref["fsdp"]["model"].load_state_dict(expected["fsdp_model"])
    ref["fsdp"]["optim"].load_state_dict(clone_tree(expected["fsdp_optim"]))
    fsdp_step(fresh, seed=98)
    fsdp_step(ref, seed=98)
    for k in ("model", "optim"):
        a, b = clone_tree(fresh["fsdp"][k].state_dict()), clone_tree(ref["fsdp"][k].state_dict())
        for d in bitwise_diff(a, b, f"after-step fsdp {k}"):
            ctx.check(False, d)
    dist.barrier()
    return {"root": my_root, "bytes_written": bytes_written}


def world2_main(ctx: Any, base: str) -> dict[str, Any]:
    out = {"roundtrip": roundtrip(ctx, f"{base}/rt", None, "roundtrip")}
    out["train"] = train_first_half(ctx, f"{base}/train")
    return out


def world4_main(ctx: Any, base: str) -> dict[str, Any]:
    return {
        "roundtrip": roundtrip(ctx, f"{base}/rt", None, "roundtrip"),
        "nodes": roundtrip(ctx, f"{base}/nodes", 2, "nodes"),
    }


# -- deterministic training -------------------------------------------------------------


def make_training(ctx: Any) -> dict[str, Any]:
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ckpt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(44, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g)).tanh() + 0.1 * torch.randn(44, 1, generator=g)
    ds = TensorDataset(x, y)
    sampler = ckpt.DistributedSampler(ds, num_replicas=ctx.world, rank=ctx.rank, shuffle=True, seed=5)
    # The loader gets its own generator: by default each iter() draws a base seed from the
    # global torch RNG, which would shift the dropout stream when a run resumes mid-epoch.
    loader = DataLoader(ds, batch_size=4, sampler=sampler, generator=torch.Generator())
    torch.manual_seed(1000 + ctx.rank)  # per-rank dropout masks
    progress = {"step": 0}
    state = {"model": model, "optim": opt, "sched": sched, "sampler": sampler, "progress": progress}
    return {"state": state, "loader": loader}


def train_loop(
    ctx: Any, run: dict[str, Any], total: int, ck: Any = None, save_at: tuple[int, ...] = (), stop_at: int = -1
) -> list[float]:
    import torch.distributed as dist
    import torch.nn.functional as F

    st = run["state"]
    model, opt, sched, sampler, progress = st["model"], st["optim"], st["sched"], st["sampler"], st["progress"]
    losses: list[float] = []
    step, epoch = progress["step"], sampler.epoch
    model.train()
    while step < total and step != stop_at:
        sampler.set_epoch(epoch)
        for xb, yb in run["loader"]:
            opt.zero_grad()
            loss = F.mse_loss(model(xb), yb)
            loss.backward()
            for p in model.parameters():  # what DDP does, in a fixed order
                dist.all_reduce(p.grad)
                p.grad.div_(ctx.world)
            opt.step()
            sched.step()
            step += 1
            progress["step"] = step
            losses.append(loss.item())
            if ck is not None and step in save_at:
                ck.save(step, st)  # async: training goes on while it commits
            if step == total or step == stop_at:
                break
        else:
            epoch += 1
    return losses


def dump_final(ctx: Any, run: dict[str, Any], path: str) -> None:
    st = run["state"]
    torch.save({"model": clone_tree(st["model"].state_dict()), "optim": clone_tree(st["optim"].state_dict())}, path)


def train_first_half(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt

    ctx.section = "train"
    ref = make_training(ctx)
    ref_losses = train_loop(ctx, ref, TRAIN_TOTAL)
    dump_final(ctx, ref, f"{base}.ref.rank{ctx.rank}.pt")

    run = make_training(ctx)
    with ckpt.Checkpointer(f"{base}/root", timeout=datetime.timedelta(seconds=60)) as ck:
        ctx.check(ck.restore(run["state"]) is None, "an empty root restored something")
        first = train_loop(ctx, run, TRAIN_TOTAL, ck, save_at=(TRAIN_FIRST_SAVE, TRAIN_SAVE_AT), stop_at=TRAIN_STOP_AT)
        ck.wait()
        ctx.check(ck.steps() == [TRAIN_FIRST_SAVE, TRAIN_SAVE_AT], f"steps() is {ck.steps()}")
    return {"ref_losses": ref_losses, "first_losses": first}


def train_resume(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt

    ctx.section = "train"
    torch.manual_seed(12345)  # whatever the new process does before restoring
    random.seed(1)
    run = make_training(ctx)
    with ckpt.Checkpointer(f"{base}/root", timeout=datetime.timedelta(seconds=60)) as ck:
        ctx.check(ck.latest_step() == TRAIN_SAVE_AT, f"latest_step() is {ck.latest_step()}")
        got = ck.restore(run["state"])  # the newest of the two saves
        ctx.check(got == TRAIN_SAVE_AT, f"restore returned {got}")
        ctx.check(run["state"]["progress"]["step"] == TRAIN_SAVE_AT, f"progress {run['state']['progress']}")
        rest = train_loop(ctx, run, TRAIN_TOTAL)
    dump_final(ctx, run, f"{base}.resumed.rank{ctx.rank}.pt")
    return {"rest_losses": rest}


# ---------------------------------------------------------------------------------------
# Launches (module-scoped: one per world size) and the tests
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("world2")
    results, failures = launch(THIS, "world2_main", 2, workdir, timeout=150, base=str(workdir))
    return {"workdir": workdir, "results": results, "failures": failures, "world": 2}


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("world4")
    results, failures = launch(THIS, "world4_main", 4, workdir, timeout=200, base=str(workdir))
    return {"workdir": workdir, "results": results, "failures": failures, "world": 4}


def _section_failures(run: dict[str, Any], section: str) -> list[str]:
    return [f for f in run["failures"] if f.startswith(f"[{section}]")]


def _grid_size(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> int:
    return math.prod(-(-s // c) for s, c in zip(shape, chunk_shape))


def _chunk_files(version_dir: Path) -> set[str]:
    out = set()
    for dirpath, _, files in os.walk(version_dir / STATE_PREFIX):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), version_dir)
            if "/c." in rel or rel.endswith("/c"):
                out.add(rel)
    return out


def check_inline_metadata(vdir: Path, m: Any) -> set[int]:
    """Every inline array's zarr.json (whoever wrote the value) gives zarr-python the value
    the manifest holds; returns the ranks that wrote inline values."""
    writers = set()
    for a in m.arrays.values():
        (chunk, *_) = a.iter_chunks()
        if chunk.inline is None:
            continue
        writers.add(chunk.writer)
        got = zarr.open_array(str(vdir / STATE_PREFIX / a.name), mode="r")[...]
        little = np.dtype(a.data_type).newbyteorder("<")
        assert np.ascontiguousarray(got, dtype=little).tobytes() == bytes.fromhex(chunk.inline), a.name
    return writers


def check_written_once(run: dict[str, Any], section: str) -> list[Any]:
    """Every chunk of every array has one writer; replicated data is spread over the ranks."""
    world = run["world"]
    per_rank = [r[section] for r in run["results"]]
    roots = sorted({p["root"] for p in per_rank})
    manifests = [versions.read_manifest(root, ROUNDTRIP_STEP) for root in roots]
    m = manifests[0]
    for other in manifests[1:]:
        assert other.to_json() == m.to_json(), "the roots hold different manifests"
    assert m.world_size == world
    replicated = [a for a in m.arrays.values() if a.replicated]
    names = {a.name for a in replicated}
    assert {"model/0.weight", "model/4.bias", "big", "dt/rep"} <= names, sorted(names)
    assert not {"shard/rows", "shard/cols", "shard/ids", "shard/dptp", "dt/s0", "dt/s1", "fsdp/model/weight"} & names
    assert "fsdp/model/bias" in names and "fsdp/optim/state/1/exp_avg" in names
    for a in m.arrays.values():
        indices = [c.index for c in a.iter_chunks()]
        assert len(set(indices)) == len(indices), f"{a.name}: a chunk is listed twice"
        assert len(indices) == _grid_size(a.shape, a.chunk_shape), f"{a.name}: {len(indices)} chunks"
        assert all(0 <= c.writer < world for c in a.iter_chunks()), a.name
    # Written once in total: the bytes all ranks wrote are exactly the manifest's bytes.
    assert sum(p["bytes_written"] for p in per_rank) == m.total_bytes
    rep_writers = {c.writer for a in replicated for c in a.iter_chunks() if c.inline is None}
    assert len(rep_writers) > 1, f"all replicated chunks were written by ranks {rep_writers}"
    big = m.arrays["big"]
    assert big.chunk_count == world and {c.writer for c in big.iter_chunks()} == set(range(world)), list(
        big.iter_chunks()
    )
    # Sharded data is written by the rank that holds it.
    rows = row_split(world)
    starts = [sum(rows[:i]) for i in range(world)]
    for c in m.arrays["shard/rows"].iter_chunks():
        holder = max(i for i in range(world) if starts[i] <= c.offsets[0])
        assert c.writer == holder, (c, holder)
    # DP x TP replicas: each half written once, by one of the ranks holding it.
    for c in m.arrays["shard/dptp"].iter_chunks():
        half = 0 if c.offsets[0] < tp_split()[0] else 1
        assert c.writer % 2 == half, c
    return manifests


def test_roundtrip_world2(world2: dict[str, Any]) -> None:
    assert not _section_failures(world2, "roundtrip"), "\n".join(_section_failures(world2, "roundtrip"))


def test_replicated_written_once_world2(world2: dict[str, Any]) -> None:
    (m,) = check_written_once(world2, "roundtrip")
    root = Path(world2["results"][0]["roundtrip"]["root"])
    vdir = root / versions.version_dirname(ROUNDTRIP_STEP)
    want = {a.chunk_path(c) for a in m.arrays.values() for c in a.iter_chunks() if c.inline is None}
    assert _chunk_files(vdir) == want
    assert versions.read_root_info(str(root), ROUNDTRIP_STEP).writers == (0, 1)
    assert check_inline_metadata(vdir, m), "no inline values"


def test_roundtrip_world4(world4: dict[str, Any]) -> None:
    assert not _section_failures(world4, "roundtrip"), "\n".join(_section_failures(world4, "roundtrip"))


def test_replicated_written_once_world4(world4: dict[str, Any]) -> None:
    (m,) = check_written_once(world4, "roundtrip")
    vdir = Path(world4["results"][0]["roundtrip"]["root"]) / versions.version_dirname(ROUNDTRIP_STEP)
    want = {a.chunk_path(c) for a in m.arrays.values() for c in a.iter_chunks() if c.inline is None}
    assert _chunk_files(vdir) == want
    # DTensor Shard(0) of 9 rows over 4 ranks: 3, 3, 3 and an empty piece.
    assert {c.writer for c in m.arrays["dt/s0"].iter_chunks()} == {0, 1, 2}


def test_two_nodes_world4(world4: dict[str, Any]) -> None:
    assert not _section_failures(world4, "nodes"), "\n".join(_section_failures(world4, "nodes"))
    manifests = check_written_once(world4, "nodes")
    assert len(manifests) == 2
    m = manifests[0]
    assert [list(g) for g in m.roots] == [[0, 1], [2, 3]]
    base = world4["workdir"] / "nodes"
    for node in (0, 1):
        assert world4["results"][2 * node]["nodes"]["root"] == str(base / f"node{node}")
        vdir = base / f"node{node}" / versions.version_dirname(ROUNDTRIP_STEP)
        info = versions.read_root_info(str(base / f"node{node}"), ROUNDTRIP_STEP)
        assert info is not None and info.writers == (2 * node, 2 * node + 1), info
        own = {
            a.chunk_path(c)
            for a in m.arrays.values()
            for c in a.iter_chunks()
            if c.inline is None and c.writer in info.writers
        }
        assert own, f"node{node} wrote nothing"
        assert _chunk_files(vdir) == own, f"node{node} holds chunk files of other nodes' ranks"
        # node1's leader writes the zarr.json of values that node0's ranks staged (at PREPARE)
        assert check_inline_metadata(vdir, m) - set(info.writers), f"node{node}: only its own inline values"
    # Replicated tensors whose only copy is on node0: node1's ranks restored them bitwise
    # (the "nodes" section compares every tensor on every rank), so they came across.
    on_node0_only = [
        a.name
        for a in m.arrays.values()
        if a.replicated and all(c.writer in (0, 1) and c.inline is None for c in a.iter_chunks())
    ]
    assert on_node0_only, "no replicated tensor was written on node0 only"
    big_writers = {c.writer for c in m.arrays["big"].iter_chunks()}
    assert big_writers & {0, 1} and big_writers & {2, 3}, big_writers


def test_training_resume_world2(world2: dict[str, Any]) -> None:
    assert not _section_failures(world2, "train"), "\n".join(_section_failures(world2, "train"))
    base = world2["workdir"] / "train"
    first = [r["train"] for r in world2["results"]]
    resumed, failures = launch(THIS, "train_resume", 2, world2["workdir"] / "resume", timeout=120, base=str(base))
    assert not failures, "\n".join(failures)
    for rank in range(2):
        ref = first[rank]["ref_losses"]
        assert len(ref) == TRAIN_TOTAL
        assert first[rank]["first_losses"] == ref[:TRAIN_STOP_AT], f"rank {rank}: the saving run diverged"
        got = ref[:TRAIN_SAVE_AT] + resumed[rank]["rest_losses"]
        assert got == ref, f"rank {rank}: losses after resume differ:\n{got}\n{ref}"
        ref_state = torch.load(f"{base}.ref.rank{rank}.pt")
        assert_bitwise(torch.load(f"{base}.resumed.rank{rank}.pt"), ref_state, f"rank {rank}: resumed")
    # Per-rank dropout makes the ranks' losses differ, so the RNG restored was each rank's own.
    assert first[0]["ref_losses"] != first[1]["ref_losses"]
    # Gradients are all-reduced, so both ranks end with the same weights.
    w0 = torch.load(f"{base}.resumed.rank0.pt")["model"]
    w1 = torch.load(f"{base}.resumed.rank1.pt")["model"]
    assert_bitwise(w1, w0, "rank 1's weights vs rank 0's")


def rng_after_growing_restore(ctx: Any, root: str) -> dict[str, Any]:
    """Each rank seeds its own RNG, restores a version a world of 1 saved, and draws."""
    import ckpt

    random.seed(1234 + ctx.rank)
    torch.manual_seed(1234 + ctx.rank)
    with ckpt.Checkpointer(root, timeout=datetime.timedelta(seconds=60)) as ck:
        ck.restore({"w": torch.zeros(3)})
    return {"python": random.random(), "torch": torch.rand(2).tolist()}


@pytest.mark.parametrize("with_rng", [False, True])
def test_a_rank_new_to_the_version_is_seeded_only_if_the_version_holds_rng(tmp_path: Path, with_rng: bool) -> None:
    """A version saved without RNG (capture_rng=False) leaves every rank's RNG as the job
    seeded it. Before, a rank the saving world did not have was seeded anew all the same:
    rank 1 drew other numbers than its own seeding gives, and rank 0 did not."""
    root = tmp_path / "root"
    with ckpt.Checkpointer(root, capture_rng=with_rng) as ck:
        ck.save(1, {"w": torch.ones(3)})
    results, failures = launch(THIS, "rng_after_growing_restore", 2, tmp_path, timeout=120, root=str(root))
    assert failures == []
    own = []
    for rank in range(2):
        random.seed(1234 + rank)
        torch.manual_seed(1234 + rank)
        own.append({"python": random.random(), "torch": torch.rand(2).tolist()})
    if with_rng:  # rank 0 continues the saved stream, rank 1 is seeded from the version
        assert results[0] != own[0] and results[1] != own[1]
    else:
        assert results == own
