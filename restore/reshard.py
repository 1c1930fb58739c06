"""Pure planning of a (resharded) read: which parts of which saved chunks fill which of this
rank's tensors. No I/O and no tensors, so the rules can be tested exhaustively.

A request is a box of a global array: where the rank's tensor sits (`offsets`) and its
`shape`. The saved array is a regular grid of chunks; the chunks a box touches are found
by grid arithmetic (O(chunks touched), not O(chunks)), and of each only the rows of dim 0
that some request needs are read. Chunk files are raw C-order bytes, so a row range is a
byte range; with verification on, reads are whole checksummed blocks (store.layout:
about 4 MiB of rows each).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt.store.dtypes import itemsize
from ckpt.store.manifest import ArrayEntry, ChunkEntry

__all__ = ["Box", "Request", "ChunkRead", "Block", "overlap", "plan_reads", "blocks", "direct_rows", "row_bytes"]


# The records below are made per array, chunk and block of every restore (thousands), and
# are not changed once made. Not frozen (so not hashable either): a frozen dataclass's
# __init__ sets each field through object.__setattr__ (~0.5 us more per object).


@dataclass(slots=True)
class Box:
    """A box of a global array: [lo, hi) along each dimension (0-d arrays: both empty)."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @staticmethod
    def at(offsets: Sequence[int], shape: Sequence[int]) -> Box:
        return Box(tuple(offsets), tuple(o + s for o, s in zip(offsets, shape)))

    @property
    def empty(self) -> bool:
        return any(map(operator.le, self.hi, self.lo))  # (no generator: asked once per tensor)


@dataclass(slots=True)
class Request:
    """A tensor of this rank to fill: array `name`, placed at `box` of the global array."""

    name: str
    box: Box


@dataclass(slots=True)
class ChunkRead:
    """The part of one saved chunk that this rank reads."""

    name: str  # the array
    index: tuple[int, ...]  # the chunk's grid index
    rows: tuple[int, int]  # chunk-local rows of dim 0 that the requests need, [lo, hi)
    requests: tuple[int, ...]  # indices (into the planned requests) of the tensors it fills
    chunk: ChunkEntry  # the chunk as the manifest describes it (schema 3: without its digests)


