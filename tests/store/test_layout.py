"""store.layout's grids for any region boundaries: bounded chunk counts, one writer per
chunk, and slivers that together with the writer's part fill each chunk exactly once."""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Sequence

import pytest

from ckpt.store.errors import ReshardError
from ckpt.store.layout import GRID_BYTES, ArrayPlan, ArraySpec, HeldRegion, plan_arrays

Region = tuple[tuple[int, ...], tuple[int, ...]]


def _spec(shape: tuple[int, ...], regions: Sequence[Region], dtype: str = "float32", name: str = "a") -> ArraySpec:
    return ArraySpec(name, dtype, shape, tuple(HeldRegion(r, o, s) for r, (o, s) in enumerate(regions)))


def _cuts(n: int, k: int, rnd: random.Random) -> list[int]:
    return [0, *sorted(rnd.sample(range(1, n), k - 1)), n] if k > 1 else [0, n]


def _cells(off: Sequence[int], shp: Sequence[int]) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = {()}
    for o, s in zip(off, shp):
        out = {c + (i,) for c in out for i in range(o, o + s)}
    return out


def _check_plan(plan: ArrayPlan, regions: Sequence[Region], exhaustive: bool) -> None:
    """Every chunk: its writer holds a part of it, each sliver comes from a rank holding that
    part, and the writer's part plus the slivers are disjoint and fill the chunk's valid box."""
    held = {r: reg for r, reg in enumerate(regions)}
    total = 0
    for c in plan.chunks:
        w_off, w_shp = held[c.writer]
        parts = []
        lo = tuple(map(max, c.offsets, w_off))
        hi = tuple(min(a + b, x + y) for a, b, x, y in zip(c.offsets, c.shape, w_off, w_shp))
        assert all(h > low for low, h in zip(lo, hi)), f"writer {c.writer} holds nothing of chunk {c.index}"
        parts.append((lo, tuple(h - low for low, h in zip(lo, hi))))
        for s in c.slivers:
            s_off, s_shp = held[s.rank]
            assert all(o >= so and o + n <= so + sn for o, n, so, sn in zip(s.offsets, s.shape, s_off, s_shp))
            parts.append((s.offsets, s.shape))
        volume = sum(math.prod(p[1]) for p in parts)
        assert volume == math.prod(c.shape), (c.index, volume, c.shape)
        if exhaustive:
            cells: set[tuple[int, ...]] = set()
            for p in parts:
                cells |= _cells(*p)
            assert cells == _cells(c.offsets, c.shape)
        total += volume
    assert total == math.prod(plan.spec.shape)


@pytest.mark.parametrize("world", [2, 3, 4, 16, 64, 1024])
def test_arbitrary_1d_boundaries_give_a_bounded_grid(world: int) -> None:
    rnd = random.Random(world)
    n = 10_000_019
    b = _cuts(n, world, rnd)
    regions = [((b[i],), (b[i + 1] - b[i],)) for i in range(world)]
    (plan,) = plan_arrays([_spec((n,), regions)])
    assert len(plan.chunks) <= world + math.ceil(n * 4 / GRID_BYTES)
    assert len({c.writer for c in plan.chunks}) <= world
    _check_plan(plan, regions, exhaustive=False)


@pytest.mark.parametrize("seed", range(40))
def test_random_2d_layouts_fill_every_chunk_exactly_once(seed: int) -> None:
    """Row splits, column splits and grids of both, uneven, small enough to check cell by cell."""
    rnd = random.Random(seed)
    shape = (rnd.randint(1, 40), rnd.randint(1, 40))
    kr = rnd.randint(1, min(4, shape[0]))
    kc = rnd.randint(1, min(4, shape[1]))
    rows, cols = _cuts(shape[0], kr, rnd), _cuts(shape[1], kc, rnd)
    regions = [
        ((rows[i], cols[j]), (rows[i + 1] - rows[i], cols[j + 1] - cols[j])) for i in range(kr) for j in range(kc)
    ]
    (plan,) = plan_arrays([_spec(shape, regions, dtype="uint8")])
    assert len(plan.chunks) <= len(regions) + 1
    _check_plan(plan, regions, exhaustive=True)


