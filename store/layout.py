"""Pure planning of a version's chunk layout: which chunks each array has and who writes them.

Input is what every rank holds (a region of each global array); output is a regular
zarr chunk grid and one writer per chunk. No I/O happens here, so the rules can be
tested exhaustively.

Rules:
- The chunk size along a dimension is the gcd of the region boundaries inside the array,
  so a chunk never straddles two ranks' regions, when that grid has at most
  regions + bytes / GRID_BYTES chunks (even splits, DTensor's ceil splits). The last
  chunk may be partial (zero-padded on disk).
- Otherwise (boundaries with no useful common divisor, as ZeRO-1 and Megatron's
  distributed optimizer cut their flat buffers) the gcd grid would have up to one chunk
  per element. The array then gets a regular grid of at most regions + bytes / GRID_BYTES
  chunks; a chunk that straddles regions is written by the holder of its largest part,
  and the other holders send it their parts (`Sliver`s) during the save (ckpt._exchange).
  Still one writer per chunk and no read-modify-write, and any zarr reader sees a
  plain regular grid.
- A region held by several ranks (replicated data) is written once, by the holder
  with the fewest bytes assigned so far; large replicated arrays are split along
  dim 0 so the writing is spread over the holders.
- Single-element arrays of plain numeric types are stored inline (zarr fill_value),
  so the ~300 Adam `step` scalars cost no files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckpt.store.dtypes import itemsize
from ckpt.store.errors import ReshardError

__all__ = [
    "HeldRegion",
    "ArraySpec",
    "Sliver",
    "ChunkPlan",
    "ArrayPlan",
    "plan_arrays",
    "chunk_file",
    "block_rows",
    "INLINE_TYPES",
    "BLOCK_BYTES",
    "GRID_BYTES",
    "CHUNK_SEPARATOR",
]

# Element types whose single value is stored inline as the array's fill_value.
INLINE_TYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)


@dataclass(frozen=True, slots=True)
class HeldRegion:
    """A box of a global array that one rank holds in memory."""

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One global array as every rank sees it."""

    name: str  # the manifest key, e.g. "model/layers.0.weight"
    data_type: str  # a store.dtypes name
    shape: tuple[int, ...]  # the global shape
    held: tuple[HeldRegion, ...]  # every rank's region; identical regions mean replication


@dataclass(frozen=True, slots=True)
class Sliver:
    """A part of a chunk that its writer does not hold: `rank` sends it to the writer."""

    rank: int
    offsets: tuple[int, ...]  # global
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One chunk of the grid and the rank that writes it."""

    index: tuple[int, ...]  # chunk grid coordinates
    writer: int
    offsets: tuple[int, ...]  # where the chunk's valid data starts in the global array
    shape: tuple[int, ...]  # the valid extent (edge chunks are smaller than chunk_shape)
    nbytes: int  # bytes on disk: the full chunk_shape, edge padding included
    inline: bool = False
    slivers: tuple[Sliver, ...] = ()  # the parts other ranks send the writer (straddling chunks)


@dataclass(frozen=True, slots=True)
class ArrayPlan:
    spec: ArraySpec
    chunk_shape: tuple[int, ...]
    chunks: tuple[ChunkPlan, ...]
    replicated: bool  # every holder holds the whole array
    regions: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = field(default=())
    """Distinct (offsets, shape, holder ranks) triples, for inspection and resharding."""


# Target size of a checksummed block: a partial read verifies whole blocks, so this bounds
# both the over-read and the bounce buffer of a resharded restore.
BLOCK_BYTES = 4 << 20
# Target chunk size of an array whose region boundaries share no useful divisor: bounds
# both its file count and the bytes a straddling chunk's writer receives from a neighbour.
GRID_BYTES = 16 << 20
# zarr's "." chunk-key separator keeps every chunk file in its array's directory: a third
# of the directories of "/" keys, each one a mkdir and an fsync per save.
CHUNK_SEPARATOR = "."


def block_rows(chunk_shape: Sequence[int], item: int, target: int = BLOCK_BYTES) -> int:
    """Rows of dim 0 per block (0 when the chunk is a single block)."""
    if not chunk_shape or math.prod(chunk_shape) * item <= target:
        return 0
    row = math.prod(chunk_shape[1:]) * item
    return max(1, target // row)


def grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Chunks along each dimension of a regular grid."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape))


def flat_index(index: Sequence[int], grid: Sequence[int]) -> int:
    """A chunk's position in grid (C) order: the order in which the manifest's writer runs
    and a rank file's digests name chunks."""
    flat = 0
    for i, g in zip(index, grid):
        flat = flat * g + i
    return flat


