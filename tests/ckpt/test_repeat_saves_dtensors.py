"""Repeated saves of DTensor states (FSDP2's) on a real 2-rank gloo job: the Describer keeps
a DTensor leaf's spec when its mesh, placements, global shape and local tensor are as in
the last save, and the EncodeMemo takes mappings of DTensors whole. What they reuse must be
what describe() and a fresh encoding make, any change must be seen, and each save restores
bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import Ctx, launch


def _piece(p: Any) -> tuple[Any, ...]:
    return (
        p.data_type,
        p.global_shape,
        p.offsets,
        p.shape,
        p.kind,
        p.mesh,
        p.placements,
        type(p.data),
        p.data.dtype,
        p.data.requires_grad,
    )


def describer_job(ctx: Ctx, with_tracked: bool) -> dict[str, Any]:
    """`with_tracked`: with a DTensor whose local tensor autograd tracks (detached at each save:
    leaf by leaf); without, an unchanged save's leaves are checked together (Describer._again)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from ckpt._tensors import Describer, describe
    from ckpt.store.errors import UnsupportedStateError

    class Sub(DTensor):  # a subclass: always the general path
        pass

    mesh = init_device_mesh("cpu", (ctx.world,))
    swapped = DeviceMesh("cpu", torch.arange(ctx.world).flip(0))
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    tracked = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local().clone().requires_grad_()
    base: dict[str, Any] = {
        "rows": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
        "cols": distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None),
        "param": torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)),
        "tracked": DTensor.from_local(tracked, mesh, [Shard(0)], run_check=False, shape=(6, 4), stride=(4, 1)),
        "plain": torch.ones(3),
        "scalar": torch.tensor(2.0),
    }
    if not with_tracked:
        del base["tracked"]
    d = Describer()

    def run(label: str, values: dict[str, Any]) -> tuple[list[Any], int]:
        """The describer's pieces against describe()'s, leaf by leaf."""
        paths = {n: (n,) for n in values}
        got = d(paths, list(values.values()))
        for name, value in values.items():
            want = describe(value, (name,))
            p = got.pieces[name]
            ctx.check(_piece(p) == _piece(want), f"{label}: {name} {_piece(p)} != {_piece(want)}")
            ctx.check(p.data.data_ptr() == want.data.data_ptr(), f"{label}: {name} is not the local tensor")
        ctx.check(got.signature == hash(tuple(got.specs)), f"{label}: the signature is the hash of the specs")
        return got.specs, got.signature

    first, sig = run("first", base)
    again, sig2 = run("same objects", base)
    out: dict[str, Any] = {
        "checked together": d._unchanged is not None,
        "kept_same_objects": [a is b for a, b in zip(first, again)],
        "sig_same_objects": sig2 == sig,
    }
    # state_dict() detaches: new DTensor objects with new (equal) specs, the same layout.
    detached, sig3 = run("detached", {k: v.detach() for k, v in base.items()})
    out["kept_detached"] = [a is b for a, b in zip(first, detached)]
    out["sig_detached"] = sig3 == sig
    changes: dict[str, Any] = {
        "placement": distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None),
        "global shape": distribute_tensor(full[:4], mesh, [Shard(0)], src_data_rank=None),
        "local dtype": distribute_tensor(full.double(), mesh, [Shard(0)], src_data_rank=None),
        "plain tensor": full.clone(),
        # The same local shape and dtype, another layout: the spec tells them apart.
        "replicated": distribute_tensor(full[:3], mesh, [Replicate()], src_data_rank=None),
        "columns of a wider": distribute_tensor(torch.zeros(3, 8), mesh, [Shard(1)], src_data_rank=None),
        # The same placements, shapes and dtype on a mesh of the ranks in the other order:
        # only the mesh tells the pieces' offsets apart.
        "mesh order": distribute_tensor(full, swapped, [Shard(0)], src_data_rank=None),
        # The same spec with another local shape (from_local takes what it is given).
        "spec's local dtype": DTensor(base["rows"]._local_tensor.double(), base["rows"]._spec, requires_grad=False),
        "local shape": DTensor.from_local(
            torch.zeros(2, 4), mesh, [Shard(0)], run_check=False, shape=(6, 4), stride=(4, 1)
        ),
        "subclass": Sub(base["rows"]._local_tensor, base["rows"]._spec, requires_grad=False),
    }
    for label, value in changes.items():
        back, _ = run("back", base)
        specs, s = run(label, {**base, "rows": value})
        out[f"changed {label}"] = {
            "rows kept": specs[0] is back[0],
            "others kept": all(a is b for a, b in zip(back[1:], specs[1:])),
            "signature changed": s != sig,
        }
    run("back", base)
    partial = DTensor.from_local(torch.ones(6, 4), mesh, [Partial()], run_check=False)
    try:
        run("partial", {**base, "rows": partial})
        out["partial refused"] = None
    except UnsupportedStateError as e:
        out["partial refused"] = str(e)
    return out


