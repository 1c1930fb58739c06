"""Hand-made shards on the first save of a layout (ckpt._plan): each rank's listed regions
go to their array's owner, which plans the array; rank 0 receives the owners' plans and
claims, never the regions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt._plan import Announcement, announce, merge, owner_of, plain_signature, plan_owned, plans_of
from ckpt._tensors import LocalPiece
from ckpt.store.errors import StateMismatchError
from ckpt.store.layout import plan_arrays
from tests._dist import launch

THIS = os.path.abspath(__file__)
SPLIT = 64 << 20


def _listed(rows: int, world: int, rank: int, name: str) -> LocalPiece:
    """Rank `rank`'s hand-made piece of a (rows x 3) float32 array cut in uneven row ranges."""
    cuts = [0] + [rows * (i * i + i) // (world * world + world) for i in range(1, world)] + [rows]
    lo, hi = cuts[rank], cuts[rank + 1]
    data = torch.empty((hi - lo, 3), dtype=torch.float32, device="meta")
    return LocalPiece(data, "float32", (rows, 3), (lo, 0), (hi - lo, 3), kind="listed")


def _routed(states: list[dict[str, LocalPiece]]) -> tuple[list[Announcement], list[int], list[int]]:
    """What agree_plans does between the ranks, with its collectives as plain loops: the
    announcements rank 0 gathers, the signatures, and how many regions each rank received."""
    world = len(states)
    sigs = [plain_signature(s) for s in states]
    anns = [announce(r, s, sigs.index(sigs[r]) == r) for r, s in enumerate(states)]
    inbox: list[list[Any]] = [[None] * world for _ in range(world)]
    for r, a in enumerate(anns):
        for entry in a.listed:
            at = owner_of(entry[0], world)
            inbox[at][r] = (inbox[at][r] or []) + [entry]
    owned = [plan_owned(((s, e) for s, e in enumerate(inbox[r]) if e), SPLIT) for r in range(world)]
    gathered = [Announcement(a.rank, a.meshed, (), a.plain, a.error, owned[r]) for r, a in enumerate(anns)]
    received = [sum(len(x or ()) for x in inbox[r]) for r in range(world)]
    return gathered, sigs, received


def test_owners_plan_what_rank_0_planned_and_rank_0_receives_no_region() -> None:
    world, arrays = 48, 30
    states = [{f"a{i}": _listed(1000 + 7 * i, world, r, f"a{i}") for i in range(arrays)} for r in range(world)]
    gathered, sigs, received = _routed(states)
    assert all(not a.listed for a in gathered)  # rank 0 gathers no region
    assert sum(received) == world * arrays and max(received) <= world * 4  # each owner: its arrays' regions
    assert len({owner_of(f"a{i}", world) for i in range(arrays)}) > arrays // 2  # spread over the ranks
    new = plans_of(gathered, sigs, SPLIT)
    everything = [announce(r, s, sigs.index(sigs[r]) == r) for r, s in enumerate(states)]
    old = plan_arrays(merge(everything, sigs), split_bytes=SPLIT)  # rank 0 planning every region
    assert [p.spec.name for p in new] == [p.spec.name for p in old]
    for a, b in zip(new, old, strict=True):
        assert (a.chunk_shape, a.runs, a.slivers, a.inline) == (b.chunk_shape, b.runs, b.slivers, b.inline), a.spec.name


def test_an_owner_names_both_ranks_of_a_disagreement() -> None:
    states = [{"w": _listed(10, 2, 0, "w")}, {"w": _listed(11, 2, 1, "w")}]
    gathered, sigs, _ = _routed(states)
    with pytest.raises(StateMismatchError, match=r"w: rank 1 holds float32\[11, 3\], rank 0 holds float32\[10, 3\]"):
        plans_of(gathered, sigs, SPLIT)


def test_a_listed_array_another_rank_holds_as_a_plain_one_is_refused() -> None:
    plain = LocalPiece(torch.empty((10, 3), device="meta"), "float32", (10, 3), (0, 0), (10, 3))
    states = [{"w": plain}, {"w": _listed(10, 2, 1, "w")}]
    gathered, sigs, _ = _routed(states)
    with pytest.raises(StateMismatchError, match="rank 1 holds it as a listed array, rank 0 as a plain array"):
        plans_of(gathered, sigs, SPLIT)


def hand_sharded(ctx: Any, root: str) -> dict[str, Any]:
    """4 ranks, each a `ckpt.Shard` of 12 arrays (owned by several ranks): a first layout
    with a gap in one array (rank 3 leaves its rows out) fails on every rank alike; the
    whole layout saves, and a restore is bitwise."""
    import datetime

    import ckpt

    names = [f"layer{i}" for i in range(12)]
    full = {n: torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3) + i for i, n in enumerate(names)}

    def mine(gap: bool) -> dict[str, Any]:
        lo, hi = ctx.rank * 10, ctx.rank * 10 + 10
        out = {n: ckpt.Shard(full[n][lo:hi].clone(), (40, 3), (lo, 0)) for n in names}
        if gap and ctx.rank == 3:
            out["layer5"] = ckpt.Shard(full["layer5"][30:35].clone(), (40, 3), (30, 0))
        return out

    result: dict[str, Any] = {"owners": sorted({owner_of(n, ctx.world) for n in names})}
    with ckpt.Checkpointer(root, timeout=datetime.timedelta(seconds=60)) as ck:
        try:
            ck.save(1, {"m": mine(gap=True)})
            ck.wait()
            result["gap"] = "saved"
        except Exception as e:  # noqa: BLE001 - what each rank saw
            result["gap"] = f"{type(e).__name__}: {e}"
        ck.save(2, {"m": mine(gap=False)})
        ck.wait()
        back = {"m": {n: ckpt.Shard(torch.zeros(10, 3), (40, 3), (ctx.rank * 10, 0)) for n in names}}
        result["restored"] = ck.restore(back)
        lo = ctx.rank * 10
        result["bitwise"] = all(torch.equal(back["m"][n].local_tensor, full[n][lo : lo + 10]) for n in names)
    return result


def test_hand_made_shards_on_4_ranks_are_planned_by_their_owners(tmp_path: Path) -> None:
    results, failures = launch(THIS, "hand_sharded", 4, tmp_path / "job", timeout=180, root=str(tmp_path / "root"))
    assert not failures, failures
    assert len(results[0]["owners"]) > 1  # the arrays' owners are several ranks
    errors = {r["gap"] for r in results}
    assert len(errors) == 1 and "layer5" in next(iter(errors)) and "gaps" in next(iter(errors)), errors
    assert [(r["restored"], r["bitwise"]) for r in results] == [(2, True)] * 4