def chunk_file(array_path: str, index: Sequence[int], separator: str = CHUNK_SEPARATOR) -> str:
    """The zarr v3 default chunk key relative to the version directory: "<array>/c.0.0"."""
    if not index:
        return f"{array_path}/c"
    return f"{array_path}/c{separator}" + separator.join(str(i) for i in index)


def _gcd_grid(shape: tuple[int, ...], regions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    """gcd of the interior region boundaries per dimension.

    The array's end is left out: zarr's edge chunk may be partial, so a ceil-split such as
    DTensor's 50257 rows over 4 ranks (12565 x 3 + 12562) keeps 12565-row chunks.
    """
    chunk = []
    for d, extent in enumerate(shape):
        g = 0
        for off, shp in regions:
            for b in (off[d], off[d] + shp[d]):
                if b != extent:
                    g = math.gcd(g, b)
        chunk.append(g or max(extent, 1))
    return chunk


def _grid(
    shape: tuple[int, ...], regions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], nbytes: int
) -> tuple[int, ...]:
    """The chunk shape: the gcd grid when it has at most regions + bytes / GRID_BYTES chunks,
    else a regular grid of at most that many.

    `regions` are the distinct non-empty held regions. The bounded grid gives each
    dimension at most as many chunks as it has distinct region intervals (halving the
    largest counts while the product exceeds the budget), keeps the gcd size along the
    dimensions where that is no finer, and spends what is left of the budget on the first
    dimension it splits too finely, so its chunks approach GRID_BYTES.
    """
    aligned = _gcd_grid(shape, regions)
    if not regions:
        return tuple(aligned)
    counts = [-(-e // c) for e, c in zip(shape, aligned)]
    budget = len(regions) + -(-nbytes // GRID_BYTES)
    if math.prod(counts) <= budget:
        return tuple(aligned)
    n = [len({(o[d], o[d] + s[d]) for o, s in regions}) for d in range(len(shape))]
    while math.prod(n) > budget:
        i = max(range(len(n)), key=lambda d: n[d])
        n[i] = -(-n[i] // 2)
    d0 = next(d for d in range(len(shape)) if counts[d] > n[d])
    rest = math.prod(n) // n[d0]
    n[d0] = max(n[d0], min(shape[d0], budget // rest))
    return tuple(c if k <= m else -(-e // m) for e, c, k, m in zip(shape, aligned, counts, n))


def _distinct_regions(spec: ArraySpec) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for h in spec.held:
        if len(h.offsets) != len(spec.shape) or len(h.shape) != len(spec.shape):
            raise ReshardError(f"{spec.name}: rank {h.rank} holds a region of another rank than the array")
        for o, s, full in zip(h.offsets, h.shape, spec.shape):
            if o < 0 or s < 0 or o + s > full:
                raise ReshardError(f"{spec.name}: rank {h.rank} region {h.offsets}+{h.shape} is outside {spec.shape}")
        regions.setdefault((h.offsets, h.shape), []).append(h.rank)
    return regions


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


@dataclass(slots=True)
class _Pending:
    """A chunk whose writer is still to choose: the held regions it overlaps, largest part first."""

    nbytes: int
    spec: ArraySpec
    index: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[tuple[Box, Box, list[int]]]  # (region, the chunk's part of it, its holders)


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(map(max, a[0], b[0]))
    hi = tuple(min(o + s, p + t) for o, s, p, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _check_disjoint(name: str, index: tuple[int, ...], boxes: list[Box]) -> None:
    """Regions that overlap share a chunk, so checking each chunk's regions finds every overlap;
    sorted along dim 0, a region is compared only with those starting before it ends."""
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b[0][0] >= a[0][0] + a[1][0]:
                break
            if _intersect(a, b) is not None:
                raise ReshardError(f"{name}: the ranks' regions overlap at chunk {index}")


def _chunks_of(spec: ArraySpec, chunk_shape: tuple[int, ...], regions: dict[Box, list[int]]) -> list[_Pending]:
    """Every chunk of the grid that holds data, with the regions it overlaps; raises on overlaps and gaps."""
    size = itemsize(spec.data_type)
    touching: dict[tuple[int, ...], list[Box]] = {}
    for region in regions:
        off, shp = region
        lo = [o // c for o, c in zip(off, chunk_shape)]
        hi = [-(-(o + s) // c) for o, s, c in zip(off, shp, chunk_shape)]
        for index in _box_indices(lo, hi):
            touching.setdefault(index, []).append(region)
    out = []
    covered = 0
    nbytes = math.prod(chunk_shape) * size
    for index, boxes in touching.items():
        c_off = tuple(i * c for i, c in zip(index, chunk_shape))
        c_shp = tuple(min(c, full - o) for c, full, o in zip(chunk_shape, spec.shape, c_off))
        parts = []
        for region in boxes:
            part = _intersect((c_off, c_shp), region)
            assert part is not None  # the region's index box holds only chunks it overlaps
            parts.append((region, part, regions[region]))
        if len(parts) > 1:
            _check_disjoint(spec.name, index, boxes)
            parts.sort(key=lambda p: (-math.prod(p[1][1]), p[0]))
        covered += sum(math.prod(p[1][1]) for p in parts)
        out.append(_Pending(nbytes, spec, index, c_off, c_shp, parts))
    if covered != math.prod(spec.shape):
        raise ReshardError(
            f"{spec.name}: the ranks' regions leave gaps ({covered} of {math.prod(spec.shape)} elements covered)"
        )
    return out


def plan_arrays(specs: Sequence[ArraySpec], *, split_bytes: int = 64 << 20) -> list[ArrayPlan]:
    """Plan every array; deterministic, so every rank computes the same plan from the same specs."""
    load: dict[int, int] = {}  # bytes each rank writes
    sent: dict[int, int] = {}  # bytes each rank sends as slivers
    pending: list[_Pending] = []
    plans: dict[
        str,
        tuple[ArraySpec, tuple[int, ...], bool, tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]],
    ] = {}
    for spec in sorted(specs, key=lambda s: s.name):
        size = itemsize(spec.data_type)
        regions = _distinct_regions(spec)
        numel = math.prod(spec.shape)
        whole = (tuple(0 for _ in spec.shape), tuple(spec.shape))
        replicated = list(regions) == [whole]
        # An empty piece (DTensor's last shard at offset = the dim's size) holds nothing:
        # it neither shapes the grid nor gets a chunk.
        held = {r: h for r, h in regions.items() if math.prod(r[1]) > 0}
        chunk_shape = _grid(spec.shape, list(held), numel * size)
        if replicated and spec.shape and numel * size > split_bytes:
            parts = min(len(regions[whole]), math.ceil(numel * size / split_bytes), spec.shape[0])
            chunk_shape = (math.ceil(spec.shape[0] / parts), *spec.shape[1:])
        region_list = tuple((o, s, tuple(sorted(r))) for (o, s), r in regions.items())
        plans[spec.name] = (spec, chunk_shape, replicated, region_list)
        if numel:
            pending.extend(_chunks_of(spec, chunk_shape, held))
    # Largest first onto the least-loaded holder: spreads replicated writes over ranks.
    pending.sort(key=lambda p: (-p.nbytes, p.spec.name, p.index))
    chunks: dict[str, list[ChunkPlan]] = {name: [] for name in plans}
    for p in pending:
        holders = p.parts[0][2]
        writer = min(holders, key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + p.nbytes
        slivers = []
        for _, (off, shp), senders in p.parts[1:]:
            sender = min(senders, key=lambda r: (sent.get(r, 0), r))
            sent[sender] = sent.get(sender, 0) + math.prod(shp)
            slivers.append(Sliver(sender, off, shp))
        inline = math.prod(p.spec.shape) == 1 and p.spec.data_type in INLINE_TYPES
        chunk = ChunkPlan(p.index, writer, p.offsets, p.shape, 0 if inline else p.nbytes, inline, tuple(slivers))
        chunks[p.spec.name].append(chunk)
    out = []
    for name, (spec, chunk_shape, replicated, region_list) in plans.items():
        ordered = tuple(sorted(chunks[name], key=lambda c: c.index))
        out.append(ArrayPlan(spec, chunk_shape, ordered, replicated, region_list))
    return out


def _box_indices(lo: Sequence[int], hi: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for a, b in zip(lo, hi):
        out = [prefix + (i,) for prefix in out for i in range(a, b)]
    return out
