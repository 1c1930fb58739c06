"""Pure planning of a version's chunk layout: which chunks each array has and who writes them.

Input is where the ranks hold each global array, in one of two forms: a `MeshSpec`
(a device mesh and its placements: a DTensor's Shard/Replicate, or a plain tensor that
every rank of a group holds), from which every piece follows without listing any rank;
or an `ArraySpec` that lists every rank's region (hand-made shards). Output is a
regular zarr chunk grid and one writer per chunk, as runs (`WriterRun`), so a plan is
O(arrays) whatever the world size and each rank materializes only its own chunks
(`ArrayPlan.chunks_of`). No I/O happens here, so the rules can be tested exhaustively.

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
- A region held by several ranks (replicated data) is written once. Replicas of a mesh
  array take turns by array (largest arrays first), so the writing is spread over the
  replicas; listed regions go to the holder with the fewest bytes assigned so far.
  Large fully replicated arrays are split along dim 0 so the writing is spread over
  the holders.
- Single-element arrays of plain numeric types are stored inline (zarr fill_value),
  so the ~300 Adam `step` scalars cost no files.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt.store.dtypes import itemsize
from ckpt.store.errors import ReshardError

__all__ = [
    "HeldRegion",
    "ArraySpec",
    "Mesh",
    "MeshSpec",
    "REPLICATE",
    "Sliver",
    "ChunkPlan",
    "ArrayPlan",
    "Sharding",
    "WriterRun",
    "writer_runs",
    "mesh_pieces",
    "plan_arrays",
    "chunk_file",
    "block_rows",
    "grid_shape",
    "flat_index",
    "INLINE_TYPES",
    "BLOCK_BYTES",
    "LEGACY_BLOCK_BYTES",
    "GRID_BYTES",
    "CHUNK_SEPARATOR",
]

# Element types whose single value is stored inline as the array's fill_value.
INLINE_TYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)
REPLICATE = -1  # a mesh dimension along which every rank holds the same piece


@dataclass(frozen=True, slots=True)
class HeldRegion:
    """A box of a global array that one rank holds in memory."""

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One global array as every rank's listed region describes it."""

    name: str  # the manifest key, e.g. "model/layers.0.weight"
    data_type: str  # a store.dtypes name
    shape: tuple[int, ...]  # the global shape
    held: tuple[HeldRegion, ...]  # every rank's region; identical regions mean replication