@pytest.mark.parametrize("tracked", [True, False])
def test_the_describer_keeps_an_unchanged_dtensor_and_sees_every_change(tmp_path: Path, tracked: bool) -> None:
    results, failures = launch(__file__, "describer_job", 2, tmp_path, with_tracked=tracked, timeout=120)
    assert not failures, failures
    leaves = 6 if tracked else 5
    for rank, got in enumerate(results):
        assert got["checked together"] == (not tracked), (rank, got)
        assert got["kept_same_objects"] == [True] * leaves, (rank, got)
        assert got["sig_same_objects"] and got["sig_detached"], (rank, got)
        assert got["kept_detached"] == [True] * leaves, (rank, got)
        for label in (
            "placement",
            "global shape",
            "local dtype",
            "plain tensor",
            "replicated",
            "columns of a wider",
            "mesh order",
            "spec's local dtype",
            "local shape",
            "subclass",
        ):
            change = got[f"changed {label}"]
            assert not change["rows kept"] and change["others kept"], (rank, label, change)
            # A subclass takes the general path to the same layout; every other change is one.
            assert change["signature changed"] == (label != "subclass"), (rank, label, change)
        assert got["partial refused"] == (
            "state['rows']: DTensor with Partial placement must be reduced before saving"
        ), (rank, got["partial refused"])


