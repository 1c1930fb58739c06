"""Copy one committed version (the part a source root holds) to one destination, verify
it, and commit it there with the manifest written last.

Destinations are fsspec locations: a local path (another disk), a peer's disk through
any fsspec URL, or the shared remote (s3://...). A *replica* destination commits the
part as soon as it is complete (its root.json lists the source's writer ranks). The
*shared* destination gathers every node's part; it is committed, by whichever node
completes it, once the parts cover every rank, with a create-only manifest write, so a
remote version is complete or invisible.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import fsspec

from ckpt.replicator.journal import Journal
from ckpt.replicator.ratelimit import RateLimiter
from ckpt.store import commit, objstore
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CorruptVersionError, TierUnavailableError
from ckpt.store.fsio import FILE_MODE, fsync_dirs, makedirs
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, ChunkEntry, Manifest, parse_manifest

__all__ = ["Destination", "Stopped", "push_version", "remote_committed", "with_retries", "disk_id"]

log = logging.getLogger("ckpt.replicator")
T = TypeVar("T")
_BLOCK = 8 << 20
_MULTIPART = 16 << 20  # s3fs part size: chunks of 32 MiB and more go as multipart uploads
_COPY_TMP = re.compile(r"\.tmp-[0-9a-f]{32}$")  # _copy_local's temp files
_RESENDS = 2  # uploads of a chunk after the first, while its copy reads back wrong


class Stopped(Exception):
    """The replicator was asked to stop; nothing was committed."""


DISK_MARKER = ".ckpt-disk"


def disk_id(location: str) -> str:
    """What 'the same disk' means for placement: protocol and host for URLs; for local paths
    the content of the nearest `.ckpt-disk` file above it (for bind mounts, network
    filesystems or tests, where the device number says too little), else the device."""
    if objstore.is_url(location) and not location.startswith("file://"):
        proto, rest = location.split("://", 1)
        return f"{proto}://{rest.split('/', 1)[0]}"
    path = location[len("file://") :] if location.startswith("file://") else location
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    probe = path
    while True:
        marker = os.path.join(probe, DISK_MARKER)
        if os.path.isfile(marker):
            with open(marker) as f:
                return f"marker:{f.read().strip()}"
        if probe == os.path.dirname(probe):
            break
        probe = os.path.dirname(probe)
    return f"dev:{os.stat(path).st_dev}"


@dataclass
class Destination:
    url: str  # a local path or an fsspec URL
    kind: Literal["replica", "shared"]
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    disk: str | None = None  # disk_id the copies must stay on (None: not checked)
    fs: fsspec.AbstractFileSystem = field(init=False)
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        self.fs, self.prefix = objstore.open_fs(self.url, self.storage_options)

    @property
    def id(self) -> str:
        return hashlib.sha1(self.url.encode()).hexdigest()[:12]

    @property
    def local(self) -> bool:
        return objstore.is_local(self.fs)

    def check_disk(self) -> None:
        """Raise TierUnavailableError if the destination is no longer on its disk: a disk
        unmounted mid-copy leaves its mount point, on another disk, in its place."""
        if self.disk is not None and self.local and (now := disk_id(self.url)) != self.disk:
            raise TierUnavailableError(errno.ENODEV, f"{self.url}: its disk ({self.disk}) is gone, found {now}")


def with_retries(
    fn: Callable[[], T], what: str, options: Mapping[str, Any], stop: threading.Event, attempts: int = 7
) -> T:
    """Retry transient failures (network, 5xx, throttling) with exponential backoff."""
    delay = 0.2
    for attempt in range(attempts):
        if stop.is_set():
            raise Stopped()
        try:
            return fn()
        except (FileExistsError, PermissionError, CorruptVersionError, TierUnavailableError, Stopped):
            raise  # TierUnavailableError: a final verdict (retries done, or the disk is gone)
        except Exception as e:  # noqa: BLE001 - backend errors are many and untyped
            if attempt == attempts - 1:
                raise TierUnavailableError(f"{what}: {objstore.redact(str(e), options)}") from None
            log.warning("%s failed (%s); retrying in %.1fs", what, objstore.redact(str(e), options)[:200], delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def _copy_local(lpath: str, rpath: str, limiter: RateLimiter, stop: threading.Event) -> None:
    makedirs(os.path.dirname(rpath))
    tmp = f"{rpath}.tmp-{uuid.uuid4().hex}"
    with open(lpath, "rb") as src:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            while block := src.read(_BLOCK):
                limiter.acquire(len(block), stop)
                if stop.is_set():
                    raise Stopped()
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
    os.replace(tmp, rpath)


def _remove_stray_copies(local_dir: str) -> None:
    """Delete the temp files (`<file>.tmp-<uuid>`) of copies that never finished: a disk
    unmounted mid-copy takes them along and brings them back; they are not the version's."""
    for top, _, names in os.walk(local_dir):
        for n in names:
            if _COPY_TMP.search(n):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(top, n))


