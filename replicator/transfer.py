"""Copying the files of one committed version (the part a source root holds) to a
destination tier, each verified, resumably.

A chunk or rank file is uploaded and verified (readback): its bytes are hashed on the way
(xxh3, against the manifest, or against its writer's rank file on the source for a
schema-3 chunk), and where the store confirms that it holds exactly those bytes (S3: the
ETag is their MD5; see Tier.put_stream) that is enough. Elsewhere, or where the store's
word differs, the copy is read back and checked against the same digest; a copy that
reads back wrong may have been damaged on the way (up or down) where no transport
checksum covers it, so it is sent again before it counts as corrupt. (Reading every
upload back doubled the traffic to the store: the replication bench ran at 0.74x a plain
s3fs put.) Verified files go into a journal beside the source root, so a restarted
replicator resumes without sending them again (unless the destination lost them). Once every file is there, the caller
commits (replicator.publish): the manifest goes up last.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ckpt.replicator.journal import Journal
from ckpt.replicator.placement import Destination
from ckpt.replicator.ratelimit import RateLimiter
from ckpt.store.chunk_read import READ_BLOCK
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CkptError, CorruptVersionError, StoppedError, TierUnavailableError, UnsupportedStateError
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest
from ckpt.store.rank_file import RankFiles, rank_file_path
from ckpt.store.tier import Tier, join_key
from ckpt.store.versions import version_dirname

__all__ = ["Transfer", "SourceReadError", "copy_files", "missing_files"]

log = logging.getLogger("ckpt.replicator")
_RESENDS = 2  # uploads of a chunk after the first, while its copy reads back wrong
_TEMP = re.compile(r"\.tmp-[0-9a-f]{32}$")  # a local tier's temp files (store._local)
_ROUNDS = 3  # full passes over what is missing before the destination counts as unreliable
T = TypeVar("T")


class SourceReadError(CkptError):
    """A file of the version failed to read on the source (an I/O error, a bad sector): the
    version's own failure, tried again on the next pass; the destination is not to blame,
    and the other versions are copied there meanwhile. Nothing is judged damaged by it."""


@dataclass(frozen=True)
class Transfer:
    """One version's part, from a source tier to a destination."""

    source: Tier
    step: int
    manifest: Manifest
    dest: Destination
    journal: Journal
    limiter: RateLimiter
    stop: threading.Event
    threads: int = 8
    readback: bool = True

    @property
    def name(self) -> str:
        return version_dirname(self.step)

    def where(self, rel: str = "") -> str:
        return f"{self.dest.tier.location}/{join_key(self.name, rel)}"


@dataclass
class _Sent:
    """What one attempt of an upload read from the source and sent."""

    digest: ChunkHasher
    nbytes: int = 0


def _blocks(
    t: Transfer, key: str, sent: list[_Sent] | None = None, block_bytes: int = 0
) -> Callable[[], Iterator[memoryview]]:
    """The source object in READ_BLOCK pieces, under the rate limit, until a stop. With
    `sent`, each attempt leaves in sent[0] the digest (its `block_bytes`: see ChunkHasher)
    and count of the bytes it yields, to check against the manifest."""

    def gen() -> Iterator[memoryview]:
        handle = _from_source(key, lambda: t.source.open_read(key))
        buf = memoryview(bytearray(min(READ_BLOCK, max(handle.size, 1))))
        if sent is not None:
            sent[:] = [_Sent(ChunkHasher(block_bytes))]
        try:
            for start in range(0, handle.size, len(buf)):
                piece = buf[: min(len(buf), handle.size - start)]
                _from_source(key, lambda: handle.read_into(start, piece))  # noqa: B023 - called at once
                if sent is not None:
                    sent[0].digest.update(piece)
                    sent[0].nbytes += len(piece)
                t.limiter.acquire(len(piece), t.stop)
                if t.stop.is_set():
                    raise StoppedError(f"stopped while copying {key}")
                yield piece
        finally:
            handle.close()

    return gen


