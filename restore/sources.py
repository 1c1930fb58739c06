"""The copies of one version a rank can read, and reading a chunk from the first good one.

Each tier that holds (part of) a version is a `Source`. A chunk is read from the first
source that holds it; a damaged copy (missing, short, failing its checksum) falls back to
the next. A block that fails its checksum is read again before it counts as damaged: a
body can arrive complete yet wrong where no transport checksum covers it (S3 range
reads, plain-HTTP endpoints), and a local re-read costs little. A source that cannot be
reached is not damage: when no source gave a good copy and one of them was unreachable,
the read fails with TierUnavailableError, so no caller takes the version for corrupt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ckpt.store.errors import CorruptVersionError, TierUnavailableError
from ckpt.store.manifest import ArrayEntry, ChunkEntry, Manifest
from ckpt.store.rank_file import RankFile, RankFiles, rank_file_path, read_rank_file_raw
from ckpt.store.rereads import reread, unproven_damage
from ckpt.store.tier import Tier
from ckpt.store.versions import version_dirname

__all__ = [
    "Source",
    "SourcesUnreachable",
    "first_good",
    "from_first_good",
    "rank_file_bytes_from",
    "rank_file_from",
]

log = logging.getLogger("ckpt")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Source:
    """One tier's copy of a version, as reachable from this rank."""

    tier: Tier
    step: int
    writers: frozenset[int]  # ranks whose chunks (and rank files) it holds
    rank_files: RankFiles = field(init=False, compare=False, repr=False)
    _prefix: str = field(init=False, compare=False, repr=False)  # the version's directory: a key per chunk read

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_files", RankFiles(self.tier))
        object.__setattr__(self, "_prefix", version_dirname(self.step) + "/")

    @property
    def name(self) -> str:
        return self.tier.location

    @property
    def always_verify(self) -> bool:
        """Whether every read is checked whatever verify_on_restore says: bytes from anywhere
        but this machine's files may arrive complete yet wrong where no transport checksum
        covers them (S3 range reads carry none)."""
        return not self.tier.capabilities.local_files

    @property
    def direct(self) -> bool:
        """Whether its chunks are read with O_DIRECT: files on a disk (not tmpfs, where a read
        is a copy from the file's own pages, and not a remote store)."""
        return self.tier.capabilities.direct_io and not self.tier.in_memory()

    def holds(self, chunk: ChunkEntry) -> bool:
        return chunk.inline is not None or chunk.writer in self.writers

    def key(self, array: ArrayEntry, chunk: ChunkEntry) -> str:
        return self._prefix + array.chunk_path(chunk)  # (a chunk path neither starts nor ends with '/')

    def resolve(self, manifest: Manifest, array: ArrayEntry, chunk: ChunkEntry) -> ChunkEntry:
        """`chunk` with its digests as this copy records them (schema 3: the writer's rank file here)."""
        return self.rank_files.resolve(self.step, manifest, array, chunk)

    def rank_file(self, manifest: Manifest, rank: int) -> RankFile:
        return self.rank_files.get(self.step, manifest, rank)


class SourcesUnreachable(TierUnavailableError):
    """No source gave a good copy, and the ones at `locations` could not be reached from
    this rank: the copy there may be good, and a rank that reaches them can read it."""

    locations: frozenset[str] = frozenset()

    @classmethod
    def at(cls, code: int | None, message: str, locations: Sequence[str]) -> SourcesUnreachable:
        e = cls(code, message)
        e.locations = frozenset(locations)
        return e


def from_first_good(
    sources: Sequence[Source],
    manifest: Manifest,
    array: ArrayEntry,
    chunk: ChunkEntry,
    read: Callable[[Source, ChunkEntry], T],
) -> T:
    """read(source, chunk with its digests) for the first source that holds the chunk and
    gives a good copy (a bad rank file, which holds the digests, is a bad copy too)."""
    return first_good(
        [s for s in sources if s.holds(chunk)],
        lambda src: read(src, src.resolve(manifest, array, chunk)),
        lambda: f"{array.name} chunk {list(chunk.index)}",
        array.path,
    )


def rank_file_bytes_from(sources: Sequence[Source], manifest: Manifest, rank: int) -> bytes:
    """Rank `rank`'s file (schema 3), verified, from the first source with a good copy."""
    return _rank_file(sources, rank, lambda src: read_rank_file_raw(src.tier, src.step, manifest, rank))


def rank_file_from(sources: Sequence[Source], manifest: Manifest, rank: int) -> RankFile:
    """Rank `rank`'s parsed file (schema 3) from the first source with a good copy."""
    return _rank_file(sources, rank, lambda src: src.rank_file(manifest, rank))


def _rank_file(sources: Sequence[Source], rank: int, read: Callable[[Source], T]) -> T:
    where = rank_file_path(rank)
    return first_good([s for s in sources if rank in s.writers], read, where, where)


def first_good(holders: Sequence[Source], read: Callable[[Source], T], what: str | Callable[[], str], path: str) -> T:
    """read(source) for the first of `holders` that gives a good copy of `what` (or of what
    what() names: made only for a message, as a restore reads thousands of chunks)."""
    damaged: list[str] = []
    unreachable: list[tuple[str, TierUnavailableError]] = []
    for src in holders:
        try:
            result = reread(lambda src=src: read(src), unproven_damage)  # type: ignore[misc]
        except CorruptVersionError as e:
            damaged.append(str(e))
            continue
        except TierUnavailableError as e:
            unreachable.append((src.name, e))
            continue
        if damaged or unreachable:
            why = damaged[-1] if damaged else str(unreachable[-1][1])
            log.warning("%s: used the copy on %s after: %s", _named(what), src.name, why)
        return result
    what = _named(what)
    if unreachable:
        detail = "; ".join([*damaged, *(str(e) for _, e in unreachable)])
        raise SourcesUnreachable.at(unreachable[0][1].errno, f"{what}: {detail}", [n for n, _ in unreachable])
    if not damaged:
        raise CorruptVersionError(f"{what} is on no reachable tier", path=path)
    raise CorruptVersionError("; ".join(damaged), path=path)


def _named(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
