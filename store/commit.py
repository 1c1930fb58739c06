"""The commit protocol of one root (a local filesystem) and the lock that guards it.

A version of step N lives in `v<N:012d>/`. It is written in `v<N>.tmp-<save_id>/` on
the same filesystem, in two phases driven by the caller (ckpt.Checkpointer):

1. *write*: every rank writes and fsyncs its chunk files in the tmp directory;
2. *prepare*: once every rank's data is durable, the root's leader writes the zarr
   metadata, `root.json` and last `manifest.json`, and fsyncs them and every directory;
3. *publish*: after every root is prepared, the leader renames tmp -> `v<N>/` and fsyncs
   the parent. A committed version is a `v<N>/` directory that contains a manifest.

A crash before publish leaves only a tmp directory, which is never listed and which the
next writer removes (or rolls forward, if another root already published the same
save). Overwriting swaps the new directory in with one atomic RENAME_EXCHANGE, so the
old version stays committed until the new one is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass

from ckpt.store.errors import ManifestError, RootLockedError, TierUnavailableError, VersionNotFoundError
from ckpt.store.faults import fault_point
from ckpt.store.fsio import DIR_MODE, FILE_MODE, exchange_dirs, fsync_dir, fsync_dirs, makedirs, write_durable
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest, parse_manifest

__all__ = [
    "LOCK_NAME",
    "TRASH_NAME",
    "RootLock",
    "PreparedVersion",
    "version_dirname",
    "tmp_dirname",
    "committed_steps",
    "prepared_versions",
    "read_manifest",
    "read_root_info",
    "prepare",
    "publish",
    "remove_tmp",
    "delete_version",
    "empty_trash",
    "root_id",
    "pin_version",
    "pinned_steps",
    "deleting",
    "writer_active",
]

log = logging.getLogger("ckpt")
LOCK_NAME = ".ckpt.lock"
ROOT_ID_NAME = ".ckpt-root-id"
PINS_NAME = ".pins"
_GC_WAIT_S = 2.0  # how long a reader waits for a GC's marker on the version it pinned
_DELETING = "gc-"  # in PINS_NAME: gc-<step>.<pid>.<id>, held by a GC while it deletes step
TRASH_NAME = ".trash"
_VERSION = re.compile(r"^v(\d{12})$")
_TMP = re.compile(r"^v(\d{12})\.tmp-([0-9a-f]{32})$")


def version_dirname(step: int) -> str:
    return f"v{step:012d}"


def tmp_dirname(step: int, save_id: str) -> str:
    return f"{version_dirname(step)}.tmp-{save_id}"


def _entries(root: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(root) as it:
            yield from it
    except FileNotFoundError:
        return
    except OSError as e:
        raise TierUnavailableError(e.errno, f"cannot list checkpoint root {root}: {e.strerror}") from None


def committed_steps(root: str) -> list[int]:
    """Steps with a published directory holding a manifest, oldest first."""
    steps = []
    for e in _entries(root):
        m = _VERSION.match(e.name)
        if m and e.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(e.path, MANIFEST_NAME)):
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass(frozen=True, slots=True)
class PreparedVersion:
    step: int
    save_id: str
    dirname: str
    has_manifest: bool  # prepared (manifest durable) rather than torn mid-write


def prepared_versions(root: str) -> list[PreparedVersion]:
    """Unpublished tmp directories, with whether they reached the prepare phase.

    After an overwrite's RENAME_EXCHANGE the tmp name holds the *old* version (another
    save_id) until it is deleted; that is not a prepared save and must never be rolled
    forward, so a tmp directory counts as prepared only if its root info names its save.
    """
    out = []
    for e in _entries(root):
        m = _TMP.match(e.name)
        if m:
            has = os.path.isfile(os.path.join(e.path, MANIFEST_NAME)) and read_root_info(e.path).get(
                "save_id"
            ) == m.group(2)
            out.append(PreparedVersion(int(m.group(1)), m.group(2), e.name, has))
    return sorted(out, key=lambda p: p.step)


def read_manifest(root: str, step: int) -> Manifest:
    path = os.path.join(root, version_dirname(step), MANIFEST_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
    except FileNotFoundError:
        raise VersionNotFoundError(f"step {step} is not committed in {root}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW: a planted symlink, not a failing disk
            raise ManifestError(f"{path} is a symbolic link", path=path) from None
        raise TierUnavailableError(e.errno, f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"{path} is not a regular file", path=path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    manifest = parse_manifest(raw)
    if manifest.step != step:
        raise ManifestError(f"{path} describes step {manifest.step}, not {step}", path=path)
    return manifest


def read_root_info(version_dir: str) -> dict[str, object]:
    """What this root holds of the version: {"save_id", "writers": [ranks]}; {} if unreadable."""
    try:
        fd = os.open(os.path.join(version_dir, ROOT_INFO_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would block the read
            return {}
        with open(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return doc if isinstance(doc, dict) else {}


def writer_active(root: str) -> bool:
    """Whether a live process holds the root's lock, read from /proc/locks: trying the
    flock ourselves could refuse a writer starting at that moment. False where unknown."""
    try:
        st = os.stat(os.path.join(root, LOCK_NAME))
        with open("/proc/locks") as f:
            held = f.read().split()
    except OSError:
        return False
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}" in held


class RootLock:
    """An exclusive advisory lock on a root, held by one process per root for the job's life.

    flock locks belong to an open file description, so a second Checkpointer in the same
    process is refused too.
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = ""
            with suppress(OSError), open(self.path) as f:
                holder = f.read().strip()
            raise RootLockedError(
                f"checkpoint root {os.path.dirname(self.path)} is in use by another writer ({holder or 'unknown'})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def prepare(tmp_dir: str, manifest: Manifest, writers: list[int], dirs: list[str]) -> None:
    """Phase 2 on one root: make the root info and the manifest durable, manifest last."""
    info = {"save_id": manifest.save_id, "step": manifest.step, "world_size": manifest.world_size, "writers": writers}
    write_durable(os.path.join(tmp_dir, ROOT_INFO_NAME), json.dumps(info).encode())
    fsync_dirs(dirs)
    write_durable(os.path.join(tmp_dir, MANIFEST_NAME), manifest.to_json())
    fsync_dir(tmp_dir)


def publish(root: str, tmp_name: str, step: int, *, overwrite: bool) -> None:
    """Phase 3 on one root: rename tmp to v<N> atomically and fsync the root."""
    tmp = os.path.join(root, tmp_name)
    final = os.path.join(root, version_dirname(step))
    if os.path.isdir(final):
        if not overwrite:
            raise FileExistsError(final)
        if exchange_dirs(tmp, final):
            fsync_dir(root)
            _discard(root, tmp)  # now the old version
            return
        # No RENAME_EXCHANGE: move the old version aside first; recovery restores it on a crash.
        aside = os.path.join(root, TRASH_NAME, f"{version_dirname(step)}.old-{tmp_name[-32:]}")
        os.makedirs(os.path.dirname(aside), mode=DIR_MODE, exist_ok=True)
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.rename(tmp, final)
    fsync_dir(root)


def remove_tmp(root: str, tmp_name: str) -> None:
    """Best effort: it runs while a failed save unwinds, where an error of its own (the disk
    is gone) would replace the save's error; what it cannot remove, the next open does."""
    try:
        _discard(root, os.path.join(root, tmp_name))
    except OSError as e:
        log.warning("cannot remove the unfinished save %s in %s: %s", tmp_name, root, e.strerror or e)


def _discard(root: str, path: str) -> None:
    """Move into the trash with one rename, then delete: a crash mid-delete leaves only trash."""
    if not os.path.exists(path):
        return
    trash = os.path.join(root, TRASH_NAME)
    os.makedirs(trash, mode=DIR_MODE, exist_ok=True)
    target = os.path.join(trash, f"{os.path.basename(path)}.del-{os.getpid()}")
    os.rename(path, target)
    shutil.rmtree(target, ignore_errors=True)


def delete_version(root: str, step: int) -> None:
    """Unpublish first (one rename into the trash), then delete: never a half-deleted `v<N>/`."""
    final = os.path.join(root, version_dirname(step))
    trash = os.path.join(root, TRASH_NAME)
    os.makedirs(trash, mode=DIR_MODE, exist_ok=True)
    target = os.path.join(trash, f"{version_dirname(step)}.del-{os.getpid()}-{id(final):x}")
    try:
        os.rename(final, target)
    except FileNotFoundError:
        return  # another GC (a daemon's, a `ckpt gc`) deleted it first: it is gone either way
    fsync_dir(root)
    fault_point("gc-mid-delete")  # unpublished, files not yet deleted
    shutil.rmtree(target, ignore_errors=True)


def empty_trash(root: str) -> None:
    """Finish interrupted deletions and overwrites (the caller holds the root lock)."""
    trash = os.path.join(root, TRASH_NAME)
    for e in _entries(trash):
        m = re.match(r"^(v\d{12})\.old-", e.name)
        if m and not os.path.exists(os.path.join(root, m.group(1))):
            os.rename(e.path, os.path.join(root, m.group(1)))  # an overwrite died between its renames
            fsync_dir(root)
            continue
        shutil.rmtree(e.path, ignore_errors=True)


def root_id(root: str) -> str:
    """The root's identity, created once: ranks that see the same id share one root (one
    directory, even one shared filesystem mounted on several hosts); else they do not."""
    path = os.path.join(root, ROOT_ID_NAME)
    try:
        with open(path) as f:
            value = f.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    write_durable(tmp, uuid.uuid4().hex.encode())  # its mode is FILE_MODE, whatever the umask
    try:
        os.link(tmp, path)  # create-only: concurrent creators agree on the first id
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    fsync_dir(root)
    with open(path) as f:
        return f.read().strip()


def _new_locked(d: str, name: str, op: int) -> tuple[int, str]:
    """Create d/<name> already flocked (`op`): made under a temp name, locked, then renamed,
    because an unlocked pin or marker is taken for the leftover of a dead process."""
    tmp = os.path.join(d, f".new-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, op)
        path = os.path.join(d, name)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return fd, path


def _held(path: str, op: int) -> bool:
    """Whether a live process holds a lock on `path` that conflicts with `op`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def pin_version(root: str, step: int) -> Iterator[bool]:
    """Hold a version against GC while it is read: a pin file under an flock, so a pin
    left by a killed reader is recognised as stale (its lock is gone) and ignored.

    Yields False when a GC is deleting the version right now: treat it as gone. A reader
    pins, then looks for GC's marker; GC marks, then looks for pins (`deleting`): one of
    them sees the other, so a version is never read and deleted at once. A GC never waits;
    a reader that finds a marker waits up to _GC_WAIT_S for it to go (the GC may have seen
    the pin and backed off), so a GC frozen mid-deletion blocks no reader for long. A
    version deleted before the pin stays deleted: readers check that it is still there
    once pinned."""
    d = os.path.join(root, PINS_NAME)
    try:
        makedirs(d)
        fd, path = _new_locked(d, f"{step}.{os.getpid()}.{uuid.uuid4().hex[:8]}", fcntl.LOCK_SH)
    except OSError:  # a read-only root cannot be garbage-collected either
        yield True
        return
    try:
        yield _gc_gone(d, step)
    finally:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)


def _gc_gone(pins_dir: str, step: int) -> bool:
    """Whether no GC is deleting `step`, once this reader's pin is in place.

    A GC that marked the step before our pin may or may not have seen the pin: if it
    did, it backs off at once and the version stays. So a marker is waited out briefly
    (the caller then checks that the version is still there) instead of taking the
    version for gone; a GC that holds its marker longer (frozen) blocks no reader for long.
    """
    prefix = f"{_DELETING}{step}."
    deadline = time.monotonic() + _GC_WAIT_S
    while any(e.name.startswith(prefix) and _held(e.path, fcntl.LOCK_SH) for e in _entries(pins_dir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def deleting(root: str, step: int) -> Iterator[bool]:
    """GC's side of pin_version: a marker held while `step` is deleted. Yields whether it
    may be deleted, False if a reader has pinned it."""
    d = os.path.join(root, PINS_NAME)
    try:
        makedirs(d)
        fd, path = _new_locked(d, f"{_DELETING}{step}.{os.getpid()}.{uuid.uuid4().hex[:8]}", fcntl.LOCK_EX)
    except OSError:  # cannot mark (read-only): the deletion fails anyway
        yield step not in pinned_steps(root)
        return
    try:
        yield step not in pinned_steps(root)
    finally:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)


def pinned_steps(root: str) -> set[int]:
    """Steps some live reader holds; stale pins are removed."""
    out: set[int] = set()
    for e in _entries(os.path.join(root, PINS_NAME)):
        if e.name.startswith("."):
            continue  # a pin or marker being made (_new_locked)
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with suppress(OSError):
                os.unlink(e.path)  # nobody holds it: a reader (or a GC) died
        except BlockingIOError:
            with suppress(ValueError):  # a live GC's marker is no pin
                out.add(int(e.name.split(".")[0]))
        finally:
            os.close(fd)
    return out
