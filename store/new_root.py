"""A root a command makes for its output (`ckpt import`, `ckpt restore --to`): removed again,
with the directories made for it, when the command fails before a version is committed
there, so that the next command does not take an empty directory for a checkpoint root."""

from __future__ import annotations

import os
import shutil

from ckpt.store.root import LOCK_NAME, ROOT_ID_NAME
from ckpt.store.versions import TRASH_NAME

__all__ = ["first_missing", "remove_unused"]


def first_missing(root: str) -> str | None:
    """The outermost directory of a local `root` path that does not exist yet (None: it
    exists, or the root is no local path)."""
    if "://" in root:
        return None
    here, missing = os.path.abspath(root), None
    while not os.path.lexists(here):
        missing, parent = here, os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return missing


def remove_unused(made: str, root: str) -> None:
    """Remove a root with no version (only the identity and lock files every root has, and
    the trash a failed write leaves its files in) and the directories made above it, up to
    `made` (first_missing's answer before the root was made), as long as each then holds
    nothing: a file another process put in one meanwhile stays, with the path to it."""
    here = os.path.abspath(root)
    try:
        if not set(os.listdir(here)) <= {ROOT_ID_NAME, LOCK_NAME, TRASH_NAME}:
            return
        shutil.rmtree(here)
        while here != made:
            here = os.path.dirname(here)
            os.rmdir(here)  # OSError (ENOTEMPTY) where something else is there
    except OSError:
        return
