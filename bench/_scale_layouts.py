"""Synthetic shard layouts for bench/scale.py: what every rank of a large job holds.

Each generator returns, per rank, the (name, dtype, global shape, offsets, local shape)
records that ckpt's save() describes and all-gathers on the first save of a layout
(ckpt._save.LocalSpec). The shapes are chosen so that every rank holds something of the
sharded arrays even at 16,384 ranks; no tensor data exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable

LocalSpec = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
Layout = Callable[[int, int], list[list[LocalSpec]]]


def _ceil_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """DTensor's Shard placement (torch.chunk): piece i of n over `parts` as (offset, length)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return lo, max(0, min(size, n - lo))


def fsdp(world: int, arrays: int) -> list[list[LocalSpec]]:
    """FSDP2: every parameter a DTensor Shard(0) over all ranks."""
    out: list[list[LocalSpec]] = [[] for _ in range(world)]
    for a in range(arrays):
        shape = (65536 + 8 * a, 128)
        for r in range(world):
            lo, n = _ceil_split(shape[0], world, r)
            out[r].append((f"model/p{a}", "bfloat16", shape, (lo, 0), (n, 128)))
    return out


def hsdp(world: int, arrays: int) -> list[list[LocalSpec]]:
    """HSDP: a 2-D mesh (replicas x shards of at most 256 ranks), Replicate x Shard(0)."""
    shards = min(world, 256)
    out: list[list[LocalSpec]] = [[] for _ in range(world)]
    for a in range(arrays):
        shape = (4096 + 8 * a, 1024)
        for r in range(world):
            lo, n = _ceil_split(shape[0], shards, r % shards)
            out[r].append((f"model/p{a}", "float32", shape, (lo, 0), (n, 1024)))
    return out


def tp_fsdp(world: int, arrays: int) -> list[list[LocalSpec]]:
    """TP x FSDP: a (world/8) x 8 mesh, Shard(0) over the first dim and Shard(1) over the second."""
    tp = min(8, world)
    dp = world // tp
    out: list[list[LocalSpec]] = [[] for _ in range(world)]
    for a in range(arrays):
        shape = (16384 + 8 * a, 4096)
        for r in range(world):
            r0, n0 = _ceil_split(shape[0], dp, r // tp)
            r1, n1 = _ceil_split(shape[1], tp, r % tp)
            out[r].append((f"model/p{a}", "bfloat16", shape, (r0, r1), (n0, n1)))
    return out


def zero1(world: int, arrays: int) -> list[list[LocalSpec]]:
    """ZeRO-1 / Megatron distributed optimizer: the parameters packed into one flat buffer
    cut into `world` equal ranges; a rank holds each parameter's intersection with its
    range (flattened), so the boundaries inside a parameter are arbitrary."""
    sizes = [1_000_003 + 37 * a for a in range(arrays)]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    total = starts[-1]
    per = -(-total // world)
    out: list[list[LocalSpec]] = [[] for _ in range(world)]
    for a, n in enumerate(sizes):
        first, last = starts[a] // per, (starts[a + 1] - 1) // per
        for r in range(first, min(last, world - 1) + 1):
            lo, hi = max(r * per, starts[a]), min((r + 1) * per, starts[a + 1])
            if lo < hi:
                out[r].append((f"optim/exp_avg/p{a}", "float32", (n,), (lo - starts[a],), (hi - lo,)))
    return out


def moe(world: int, arrays: int) -> list[list[LocalSpec]]:
    """MoE expert parallelism: each expert held whole by one rank of every group of 64
    (expert parallel), replicated over the groups (data parallel)."""
    ep = min(64, world)
    out: list[list[LocalSpec]] = [[] for _ in range(world)]
    for a in range(arrays):
        shape = (2048, 1024)
        for r in range(a % ep, world, ep):
            out[r].append((f"experts/e{a}", "bfloat16", shape, (0, 0), shape))
    return out


LAYOUTS: dict[str, Layout] = {"fsdp": fsdp, "hsdp": hsdp, "tp_fsdp": tp_fsdp, "zero1": zero1, "moe": moe}


def regions_of(per_rank: list[list[LocalSpec]]) -> dict[str, int]:
    """Distinct non-empty regions per array (the arbitrary-boundary bound counts them)."""
    seen: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for entries in per_rank:
        for name, _, _, off, shp in entries:
            if math.prod(shp):
                seen.setdefault(name, set()).add((off, shp))
    return {k: len(v) for k, v in seen.items()}
