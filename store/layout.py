"""Pure planning of a version's chunk layout: which chunks each array has and who writes them.

Input is what every rank holds (a region of each global array); output is a regular
zarr chunk grid whose every chunk lies inside one held region, and one writer per
chunk. No I/O happens here, so the rules can be tested exhaustively.

Rules:
- The chunk size along a dimension is the gcd of the region boundaries inside the array,
  so a chunk never straddles two ranks' regions: one writer per chunk, no
  read-modify-write. The last chunk may be partial (zero-padded on disk).
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
    "ChunkPlan",
    "ArrayPlan",
    "plan_arrays",
    "chunk_file",
    "block_rows",
    "INLINE_TYPES",
    "BLOCK_BYTES",
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
class ChunkPlan:
    """One chunk of the grid and the rank that writes it."""

    index: tuple[int, ...]  # chunk grid coordinates
    writer: int
    offsets: tuple[int, ...]  # where the chunk's valid data starts in the global array
    shape: tuple[int, ...]  # the valid extent (edge chunks are smaller than chunk_shape)
    nbytes: int  # bytes on disk: the full chunk_shape, edge padding included
    inline: bool = False


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
# zarr's "." chunk-key separator keeps every chunk file in its array's directory: a third
# of the directories of "/" keys, each one a mkdir and an fsync per save.
CHUNK_SEPARATOR = "."


def block_rows(chunk_shape: Sequence[int], item: int, target: int = BLOCK_BYTES) -> int:
    """Rows of dim 0 per block (0 when the chunk is a single block)."""
    if not chunk_shape or math.prod(chunk_shape) * item <= target:
        return 0
    row = math.prod(chunk_shape[1:]) * item
    return max(1, target // row)


def chunk_file(array_path: str, index: Sequence[int], separator: str = CHUNK_SEPARATOR) -> str:
    """The zarr v3 default chunk key relative to the version directory: "<array>/c.0.0"."""
    if not index:
        return f"{array_path}/c"
    return f"{array_path}/c{separator}" + separator.join(str(i) for i in index)


def _grid(spec: ArraySpec, regions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...]:
    """gcd of the interior region boundaries per dimension.

    The array's end is left out: zarr's edge chunk may be partial, so a ceil-split such as
    DTensor's 50257 rows over 4 ranks (12565 x 3 + 12562) keeps 12565-row chunks.
    """
    chunk = []
    for d, extent in enumerate(spec.shape):
        g = 0
        for off, shp in regions:
            if math.prod(shp) == 0:  # an empty piece holds nothing: it must not shape the grid
                continue
            for b in (off[d], off[d] + shp[d]):
                if b != extent:
                    g = math.gcd(g, b)
        chunk.append(g or max(extent, 1))
    return tuple(chunk)


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


def plan_arrays(specs: Sequence[ArraySpec], *, split_bytes: int = 64 << 20) -> list[ArrayPlan]:
    """Plan every array; deterministic, so every rank computes the same plan from the same specs."""
    load: dict[int, int] = {}
    pending: list[tuple[int, str, int, tuple[int, ...], list[int], ArraySpec, tuple[int, ...], tuple[int, ...]]] = []
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
        chunk_shape = _grid(spec, list(regions))
        holders_of = dict(regions)
        if replicated and spec.shape and numel * size > split_bytes:
            parts = min(len(regions[whole]), math.ceil(numel * size / split_bytes), spec.shape[0])
            chunk_shape = (math.ceil(spec.shape[0] / parts), *spec.shape[1:])
        region_list = tuple((o, s, tuple(sorted(r))) for (o, s), r in regions.items())
        plans[spec.name] = (spec, chunk_shape, replicated, region_list)
        if numel == 0:
            continue
        covered = 0
        seen: set[tuple[int, ...]] = set()
        for (off, shp), holders in holders_of.items():
            if math.prod(shp) == 0:  # e.g. DTensor's empty last shard, at offset = the dim's size
                continue
            lo = [o // c for o, c in zip(off, chunk_shape)]
            hi = [math.ceil((o + s) / c) for o, s, c in zip(off, shp, chunk_shape)]
            for index in _box_indices(lo, hi):
                c_off = tuple(i * c for i, c in zip(index, chunk_shape))
                c_shp = tuple(min(c, full - o) for c, full, o in zip(chunk_shape, spec.shape, c_off))
                nbytes = math.prod(chunk_shape) * size
                if index in seen:
                    raise ReshardError(f"{spec.name}: the ranks' regions overlap at chunk {index}")
                seen.add(index)
                covered += math.prod(c_shp)
                pending.append((nbytes, spec.name, 0, index, sorted(holders), spec, c_off, c_shp))
        if covered != numel:
            raise ReshardError(f"{spec.name}: the ranks' regions leave gaps ({covered} of {numel} elements covered)")
    # Largest first onto the least-loaded holder: spreads replicated writes over ranks.
    pending.sort(key=lambda p: (-p[0], p[1], p[3]))
    chunks: dict[str, list[ChunkPlan]] = {name: [] for name in plans}
    for nbytes, name, _, index, holders, spec, c_off, c_shp in pending:
        writer = min(holders, key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + nbytes
        inline = math.prod(spec.shape) == 1 and spec.data_type in INLINE_TYPES
        chunks[name].append(ChunkPlan(index, writer, c_off, c_shp, 0 if inline else nbytes, inline))
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
