"""Recomputing every checksum of the part of a version a tier holds (`ckpt verify`, tests)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from ckpt.store.chunk_read import READ_BLOCK, open_chunk, read_chunk, read_exact
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CorruptVersionError
from ckpt.store.manifest import Manifest
from ckpt.store.rank_file import RankFiles, rank_file_path
from ckpt.store.tier import Tier
from ckpt.store.versions import version_dirname

__all__ = ["ChunkProblem", "verify_chunks"]


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    array: str  # "" for a rank file
    path: str
    reason: str


def verify_chunks(tier: Tier, step: int, manifest: Manifest, writers: set[int] | None = None) -> Iterator[ChunkProblem]:
    """Recompute every checksum (streaming, one small buffer); yield each bad file.

    `writers` limits the check to the files of those ranks (the part a tier holds). Since
    schema 3 each writer's rank file is checked too, and a chunk whose rank file is bad is
    reported with it (its digests are unknown).
    """
    view = memoryview(bytearray(READ_BLOCK))
    book = RankFiles(tier)
    bad_ranks: set[int] = set()
    if manifest.rank_files:
        for rank in range(manifest.world_size):
            if writers is not None and rank not in writers:
                continue
            try:
                book.get(step, manifest, rank)
            except CorruptVersionError as e:
                bad_ranks.add(rank)
                yield ChunkProblem("", rank_file_path(rank), str(e))
    for array in manifest.arrays.values():
        for chunk in array.iter_chunks():
            if writers is not None and chunk.writer not in writers:
                continue
            path = array.chunk_path(chunk)
            where = os.path.join(tier.location, version_dirname(step), path)
            if chunk.inline is None and chunk.writer in bad_ranks:
                yield ChunkProblem(array.name, path, f"its digests are in the bad {rank_file_path(chunk.writer)}")
                continue
            try:
                chunk = book.resolve(step, manifest, array, chunk)
                if chunk.inline is not None:
                    read_chunk(tier, step, array, chunk, memoryview(bytearray(len(chunk.inline) // 2)))
                    continue
                handle = open_chunk(tier, step, array, chunk)
                hasher = ChunkHasher(array.digest_block_bytes(chunk))
                try:
                    for start in range(0, chunk.nbytes, READ_BLOCK):
                        piece = view[: min(READ_BLOCK, chunk.nbytes - start)]
                        read_exact(handle, piece, start, where)
                        hasher.update(piece)
                finally:
                    handle.close()
            except CorruptVersionError as e:
                yield ChunkProblem(array.name, path, str(e))
                continue
            got = hasher.hexdigest()
            if got != chunk.xxh3:
                yield ChunkProblem(array.name, path, f"xxh3 {got} != manifest {chunk.xxh3}")