def _upload(dest: Destination, lpath: str, rpath: str, limiter: RateLimiter, stop: threading.Event) -> None:
    if dest.local:
        _copy_local(lpath, rpath, limiter, stop)
    elif limiter.rate is None:
        dest.fs.put_file(lpath, rpath, chunksize=_MULTIPART)
    else:
        with open(lpath, "rb") as src:
            out = dest.fs.open(rpath, "wb", block_size=_MULTIPART)
            try:
                while block := src.read(_BLOCK):
                    limiter.acquire(len(block), stop)
                    if stop.is_set():
                        raise Stopped()
                    out.write(block)
            except BaseException:
                # Abandon the upload: closing would publish the truncated object.
                with contextlib.suppress(Exception):
                    out.discard()
                    out.closed = True
                raise
            out.close()


def _digest(dest: Destination, rpath: str, block_bytes: int) -> tuple[int, str]:
    hasher = ChunkHasher(block_bytes)
    size = 0
    with dest.fs.open(rpath, "rb", block_size=_BLOCK) as f:
        while block := f.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def _size_or_none(dest: Destination, rpath: str) -> int | None:
    try:
        return int(dest.fs.size(rpath))
    except FileNotFoundError:
        return None


def _missing(dest: Destination, remote_dir: str, sizes: Mapping[str, int], stop: threading.Event) -> list[str]:
    """The files of `sizes` (relative path -> bytes) that the destination does not hold at
    that size, from one fresh recursive listing."""
    dest.fs.invalidate_cache(remote_dir)
    found = with_retries(lambda: dest.fs.find(remote_dir, detail=True), "list copied files", dest.storage_options, stop)
    base = dest.fs._strip_protocol(remote_dir).rstrip("/") + "/"
    held = {}
    for path, info in found.items():
        path = dest.fs._strip_protocol(path)
        if path.startswith(base):
            held[path[len(base) :]] = info.get("size")
    return sorted(rel for rel, size in sizes.items() if held.get(rel) != size)


def remote_committed(dest: Destination, step: int, stop: threading.Event | None = None) -> dict[str, Any] | None:
    """The destination's root info if the version is committed there, else None."""
    vdir = objstore.join(dest.prefix, commit.version_dirname(step))

    def read() -> Any:
        try:
            if not dest.fs.exists(objstore.join(vdir, MANIFEST_NAME)):
                return None
            return json.loads(dest.fs.cat_file(objstore.join(vdir, ROOT_INFO_NAME)))
        except (FileNotFoundError, ValueError):
            return None

    # Network and credential errors are retried, then raised as TierUnavailableError.
    info = with_retries(read, f"look up step {step}", dest.storage_options, stop or threading.Event())
    return info if isinstance(info, dict) else None


