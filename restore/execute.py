"""Reading a version's chunks into the tensors of the current ranks.

Each request names a destination tensor and where it sits in the global array; only
the chunks that overlap it are read. A chunk on this rank's own root is read (and its
xxh3 verified) from disk; a chunk that only another rank can reach (ranks do not share
filesystems) is read there and broadcast over the checkpointer's gloo group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from restore.torch_dtypes import ZARR_TO_TORCH
from store.chunk_read import read_chunk
from store.errors import CorruptVersionError, RankFailures
from store.manifest import ArrayEntry, ChunkEntry, Manifest

__all__ = ["ReadRequest", "load_arrays"]


class _Comm(Protocol):
    """The collectives used here (ckpt._dist.Comm provides them)."""

    rank: int
    world: int

    def all_gather(self, obj: Any) -> list[Any]: ...
    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None: ...


@dataclass(frozen=True)
class ReadRequest:
    array: ArrayEntry
    dest: torch.Tensor  # a plain local tensor, filled in place
    offsets: tuple[int, ...]  # where dest starts in the global array


def _overlaps(chunk: ChunkEntry, req: ReadRequest) -> bool:
    return all(
        c < d + ds and d < c + cs for c, cs, d, ds in zip(chunk.offsets, chunk.shape, req.offsets, req.dest.shape)
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _place(raw: torch.Tensor, chunk: ChunkEntry, req: ReadRequest) -> None:
    """Copy the part of a chunk (raw bytes, full chunk_shape) that overlaps the destination."""
    a = req.array
    shape = a.chunk_shape if chunk.inline is None else (1,) * len(a.shape)
    full = raw.view(ZARR_TO_TORCH[a.data_type]).view(shape)
    lo = [max(c, d) for c, d in zip(chunk.offsets, req.offsets)]
    hi = [min(c + cs, d + ds) for c, cs, d, ds in zip(chunk.offsets, chunk.shape, req.offsets, req.dest.shape)]
    src = full[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets))]
    req.dest[tuple(slice(a - d, b - d) for a, b, d in zip(lo, hi, req.offsets))].copy_(src)


def _direct(chunk: ChunkEntry, req: ReadRequest) -> bool:
    """Whether the chunk is exactly the destination, so it can be read straight into it."""
    d = req.dest
    return (
        chunk.inline is None
        and tuple(chunk.shape) == tuple(req.array.chunk_shape) == tuple(d.shape)
        and tuple(chunk.offsets) == tuple(req.offsets)
        and d.device.type == "cpu"
        and d.is_contiguous()
        and d.dim() > 0
    )


def _staged_bytes(chunk: ChunkEntry, array: ArrayEntry) -> int:
    return len(chunk.inline) // 2 if chunk.inline is not None else chunk.nbytes


def load_arrays(
    comm: _Comm,
    version_dir: str | None,
    manifest: Manifest,
    requests: Sequence[ReadRequest],
    local_writers: set[int],
    *,
    verify: bool = True,
) -> None:
    """Fill every request. Collective: every rank of `comm` calls it, with its own requests."""
    wanted: dict[tuple[str, tuple[int, ...]], list[ReadRequest]] = {}
    for req in requests:
        for chunk in req.array.chunks:
            if _overlaps(chunk, req):
                wanted.setdefault((req.array.name, chunk.index), []).append(req)
    remote = sorted(
        key
        for key in wanted
        if (c := _chunk(manifest, key)).inline is None and (version_dir is None or c.writer not in local_writers)
    )
    views = comm.all_gather((remote, sorted(local_writers) if version_dir is not None else []))
    error: BaseException | None = None
    # Transfers first, in one global order, so every rank joins the same broadcasts.
    needed = sorted({tuple(k) for v, _ in views for k in v})
    for name, index in needed:
        chunk = _chunk(manifest, (name, index))
        holders = [r for r, (_, w) in enumerate(views) if chunk.writer in w]
        if not holders:
            error = error or CorruptVersionError(f"{name} chunk {list(index)} is on no reachable root")
            continue
        buf = torch.zeros(chunk.nbytes, dtype=torch.uint8)
        if comm.rank == holders[0]:
            try:
                read_chunk(version_dir or "", manifest.arrays[name], chunk, _byte_view(buf), verify=verify)
            except CorruptVersionError as e:
                error = error or e
        comm.broadcast_tensor(buf, holders[0])
        for req in wanted.get((name, index), []):
            _place(buf, chunk, req)
    for key, reqs in wanted.items():
        if key in remote:
            continue
        chunk = _chunk(manifest, key)
        array = manifest.arrays[key[0]]
        try:
            if len(reqs) == 1 and _direct(chunk, reqs[0]):
                read_chunk(version_dir or "", array, chunk, _byte_view(reqs[0].dest), verify=verify)
                continue
            buf = torch.empty(_staged_bytes(chunk, array), dtype=torch.uint8)
            read_chunk(version_dir or "", array, chunk, _byte_view(buf), verify=verify)
            for req in reqs:
                _place(buf, chunk, req)
        except CorruptVersionError as e:
            error = error or e
    causes = comm.all_gather(None if error is None else str(error))
    bad = {r: c for r, c in enumerate(causes) if c is not None}
    if bad:
        if isinstance(error, CorruptVersionError):
            raise error
        raise CorruptVersionError(str(RankFailures(bad)))


def _chunk(manifest: Manifest, key: tuple[str, tuple[int, ...]]) -> ChunkEntry:
    array = manifest.arrays[key[0]]
    # Chunks are stored in grid order, so the flat position follows from the index.
    grid = [-(-s // c) for s, c in zip(array.shape, array.chunk_shape)]
    flat = 0
    for i, g in zip(key[1], grid):
        flat = flat * g + i
    if flat < len(array.chunks) and array.chunks[flat].index == key[1]:
        return array.chunks[flat]
    for c in array.chunks:
        if c.index == key[1]:
            return c
    raise CorruptVersionError(f"{key[0]} has no chunk {list(key[1])}")


def full_tensor(array: ArrayEntry) -> torch.Tensor:
    """A fresh CPU tensor for an array the live state has no tensor for."""
    return torch.empty(tuple(array.shape), dtype=ZARR_TO_TORCH[array.data_type])