@dataclass(frozen=True, slots=True)
class Mesh:
    """Ranks laid out as an n-d grid (a DeviceMesh, or a group of ranks as a 1-d mesh)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks in row-major mesh order


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """One global array whose pieces follow from a mesh: along each mesh dimension it is
    either split into ceil-sized pieces (torch.chunk, as DTensor's Shard) or replicated."""

    name: str
    data_type: str
    shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[int, ...]  # per mesh dimension: the array dimension it splits, or REPLICATE


Spec = ArraySpec | MeshSpec


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
class WriterRun:
    """`count` chunks from flat grid index `start` on, written by ranks first, first + stride, ..."""

    start: int
    count: int
    first: int
    stride: int


def writer_runs(writers: Sequence[int]) -> tuple[WriterRun, ...]:
    """The writers of an array's chunks in grid order, as runs."""
    runs: list[WriterRun] = []
    i = 0
    while i < len(writers):
        first = writers[i]
        stride = writers[i + 1] - first if i + 1 < len(writers) and writers[i + 1] >= first else 0
        j = i + 1
        while j < len(writers) and writers[j] == first + stride * (j - i):
            j += 1
        runs.append(WriterRun(i, j - i, first, stride))
        i = j
    return tuple(runs)


def _runs_of(writers: np.ndarray) -> tuple[WriterRun, ...]:
    """writer_runs of an array of writers, without a Python loop when they form one run."""
    if writers.size >= 2:
        stride = int(writers[1] - writers[0])
        if stride >= 0 and bool(np.all(np.diff(writers) == stride)):
            return (WriterRun(0, int(writers.size), int(writers[0]), stride),)
    return writer_runs([int(w) for w in writers.tolist()])


@dataclass(frozen=True, slots=True)
class Sharding:
    """How ranks held an array, in O(1) space (the manifest's "sharding")."""

    pieces: int  # distinct non-empty regions
    dims: tuple[int, ...]  # the dimensions it is split along
    uneven: bool  # pieces of different shapes
    replicas: int  # the most ranks holding one piece

    def to_json(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "dims": list(self.dims), "uneven": self.uneven, "replicas": self.replicas}

    @staticmethod
    def of(regions: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> Sharding:
        """The summary of listed (offsets, shape, holders) regions."""
        live = [r for r in regions if not any(n == 0 for n in r[1])]  # an empty region holds nothing
        return Sharding(
            len(live),
            tuple(sorted({d for offsets, _, _ in live for d, o in enumerate(offsets) if o})),
            len({tuple(shape) for _, shape, _ in live}) > 1,
            max((len(ranks) for _, _, ranks in live), default=0),
        )


@dataclass(frozen=True, slots=True)
class ArrayPlan:
    """One array's grid and writers: O(runs), the same on every rank (rank 0 plans, the
    others receive it); each rank asks for its own chunks."""

    spec: Spec
    chunk_shape: tuple[int, ...]
    runs: tuple[WriterRun, ...]  # the writer of every chunk, in grid order
    replicated: bool  # every holder holds the whole array
    sharding: Sharding
    inline: bool = False  # a single chunk stored as the array's fill_value
    slivers: Mapping[int, tuple[Sliver, ...]] = field(default_factory=dict)  # flat index -> parts others send

    @property
    def grid(self) -> tuple[int, ...]:
        return grid_shape(self.spec.shape, self.chunk_shape)

    @property
    def chunk_count(self) -> int:
        return sum(r.count for r in self.runs)

    def chunk(self, flat: int, writer: int | None = None) -> ChunkPlan:
        """The chunk at grid position `flat`."""
        if writer is None:
            run = self.runs[bisect.bisect_right([r.start for r in self.runs], flat) - 1]
            writer = run.first + run.stride * (flat - run.start)
        index = _unravel(flat, self.grid)
        offsets = tuple(i * c for i, c in zip(index, self.chunk_shape))
        shape = tuple(min(c, full - o) for c, full, o in zip(self.chunk_shape, self.spec.shape, offsets))
        nbytes = 0 if self.inline else math.prod(self.chunk_shape) * itemsize(self.spec.data_type)
        return ChunkPlan(index, writer, offsets, shape, nbytes, self.inline, self.slivers.get(flat, ()))

    def flats_of(self, rank: int) -> Iterator[int]:
        """Grid positions of the chunks `rank` writes, ascending: O(runs + its chunks)."""
        for r in self.runs:
            if r.stride == 0:
                if r.first == rank:
                    yield from range(r.start, r.start + r.count)
            elif (rank - r.first) % r.stride == 0 and 0 <= (rank - r.first) // r.stride < r.count:
                yield r.start + (rank - r.first) // r.stride

    def chunks_of(self, rank: int) -> list[ChunkPlan]:
        return [self.chunk(f, rank) for f in self.flats_of(rank)]

    @property
    def chunks(self) -> tuple[ChunkPlan, ...]:
        """Every chunk, in grid order: O(chunks), for inspection and tests."""
        out = []
        for r in self.runs:
            out += [self.chunk(r.start + k, r.first + r.stride * k) for k in range(r.count)]
        return tuple(out)


def _unravel(flat: int, grid: Sequence[int]) -> tuple[int, ...]:
    index = []
    for g in reversed(grid):
        flat, i = divmod(flat, g) if g else (flat, 0)
        index.append(i)
    return tuple(reversed(index))


# Target size of a checksummed block: a partial read verifies whole blocks, so this bounds
# the over-read and the bounce copies of a resharded restore (at 4 MiB, a rank of a 2->3
# reshard read 8.7 MB to use 3.1 MB of a 9.4 MB matrix). Schemas 1-3 used LEGACY_BLOCK_BYTES.
BLOCK_BYTES = 1 << 20
LEGACY_BLOCK_BYTES = 4 << 20
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


Interval = tuple[int, int]  # [lo, hi) along one dimension
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def _gcd_sizes(shape: Sequence[int], bounds: Sequence[np.ndarray]) -> tuple[int, ...]:
    """Per dimension, the gcd of the boundaries inside the array (the chunk size at which no
    chunk straddles two pieces)."""
    out = []
    for extent, b in zip(shape, bounds):
        inner = b[b != extent]
        out.append(int(np.gcd.reduce(inner)) if inner.size else 0)
    return tuple(g or max(e, 1) for g, e in zip(out, shape))


def _grid(
    shape: tuple[int, ...], bounds: Sequence[np.ndarray], distinct: Sequence[int], pieces: int, nbytes: int
) -> tuple[int, ...]:
    """The chunk shape: the gcd grid when it has at most pieces + bytes / GRID_BYTES chunks,
    else a regular grid of at most that many.

    `bounds[d]` are the boundaries (starts and ends) of the non-empty pieces along dimension
    d, `distinct[d]` the number of distinct extents among them, `pieces` their number. The
    gcd leaves out the array's end: zarr's edge chunk may be partial, so a ceil split such
    as DTensor's 50257 rows over 4 ranks (12565 x 3 + 12562) keeps 12565-row chunks. The
    bounded grid gives each dimension at most as many chunks as it has distinct extents
    (halving the largest counts while the product exceeds the budget), keeps the gcd size
    along the dimensions where that is no finer, and spends what is left of the budget on
    the first dimension it splits too finely, so its chunks approach GRID_BYTES.
    """
    aligned = _gcd_sizes(shape, bounds)
    if not pieces:
        return tuple(aligned)
    counts = [-(-e // c) for e, c in zip(shape, aligned)]
    budget = pieces + -(-nbytes // GRID_BYTES)
    if math.prod(counts) <= budget:
        return tuple(aligned)
    n = list(distinct)
    while math.prod(n) > budget:
        i = max(range(len(n)), key=lambda d: n[d])
        n[i] = -(-n[i] // 2)
    d0 = next(d for d in range(len(shape)) if counts[d] > n[d])
    rest = math.prod(n) // n[d0]
    n[d0] = max(n[d0], min(shape[d0], budget // rest))
    return tuple(c if k <= m else -(-e // m) for e, c, k, m in zip(shape, aligned, counts, n))


def _split_replicated(shape: tuple[int, ...], nbytes: int, holders: int, split_bytes: int) -> tuple[int, ...] | None:
    """The chunk shape of a large fully replicated array: split along dim 0 over its holders."""
    if not shape or nbytes <= split_bytes:
        return None
    parts = min(holders, math.ceil(nbytes / split_bytes), shape[0])
    return (math.ceil(shape[0] / parts), *shape[1:])


def _turns_of(spec: MeshSpec, split_bytes: int) -> int:
    """How many writers' turns an array takes: one per chunk of a fully replicated array."""
    if any(p != REPLICATE for p in spec.placements):
        return 1
    nbytes = math.prod(spec.shape) * itemsize(spec.data_type)
    split = _split_replicated(spec.shape, nbytes, len(spec.mesh.ranks), split_bytes)
    return 1 if split is None else -(-spec.shape[0] // split[0])


def _inline(spec: Spec) -> bool:
    return math.prod(spec.shape) == 1 and spec.data_type in INLINE_TYPES


def mesh_pieces(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[int]) -> list[np.ndarray]:
    """Per array dimension, the [lo, hi) of each piece along it (an (n, 2) array), in the
    row-major order of the mesh dimensions that split it: DTensor's Shard, torch.chunk
    sizes (ceil; trailing pieces may be short or empty), applied in mesh order."""
    out = []
    for d, n in enumerate(shape):
        lo, hi = np.zeros(1, dtype=np.int64), np.full(1, n, dtype=np.int64)
        for m, p in enumerate(placements):
            if p == d:
                size = -(-(hi - lo) // mesh_shape[m])
                start = lo[:, None] + np.arange(mesh_shape[m], dtype=np.int64)[None, :] * size[:, None]
                a = np.minimum(start, hi[:, None])
                lo, hi = a.ravel(), np.minimum(a + size[:, None], hi[:, None]).ravel()
        out.append(np.stack([lo, hi], axis=1))
    return out


@dataclass(slots=True)
class _Turns:
    """Whose turn it is to write, per mesh: replicas (and holders of replicated arrays) take turns."""

    next: dict[Mesh, int] = field(default_factory=dict)
    ranks: dict[Mesh, np.ndarray] = field(default_factory=dict)

    def take(self, mesh: Mesh, n: int) -> int:
        start = self.next.get(mesh, 0)
        self.next[mesh] = start + n
        return start

    def grid(self, mesh: Mesh) -> np.ndarray:
        if mesh not in self.ranks:
            self.ranks[mesh] = np.asarray(mesh.ranks, dtype=np.int64).reshape(mesh.shape)
        return self.ranks[mesh]


def _digits(value: np.ndarray | int, radices: Sequence[int]) -> list[Any]:
    """Mixed-radix digits, most significant first."""
    out = []
    for k in reversed(radices):
        out.append(value % k)
        value = value // k
    return out[::-1]


def _plan_mesh(spec: MeshSpec, turn: int, turns: _Turns, split_bytes: int) -> ArrayPlan | None:
    """The plan of a mesh array in O(grid) vectorized work, or None when its pieces need a
    grid that straddles them (then it is planned from its listed regions)."""
    size = itemsize(spec.data_type)
    numel = math.prod(spec.shape)
    if len(spec.mesh.ranks) != math.prod(spec.mesh.shape) or any(
        p != REPLICATE and not 0 <= p < len(spec.shape) for p in spec.placements
    ):
        raise ReshardError(f"{spec.name}: mesh {spec.mesh.shape} and placements {spec.placements} do not fit")
    replica_dims = [m for m, p in enumerate(spec.placements) if p == REPLICATE]
    replicas = math.prod(spec.mesh.shape[m] for m in replica_dims)
    if not numel:
        return ArrayPlan(
            spec, tuple(max(e, 1) for e in spec.shape), (), replicas == len(spec.mesh.ranks), Sharding(0, (), False, 0)
        )
    pieces = mesh_pieces(spec.shape, spec.mesh.shape, spec.placements)
    live = [np.nonzero(p[:, 1] > p[:, 0])[0] for p in pieces]  # the non-empty pieces' positions
    bounds = [p[k].ravel() for p, k in zip(pieces, live)]
    lengths = [np.unique(p[k, 1] - p[k, 0]) for p, k in zip(pieces, live)]
    count = math.prod(len(k) for k in live)
    sharding = Sharding(
        count, tuple(d for d, k in enumerate(live) if len(k) > 1), any(len(x) > 1 for x in lengths), replicas
    )
    aligned = _grid(spec.shape, bounds, [len(k) for k in live], count, numel * size)
    holders = turns.grid(spec.mesh)
    if replicas == len(spec.mesh.ranks):  # every rank of the mesh holds the whole array
        chunk_shape = _split_replicated(spec.shape, numel * size, replicas, split_bytes) or aligned
        n = math.prod(grid_shape(spec.shape, chunk_shape))
        writers = holders.ravel()[(turn + np.arange(n)) % replicas]
        return ArrayPlan(spec, chunk_shape, _runs_of(writers), True, sharding, _inline(spec))
    if aligned != _gcd_sizes(spec.shape, bounds):  # the budget asks for chunks that straddle pieces
        return None
    grid = grid_shape(spec.shape, aligned)
    index: list[Any] = list(_digits(turn % replicas, [spec.mesh.shape[m] for m in replica_dims]))
    coords: list[Any] = [None] * len(spec.mesh.shape)
    for m, c in zip(replica_dims, index):
        coords[m] = c
    for d, (p, k) in enumerate(zip(pieces, live)):
        splitters = [m for m, q in enumerate(spec.placements) if q == d]
        if not splitters:
            continue
        starts = p[k, 0]
        at = np.arange(grid[d], dtype=np.int64) * aligned[d]
        piece = k[np.searchsorted(starts, at, side="right") - 1]
        axis = [1] * len(grid)
        axis[d] = grid[d]
        for m, digit in zip(splitters, _digits(piece, [spec.mesh.shape[m] for m in splitters])):
            coords[m] = digit.reshape(axis)
    writers = np.broadcast_to(holders[tuple(coords)], grid).ravel()
    return ArrayPlan(spec, aligned, _runs_of(writers), False, sharding, _inline(spec))


def mesh_regions(spec: MeshSpec) -> ArraySpec:
    """Every rank's region of a mesh array, listed: O(mesh size), for the arrays whose pieces
    a regular grid cannot follow."""
    pieces = mesh_pieces(spec.shape, spec.mesh.shape, spec.placements)
    held = []
    for flat, rank in enumerate(spec.mesh.ranks):
        coord = _digits(flat, spec.mesh.shape)
        offsets, shape = [], []
        for d, p in enumerate(pieces):
            splitters = [m for m, q in enumerate(spec.placements) if q == d]
            pos = 0
            for m in splitters:
                pos = pos * spec.mesh.shape[m] + coord[m]
            offsets.append(int(p[pos, 0]))
            shape.append(int(p[pos, 1] - p[pos, 0]))
        held.append(HeldRegion(rank, tuple(offsets), tuple(shape)))
    return ArraySpec(spec.name, spec.data_type, spec.shape, tuple(held))


def _distinct_regions(spec: ArraySpec) -> dict[Box, list[int]]:
    regions: dict[Box, list[int]] = {}
    for h in spec.held:
        if len(h.offsets) != len(spec.shape) or len(h.shape) != len(spec.shape):
            raise ReshardError(f"{spec.name}: rank {h.rank} holds a region of another rank than the array")
        for o, s, full in zip(h.offsets, h.shape, spec.shape):
            if o < 0 or s < 0 or o + s > full:
                raise ReshardError(f"{spec.name}: rank {h.rank} region {h.offsets}+{h.shape} is outside {spec.shape}")
        regions.setdefault((h.offsets, h.shape), []).append(h.rank)
    return regions


@dataclass(slots=True)
class _Pending:
    """A chunk whose writer is still to choose: the held regions it overlaps, largest part first."""

    nbytes: int
    name: str
    flat: int
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
    touching: dict[tuple[int, ...], list[Box]] = {}
    for region in regions:
        off, shp = region
        lo = [o // c for o, c in zip(off, chunk_shape)]
        hi = [-(-(o + s) // c) for o, s, c in zip(off, shp, chunk_shape)]
        for index in _box_indices(lo, hi):
            touching.setdefault(index, []).append(region)
    out = []
    covered = 0
    nbytes = math.prod(chunk_shape) * itemsize(spec.data_type)
    grid = grid_shape(spec.shape, chunk_shape)
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
        out.append(_Pending(nbytes, spec.name, flat_index(index, grid), parts))
    if covered != math.prod(spec.shape):
        raise ReshardError(
            f"{spec.name}: the ranks' regions leave gaps ({covered} of {math.prod(spec.shape)} elements covered)"
        )
    return out


def _box_indices(lo: Sequence[int], hi: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for a, b in zip(lo, hi):
        out = [prefix + (i,) for prefix in out for i in range(a, b)]
    return out


def _plan_listed(specs: Sequence[ArraySpec], split_bytes: int) -> list[ArrayPlan]:
    """Arrays planned from every rank's listed region: O(regions + chunks)."""
    load: dict[int, int] = {}  # bytes each rank writes
    sent: dict[int, int] = {}  # bytes each rank sends as slivers
    pending: list[_Pending] = []
    shapes: dict[str, tuple[ArraySpec, tuple[int, ...], bool, Sharding]] = {}
    for spec in specs:
        size = itemsize(spec.data_type)
        regions = _distinct_regions(spec)
        numel = math.prod(spec.shape)
        whole = (tuple(0 for _ in spec.shape), tuple(spec.shape))
        replicated = list(regions) == [whole]
        # An empty piece (DTensor's last shard at offset = the dim's size) holds nothing:
        # it neither shapes the grid nor gets a chunk.
        held = {r: h for r, h in regions.items() if math.prod(r[1]) > 0}
        extents = [{(o[d], o[d] + s[d]) for o, s in held} for d in range(len(spec.shape))]
        bounds = [np.asarray(sorted({b for iv in ivs for b in iv}), dtype=np.int64) for ivs in extents]
        chunk_shape = _grid(spec.shape, bounds, [len(ivs) for ivs in extents], len(held), numel * size)
        if replicated:
            chunk_shape = _split_replicated(spec.shape, numel * size, len(regions[whole]), split_bytes) or chunk_shape
        sharding = Sharding.of((o, s, r) for (o, s), r in held.items())
        shapes[spec.name] = (spec, chunk_shape, replicated, sharding)
        if numel:
            pending.extend(_chunks_of(spec, chunk_shape, held))
    # Largest first onto the least-loaded holder: spreads replicated writes over ranks.
    pending.sort(key=lambda p: (-p.nbytes, p.name, p.flat))
    writers: dict[str, dict[int, int]] = {name: {} for name in shapes}
    slivers: dict[str, dict[int, tuple[Sliver, ...]]] = {name: {} for name in shapes}
    for p in pending:
        writer = min(p.parts[0][2], key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + p.nbytes
        writers[p.name][p.flat] = writer
        if len(p.parts) > 1:
            out = []
            for _, (off, shp), senders in p.parts[1:]:
                sender = min(senders, key=lambda r: (sent.get(r, 0), r))
                sent[sender] = sent.get(sender, 0) + math.prod(shp)
                out.append(Sliver(sender, off, shp))
            slivers[p.name][p.flat] = tuple(out)
    plans = []
    for name, (spec, chunk_shape, replicated, sharding) in shapes.items():
        runs = writer_runs([w for _, w in sorted(writers[name].items())])
        # Without the ranks' regions: the runs and slivers say all that is planned from them,
        # and every rank receives the plans (ckpt._plan), so they stay O(runs), not O(ranks).
        bare = ArraySpec(spec.name, spec.data_type, spec.shape, ())
        plans.append(ArrayPlan(bare, chunk_shape, runs, replicated, sharding, _inline(spec), slivers[name]))
    return plans


def plan_arrays(specs: Sequence[Spec], *, split_bytes: int = 64 << 20) -> list[ArrayPlan]:
    """Plan every array, sorted by name; deterministic. O(arrays) plus, per mesh array, its
    grid (vectorized) and, per listed array, its regions and chunks."""
    turns = _Turns()
    meshed = [s for s in specs if isinstance(s, MeshSpec)]
    # Replicas take turns by array, largest first, so the bytes each writes even out.
    turn = {
        s.name: turns.take(s.mesh, _turns_of(s, split_bytes))
        for s in sorted(meshed, key=lambda s: (-math.prod(s.shape) * itemsize(s.data_type), s.name))
    }
    plans: list[ArrayPlan] = []
    listed: list[ArraySpec] = [s for s in specs if isinstance(s, ArraySpec)]
    for s in meshed:
        plan = _plan_mesh(s, turn[s.name], turns, split_bytes)
        if plan is None:
            listed.append(mesh_regions(s))
        else:
            plans.append(plan)
    plans += _plan_listed(sorted(listed, key=lambda s: s.name), split_bytes)
    return sorted(plans, key=lambda p: p.spec.name)
