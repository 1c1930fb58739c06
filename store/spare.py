"""Spare version trees: a version that retention deletes, kept for the next save to write into.

Creating a file or a directory on ext4 costs ten times overwriting one (0.5-0.8 ms of CPU
against 0.05 ms here, and with writeback running a create waits for the journal), and a
version holds a directory and a file per array, and a file per chunk. On tmpfs a new file's
pages are allocated and zeroed, and a deleted version's freed, while an overwritten file
keeps its pages. So retention keeps the tree of one version it deletes, unpublished, as
`.spare-<layout>`; the next save of the same layout renames it to its tmp directory and
overwrites its files in place: the same paths and sizes, their blocks (or pages) already
allocated. A save of another layout creates its tree as before.

A spare is never listed (its name is no version's), so a crash at any point leaves at
worst a spare or a tmp directory that the next save or open cleans up. Space (on tmpfs,
memory): a spare holds what the save that takes it would allocate anyway, so a root's peak
(retained versions plus the one being written) does not grow; between saves it holds one
version more per kept layout (at most MAX_LAYOUTS). A root low on space keeps none
(ckpt._retention).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from collections.abc import Sequence

import xxhash

from ckpt.store.fsio import fsync_dir, makedirs_within
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME
from ckpt.store.pins import deleting
from ckpt.store.removal import remove_tree
from ckpt.store.tier import Tier
from ckpt.store.versions import version_dirname

__all__ = ["SPARE", "MAX_LAYOUTS", "drop", "retire", "spare_key", "spares", "take"]

log = logging.getLogger("ckpt")

SPARE = ".spare"  # `.spare` (peer copies, any layout) or `.spare-<layout key>`
MAX_LAYOUTS = 2  # e.g. full versions and params-only ones between them
_DROPPED = ".del-"  # in the name a spare is renamed to before it is deleted (drop)


def spare_key(layout: str, writers: Sequence[int]) -> str:
    """The key of one root's tree of a version: its layout (the manifest's `layout`) and the
    ranks that wrote to this root (a root may hold another node's part after a restart)."""
    return xxhash.xxh3_64_hexdigest(f"{layout}/{','.join(map(str, writers))}".encode())


def _name(key: str) -> str:
    return f"{SPARE}-{key}" if key else SPARE


def spares(home: str) -> list[str]:
    """The spare trees under `home`, oldest first (what a drop left first of all)."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        with os.scandir(home) as it:
            for e in it:
                if (e.name == SPARE or e.name.startswith(SPARE + "-")) and e.is_dir(follow_symlinks=False):
                    found.append((_DROPPED not in e.name, e.stat(follow_symlinks=False).st_mtime, e.path))
    return [p for _, _, p in sorted(found)]


def retire(tier: Tier, home: str, step: int, key: str = "") -> bool:
    """Unpublish version `step` of `home` as the spare of layout `key` instead of deleting it;
    whether it was (False: a spare of that layout is there already, or a reader pinned the
    version: the caller deletes it as usual). Spares beyond MAX_LAYOUTS go, oldest first."""
    target = os.path.join(home, _name(key))
    if os.path.lexists(target):
        return False
    with deleting(tier, step) as free:  # a reader may have pinned it since
        if not free:
            return False
        os.rename(os.path.join(home, version_dirname(step)), target)  # unpublished, as a deletion does
    os.utime(target)  # the newest spare: kept longest
    for old in spares(home)[:-MAX_LAYOUTS]:
        drop(home, old)
    fsync_dir(home)
    return True


def drop(home: str, spare: str) -> None:
    """Delete a spare tree of `home`. It is renamed first, within `home` (no directory to
    make on a full disk, where deleting it matters most): a save's `take` on another thread
    then gets the whole tree or none, never one that `rm` is emptying under its new name.
    What a crash or a failed `rm` leaves is still a spare by its name (`.spare-….del-…`),
    which no save takes and the next drop deletes."""
    gone = f"{spare}{_DROPPED}{uuid.uuid4().hex[:12]}"
    try:
        os.rename(spare, gone)
    except FileNotFoundError:
        return  # taken or deleted meanwhile
    except OSError as e:
        log.warning("cannot delete the spare tree %s: %s", spare, e.strerror or e)
        return
    remove_tree(gone, ignore_errors=True)


def take(home: str, dest: str, key: str = "") -> bool:
    """Move the spare of layout `key` to `dest` (absent, or an empty directory) for a save
    to overwrite; whether there was one. Its manifest and root info go at once: the tree
    must not look prepared for another save while it is being written."""
    spare = os.path.join(home, _name(key))
    try:
        if os.path.islink(spare):
            return False
        makedirs_within(home, os.path.dirname(dest))  # (ENOENT where the root is gone: no spare)
        os.rename(spare, dest)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            return False  # none, or another writer of the root made `dest` first
        raise
    for name in (MANIFEST_NAME, ROOT_INFO_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dest, name))
    return True
