"""Reader pins against GC on local tiers: a reader holds a version while it reads it, and a
GC deleting a version holds a marker; each looks for the other, so a version is never
read and deleted at once. Pins are flocked files under `.pins/`, so one left by a killed
process is recognised as stale (its lock is gone) and ignored. Object stores cannot hold
locks: on them pinning is a no-op, and a reader whose version vanishes mid-read sees
missing chunks and chooses again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress

from ckpt.store.errors import TierUnavailableError
from ckpt.store.fsio import FILE_MODE, entries, makedirs_within
from ckpt.store.tier import Tier

__all__ = ["PINS_NAME", "pin_version", "pinned_steps", "deleting"]

PINS_NAME = ".pins"
_GC_WAIT_S = 2.0  # how long a reader waits for a GC's marker on the version it pinned
_DELETING = "gc-"  # in PINS_NAME: gc-<step>.<pid>.<id>, held by a GC while it deletes step


def _entries(d: str) -> list[os.DirEntry[str]]:
    try:
        return entries(d)
    except TierUnavailableError:  # a failing disk holds no pins anyone could act on
        return []


def _pins_dir(tier: Tier) -> str | None:
    root = tier.local_path("")
    return None if root is None else os.path.join(root, PINS_NAME)


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
def pin_version(tier: Tier, step: int) -> Iterator[bool]:
    """Hold a version against GC while it is read: a pin file under an flock, so a pin
    left by a killed reader is recognised as stale (its lock is gone) and ignored.

    Yields False when a GC is deleting the version right now: treat it as gone. A reader
    pins, then looks for GC's marker; GC marks, then looks for pins (`deleting`): one of
    them sees the other, so a version is never read and deleted at once. A GC never waits;
    a reader that finds a marker waits up to _GC_WAIT_S for it to go (the GC may have seen
    the pin and backed off), so a GC frozen mid-deletion blocks no reader for long. A
    version deleted before the pin stays deleted: readers check that it is still there
    once pinned."""
    with _marker(tier, str(step), fcntl.LOCK_SH) as d:
        # None: an object store, or a read-only root, which cannot be garbage-collected either
        yield True if d is None else _gc_gone(d, step)


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
def deleting(tier: Tier, step: int) -> Iterator[bool]:
    """GC's side of pin_version: a marker held while `step` is deleted. Yields whether it
    may be deleted, False if a reader has pinned it."""
    with _marker(tier, f"{_DELETING}{step}", fcntl.LOCK_EX):  # read-only: the deletion fails anyway
        yield step not in pinned_steps(tier)


@contextlib.contextmanager
def _marker(tier: Tier, name: str, op: int) -> Iterator[str | None]:
    """A flocked `.pins/<name>.<pid>.<id>` for the duration; yields the pins directory, or
    None where none can be made (an object store, a read-only root)."""
    d = _pins_dir(tier)
    if d is None:
        yield None
        return
    try:
        makedirs_within(os.path.dirname(d), d)
        fd, path = _new_locked(d, f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}", op)
    except OSError:
        yield None
        return
    try:
        yield d
    finally:
        os.close(fd)
        with suppress(OSError):
            os.unlink(path)


def pinned_steps(tier: Tier) -> set[int]:
    """Steps some live reader holds; stale pins are removed."""
    out: set[int] = set()
    d = _pins_dir(tier)
    for e in _entries(d) if d is not None else ():
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
