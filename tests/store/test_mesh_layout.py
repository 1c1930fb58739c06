"""Planning from a mesh and placements (store.layout.MeshSpec) and the first-save agreement
(ckpt._plan): the pieces match DTensor's, the plans match those of the listed regions,
and a plan stays O(arrays) at 16,384 ranks."""

from __future__ import annotations

import itertools
import math
import pickle
import random

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckpt._plan import announce, merge, plain_signature
from ckpt._replicas import shared_across_groups
from ckpt._tensors import LocalPiece
from ckpt.store.errors import StateMismatchError
from ckpt.store.layout import (
    REPLICATE,
    ArrayPlan,
    Mesh,
    MeshSpec,
    mesh_pieces,
    mesh_regions,
    plan_arrays,
)

CASES = [
    ((10,), (4,), (0,)),
    ((9,), (4,), (0,)),
    ((5,), (4,), (0,)),
    ((3,), (8,), (0,)),
    ((50257, 7), (4,), (0,)),
    ((13, 7), (2, 3), (0, 1)),
    ((13, 7), (2, 3), (REPLICATE, 1)),
    ((13, 7), (3, 2), (1, REPLICATE)),
    ((17,), (2, 3), (0, 0)),  # one dimension split by two mesh dimensions, unevenly
    ((11, 6), (2, 2, 2), (0, REPLICATE, 0)),
    ((8, 8), (2, 2, 2), (0, 1, REPLICATE)),
    ((6,), (2, 2), (REPLICATE, REPLICATE)),
    ((), (3,), (REPLICATE,)),
]


def _torch_placements(placements: tuple[int, ...]) -> list[object]:
    return [Replicate() if p == REPLICATE else DShard(p) for p in placements]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), CASES, ids=str)
def test_mesh_pieces_are_where_dtensor_puts_them(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[int, ...]
) -> None:
    """Every coordinate's piece, from store.layout's rule and from ckpt._plan's per-rank check,
    equals torch's own computation (empty pieces: their shape; their offset is unused)."""
    from ckpt._plan import _piece_at

    pieces = mesh_pieces(shape, mesh_shape, placements)
    mesh = Mesh(mesh_shape, tuple(range(math.prod(mesh_shape))))
    spec = MeshSpec("a", "float32", shape, mesh, placements)
    listed = mesh_regions(spec)
    for flat, coord in enumerate(itertools.product(*(range(k) for k in mesh_shape))):
        want_shape, want_off = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), _torch_placements(placements)
        )
        region = listed.held[flat]
        assert region.shape == tuple(want_shape), (coord, region)
        off, shp = _piece_at(shape, mesh, placements, flat)
        assert shp == tuple(want_shape)
        if all(want_shape):
            assert region.offsets == tuple(want_off) == off, (coord, region, want_off)
    assert [len(p) for p in pieces] == [
        math.prod(mesh_shape[m] for m, q in enumerate(placements) if q == d) for d in range(len(shape))
    ]


def _check_writers_hold(plan: ArrayPlan, spec: MeshSpec) -> None:
    """Each chunk lies inside its writer's piece (no slivers), and the chunks tile the array once."""
    held = {h.rank: h for h in mesh_regions(spec).held}
    total = 0
    for c in plan.chunks:
        h = held[c.writer]
        assert not c.slivers
        assert all(o >= ho and o + n <= ho + hn for o, n, ho, hn in zip(c.offsets, c.shape, h.offsets, h.shape)), (
            c,
            h,
        )
        total += math.prod(c.shape)
    assert total == math.prod(spec.shape)


@pytest.mark.parametrize("seed", range(40))
def test_mesh_plans_agree_with_the_listed_regions(seed: int) -> None:
    """A mesh array gets the grid its listed regions would get, and every chunk's writer holds it."""
    rnd = random.Random(seed)
    ndim = rnd.choice([1, 2])
    shape = tuple(rnd.randint(1, 60) for _ in range(ndim))
    mesh_shape = tuple(rnd.randint(1, 4) for _ in range(rnd.choice([1, 2])))
    placements = tuple(rnd.choice([REPLICATE, *range(ndim)]) for _ in mesh_shape)
    ranks = tuple(rnd.sample(range(100), math.prod(mesh_shape)))  # a sub-mesh of a larger job
    spec = MeshSpec("a", "float32", shape, Mesh(mesh_shape, ranks), placements)
    (plan,) = plan_arrays([spec])
    (listed,) = plan_arrays([mesh_regions(spec)])
    assert plan.chunk_shape == listed.chunk_shape
    assert plan.replicated == listed.replicated
    assert plan.sharding == listed.sharding
    if not listed.slivers:  # an aligned grid: planned from the mesh, not from the listing
        _check_writers_hold(plan, spec)
    for rank in set(ranks):
        assert plan.chunks_of(rank) == [c for c in plan.chunks if c.writer == rank]


