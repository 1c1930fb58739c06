"""The one storage interface: a place holding objects under relative keys
(`v000000000100/state/model/w/c.0.0`), on a local filesystem or anything fsspec reaches.

Restore, replication, export and GC read, write and delete through a `Tier`; only the
save path writes a local root directly (store.commit, store.fsio: O_DIRECT, fsync
discipline). What a tier can do is declared in `capabilities`, never inferred from
its type. Keys are '/'-separated, relative, without '.' or '..' components.

Call order: `open_tier(location)`; then any of the operations, from any thread. A
missing key raises FileNotFoundError; an unreachable store TierUnavailableError (after
the retries of store.retry, for the fsspec backend); refused access PermissionError.

Semantics every backend keeps (the conformance suite in tests/store/test_tier_conformance.py checks
them against a local directory, `file://` and S3 on a moto server):
- `put`, `put_stream`: readers see the old object or the whole new one, never a part;
  an interrupted upload leaves nothing behind;
- `put_if_absent`: atomic create-only: of two concurrent callers exactly one succeeds,
  the other gets FileExistsError; durable on return;
- `listdir(prefix)`: the names directly beneath `prefix`, fresh (no stale cache);
- `delete`, `delete_many`: no error for keys already gone;
- `sync(prefix)`: everything put beneath `prefix` is durable once it returns.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt.store.errors import TierUnavailableError
from ckpt.store.retry import DEFAULT_POLICY, RetryPolicy

__all__ = ["Capabilities", "ObjectInfo", "ReadHandle", "Tier", "open_tier", "is_url", "join_key"]

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*(://|::)")  # chained too (simplecache::...), which fsspec refuses


def is_url(location: str) -> bool:
    return bool(_URL.match(location))


def join_key(*parts: str) -> str:
    return "/".join([s for p in parts if (s := p.strip("/"))])


@dataclass(frozen=True, slots=True)
class Capabilities:
    atomic_rename: bool
    """Directories rename atomically: a version is unpublished with one rename into the
    trash. Without it (object stores) the manifest is the commit marker, written
    create-only, and a deletion carries a `.deleting` marker until it is finished."""
    range_reads: bool
    """A ReadHandle reads any byte range without fetching the rest of the object."""
    direct_io: bool
    """Files can be written with O_DIRECT from aligned buffers (the save path's writer),
    and read so into them (ReadHandle.read_direct)."""
    local_files: bool
    """Keys are files of this machine's filesystem (`local_path`): readers may pin them
    against GC with flocks, and read their directory entries ahead of a read pass."""
    shared: bool = False
    """Every process of the job that opens this location reaches the same objects (an
    object store): a restore lists it on one rank for all of them (restore.locate)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the tier
    size: int  # bytes
    mtime: float  # unix time of its last write; 0.0 where the backend says nothing


class ReadHandle(Protocol):
    """An open object: positional reads of any range, until `close()`."""

    size: int

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` from `offset`; an object that ends first is an EOFError."""

    def read_shared(self, offset: int, out: memoryview) -> None:
        """read_into, for bytes that other readers of this machine read too (a block that
        two ranks of a resharded restore each need part of): a local file is read through
        the page cache, where the first reader's read from the device serves the others,
        with no readahead past `out` (the rest of the file may be read with O_DIRECT)."""

    def read_direct(self, offset: int, out: memoryview) -> int:
        """Fill `out` from `offset` up to the object's end; how many bytes that is. `out`
        starts on a DIRECT_ALIGN boundary of memory, and `offset` and len(out) are
        multiples of it: where `capabilities.direct_io`, the file is read with O_DIRECT
        (straight into `out`, not through the page cache) wherever its filesystem takes it."""

    def close(self) -> None: ...


class Tier(ABC):
    """A storage location (a checkpoint root, a replica directory, a remote prefix)."""

    location: str  # as given, credentials scrubbed: for messages and logs
    capabilities: Capabilities

    @property
    def store_id(self) -> str:
        """What names the store to other processes: two ranks' shared tiers (Capabilities.
        shared) with one id reach the same objects. The location (FsspecTier adds the S3 endpoint)."""
        return self.location

    @property
    def key_room(self) -> int | None:
        """The most bytes a key below this tier may have, where its store limits the length
        of an object's key (S3, GCS and Azure: 1,024 bytes, this tier's own prefix in its
        bucket included); None where it does not (a path's own limits are checked where a
        name is made: store.manifest)."""
        return None

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abstractmethod
    def open_read(self, key: str) -> ReadHandle:
        """The object for range reads. Local tiers refuse symlinks anywhere below the tier
        and anything but a regular file (ckpt.store.errors.CorruptVersionError)."""

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset`."""
        out = bytearray(length)
        handle = self.open_read(key)
        try:
            handle.read_into(offset, memoryview(out))
        finally:
            handle.close()
        return bytes(out)

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object, atomically for readers."""

    @abstractmethod
    def put_stream(self, key: str, blocks: Callable[[], Iterable[bytes | memoryview]], size: int) -> bool:
        """Create or replace the object from the blocks `blocks()` yields (`size` bytes in
        all), atomically for readers; `blocks` is called again for each attempt. An exception
        raised by the blocks (a stop request) abandons the upload and propagates. A block may
        be a view of a buffer the iterator reuses: it is consumed before the next one.

        True when the store itself confirms that it received exactly the bytes sent (S3: the
        ETag in its answer to the PUT, or to each part's upload, is their MD5), so no read
        back is needed to know it; False where it cannot say."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create the object only if no object has that key: FileExistsError otherwise.
        Atomic and durable on return: the commit marker of object stores."""

    @abstractmethod
    def listdir(self, prefix: str = "") -> list[str]:
        """Names (not keys) directly beneath `prefix`, sorted; [] if there are none."""

    @abstractmethod
    def find(self, prefix: str) -> list[ObjectInfo]:
        """Every object beneath `prefix`, at any depth (keys relative to the tier)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; no error if it is gone already."""

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    @abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Remove everything beneath `prefix` (and the directory itself where there is one)."""

    def rename(self, src: str, dst: str) -> None:
        """Move a directory or object in one atomic step, durably. Only where
        `capabilities.atomic_rename`; elsewhere it is refused with TierUnavailableError."""
        raise TierUnavailableError(f"{self.location} cannot rename {src} atomically")

    def sync(self, prefix: str) -> None:
        """Make everything put beneath `prefix` durable (directories included)."""
        return None

    def local_path(self, key: str) -> str | None:
        """The file behind `key` where `capabilities.local_files`, else None."""
        return None

    def reading(self, keys: Iterable[str]) -> AbstractContextManager[None]:
        """A read pass over these objects (and maybe others of the tier), many at once, from
        several threads: a local tier reads their inodes and directory entries ahead and
        keeps its directory open for the pass; no effect elsewhere."""
        return contextlib.nullcontext()

    def in_memory(self) -> bool:
        """Whether its objects are in this machine's memory (a local tier on tmpfs): every
        read is a copy, bound by the cores, with no latency for more readers to hide."""
        return False


def local_location(location: str) -> str | None:
    """The directory a local path or `file://` URL names; None for any other URL. A URL's
    path is taken as written, as fsspec's local filesystem takes it (no %-decoding), on
    this machine (`file:///path`, `file://localhost/path`, `file:/path`); ValueError for
    any other (`file://` alone, as an unset variable leaves it, named the working
    directory; `file://host/path` named `./host/path`)."""
    if location.startswith("file:"):
        path = location[len("file:") :]
        if path.startswith("//"):  # file://host/path: this machine's, or none
            path = path[len("//localhost") :] if path.startswith("//localhost/") else path[2:]
        if not path.startswith("/") or path.startswith("//"):
            raise ValueError(f"{location!r} names no path of this machine: write file:///absolute/path")
        return path
    return None if is_url(location) else location


def open_tier(
    location: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> Tier:
    """A tier for a local path or `file://` URL (a directory of this machine's filesystem,
    which need not exist yet), or for any other fsspec URL (`s3://bucket/prefix`),
    configured by `storage_options` or, for S3, the standard AWS_* variables and files."""
    local = local_location(location)
    if local is not None:
        from ckpt.store._local import LocalTier

        return LocalTier(local)
    from ckpt.store._fsspec import FsspecTier

    return FsspecTier(location, storage_options, retry=retry)