def _from_source(key: str, read: Callable[[], T]) -> T:
    try:
        return read()
    except FileNotFoundError:  # deleted meanwhile (a GC): the copy fails as before
        raise
    except OSError as e:
        raise SourceReadError(f"cannot read {key} on the source: {e}") from e


def _digest(tier: Tier, key: str, block_bytes: int) -> tuple[int, str]:
    hasher = ChunkHasher(block_bytes)
    handle = tier.open_read(key)
    try:
        view = memoryview(bytearray(READ_BLOCK))
        for start in range(0, handle.size, READ_BLOCK):
            piece = view[: min(READ_BLOCK, handle.size - start)]
            handle.read_into(start, piece)
            hasher.update(piece)
        return handle.size, hasher.hexdigest()
    finally:
        handle.close()


def _size(tier: Tier, key: str) -> int:
    handle = tier.open_read(key)
    handle.close()
    return handle.size


def _send(t: Transfer, rel: str, size: int, digest: str | None, block_bytes: int) -> None:
    """Upload one file and check it arrived. A file (or directory) the destination lost
    between the upload and the check (an operator's rm -rf) is sent again."""
    for attempt in range(_RESENDS + 1):
        try:
            _send_once(t, rel, size, digest, block_bytes)
            return
        except FileNotFoundError:
            t.dest.check_disk()  # an unmounted disk takes its files along: not worth sending again
            if attempt == _RESENDS:
                raise
            log.warning("%s vanished while it was copied; sending it again", t.where(rel))


def _send_once(t: Transfer, rel: str, size: int, digest: str | None, block_bytes: int) -> None:
    """Upload one file and check it arrived: its digest (readback) or its size."""
    key = join_key(t.name, rel)
    t.dest.check_disk()
    sent: list[_Sent] = []
    confirmed = t.dest.tier.put_stream(key, _blocks(t, key, sent, block_bytes), size)
    if (
        confirmed
        and sent[0].nbytes == size
        and (digest is None or not t.readback or sent[0].digest.hexdigest() == digest)
    ):
        # The store says it received exactly the bytes sent (S3: their MD5 is the ETag of
        # its answer), and they are the manifest's: a read back would only say it again.
        pass
    elif t.readback and digest is not None:
        for resend in range(_RESENDS + 1):
            got_size, got = _digest(t.dest.tier, key, block_bytes)
            if got_size == size and got == digest:
                break
            if resend == _RESENDS:
                raise CorruptVersionError(f"{t.where(rel)}: copy does not match the manifest", path=rel)
            log.warning("%s: the copy read back does not match the manifest; sending it again", t.where(rel))
            t.dest.tier.put_stream(key, _blocks(t, key), size)
    else:
        got_size = _size(t.dest.tier, key)
        if got_size != size:
            raise CorruptVersionError(f"{t.where(rel)}: copy has {got_size} bytes, want {size}", path=rel)
    t.dest.check_disk()  # verified where it should be, not below an unmounted disk's mount point


def part_sizes(tier: Tier, step: int) -> dict[str, int]:
    """The files of version `step` on `tier` that a copy copies (all but the manifest and the
    root info, which each copy writes itself): relative path -> bytes, from one listing."""
    name = version_dirname(step)
    return {
        o.key[len(name) + 1 :]: o.size
        for o in tier.find(name)
        if o.key.rsplit("/", 1)[-1] not in (MANIFEST_NAME, ROOT_INFO_NAME)
    }


def missing_files(tier: Tier, step: int, sizes: dict[str, int]) -> list[str]:
    """The files of `sizes` (relative path -> bytes) that `tier` does not hold at that size,
    from one fresh listing."""
    name = version_dirname(step)
    held = {o.key[len(name) + 1 :]: o.size for o in tier.find(name)}
    return sorted(rel for rel, size in sizes.items() if held.get(rel) != size)