def test_plans_are_o_of_arrays_at_16384_ranks() -> None:
    """FSDP, HSDP and TP x FSDP at 16,384 ranks: one writer run per array, whatever the world;
    each rank's own chunk comes from the run."""
    world = 16384
    flat = Mesh((world,), tuple(range(world)))
    two_d = Mesh((64, 256), flat.ranks)
    tp = Mesh((2048, 8), flat.ranks)
    specs = [
        MeshSpec("fsdp", "bfloat16", (65536, 128), flat, (0,)),
        *(MeshSpec(f"hsdp{i}", "float32", (4096, 1024), two_d, (REPLICATE, 0)) for i in range(128)),
        MeshSpec("tp", "bfloat16", (16384, 4096), tp, (0, 1)),
    ]
    plans = {p.spec.name: p for p in plan_arrays(specs)}
    assert all(len(p.runs) == 1 for p in plans.values())
    fsdp = plans["fsdp"]
    assert fsdp.chunk_count == world and fsdp.chunk_shape == (4, 128)
    (mine,) = fsdp.chunks_of(12345)
    assert mine.index == (12345, 0) and mine.offsets == (12345 * 4, 0) and mine.shape == (4, 128)
    # The 64 replicas take turns: each writes the chunks of two of the 128 arrays.
    replica_of = {name: p.runs[0].first // 256 for name, p in plans.items() if name.startswith("hsdp")}
    assert sorted(replica_of.values()) == sorted(list(range(64)) * 2)
    tp_plan = plans["tp"]
    assert tp_plan.chunk_shape == (8, 512) and tp_plan.chunk_count == world
    (c,) = tp_plan.chunks_of(8 * 100 + 3)
    assert c.index == (100, 3) and c.offsets == (800, 1536)


def test_fully_replicated_arrays_spread_their_writing_over_the_holders() -> None:
    holders = Mesh((4,), (3, 5, 7, 9))
    big = MeshSpec("big", "uint8", (1000, 1000), holders, (REPLICATE,))
    small = [MeshSpec(f"s{i}", "float32", (3,), holders, (REPLICATE,)) for i in range(4)]
    plans = {p.spec.name: p for p in plan_arrays([big, *small], split_bytes=300_000)}
    assert sorted(c.writer for c in plans["big"].chunks) == [3, 5, 7, 9]
    assert sorted(p.chunks[0].writer for n, p in plans.items() if n != "big") == [3, 5, 7, 9]


def _piece(data: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], **kw: object) -> LocalPiece:
    return LocalPiece(data, "float32", shape, offsets, tuple(data.shape), **kw)  # type: ignore[arg-type]


def test_plain_arrays_are_held_by_their_signature_group() -> None:
    """Pipeline stages: ranks 0-1 and 2-3 hold different plain arrays; one rank of each group
    speaks, and each array's holders are its group."""
    states = [
        {"s0/w": _piece(torch.zeros(4), (4,), (0,))},
        {"s0/w": _piece(torch.zeros(4), (4,), (0,))},
        {"s1/w": _piece(torch.zeros(6), (6,), (0,))},
        {"s1/w": _piece(torch.zeros(6), (6,), (0,))},
    ]
    sigs = [plain_signature(s) for s in states]
    assert sigs[0] == sigs[1] != sigs[2] == sigs[3]
    anns = [announce(r, s, sigs.index(sigs[r]) == r) for r, s in enumerate(states)]
    assert [a.plain is not None for a in anns] == [True, False, True, False]
    specs = {s.name: s for s in merge(anns, sigs)}
    assert isinstance(specs["s0/w"], MeshSpec) and specs["s0/w"].mesh.ranks == (0, 1)
    assert isinstance(specs["s1/w"], MeshSpec) and specs["s1/w"].mesh.ranks == (2, 3)
    plans = {p.spec.name: p for p in plan_arrays(list(specs.values()))}
    assert plans["s0/w"].chunks[0].writer in (0, 1) and plans["s1/w"].chunks[0].writer in (2, 3)


