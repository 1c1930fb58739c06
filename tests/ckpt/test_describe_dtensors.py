"""describe() of DTensors on a real 2-rank gloo job: for each placement, the local piece,
its global offsets and how the plan learns the other pieces; and the refusals, with the
messages. A subclass of DTensor must describe and refuse exactly like a DTensor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)


def _shown(piece: Any) -> dict[str, Any]:
    return {
        "kind": piece.kind,
        "offsets": list(piece.offsets),
        "global": list(piece.global_shape),
        "shape": list(piece.shape),
        "placements": list(piece.placements),
        "mesh": None if piece.mesh is None else [list(piece.mesh.shape), list(piece.mesh.ranks)],
        "dtype": piece.data_type,
        "plain": type(piece.data) is torch.Tensor,
        "requires_grad": piece.data.requires_grad,
        "values": piece.data.flatten().tolist(),
    }


def describe_job(ctx: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt._tensors import describe
    from ckpt.store.errors import UnsupportedStateError

    class Sub(DTensor):  # a subclass: the general path
        pass

    mesh = init_device_mesh("cpu", (ctx.world,))
    full = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    cases = {
        "rows": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),  # 3 rows and 2
        "cols": distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None),
        "replicated": distribute_tensor(full, mesh, [Replicate()], src_data_rank=None),
        "strided": DTensor.from_local(  # split factor 1: this rank's rows are one run
            full[ctx.rank * 2 : ctx.rank * 2 + 2].clone(), mesh, [_StridedShard(0, split_factor=1)], run_check=False
        ),
        "param": torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)),
    }
    # A DTensor made from a local tensor that autograd tracks: its local piece tracks it too.
    rows_local = cases["rows"].to_local().clone().requires_grad_()
    cases["tracked"] = DTensor.from_local(rows_local, mesh, [Shard(0)], run_check=False, shape=(5, 4), stride=(4, 1))
    out: dict[str, Any] = {name: _shown(describe(value, (name,))) for name, value in cases.items()}
    out["tracked_local_requires_grad"] = cases["tracked"]._local_tensor.requires_grad
    rows = cases["rows"]
    sub = Sub(rows._local_tensor, rows._spec, requires_grad=False)
    out["subclass_is_sub"] = type(sub) is Sub
    out["subclass"] = _shown(describe(sub, ("subclass",)))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    complex32 = distribute_tensor(torch.zeros(4, dtype=torch.complex32), mesh, [Shard(0)], src_data_rank=None)
    refused = {
        "partial": partial,
        "complex32": complex32,
        "sub_partial": Sub(partial._local_tensor, partial._spec, requires_grad=False),
        "sub_complex32": Sub(complex32._local_tensor, complex32._spec, requires_grad=False),
        # split factor 2: this rank's rows are every other one (0 and 2, or 1 and 3)
        "scattered": DTensor.from_local(full[:2].clone(), mesh, [_StridedShard(0, split_factor=2)], run_check=False),
        "flattened": distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None).flatten(),
    }
    for name, value in refused.items():
        try:
            describe(value, ("opt", 3, name))
            out[f"refused_{name}"] = None
        except UnsupportedStateError as e:
            out[f"refused_{name}"] = str(e)
    return out


def test_every_placement_is_described_by_its_layout_and_the_refusals_name_the_leaf(tmp_path: Path) -> None:
    results, failures = launch(THIS, "describe_job", 2, tmp_path, timeout=120)
    assert not failures, failures
    full = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    mesh = [[2], [0, 1]]
    for rank, got in enumerate(results):
        lo, hi = (0, 3) if rank == 0 else (3, 5)
        rows = full[lo:hi].flatten().tolist()
        assert got["rows"] == {
            "kind": "mesh",
            "offsets": [lo, 0],
            "global": [5, 4],
            "shape": [hi - lo, 4],
            "placements": [0],
            "mesh": mesh,
            "dtype": "float32",
            "plain": True,
            "requires_grad": False,
            "values": rows,
        }, (rank, got["rows"])
        assert got["cols"]["offsets"] == [0, 2 * rank] and got["cols"]["shape"] == [5, 2], (rank, got["cols"])
        assert got["cols"]["values"] == full[:, 2 * rank : 2 * rank + 2].flatten().tolist()
        assert got["cols"]["placements"] == [1]
        assert got["replicated"]["offsets"] == [0, 0] and got["replicated"]["shape"] == [5, 4]
        assert got["replicated"]["placements"] == [-1] and got["replicated"]["kind"] == "mesh"
        # A strided shard is planned from the listed regions: no mesh, no placements.
        assert got["strided"]["kind"] == "listed" and got["strided"]["mesh"] is None, (rank, got["strided"])
        assert got["strided"]["placements"] == [] and got["strided"]["global"] == [4, 4]
        assert got["param"] == got["rows"], (rank, got["param"])  # an FSDP2 parameter
        # A local piece that autograd tracks is described detached.
        assert got["tracked_local_requires_grad"]
        assert got["tracked"] == got["rows"], (rank, got["tracked"])
        # A subclass takes the general path, and describes alike.
        assert got["subclass_is_sub"]
        assert got["subclass"] == got["rows"], (rank, got["subclass"])
        for name in ("partial", "sub_partial"):
            assert got[f"refused_{name}"] == (
                f"state['opt'][3]['{name}']: DTensor with Partial placement must be reduced before saving"
            )
        for name in ("complex32", "sub_complex32"):
            assert got[f"refused_{name}"] == f"state['opt'][3]['{name}']: dtype torch.complex32 is not supported"
        # Before, described as one block at the first row's offset: restored with the wrong rows.
        for name in ("scattered", "flattened"):
            assert "is not one block of the global tensor" in got[f"refused_{name}"], (rank, got[f"refused_{name}"])


def fsdp_tp_job(ctx: Any, root: str) -> dict[str, Any]:
    """FSDP2 over TP (dp 2 x tp 2): placements (_StridedShard(0, 2), Shard(0)), each rank's
    rows one run; saved, restored into zeros of the same layout and, flattened from a
    Shard(1) DTensor, refused at restore."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt import Checkpointer
    from ckpt.store.errors import UnsupportedStateError

    mesh = init_device_mesh("cpu", (2, 2))
    dp, tp = mesh.get_coordinate()
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    lo = 4 * tp + 2 * dp  # TP takes a half of the rows, FSDP a half of that
    placements = [_StridedShard(0, split_factor=2), Shard(0)]

    def made(values: torch.Tensor) -> Any:
        return DTensor.from_local(
            values[lo : lo + 2].clone(), mesh, placements, run_check=False, shape=(8, 3), stride=(3, 1)
        )

    ctx.check(torch.equal(made(full).full_tensor(), full), "the test's rows are not torch's for these placements")
    with Checkpointer(root, capture_rng=False) as ck:
        ck.save(1, {"w": made(full), "flat": torch.arange(32.0)})
    got = made(torch.zeros(8, 3))
    with Checkpointer(root, capture_rng=False) as ck:
        ck.restore({"w": got})
    ctx.check(torch.equal(got.full_tensor(), full), "restored FSDP2+TP DTensor differs")
    flat = distribute_tensor(torch.zeros(4, 8), init_device_mesh("cpu", (4,)), [Shard(1)]).flatten()
    try:
        with Checkpointer(root, capture_rng=False) as ck:
            ck.restore({"flat": flat}, strict=False)
        refused = None
    except UnsupportedStateError as e:
        refused = str(e)
    return {"placements": str(got.placements), "refused": refused}


