"""Storage tiers the restore layer reads from. Local roots are the first tier; replica
disks and remote stores (the replicator's) plug in through the same interface.

Call order: `committed()` to list, then `manifest(step)`, then `version_dir(step)` for
chunk reads. A tier that cannot be reached raises TierUnavailableError.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt.store import commit, objstore
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CkptError, CorruptVersionError, TierUnavailableError, VersionNotFoundError
from ckpt.store.fsio import FILE_MODE, makedirs
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest, parse_manifest

log = logging.getLogger("ckpt")
_VERSION = re.compile(r"^v(\d{12})$")
# RemoteTier tries a backend call 4 times, 0.2 s apart and doubling (1.4 s of waits), on top
# of s3fs's and botocore's own retries, which cover only some errors.
_RETRY_ATTEMPTS = 4
_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0
_REFETCHES = 2  # downloads of a chunk after the first, while they fail the manifest's checksum

__all__ = ["Tier", "LocalTier", "RemoteTier", "Candidate", "Fetch", "open_tier"]


class Fetch(Protocol):
    """Brings one file of a version into the tier's version_dir: (relative path, size, and
    the xxh3 the manifest gives it, if known, with its block size: ArrayEntry.digest_block_bytes).
    Raises CorruptVersionError when every download fails that checksum; a missing file is
    left missing for the reader to report."""

    def __call__(self, rel: str, nbytes: int, xxh3: str | None = None, block_bytes: int = 0, /) -> None: ...


def _xxh3_file(path: str, block_bytes: int) -> str:
    hasher = ChunkHasher(block_bytes)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            hasher.update(block)
    return hasher.hexdigest()


@dataclass(frozen=True)
class Candidate:
    """A committed version as one tier sees it."""

    step: int
    save_id: str
    world_size: int  # ranks that saved it
    writers: tuple[int, ...]  # ranks whose chunks this tier holds


class Tier(ABC):
    name: str

    @abstractmethod
    def committed(self) -> list[Candidate]:
        """Committed versions on this tier, oldest first."""

    @abstractmethod
    def manifest(self, step: int) -> Manifest:
        """The parsed, validated manifest; raises VersionNotFoundError or ManifestError."""

    @abstractmethod
    def version_dir(self, step: int) -> str:
        """A local directory holding the version's files (tiers that are not local fetch first)."""

    def fetcher(self, step: int) -> Fetch | None:
        """For tiers that are not local: a function that brings one file into version_dir(step)
        before it is read. None for local tiers."""
        return None


class LocalTier(Tier):
    """A root directory on a local filesystem."""

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        self.name = f"local:{self.root}"

    def committed(self) -> list[Candidate]:
        out = []
        for step in commit.committed_steps(self.root):
            info = commit.read_root_info(self.version_dir(step))
            writers = info.get("writers")
            save_id = info.get("save_id")
            world = info.get("world_size")
            if isinstance(writers, list) and isinstance(save_id, str) and isinstance(world, int):
                out.append(Candidate(step, save_id, world, tuple(int(w) for w in writers)))
        return out

    def manifest(self, step: int) -> Manifest:
        return commit.read_manifest(self.root, step)

    def version_dir(self, step: int) -> str:
        return os.path.join(self.root, commit.version_dirname(step))