def test_names_shared_by_pipeline_stages_are_found_among_16384_ranks() -> None:
    """4 pipeline stages of 4,096 data-parallel replicas each: each stage's layers are its
    own, its optimizer's state is keyed like every other stage's. Only the shared names are
    compared (ckpt._replicas), found on any rank from the broadcast plans alone."""
    world, stages, layers = 16384, 4, 64
    per = world // stages

    def state(stage: int) -> dict[str, LocalPiece]:
        own = {f"model/layer{stage * layers + i}/w": _piece(torch.zeros(8), (8,), (0,)) for i in range(layers)}
        shared = {f"opt/state/{i}/exp_avg": _piece(torch.zeros(8), (8,), (0,)) for i in range(layers)}
        return own | shared

    speakers = {s * per: state(s) for s in range(stages)}
    sigs = [plain_signature(speakers[r - r % per]) for r in range(world)]
    anns = [announce(r, speakers[r], True) if r in speakers else announce(r, {}, False) for r in range(world)]
    plans = pickle.loads(pickle.dumps(plan_arrays(merge(anns, sigs))))  # as the broadcast sends them
    names = [plans[i].spec.name for i in shared_across_groups(plans, sigs)]
    assert names == sorted(f"opt/state/{i}/exp_avg" for i in range(layers))
    held = next(p for p in plans if p.spec.name == "opt/state/0/exp_avg").spec
    assert isinstance(held, MeshSpec) and held.mesh.ranks == tuple(range(world))
    # Data-parallel replicas alone (every rank one group): nothing to compare, no collective.
    assert shared_across_groups(plans, [0] * world) == []


def test_disagreements_name_both_ranks() -> None:
    a = {"w": _piece(torch.zeros(4), (4,), (0,))}
    b = {"w": _piece(torch.zeros(5), (5,), (0,))}
    sigs = [plain_signature(a), plain_signature(b)]
    with pytest.raises(StateMismatchError, match=r"w: rank 1 holds float32\[5\], rank 0 holds float32\[4\]"):
        merge([announce(0, a, True), announce(1, b, True)], sigs)
    mesh = Mesh((1,), (1,))  # rank 1 alone holds a DTensor of the name rank 0 holds as a tensor
    c = {"w": _piece(torch.zeros(4), (4,), (0,), kind="mesh", mesh=mesh, placements=(0,))}
    with pytest.raises(StateMismatchError, match="rank 1 holds it as a mesh array, rank 0 as a plain array"):
        merge([announce(0, a, True), announce(1, c, False)], [sigs[0], plain_signature(c)])


def test_a_piece_the_placements_do_not_put_there_is_refused() -> None:
    mesh = Mesh((2,), (0, 1))
    wrong = {"w": _piece(torch.zeros(2), (4,), (0,), kind="mesh", mesh=mesh, placements=(0,))}  # rank 1 holds [2, 4)
    ann = announce(1, wrong, True)
    assert ann.error is not None and "put [2] at [2]" in ann.error
    with pytest.raises(StateMismatchError, match="placements"):
        merge(
            [
                announce(0, {"w": _piece(torch.zeros(2), (4,), (0,), kind="mesh", mesh=mesh, placements=(0,))}, True),
                ann,
            ],
            [0, 0],
        )


def test_one_name_on_disjoint_sub_meshes_is_refused_for_they_may_hold_different_values() -> None:
    """Data-parallel replicas (DDP beside TP) and pipeline stages (an optimizer's state keyed
    0, 1, ... on each stage's tp mesh) look alike here; only the values differ, so neither
    is taken for a copy of the other."""
    pieces = {
        lead: {
            "opt/state/0/exp_avg": _piece(torch.zeros(2, 3), (4, 3), (0, 0), kind="mesh", mesh=mesh, placements=(0,))
        }
        for lead, mesh in ((0, Mesh((2,), (0, 1))), (2, Mesh((2,), (2, 3))))
    }
    anns = [announce(0, pieces[0], True), announce(1, {}, False), announce(2, pieces[2], False), announce(3, {}, False)]
    with pytest.raises(StateMismatchError, match="ranks 0 and 2 place it on different DTensor meshes"):
        merge(anns, [0, 0, 0, 0])