def encode_job(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt._tree import DICT, EncodeMemo, encode_state

    mesh = init_device_mesh("cpu", (ctx.world,))

    def dt(seed: int) -> Any:
        return distribute_tensor(torch.full((4, 2), float(seed)), mesh, [Shard(0)], src_data_rank=None)

    state: dict[str, Any] = {
        "model": {"w": dt(0), "b": dt(1)},
        "optim": {0: {"step": torch.tensor(1.0), "exp_avg": dt(2)}, 1: {"step": torch.tensor(1.0), "exp_avg": dt(3)}},
    }
    memo = EncodeMemo()
    out: dict[str, Any] = {}
    trees = []
    for label in ("first", "second", "replaced optimizer state"):
        if label == "replaced optimizer state":  # a DTensor becomes a scalar: encoded anew
            state["optim"][1]["exp_avg"] = 0.5
        tree, leaves = encode_state(state, memo)
        want_tree, want = encode_state(state)
        ctx.check(tree == want_tree, f"{label}: the tree is the fresh one")
        ctx.check(list(leaves.paths.items()) == list(want.paths.items()), f"{label}: the names are the fresh ones")
        ctx.check(all(a is b for a, b in zip(leaves.values, want.values)), f"{label}: the leaves are the state's")
        ctx.check(len(leaves.values) == len(want.values), f"{label}: as many leaves as a fresh encoding")
        trees.append(tree)
    out["model reused"] = trees[1]["model"] is trees[0]["model"]
    out["optim reused"] = trees[1]["optim"] is trees[0]["optim"]
    out["first parameter reused after the change"] = trees[2]["optim"][DICT][0][1] is trees[0]["optim"][DICT][0][1]
    out["changed parameter anew"] = trees[2]["optim"][DICT][1][1] is not trees[0]["optim"][DICT][1][1]
    return out


def test_the_encode_memo_takes_mappings_of_dtensors_whole(tmp_path: Path) -> None:
    results, failures = launch(__file__, "encode_job", 2, tmp_path, timeout=120)
    assert not failures, failures
    for rank, got in enumerate(results):
        assert all(got.values()), (rank, got)


def saves_job(ctx: Ctx, root: str) -> dict[str, Any]:
    """Through a Checkpointer: the same DTensors saved again, then detached, then with rows
    sharded by columns, then a longer tensor; each step restores bitwise into blank
    DTensors of its layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt import Checkpointer

    mesh = init_device_mesh("cpu", (ctx.world,))
    torch.manual_seed(0)
    full = {"w": torch.randn(10, 6), "b": torch.randn(7)}
    layouts = [
        ("same", {"w": [Shard(0)], "b": [Shard(0)]}, 10),
        ("same again", {"w": [Shard(0)], "b": [Shard(0)]}, 10),
        ("detached", {"w": [Shard(0)], "b": [Shard(0)]}, 10),
        ("columns", {"w": [Shard(1)], "b": [Shard(0)]}, 10),
        ("longer", {"w": [Shard(1)], "b": [Shard(0)]}, 12),
    ]
    saved = []
    with Checkpointer(root, capture_rng=False) as ck:
        state: dict[str, Any] = {}
        for step, (label, placements, rows) in enumerate(layouts):
            values = {"w": torch.randn(rows, 6) if rows != 10 else full["w"] + step, "b": full["b"] - step}
            if label == "same again":
                with torch.no_grad():
                    for k, v in state.items():
                        v.to_local().copy_(
                            distribute_tensor(values[k], mesh, placements[k], src_data_rank=None).to_local()
                        )
            else:
                state = {k: distribute_tensor(values[k], mesh, placements[k], src_data_rank=None) for k in full}
                if label == "detached":
                    state = {k: v.detach() for k, v in state.items()}
            ck.save(step, {"model": state})
            ck.wait()
            saved.append((placements, rows, {k: v.full_tensor().clone() for k, v in state.items()}))
    out = {}
    with Checkpointer(root, capture_rng=False) as ck:
        for step, (placements, rows, want) in enumerate(saved):
            target = {
                "w": distribute_tensor(torch.zeros(rows, 6), mesh, placements["w"], src_data_rank=None),
                "b": distribute_tensor(torch.zeros(7), mesh, placements["b"], src_data_rank=None),
            }
            ck.restore({"model": target}, step=step)
            out[layouts[step][0]] = all(
                torch.equal(target[k].full_tensor().view(torch.int32), want[k].view(torch.int32)) for k in want
            )
    return out


def test_repeated_dtensor_saves_restore_bitwise(tmp_path: Path) -> None:
    results, failures = launch(__file__, "saves_job", 2, tmp_path / "job", root=str(tmp_path / "root"), timeout=180)
    assert not failures, failures
    for rank, got in enumerate(results):
        assert got == {"same": True, "same again": True, "detached": True, "columns": True, "longer": True}, (rank, got)


def one_rank_changes_job(ctx: Ctx, root: str) -> dict[str, Any]:
    """Saves of a DTensor and a tensor of each rank's own, where at the third save only
    rank 1's own tensor changes shape: every rank plans again, rank 0 (the mesh's lowest,
    which describes the DTensor's layout to the plan) from the pieces of a save whose
    leaves it found unchanged (made then, with their meshes). Each step restores bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt import Checkpointer

    mesh = init_device_mesh("cpu", (ctx.world,))
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(10, 6), mesh, [Shard(0)], src_data_rank=None)
    lengths = [4, 4, 5] if ctx.rank == 1 else [3, 3, 3]
    saved = []
    with Checkpointer(root, capture_rng=False) as ck:
        for step, n in enumerate(lengths):
            with torch.no_grad():
                w.to_local().add_(1.0)
            own = torch.arange(n, dtype=torch.float32) + 10 * step + ctx.rank
            specs = ck._saver._describe._specs
            ck.save(step, {"model": {"w": w}, "own": {f"r{ctx.rank}": own}})
            ck.wait()
            if step == 2:  # (the specs of a save checked together are the last save's list)
                kept = ck._saver._describe._specs is specs
                ctx.check(kept == (ctx.rank != 1), "rank 0's third save is checked together, rank 1's is not")
            saved.append((w.full_tensor().clone(), own.clone()))
    out = {}
    with Checkpointer(root, capture_rng=False) as ck:
        for step, (want_w, want_own) in enumerate(saved):
            target_w = distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)], src_data_rank=None)
            target_own = torch.zeros(lengths[step])
            ck.restore({"model": {"w": target_w}, "own": {f"r{ctx.rank}": target_own}}, step=step)
            out[str(step)] = torch.equal(target_w.full_tensor().view(torch.int32), want_w.view(torch.int32)) and (
                torch.equal(target_own.view(torch.int32), want_own.view(torch.int32))
            )
    return out


def test_a_layout_change_on_one_rank_replans_from_the_others_unchanged_leaves(tmp_path: Path) -> None:
    results, failures = launch(
        __file__, "one_rank_changes_job", 2, tmp_path / "job", root=str(tmp_path / "root"), timeout=180
    )
    assert not failures, failures
    for rank, got in enumerate(results):
        assert got == {"0": True, "1": True, "2": True}, (rank, got)
