"""Reading chunks back with their checksums verified, and whole-version verification.

Opens refuse symlinks (O_NOFOLLOW) and check the size before reading, so a truncated
or swapped file is reported without reading past what the manifest promises.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from store.errors import CorruptVersionError
from store.manifest import ArrayEntry, ChunkEntry, Manifest

__all__ = ["read_chunk", "ChunkProblem", "verify_chunks"]

_READ_BLOCK = 4 << 20  # readinto in small blocks: 1-4 MiB reads measured ~5x faster than 64 MiB here


def _open_chunk(version_dir: str, array: ArrayEntry, chunk: ChunkEntry) -> int:
    path = os.path.join(version_dir, array.chunk_path(chunk))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptVersionError(f"chunk {path} is missing", path=path, expected=chunk.xxh3) from None
    except OSError as e:
        raise CorruptVersionError(f"chunk {path} cannot be opened: {e.strerror}", path=path) from None
    size = os.fstat(fd).st_size
    if size != chunk.nbytes:
        os.close(fd)
        raise CorruptVersionError(
            f"chunk {path} has {size} bytes, the manifest says {chunk.nbytes}", path=path, expected=chunk.xxh3
        )
    return fd


def read_chunk(version_dir: str, array: ArrayEntry, chunk: ChunkEntry, out: memoryview, *, verify: bool = True) -> None:
    """Fill `out` (exactly chunk.nbytes, or the inline value's size) with the chunk's bytes."""
    view = out.cast("B")
    if chunk.inline is not None:
        raw = bytes.fromhex(chunk.inline)
        view[: len(raw)] = raw
        digest = xxhash.xxh3_64_hexdigest(raw)
        if verify and digest != chunk.xxh3:
            raise CorruptVersionError(
                f"{array.name}: inline value fails its checksum", path=array.path, expected=chunk.xxh3, actual=digest
            )
        return
    fd = _open_chunk(version_dir, array, chunk)
    hasher = xxhash.xxh3_64()
    try:
        done = 0
        while done < chunk.nbytes:
            piece = view[done : min(done + _READ_BLOCK, chunk.nbytes)]
            n = os.readv(fd, [piece])
            if n <= 0:
                break
            if verify:
                hasher.update(piece[:n])
            done += n
    finally:
        os.close(fd)
    path = os.path.join(version_dir, array.chunk_path(chunk))
    if done != chunk.nbytes:
        raise CorruptVersionError(f"chunk {path} ended after {done} bytes", path=path, expected=chunk.xxh3)
    if verify and hasher.hexdigest() != chunk.xxh3:
        raise CorruptVersionError(
            f"chunk {path} fails its checksum (xxh3 {hasher.hexdigest()}, manifest {chunk.xxh3})",
            path=path,
            expected=chunk.xxh3,
            actual=hasher.hexdigest(),
        )


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    array: str
    path: str
    reason: str


def verify_chunks(version_dir: str, manifest: Manifest, writers: set[int] | None = None) -> Iterator[ChunkProblem]:
    """Recompute every checksum (streaming, one small buffer); yield each bad chunk.

    `writers` limits the check to chunks written by those ranks (the part a root holds).
    """
    buf = bytearray(_READ_BLOCK)
    view = memoryview(buf)
    for array in manifest.arrays.values():
        for chunk in array.chunks:
            if writers is not None and chunk.writer not in writers:
                continue
            path = array.chunk_path(chunk)
            try:
                if chunk.inline is not None:
                    read_chunk(version_dir, array, chunk, memoryview(bytearray(len(chunk.inline) // 2)))
                    continue
                fd = _open_chunk(version_dir, array, chunk)
            except CorruptVersionError as e:
                yield ChunkProblem(array.name, path, str(e))
                continue
            hasher = xxhash.xxh3_64()
            try:
                while n := os.readv(fd, [view]):
                    hasher.update(view[:n])
            finally:
                os.close(fd)
            if hasher.hexdigest() != chunk.xxh3:
                yield ChunkProblem(array.name, path, f"xxh3 {hasher.hexdigest()} != manifest {chunk.xxh3}")