class RemoteTier(Tier):
    """A prefix on an fsspec filesystem (s3://bucket/prefix, file://...). Chunks are fetched
    on demand into a local cache directory, so a rank downloads only what it reads."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None):
        self.url = url
        self.options = dict(storage_options or {})
        self.fs, self.prefix = objstore.open_fs(url, self.options)
        self.name = url
        digest = hashlib.sha1(url.encode()).hexdigest()[:12]
        base = cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ckpt")
        self.cache = os.path.join(base, digest)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn(), retried with backoff while it fails in a way that may pass: a dropped
        connection, a 5xx, throttling, a timeout, a cut or corrupted body (botocore's checksum).
        s3fs retries only some of these and gives up after a few quick tries, and one failed
        read here would make the whole tier unavailable, so a restore would skip the remote.
        Missing objects, refused access and ckpt errors are final at once."""
        delay = _RETRY_FIRST_S
        for attempt in range(_RETRY_ATTEMPTS):
            try:
                return fn()
            except (FileNotFoundError, PermissionError, CkptError):
                raise
            except Exception as e:  # noqa: BLE001 - backend errors become one documented type
                msg = objstore.redact(f"{type(e).__name__}: {e}", self.options)
                if attempt == _RETRY_ATTEMPTS - 1:
                    raise TierUnavailableError(f"{self.url}: cannot {what}: {msg}") from None
                log.warning("%s: %s failed (%s); retrying in %.1fs", self.url, what, msg[:200], delay)
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
        raise AssertionError("unreachable")

    def committed(self) -> list[Candidate]:
        # fsspec filesystems (s3fs) cache listings per instance, and instances are shared
        # process-wide: without this, versions committed or deleted since would go unseen.
        self.fs.invalidate_cache()
        try:
            names = self._call("list", lambda: self.fs.ls(self.prefix, detail=False))
        except FileNotFoundError:
            return []
        out = []
        for full in names:
            m = _VERSION.match(full.rstrip("/").rsplit("/", 1)[-1])
            if not m:
                continue
            step = int(m.group(1))
            try:
                info_path, manifest_path = objstore.join(full, ROOT_INFO_NAME), objstore.join(full, MANIFEST_NAME)
                raw = self._call("read", functools.partial(self.fs.cat_file, info_path))
                if not self._call("stat", functools.partial(self.fs.exists, manifest_path)):
                    continue  # an upload in progress: invisible until its manifest exists
                info = json.loads(raw)
                writers = tuple(int(w) for w in info["writers"])
                out.append(Candidate(step, str(info["save_id"]), int(info["world_size"]), writers))
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda c: c.step)

    def manifest(self, step: int) -> Manifest:
        path = objstore.join(self.prefix, commit.version_dirname(step), MANIFEST_NAME)
        try:
            raw = self._call("read", lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            raise VersionNotFoundError(f"step {step} is not committed in {self.url}") from None
        return parse_manifest(raw)

    def version_dir(self, step: int) -> str:
        d = os.path.join(self.cache, commit.version_dirname(step))
        makedirs(d)
        return d

    def fetcher(self, step: int) -> Fetch:
        local_dir = self.version_dir(step)
        remote_dir = objstore.join(self.prefix, commit.version_dirname(step))

        def fetch(rel: str, nbytes: int, xxh3: str | None = None, block_bytes: int = 0, /) -> None:
            dest = os.path.join(local_dir, rel)
            if os.path.isfile(dest) and os.path.getsize(dest) == nbytes:
                return
            makedirs(os.path.dirname(dest))
            got: str | None = None
            for attempt in range(1 + _REFETCHES):
                tmp = f"{dest}.part-{uuid.uuid4().hex}"
                try:
                    self._call("download", functools.partial(self.fs.get_file, objstore.join(remote_dir, rel), tmp))
                    # A body can arrive complete yet wrong where no transport checksum covers it
                    # (range requests, objects uploaded without one, plain-HTTP endpoints): only
                    # a copy that matches the manifest enters the cache, whatever verify_on_restore says.
                    got = None if xxh3 is None else _xxh3_file(tmp, block_bytes)
                    if got == xxh3:
                        os.chmod(tmp, FILE_MODE)  # fsspec creates it with 0o666 & ~umask
                        os.replace(tmp, dest)
                        return
                except FileNotFoundError:
                    return  # the reader reports the chunk missing and tries another tier
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                if attempt < _REFETCHES:
                    where = f"{self.name}/{commit.version_dirname(step)}/{rel}"
                    log.warning("%s: a download fails its checksum (xxh3 %s, manifest %s); again", where, got, xxh3)
            raise CorruptVersionError(
                f"{self.name}: {1 + _REFETCHES} downloads of {commit.version_dirname(step)}/{rel} fail their "
                f"checksum (last xxh3 {got}, manifest {xxh3})",
                path=rel,
                expected=xxh3 or "",
                actual=got or "",
            )

        return fetch

    def clear_cache(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)


def open_tier(location: str, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None) -> Tier:
    """A local root for a path, a RemoteTier for a URL (file:// URLs too)."""
    if objstore.is_url(location):
        return RemoteTier(location, storage_options, cache_dir)
    return LocalTier(location)
