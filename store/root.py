"""A local checkpoint root's own files: the lock of its one writer process (`.ckpt.lock`)
and its identity (`.ckpt-root-id`), by which ranks learn which of them share a root."""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from contextlib import suppress

from ckpt.store.errors import RootLockedError
from ckpt.store.fsio import fsync_dir, write_durable

__all__ = ["LOCK_NAME", "ROOT_ID_NAME", "RootLock", "root_id", "writer_active", "version_above"]

LOCK_NAME = ".ckpt.lock"
ROOT_ID_NAME = ".ckpt-root-id"


_VERSION_OR_TMP = re.compile(r"^v\d{12}(\.tmp-[0-9a-f]{32})?$")


def version_above(path: str) -> str | None:
    """The version directory (or unpublished save) that `path` lies in, if any: a root
    there would write into a committed version, and a deletion of that version would take
    the root with it."""
    here = os.path.realpath(path)
    while True:
        parent = os.path.dirname(here)
        if parent == here:
            return None
        if _VERSION_OR_TMP.match(os.path.basename(here)):
            return here
        here = parent


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
