"""Synthetic shard layouts for bench/scale.py: what every rank of a large job holds.

Each layout gives what one rank holds (`pieces`: ckpt._tensors.LocalPiece records on meta
tensors, as save() describes them) and what every rank tells rank 0 on the first save of
the layout (`announcements`: ckpt._plan.Announcement, with each rank's plain-array
signature). The announcements are built directly, since calling `announce` on every rank's
pieces would cost the simulation ranks x arrays; bench/scale.py checks them against the
real `announce` on a sample of ranks. No tensor data exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ckpt._plan import Announcement, ListedEntry, announce, plain_signature
from ckpt._tensors import LocalPiece
from ckpt.store.layout import REPLICATE, Mesh, MeshSpec


@dataclass(frozen=True)
class Layout:
    pieces: Callable[[int, int, int], dict[str, LocalPiece]]  # (world, arrays, rank) -> what the rank holds
    announcements: Callable[
        [int, int], tuple[list[Announcement], list[int]]
    ]  # (world, arrays) -> (per rank, signatures)


def _ceil_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """DTensor's Shard placement (torch.chunk): piece i of n over `parts` as (offset, length)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return lo, max(0, min(size, n - lo))


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@functools.lru_cache(maxsize=8)
def _mesh(shape: tuple[int, ...]) -> Mesh:
    n = 1
    for k in shape:
        n *= k
    return Mesh(shape, tuple(range(n)))


def _meshed(
    mesh_of: Callable[[int], tuple[int, ...]],
    placements: tuple[int, ...],
    shape_of: Callable[[int], tuple[int, ...]],
    dtype: str,
    tdtype: torch.dtype,
) -> Layout:
    """A layout of DTensors on one mesh over all ranks: rank 0 leads the mesh and announces them."""

    def pieces(world: int, arrays: int, rank: int) -> dict[str, LocalPiece]:
        mesh = _mesh(mesh_of(world))
        coord, flat = [], rank
        for k in reversed(mesh.shape):
            flat, c = divmod(flat, k)
            coord.append(c)
        coord.reverse()
        out = {}
        for a in range(arrays):
            shape = shape_of(a)
            offsets, local = [0] * len(shape), list(shape)
            for m, d in enumerate(placements):
                if d != REPLICATE:
                    offsets[d], local[d] = _ceil_split(shape[d], mesh.shape[m], coord[m])
            out[f"model/p{a}"] = LocalPiece(
                _meta(tuple(local), tdtype), dtype, shape, tuple(offsets), tuple(local), "mesh", mesh, placements
            )
        return out

    def announcements(world: int, arrays: int) -> tuple[list[Announcement], list[int]]:
        mesh = _mesh(mesh_of(world))
        specs = tuple(MeshSpec(f"model/p{a}", dtype, shape_of(a), mesh, placements) for a in range(arrays))
        sig = plain_signature({})
        anns = [Announcement(0, specs, (), ())] + [Announcement(r, (), (), None) for r in range(1, world)]
        return anns, [sig] * world

    return Layout(pieces, announcements)


# FSDP2: every parameter a DTensor Shard(0) over all ranks.
fsdp = _meshed(lambda w: (w,), (0,), lambda a: (65536 + 8 * a, 128), "bfloat16", torch.bfloat16)
# HSDP: a 2-D mesh (replicas x shards of at most 256 ranks), Replicate x Shard(0).
hsdp = _meshed(
    lambda w: (w // min(w, 256), min(w, 256)), (REPLICATE, 0), lambda a: (4096 + 8 * a, 1024), "float32", torch.float32
)
# TP x FSDP: a (world/8) x 8 mesh, Shard(0) over the first dim and Shard(1) over the second.
tp_fsdp = _meshed(
    lambda w: (w // min(8, w), min(8, w)), (0, 1), lambda a: (16384 + 8 * a, 4096), "bfloat16", torch.bfloat16
)


def _zero1_entries(world: int, arrays: int) -> list[list[ListedEntry]]:
    """ZeRO-1 / Megatron distributed optimizer: the parameters packed into one flat buffer
    cut into `world` equal ranges; a rank holds each parameter's intersection with its
    range (flattened), so the boundaries inside a parameter are arbitrary."""
    sizes = [1_000_003 + 37 * a for a in range(arrays)]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    per = -(-starts[-1] // world)
    out: list[list[ListedEntry]] = [[] for _ in range(world)]
    for a, n in enumerate(sizes):
        first, last = starts[a] // per, (starts[a + 1] - 1) // per
        for r in range(first, min(last, world - 1) + 1):
            lo, hi = max(r * per, starts[a]), min((r + 1) * per, starts[a + 1])
            if lo < hi:
                out[r].append((f"optim/exp_avg/p{a}", "float32", (n,), (lo - starts[a],), (hi - lo,)))
    return out


def _zero1_pieces(world: int, arrays: int, rank: int) -> dict[str, LocalPiece]:
    return {
        name: LocalPiece(_meta(local, torch.float32), dtype, shape, offsets, tuple(local), "listed")
        for name, dtype, shape, offsets, local in _zero1_entries(world, arrays)[rank]
    }


def _zero1_announcements(world: int, arrays: int) -> tuple[list[Announcement], list[int]]:
    sig = plain_signature({})
    entries = _zero1_entries(world, arrays)
    anns = [Announcement(r, (), tuple(entries[r]), () if r == 0 else None) for r in range(world)]
    return anns, [sig] * world


zero1 = Layout(_zero1_pieces, _zero1_announcements)


def _moe_pieces(world: int, arrays: int, rank: int) -> dict[str, LocalPiece]:
    """MoE expert parallelism: each expert a plain tensor held whole by one rank of every
    group of 64 (expert parallel), so replicated over the groups (data parallel)."""
    ep = min(64, world)
    shape = (2048, 1024)
    return {
        f"experts/e{a}": LocalPiece(_meta(shape, torch.bfloat16), "bfloat16", shape, (0, 0), shape)
        for a in range(rank % ep, arrays, ep)
    }


def _moe_announcements(world: int, arrays: int) -> tuple[list[Announcement], list[int]]:
    ep = min(64, world)
    groups = [_moe_pieces(world, arrays, g) for g in range(ep)]  # ranks g, g + ep, ... hold alike
    sigs = [plain_signature(p) for p in groups]
    anns = [announce(g, groups[g], True) for g in range(ep)]
    anns += [Announcement(r, (), (), None) for r in range(ep, world)]
    return anns, [sigs[r % ep] for r in range(world)]


moe = Layout(_moe_pieces, _moe_announcements)

LAYOUTS: dict[str, Layout] = {"fsdp": fsdp, "hsdp": hsdp, "tp_fsdp": tp_fsdp, "zero1": zero1, "moe": moe}