def test_even_and_ceil_splits_keep_one_chunk_per_rank_and_no_slivers() -> None:
    for world, n in ((4, 50257), (8, 4096), (3, 10)):
        size = -(-n // world)
        regions = [((r * size,), (max(0, min(size, n - r * size)),)) for r in range(world)]
        regions = [r for r in regions if r[1][0] > 0]
        (plan,) = plan_arrays([_spec((n,), regions)])
        assert plan.chunk_shape == (size,) and not any(c.slivers for c in plan.chunks)
        assert [c.writer for c in plan.chunks] == list(range(len(regions)))


def test_the_plans_every_rank_receives_do_not_grow_with_the_ranks_regions() -> None:
    """Hand-made shards (ckpt.Shard): rank 0 plans them from every rank's region and sends
    the plans, pickled, to every rank (ckpt._plan.agree_plans). They carry each array's
    writers as runs, not the regions: as many bytes at 4096 ranks as at 64 (before: 70 times as many)."""

    def sent(world: int) -> int:
        rows = [((64 * r, 0), (64, 16)) for r in range(world)]
        plans = plan_arrays([_spec((64 * world, 16), rows, name=f"p{a}") for a in range(8)])
        assert all(len(p.runs) == 1 for p in plans)
        return len(pickle.dumps((plans, None)))

    small, large = sent(64), sent(4096)
    assert large < 1.1 * small, (small, large)


def test_a_straddling_chunk_is_written_by_the_holder_of_its_largest_part() -> None:
    n = 1_000_003  # cut at 3 and 500_001: the gcd grid would have a chunk per element
    regions = [((0,), (3,)), ((3,), (499_998,)), ((500_001,), (500_002,))]
    (plan,) = plan_arrays([_spec((n,), regions)])
    assert len(plan.chunks) <= 3 + 1
    for c in plan.chunks:
        if c.slivers:
            mine = min(c.offsets[0] + c.shape[0], {0: 3, 1: 500_001, 2: n}[c.writer]) - max(
                c.offsets[0], {0: 0, 1: 3, 2: 500_001}[c.writer]
            )
            assert all(mine >= math.prod(s.shape) for s in c.slivers)
    _check_plan(plan, regions, exhaustive=False)


def test_replicated_holders_share_the_sending() -> None:
    """HSDP with an arbitrary cut: two replicas of each region; both write and both send."""
    n = 999_983
    regions = [((0,), (1234,)), ((1234,), (n - 1234,))] * 2
    (plan,) = plan_arrays([_spec((n,), regions)])
    straddling = [c for c in plan.chunks if c.slivers]
    assert straddling and len(plan.chunks) <= 2 + 1
    _check_plan(plan, regions, exhaustive=False)


def test_overlaps_and_gaps_are_refused_whatever_the_grid() -> None:
    n = 1_000_003
    # An overlap (at 499_999) and a gap (at 500_001) inside one chunk: the element counts agree.
    overlap_and_gap = [((0,), (500_000,)), ((499_999,), (2,)), ((500_002,), (500_001,))]
    (plan,) = plan_arrays([_spec((n,), [((0,), (499_999,)), ((499_999,), (3,)), ((500_002,), (500_001,))])])
    assert any(c.offsets[0] <= 499_999 and 500_001 < c.offsets[0] + c.shape[0] for c in plan.chunks)
    with pytest.raises(ReshardError, match="overlap"):
        plan_arrays([_spec((n,), overlap_and_gap)])
    with pytest.raises(ReshardError, match="gaps"):
        plan_arrays([_spec((n,), [((0,), (500_000,)), ((500_001,), (500_002,))])])
    with pytest.raises(ReshardError, match="overlap"):
        plan_arrays([_spec((20, 20), [((0, 0), (11, 20)), ((10, 0), (10, 13)), ((10, 13), (10, 7))], "uint8")])
