"""The commit protocol of one local root: how a save becomes a committed version.

A version of step N is written in `v<N>.tmp-<save_id>/` on the root's filesystem, in
phases driven by the caller (ckpt's commit thread):

1. *write*: every rank writes and fsyncs its chunk files in the tmp directory;
2. *prepare*: once every rank's data is durable, the root's leader writes the zarr
   metadata, `root.json` and last `manifest.json`, and fsyncs them and every directory;
3. *publish*: after every root is prepared, the leader renames tmp -> `v<N>/` and fsyncs
   the parent. A committed version is a `v<N>/` directory that contains a manifest.

A crash before publish leaves only a tmp directory, which is never listed and which the
next writer removes (or rolls forward, if another root already published the same
save). Overwriting swaps the new directory in with one atomic RENAME_EXCHANGE, so the
old version stays committed until the new one is. Listing and deleting committed
versions is store.versions' (on any tier); the root's lock and identity are store.root's.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass

from ckpt.store.errors import VersionExistsError
from ckpt.store.fsio import DIR_MODE, entries, exchange_dirs, fsync_dir, fsync_dirs, write_durable
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest
from ckpt.store.removal import remove_tree
from ckpt.store.versions import TRASH_NAME, RootInfo, parse_root_info, version_dirname

__all__ = [
    "PreparedVersion",
    "tmp_dirname",
    "prepared_versions",
    "prepare",
    "publish",
    "remove_tmp",
    "empty_trash",
]

log = logging.getLogger("ckpt")
_TMP = re.compile(r"^v(\d{12})\.tmp-([0-9a-f]{32})$")
_OLD = re.compile(r"^(v\d{12})\.old-")


def tmp_dirname(step: int, save_id: str) -> str:
    return f"{version_dirname(step)}.tmp-{save_id}"


@dataclass(frozen=True, slots=True)
class PreparedVersion:
    step: int
    save_id: str
    dirname: str
    has_manifest: bool  # prepared (manifest durable) rather than torn mid-write


def _tmp_root_info(path: str) -> RootInfo | None:
    try:
        with open(os.path.join(path, ROOT_INFO_NAME), "rb") as f:
            return parse_root_info(f.read())
    except OSError:
        return None


def prepared_versions(root: str) -> list[PreparedVersion]:
    """Unpublished tmp directories, with whether they reached the prepare phase.

    After an overwrite's RENAME_EXCHANGE the tmp name holds the *old* version (another
    save_id) until it is deleted; that is not a prepared save and must never be rolled
    forward, so a tmp directory counts as prepared only if its root info names its save.
    """
    out = []
    for e in entries(root):
        m = _TMP.match(e.name)
        if m:
            info = _tmp_root_info(e.path) if os.path.isfile(os.path.join(e.path, MANIFEST_NAME)) else None
            has = info is not None and info.save_id == m.group(2)
            out.append(PreparedVersion(int(m.group(1)), m.group(2), e.name, has))
    return sorted(out, key=lambda p: p.step)


def prepare(tmp_dir: str, manifest: Manifest, writers: list[int], dirs: list[str], raw: bytes | None = None) -> None:
    """Phase 2 on one root: make the root info and the manifest durable, manifest last.
    `raw`: the manifest's bytes, where the caller has them (its parse is `manifest`)."""
    info = RootInfo(
        manifest.save_id,
        manifest.step,
        manifest.world_size,
        tuple(writers),
        manifest.keys,
        manifest.created,
        manifest.partial,
    )
    write_durable(os.path.join(tmp_dir, ROOT_INFO_NAME), info.to_json())
    fsync_dirs(dirs)
    write_durable(os.path.join(tmp_dir, MANIFEST_NAME), manifest.to_json() if raw is None else raw)
    fsync_dir(tmp_dir)


def publish(root: str, tmp_name: str, step: int, *, overwrite: bool) -> None:
    """Phase 3 on one root: rename tmp to v<N> atomically and fsync the root.
    VersionExistsError if v<N> exists and `overwrite` is not asked for."""
    tmp = os.path.join(root, tmp_name)
    final = os.path.join(root, version_dirname(step))
    if os.path.lexists(final) and not _is_version(final):
        # Damaged (see versions.damaged_entries): no restore can use it, and leaving it would
        # block this step forever. It goes into the trash like any deletion.
        log.warning("%s: replacing %s, which is no committed version", root, version_dirname(step))
        _discard(root, final)
    if os.path.isdir(final):
        if not overwrite:
            raise VersionExistsError(f"step {step} is already committed in {root}")
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
        remove_tree(aside, ignore_errors=True)
        return
    os.rename(tmp, final)
    fsync_dir(root)


def _is_version(path: str) -> bool:
    return not os.path.islink(path) and os.path.isdir(path) and os.path.lexists(os.path.join(path, MANIFEST_NAME))


def remove_tmp(root: str, tmp_name: str) -> None:
    """Best effort: it runs while a failed save unwinds, where an error of its own (the disk
    is gone) would replace the save's error; what it cannot remove, the next open does."""
    try:
        _discard(root, os.path.join(root, tmp_name))
    except OSError as e:
        log.warning("cannot remove the unfinished save %s in %s: %s", tmp_name, root, e.strerror or e)


def _discard(root: str, path: str) -> None:
    """Move into the trash with one rename, then delete: a crash mid-delete leaves only trash."""
    if not os.path.lexists(path):
        return
    trash = os.path.join(root, TRASH_NAME)
    os.makedirs(trash, mode=DIR_MODE, exist_ok=True)
    target = os.path.join(trash, f"{os.path.basename(path)}.del-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, target)  # a link moves itself, never its target
    except FileNotFoundError:
        return  # removed meanwhile
    if os.path.islink(target) or not os.path.isdir(target):
        os.unlink(target)
        return
    remove_tree(target, ignore_errors=True)


def empty_trash(root: str) -> None:
    """Finish interrupted deletions and overwrites (the caller holds the root lock): an
    overwrite that died between its two renames gets its old version back."""
    trash = os.path.join(root, TRASH_NAME)
    for e in entries(trash):
        m = _OLD.match(e.name)
        if m and not os.path.exists(os.path.join(root, m.group(1))):
            os.rename(e.path, os.path.join(root, m.group(1)))
            fsync_dir(root)
            continue
        if os.path.islink(e.path) or not os.path.isdir(e.path):
            os.unlink(e.path)
            continue
        remove_tree(e.path, ignore_errors=True)
