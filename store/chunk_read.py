"""Reading chunk bytes back from any tier, safely, and whole-version verification.

A chunk is opened through its tier (local tiers refuse symlinks anywhere beneath the tier
and anything but a regular file) and its size is checked against the manifest before
anything is read; reads are positional, so ranges of a chunk can be read without the rest.

What a failure means: a missing, short, misplaced or mismatching chunk is damage
(CorruptVersionError); so is an I/O error of a local file (a bad sector) that persists:
it is marked `io_error`, and readers (store.rereads: restore, `ckpt verify`) read it again
first, as they do a checksum mismatch (restore then falls back past it; verify reports it
as unreadable, apart from proven damage). A tier that cannot be reached (TierUnavailableError,
after retries) is not damage and is raised as it is: nothing is skipped or deleted
because a read failed once.
"""

from __future__ import annotations

import errno

import xxhash

from ckpt.store.digest import chunk_digest
from ckpt.store.errors import CorruptVersionError, TierUnavailableError
from ckpt.store.manifest import ArrayEntry, ChunkEntry
from ckpt.store.tier import ReadHandle, Tier, join_key
from ckpt.store.versions import version_dirname

__all__ = [
    "READ_BLOCK",
    "open_chunk",
    "open_checked",
    "read_exact",
    "read_direct_exact",
    "read_chunk",
    "check_digest",
]

READ_BLOCK = 4 << 20


# Failures that say nothing about the bytes: refused access (an expired token, a changed
# bucket policy, a permission), a mount that went away, a reader out of descriptors or memory.
_NOT_DAMAGE = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.ENOTCONN,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.ENODEV,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
        errno.EINTR,
        errno.EAGAIN,
    }
)


def _unavailable(e: OSError) -> bool:
    return isinstance(e, PermissionError) or e.errno in _NOT_DAMAGE


def open_chunk(tier: Tier, step: int, array: ArrayEntry, chunk: ChunkEntry) -> ReadHandle:
    """The chunk's object, checked to have the manifest's size."""
    return open_checked(tier, join_key(version_dirname(step), array.chunk_path(chunk)), chunk.nbytes, chunk.xxh3)


def open_checked(tier: Tier, key: str, nbytes: int, expected: str, what: str = "chunk") -> ReadHandle:
    """A file of a version (a chunk, a rank file), checked to have the size the manifest gives."""
    try:
        handle = tier.open_read(key)
    except (CorruptVersionError, TierUnavailableError):
        raise
    except FileNotFoundError:
        where = f"{tier.location}/{key}"
        raise CorruptVersionError(f"{what} {where} is missing", path=where, expected=expected) from None
    except OSError as e:
        where = f"{tier.location}/{key}"
        # A remote store's refusal or unknown error is no proof of damage; a local file that
        # cannot be opened (a bad sector, a planted directory) is, unless errno says otherwise.
        if _unavailable(e) or (not tier.capabilities.local_files and not isinstance(e, IsADirectoryError)):
            raise TierUnavailableError(
                e.errno or errno.EIO, f"{what} {where} cannot be opened: {e.strerror or e}"
            ) from None
        raise CorruptVersionError(
            f"{what} {where} cannot be opened: {e.strerror or e}",
            path=where,
            io_error=not isinstance(e, IsADirectoryError),  # (a planted directory stays one)
        ) from None
    if handle.size != nbytes:
        handle.close()
        where = f"{tier.location}/{key}"
        raise CorruptVersionError(
            f"{what} {where} has {handle.size} bytes, the manifest says {nbytes}", path=where, expected=expected
        )
    return handle


def read_exact(handle: ReadHandle, out: memoryview, offset: int, where: str, shared: bool = False) -> None:
    """Fill `out` from `offset` (with `shared`, by ReadHandle.read_shared); an object that
    ends first, or a local I/O error, is damage."""
    try:
        if shared:
            handle.read_shared(offset, out)
        else:
            handle.read_into(offset, out)
    except (EOFError, OSError) as e:
        raise _read_error(e, where) from None


def read_direct_exact(handle: ReadHandle, out: memoryview, offset: int, need: int, where: str) -> None:
    """ReadHandle.read_direct into `out` (aligned as it asks), which must bring at least
    `need` bytes: the rest of `out` may lie past the object's end."""
    try:
        if handle.read_direct(offset, out) < need:
            raise EOFError(where)
    except (EOFError, OSError) as e:
        raise _read_error(e, where) from None


def _read_error(e: EOFError | OSError, where: str) -> Exception:
    """What a failed read raises: TierUnavailableError as it is, or for a failure that says
    nothing about the bytes; damage (CorruptVersionError) otherwise."""
    if isinstance(e, TierUnavailableError):
        return e
    if isinstance(e, EOFError):
        return CorruptVersionError(f"chunk {where} ended early", path=where)
    if _unavailable(e):
        return TierUnavailableError(e.errno or errno.EIO, f"chunk {where} cannot be read: {e.strerror or e}")
    return CorruptVersionError(f"chunk {where} cannot be read: {e.strerror or e}", path=where, io_error=True)


def read_chunk(tier: Tier, step: int, array: ArrayEntry, chunk: ChunkEntry, out: memoryview) -> None:
    """Fill `out` (chunk.nbytes, or the inline value's size) with the whole chunk, verified."""
    view = out.cast("B")
    where = f"{tier.location}/{version_dirname(step)}/{array.chunk_path(chunk)}"
    if chunk.inline is not None:
        raw = bytes.fromhex(chunk.inline)
        view[: len(raw)] = raw
        got = xxhash.xxh3_64_hexdigest(raw)
    else:
        handle = open_chunk(tier, step, array, chunk)
        try:
            read_exact(handle, view[: chunk.nbytes], 0, where)
        finally:
            handle.close()
        got = chunk_digest(view[: chunk.nbytes], array.digest_block_bytes(chunk))
    check_digest(got, chunk.xxh3, f"chunk {where} fails its checksum", where)


def check_digest(got: str, expected: str, what: str, where: str) -> None:
    """CorruptVersionError (with both digests) unless they match."""
    if got != expected:
        raise CorruptVersionError(
            f"{what} (xxh3 {got}, manifest {expected})", path=where, expected=expected, actual=got
        )