@dataclass(slots=True)
class Block:
    """A checksummed block of a chunk file: chunk-local rows [lo, hi) of dim 0."""

    rows: tuple[int, int]
    offset: int  # byte offset in the chunk file
    nbytes: int
    xxh3: str


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None if it is empty."""
    box = Box(tuple(map(max, a.lo, b.lo)), tuple(map(min, a.hi, b.hi)))
    return None if box.empty else box


def chunk_box(chunk: ChunkEntry) -> Box:
    return Box.at(chunk.offsets, chunk.shape)


def _touched(array: ArrayEntry, box: Box) -> list[tuple[int, ...]]:
    """Grid indices of the chunks that overlap `box`."""
    if not array.shape:
        return [()]
    if box.empty:
        return []
    ranges = [range(lo // c, (hi - 1) // c + 1) for lo, hi, c in zip(box.lo, box.hi, array.chunk_shape)]
    return list(itertools.product(*ranges))


def plan_reads(arrays: Mapping[str, ArrayEntry], requests: Sequence[Request]) -> list[ChunkRead]:
    """Every chunk part the requests need, each chunk once (with all the requests it fills),
    in grid order per array."""
    needs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, req in enumerate(requests):
        for index in _touched(arrays[req.name], req.box):
            needs.setdefault((req.name, index), []).append(i)
    out = []
    for (name, index), which in needs.items():
        chunk = arrays[name].chunk_at(index)
        out.append(ChunkRead(name, index, _rows(chunk, [requests[i].box for i in which]), tuple(which), chunk))
    return out


def _rows(chunk: ChunkEntry, boxes: Sequence[Box]) -> tuple[int, int]:
    """Chunk-local rows of dim 0 that the boxes need (0-d: (0, 1))."""
    if not chunk.offsets:
        return 0, 1
    start, end = chunk.offsets[0], chunk.offsets[0] + chunk.shape[0]
    if len(boxes) == 1:  # the usual case: one tensor of this rank per chunk
        return max(boxes[0].lo[0], start) - start, min(boxes[0].hi[0], end) - start
    lo = min(max(b.lo[0], start) for b in boxes) - start
    hi = max(min(b.hi[0], end) for b in boxes) - start
    return lo, hi


def row_bytes(array: ArrayEntry) -> int:
    """Bytes of one row of dim 0 of a chunk file."""
    return math.prod(array.chunk_shape[1:]) * itemsize(array.data_type)


def block_count(array: ArrayEntry, chunk: ChunkEntry) -> int:
    """How many checksummed blocks the chunk has (1: checksummed whole)."""
    if not array.block_rows or chunk.inline is not None:
        return 1
    return len(chunk.blocks) or -(-(array.chunk_shape or (1,))[0] // array.block_rows)


def _nth(i: int, block_rows: int, rows: int, rb: int, digest: str) -> Block:
    lo, hi = i * block_rows, min(rows, (i + 1) * block_rows)
    return Block((lo, hi), lo * rb, (hi - lo) * rb, digest)


def blocks(array: ArrayEntry, chunk: ChunkEntry, rows: tuple[int, int] | None = None) -> list[Block]:
    """The chunk's checksummed blocks, or only those overlapping chunk-local `rows`."""
    shape = array.chunk_shape or (1,)
    if not array.block_rows or chunk.inline is not None:
        out = [Block((0, shape[0]), 0, chunk.nbytes, chunk.xxh3)]
    else:  # the geometry follows from block_rows; the digests are "" where not resolved (schema 3)
        k, rb = array.block_rows, row_bytes(array)
        digests = chunk.blocks or ("",) * block_count(array, chunk)
        out = [_nth(i, k, shape[0], rb, d) for i, d in enumerate(digests)]
    if rows is None:
        return out
    return [b for b in out if b.rows[0] < rows[1] and b.rows[1] > rows[0]]


def block_at(array: ArrayEntry, chunk: ChunkEntry, i: int) -> Block:
    """blocks(array, chunk)[i] for 0 <= i < block_count, without making the others
    (IndexError otherwise)."""
    count = block_count(array, chunk)
    if not 0 <= i < count:
        raise IndexError(f"block {i} of {count}")
    if not array.block_rows or chunk.inline is not None:
        return blocks(array, chunk)[0]
    shape = array.chunk_shape or (1,)
    return _nth(i, array.block_rows, shape[0], row_bytes(array), chunk.blocks[i] if chunk.blocks else "")


def direct_rows(array: ArrayEntry, chunk: ChunkEntry, box: Box) -> tuple[int, int] | None:
    """The chunk-local rows [lo, hi) that land as one contiguous byte range in a C-order
    tensor at `box`, or None.

    That is the case when the chunk and the box span the same full extent in every
    dimension but the first (a split along dim 0 only, as DTensor Shard(0) or FSDP make):
    those rows can be read straight into the tensor, with no bounce buffer and no copy.
    (The tensor itself must also be a plain contiguous CPU tensor of the array's type:
    the reader checks that.)
    """
    tail = tuple(array.chunk_shape[1:])
    if (
        not chunk.offsets
        or tuple(chunk.shape[1:]) != tail  # no padding in the trailing dims
        or any(chunk.offsets[1:])  # (offsets are never negative: any() is "any but 0")
        or any(box.lo[1:])
        or tuple(box.hi[1:]) != tail  # (from 0)
    ):
        return None
    lo = max(box.lo[0], chunk.offsets[0]) - chunk.offsets[0]
    hi = min(box.hi[0], chunk.offsets[0] + chunk.shape[0]) - chunk.offsets[0]
    return (lo, hi) if lo < hi else None