def test_a_strided_shard_restores_where_its_rows_are_one_run_and_is_refused_elsewhere(tmp_path: Path) -> None:
    results, failures = launch(THIS, "fsdp_tp_job", 4, tmp_path / "job", timeout=180, root=str(tmp_path / "root"))
    assert not failures, failures
    for r in results:
        assert "_StridedShard" in r["placements"] or "StridedShard" in r["placements"], r
        assert r["refused"] is not None and "is not one block of the global tensor" in r["refused"], r


def strided_reshard_job(ctx: Any, root: str, mode: str) -> str:
    """FSDP2 over TP (dp 2 x tp 2, a strided shard's rows) saved on 4 ranks and restored on
    2 into Shard(1) columns and into a plain tensor; and Shard(0) rows saved on 2 ranks and
    restored on 4 into the strided layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt import Checkpointer

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) * 1.5 - 7

    def strided(values: torch.Tensor) -> Any:
        mesh = init_device_mesh("cpu", (2, 2))
        dp, tp = mesh.get_coordinate()
        lo = 4 * tp + 2 * dp
        placements = [_StridedShard(0, split_factor=2), Shard(0)]
        return DTensor.from_local(
            values[lo : lo + 2].clone(), mesh, placements, run_check=False, shape=(8, 6), stride=(6, 1)
        )

    with Checkpointer(root, capture_rng=False) as ck:
        if mode == "save-strided":
            d = strided(full)
            ctx.check(torch.equal(d.full_tensor(), full), "the test's rows are not torch's for these placements")
            ck.save(1, {"w": d})
        elif mode == "restore-strided":
            d = strided(torch.zeros(8, 6))
            ck.restore({"w": d})
            ctx.check(torch.equal(d.full_tensor(), full), "Shard(0) rows restored into FSDP2+TP differ")
        elif mode == "save-rows":
            ck.save(1, {"w": distribute_tensor(full, init_device_mesh("cpu", (2,)), [Shard(0)])})
        else:  # restore-cols
            cols = distribute_tensor(torch.zeros(8, 6), init_device_mesh("cpu", (2,)), [Shard(1)])
            plain = torch.zeros(8, 6)
            ck.restore({"w": cols})
            ctx.check(torch.equal(cols.full_tensor(), full), "FSDP2+TP restored into Shard(1) columns differs")
            ck.restore({"w": plain})
            ctx.check(torch.equal(plain, full), "FSDP2+TP restored into a plain tensor differs")
    return mode


def test_a_strided_shard_reshards_both_ways(tmp_path: Path) -> None:
    for world, mode, root in [
        (4, "save-strided", "a"),
        (2, "restore-cols", "a"),
        (2, "save-rows", "b"),
        (4, "restore-strided", "b"),
    ]:
        results, failures = launch(
            THIS, "strided_reshard_job", world, tmp_path / mode, root=str(tmp_path / root), mode=mode
        )
        assert not failures, failures
        assert results == [mode] * world, results


def outside_the_mesh_job(ctx: Any, root: str, mode: str) -> str:
    import datetime

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt

    full = torch.arange(24.0).reshape(6, 4)
    mesh = DeviceMesh("cpu", [0, 1, 2] if mode == "save" else [0, 1])
    d = distribute_tensor(full.clone() if mode == "save" else torch.zeros(6, 4), mesh, [Shard(0)], src_data_rank=None)
    with ckpt.Checkpointer(root, timeout=datetime.timedelta(seconds=60)) as ck:
        if mode == "save":
            ck.save(1, {"m": {"w": d}})
            return "saved"
        try:
            return f"restored step {ck.restore({'m': {'w': d}})}"
        except Exception as e:  # noqa: BLE001 - the result under test
            return f"{type(e).__name__}: {e}"


def test_a_dtensor_whose_mesh_leaves_a_rank_out_is_refused_not_taken_for_damage(tmp_path: Path) -> None:
    """Rank 2 restores into a DTensor on the mesh [0, 1]: it holds no piece. A save refuses
    that layout (StateMismatchError); a restore called the intact version damaged, and every
    older one (found by review: the rank's piece had no offsets, a 0-d box)."""
    kw = {"root": str(tmp_path / "root"), "timeout": 120}
    results, failures = launch(THIS, "outside_the_mesh_job", 3, tmp_path / "save", mode="save", **kw)
    assert failures == [] and results == ["saved"] * 3
    results, failures = launch(THIS, "outside_the_mesh_job", 3, tmp_path / "restore", mode="restore", **kw)
    assert failures == []
    assert results[2].startswith("StateMismatchError") and "rank 2 is not in its DTensor's mesh" in results[2], results
    assert all(r.startswith("RankFailures") and "rank 2: StateMismatchError" in r for r in results[:2]), results
