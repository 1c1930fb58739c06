"""Where the commands that write may write: a directory that is empty or a checkpoint
root, never an ordinary directory given by mistake, never one inside a version."""

from __future__ import annotations

import os

from ckpt.replicator.placement import DISK_MARKER
from ckpt.replicator.status import STATE_DIR
from ckpt.store.errors import CkptError
from ckpt.store.pins import PINS_NAME
from ckpt.store.root import LOCK_NAME, ROOT_ID_NAME, version_above
from ckpt.store.versions import TRASH_NAME, parse_version_dirname

__all__ = ["check_writable_root"]

_OWN_NAMES = frozenset({LOCK_NAME, ROOT_ID_NAME, TRASH_NAME, PINS_NAME, STATE_DIR, DISK_MARKER, "replicas"})
"""What ckpt itself may have left in a directory that holds no version yet."""


def check_writable_root(path: str, shown: str | None = None) -> None:
    """Refuse, before anything is written, a directory that is neither empty nor a checkpoint
    root (one with a root id, versions, or only ckpt's own files): an ordinary directory
    given by mistake. And refuse one inside a version (store.root.version_above)."""
    above = version_above(path)
    if above is not None:
        raise CkptError(f"{shown or path} is inside the version {above}: give a directory of its own")
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return  # created by the command
    if ROOT_ID_NAME in names or set(names) <= _OWN_NAMES:
        return
    if any(parse_version_dirname(n.partition(".tmp-")[0]) is not None for n in names):
        return
    held = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    raise CkptError(f"{shown or path} is neither empty nor a checkpoint root (it holds {held}): not touching it")
