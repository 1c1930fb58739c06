"""The checksum of a chunk file, as the manifest records it.

A chunk of one block: xxh3_64 of its bytes. A chunk checksummed in blocks (schema 2):
each block's xxh3_64, and for the chunk the xxh3_64 of the blocks' 8-byte big-endian
digests, concatenated. Every byte is hashed once, whether a reader checks the whole
chunk or only the blocks it needs. (Schema 1 hashed the whole file a second time.)
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

__all__ = ["ChunkHasher", "combine_blocks", "chunk_digest"]


def combine_blocks(blocks: Sequence[str]) -> str:
    """The chunk digest of a chunk checksummed in `blocks` (hex xxh3_64 digests)."""
    return xxhash.xxh3_64_hexdigest(bytes.fromhex("".join(blocks)))


class ChunkHasher:
    """Streaming chunk digest; `block_bytes` 0 hashes the bytes as one block.

    update() takes pieces of any size; pieces that are whole blocks (the writer's case)
    are hashed in one call each.
    """

    __slots__ = ("_block_bytes", "_current", "_filled", "blocks")

    def __init__(self, block_bytes: int = 0) -> None:
        self._block_bytes = block_bytes
        self._current = xxhash.xxh3_64()
        self._filled = 0  # bytes in _current
        self.blocks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._block_bytes <= 0:
            self._current.update(data)
            return
        view = memoryview(data).cast("B")
        while len(view):
            if self._filled == 0 and len(view) >= self._block_bytes:
                self.blocks.append(xxhash.xxh3_64_hexdigest(view[: self._block_bytes]))
                view = view[self._block_bytes :]
                continue
            take = min(len(view), self._block_bytes - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self._block_bytes:
                self._close_block()

    def _close_block(self) -> None:
        self.blocks.append(self._current.hexdigest())
        self._current = xxhash.xxh3_64()
        self._filled = 0

    def hexdigest(self) -> str:
        """The chunk's digest; call once, after the last update()."""
        if self._block_bytes <= 0:
            return self._current.hexdigest()
        if self._filled:
            self._close_block()
        return combine_blocks(self.blocks)


def chunk_digest(data: bytes | bytearray | memoryview, block_bytes: int = 0) -> str:
    hasher = ChunkHasher(block_bytes)
    hasher.update(data)
    return hasher.hexdigest()