def _check_keys(t: Transfer, sizes: dict[str, int]) -> None:
    """UnsupportedStateError, before anything is sent, where a file's key would be longer
    than the destination's store takes: the version cannot be copied there (the state's
    keys make its array names), while its other versions can."""
    room = t.dest.tier.key_room
    if room is None or not sizes:
        return
    key = max((join_key(t.name, rel) for rel in sizes), key=lambda k: len(k.encode()))
    if len(key.encode()) > room:
        raise UnsupportedStateError(
            f"{t.where()}: the key {key!r} has {len(key.encode())} bytes, and this store takes {room} below "
            "that prefix; the state's keys (its array names) are too long to copy this version there"
        )


def copy_files(t: Transfer, progress: Callable[[int], None] = lambda n: None) -> dict[str, int]:
    """Copy and verify every file of the part (not the manifest or root info); returns the
    files copied (relative path -> size). Raises what stopped it (TierUnavailableError,
    CorruptVersionError, StoppedError)."""
    chunks = {a.chunk_path(c): (a, c) for a in t.manifest.arrays.values() for c in a.iter_chunks() if c.inline is None}
    rank_files = {rank_file_path(r): ref.xxh3 for r, ref in enumerate(t.manifest.rank_files)}
    book = RankFiles(t.source)  # schema 3: the chunks' digests, from the rank files of the source
    sizes = part_sizes(t.source, t.step)
    _check_keys(t, sizes)
    done = set(t.journal.done)
    held = {o.key[len(t.name) + 1 :]: o.size for o in t.dest.tier.find(t.name)} if done else {}
    todo = sorted((rel for rel in sizes if not (rel in done and held.get(rel) == sizes[rel])), key=lambda r: -sizes[r])
    last_save = [time.monotonic()]

    def one(rel: str) -> None:
        array_chunk = chunks.get(rel)
        digest, block_bytes = rank_files.get(rel), 0
        if array_chunk is not None:
            array, chunk = array_chunk
            chunk = _from_source(rel, lambda: book.resolve(t.step, t.manifest, array, chunk))
            digest, block_bytes = chunk.xxh3, array.digest_block_bytes(chunk)
        _send(t, rel, sizes[rel], digest, block_bytes)
        t.journal.add(rel)
        progress(sizes[rel])
        if time.monotonic() - last_save[0] > 0.5:
            last_save[0] = time.monotonic()
            t.journal.save()

    for _ in range(_ROUNDS):
        try:
            with ThreadPoolExecutor(max(1, t.threads), thread_name_prefix="ckpt-push") as pool:
                for f in [pool.submit(one, rel) for rel in todo]:
                    f.result()
        finally:
            t.journal.save()
        # The manifest may go up only if every file is there now: a store that lost objects
        # since they were verified (restarted, wiped) must not get a manifest naming them.
        todo = missing_files(t.dest.tier, t.step, sizes)
        if not todo:
            break
        log.warning("%s: %d verified file(s) are gone; sending them again", t.where(), len(todo))
        for rel in todo:
            t.journal.discard(rel)
    else:
        raise TierUnavailableError(f"{t.where()}: files keep vanishing after upload")
    # Temp files of copies that never finished (a disk unmounted mid-copy takes them along
    # and brings them back) are not the version's. On the shared remote only this part's:
    # the other nodes' (the zarr.json documents every part holds too) may be in flight.
    mine = {rel for rel in sizes if rel in chunks or rel in rank_files} if t.dest.kind == "shared" else None
    prefix = t.name + "/"
    t.dest.tier.delete_many(
        o.key
        for o in t.dest.tier.find(t.name)
        if _TEMP.search(o.key) and (mine is None or _TEMP.sub("", o.key).removeprefix(prefix) in mine)
    )
    t.dest.tier.sync(t.name)
    return sizes


def journal_for(state_dir: str, dest: Destination, step: int, save_id: str) -> Journal:
    """The journal of a version's copy to `dest`, under the source root's `state_dir`."""
    path = os.path.join(state_dir, dest.id, f"{version_dirname(step)}-{save_id}.json")
    return Journal(path, os.path.dirname(state_dir))