def push_version(
    source_root: str,
    step: int,
    manifest: Manifest,
    writers: list[int],
    dest: Destination,
    state_dir: str,
    *,
    part_index: int = 0,
    limiter: RateLimiter | None = None,
    threads: int = 8,
    readback: bool = True,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] = lambda n: None,
) -> bool:
    """Copy, verify and commit; True once the destination holds the version (or this part).

    Resumable: chunks recorded as verified in the journal (and still of the right size at
    the destination) are not sent again.
    """
    stop = stop or threading.Event()
    limiter = limiter or RateLimiter(None)
    opts = dest.storage_options
    dest.check_disk()
    info = remote_committed(dest, step, stop)
    if info is not None and info.get("save_id") == manifest.save_id:
        if dest.kind == "shared" or set(writers) <= set(info.get("writers", [])):
            return True
    name = commit.version_dirname(step)
    local_dir = os.path.join(source_root, name)
    remote_dir = objstore.join(dest.prefix, name)
    journal = Journal(os.path.join(state_dir, dest.id, f"{name}-{manifest.save_id}.json"))
    chunks: dict[str, ChunkEntry] = {
        a.chunk_path(c): c for a in manifest.arrays.values() for c in a.chunks if c.inline is None
    }
    block_bytes = {
        a.chunk_path(c): a.digest_block_bytes(c) for a in manifest.arrays.values() for c in a.chunks if c.blocks
    }
    files = []
    for top, _, names in os.walk(local_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(top, n), local_dir).replace(os.sep, "/")
            if rel not in (MANIFEST_NAME, ROOT_INFO_NAME):
                files.append(rel)
    files.sort(key=lambda r: -(chunks[r].nbytes if r in chunks else 0))
    last_save = [time.monotonic()]

    def one(rel: str) -> None:
        rpath = objstore.join(remote_dir, rel)
        chunk = chunks.get(rel)
        size = chunk.nbytes if chunk else os.path.getsize(os.path.join(local_dir, rel))
        if rel in journal.done:
            try:
                if with_retries(lambda: _size_or_none(dest, rpath), f"stat {rpath}", opts, stop) == size:
                    return
            except TierUnavailableError:
                pass
            # gone (e.g. a restarted object store): send it again

        def send() -> None:
            # Upload and check as one unit: a copy that vanished before it was read back
            # is sent again rather than looked for until the retries run out.
            dest.check_disk()
            _upload(dest, os.path.join(local_dir, rel), rpath, limiter, stop)
            if readback and chunk is not None:
                # A mismatch may be damage on the way (up or down) that no transport checksum
                # caught (plain HTTP, range reads): send it again before calling the copy corrupt.
                for resend in range(_RESENDS + 1):
                    got_size, got = _digest(dest, rpath, block_bytes.get(rel, 0))
                    if got_size == size and got == chunk.xxh3:
                        break
                    where = f"{objstore.redact(dest.url, opts)}/{name}/{rel}"
                    if resend == _RESENDS:
                        raise CorruptVersionError(f"{where}: copy does not match the manifest", path=rel)
                    log.warning("%s: the copy read back does not match the manifest; sending it again", where)
                    _upload(dest, os.path.join(local_dir, rel), rpath, limiter, stop)
            else:
                got_size = dest.fs.size(rpath)
                if got_size != size:
                    raise CorruptVersionError(f"{dest.url}/{name}/{rel}: copy has {got_size} bytes, want {size}")
            dest.check_disk()  # verified where it should be, not below an unmounted disk's mount point

        with_retries(send, f"upload {rel}", opts, stop)
        journal.add(rel)
        progress(size)
        if time.monotonic() - last_save[0] > 0.5:
            last_save[0] = time.monotonic()
            journal.save()

    sizes = {
        rel: chunks[rel].nbytes if rel in chunks else os.path.getsize(os.path.join(local_dir, rel)) for rel in files
    }
    todo = files
    for _attempt in range(3):
        try:
            with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-push") as pool:
                for f in [pool.submit(one, rel) for rel in todo]:
                    f.result()
        finally:
            journal.save()
        # The manifest may go up only if every file is there now: an object store that lost
        # objects since they were verified (restarted, wiped) must not get a manifest naming them.
        todo = _missing(dest, remote_dir, sizes, stop)
        if not todo:
            break
        where = objstore.redact(dest.url, opts)
        log.warning("%s/%s: %d verified file(s) are gone; sending them again", where, name, len(todo))
        for rel in todo:
            journal.discard(rel)
    else:
        raise TierUnavailableError(f"{objstore.redact(dest.url, opts)}/{name}: files keep vanishing after upload")
    if dest.local:
        _remove_stray_copies(remote_dir)
        fsync_dirs({os.path.dirname(objstore.join(remote_dir, r)) for r in files} | {remote_dir})
    return _commit(dest, step, manifest, writers, part_index, journal, stop)


def _commit(
    dest: Destination,
    step: int,
    manifest: Manifest,
    writers: list[int],
    part_index: int,
    journal: Journal,
    stop: threading.Event,
) -> bool:
    opts = dest.storage_options
    name = commit.version_dirname(step)
    remote_dir = objstore.join(dest.prefix, name)
    if dest.kind == "shared":
        part = {"save_id": manifest.save_id, "writers": sorted(writers)}
        with_retries(
            lambda: objstore.put_durable(
                dest.fs, objstore.join(remote_dir, "parts", f"{part_index}.json"), json.dumps(part).encode()
            ),
            "record part",
            opts,
            stop,
        )
        covered: set[int] = set()
        for p in with_retries(
            lambda: dest.fs.ls(objstore.join(remote_dir, "parts"), detail=False), "list parts", opts, stop
        ):
            try:
                doc = json.loads(dest.fs.cat_file(p))
            except (FileNotFoundError, ValueError):
                continue
            if doc.get("save_id") == manifest.save_id:
                covered |= set(doc.get("writers", []))
        if not covered >= set(range(manifest.world_size)):
            return False  # other nodes' parts are still on their way; whoever completes the set commits
        holders = list(range(manifest.world_size))
    else:
        holders = sorted(writers)
    root_info = {"save_id": manifest.save_id, "step": step, "world_size": manifest.world_size, "writers": holders}
    dest.check_disk()
    with_retries(
        lambda: objstore.put_durable(
            dest.fs, objstore.join(remote_dir, ROOT_INFO_NAME), json.dumps(root_info).encode()
        ),
        "write root info",
        opts,
        stop,
    )
    if stop.is_set():
        raise Stopped()
    manifest_path = objstore.join(remote_dir, MANIFEST_NAME)
    try:
        with_retries(lambda: objstore.create_only(dest.fs, manifest_path, manifest.to_json()), "commit", opts, stop)
    except FileExistsError:
        existing = parse_manifest(dest.fs.cat_file(manifest_path))
        if existing.save_id != manifest.save_id:
            log.warning("%s already holds step %d from another save; not replaced", dest.url, step)
            return False
    if dest.local:
        fsync_dirs([remote_dir, os.path.dirname(remote_dir)])
    journal.remove()
    return True
