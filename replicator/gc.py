"""Garbage collection of versions, per tier, crash-safe.

Local roots: a version is unpublished with one rename into the root's trash (then the
root is fsynced) before its files are deleted, so a GC killed at any point leaves no
half-deleted version that still looks committed; the trash is emptied on the next open.
Remote (fsspec) tiers have no rename: a `.deleting` marker is written, then the manifest
is removed (the version is invisible from then on), then the rest, the marker last; a
later GC finishes any directory that carries the marker. Directories without a manifest
or a marker are uploads in progress and are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ckpt.replicator.policy import Policy, VersionInfo, plan_deletions
from ckpt.store import commit, objstore
from ckpt.store.faults import fault_point
from ckpt.store.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from ckpt.restore.tiers import RemoteTier

__all__ = ["GcResult", "gc_local", "gc_remote", "local_versions", "remote_versions"]

log = logging.getLogger("ckpt.replicator")
DELETING = ".deleting"


@dataclass(frozen=True)
class GcResult:
    kept: list[int]
    deleted: list[int]


def local_versions(root: str, redundant: Iterable[int] | None = None) -> list[VersionInfo]:
    """VersionInfo of every committed version of a local root; `redundant` = steps whose
    required copies are verified (None: copies are not required)."""
    ok = None if redundant is None else set(redundant)
    out = []
    for step in commit.committed_steps(root):
        try:
            m = commit.read_manifest(root, step)
            intact, created, tagged = True, m.created, bool(m.meta.get("milestone"))
        except Exception:  # noqa: BLE001 - an unreadable version is simply not intact
            intact, created, tagged = False, 0.0, False
        out.append(VersionInfo(step, created, intact, tagged, ok is None or step in ok))
    return out


def gc_local(
    root: str,
    policy: Policy,
    *,
    redundant: Iterable[int] | None = None,
    pinned: Iterable[int] = (),
    dry_run: bool = False,
    versions: list[VersionInfo] | None = None,
) -> GcResult:
    """Delete what `policy` does not keep (see policy.plan_deletions for what is never
    deleted). `versions`: local_versions(root, redundant), if the caller has them already."""
    versions = local_versions(root, redundant) if versions is None else versions
    pins = set(pinned) | commit.pinned_steps(root)  # versions a restore is reading right now
    doomed = plan_deletions(versions, policy, pinned=pins, require_redundant=redundant is not None)
    deleted = list(doomed) if dry_run else []
    for step in [] if dry_run else doomed:
        with commit.deleting(root, step) as free:  # a reader may have pinned it since
            if not free:
                log.info("gc %s: step %d is being read; kept", root, step)
                continue
            fault_point("gc-delete")
            commit.delete_version(root, step)
        deleted.append(step)
        log.info("gc %s: deleted step %d", root, step)
    return GcResult([v.step for v in versions if v.step not in deleted], deleted)


def gc_remote(
    url: str, policy: Policy, *, storage_options: dict[str, object] | None = None, dry_run: bool = False
) -> GcResult:
    from ckpt.restore.tiers import RemoteTier

    tier = RemoteTier(url, storage_options)
    fs, prefix = tier.fs, tier.prefix
    if not dry_run:
        tier._call("finish interrupted deletions", lambda: _finish_interrupted(fs, prefix))
    versions = _remote_versions(tier)
    doomed = plan_deletions(versions, policy, require_redundant=False)
    for step in [] if dry_run else doomed:
        vdir = objstore.join(prefix, commit.version_dirname(step))
        if not tier._call("mark a deletion", partial(_mark, fs, vdir)):
            continue
        fault_point("gc-delete")
        tier._call("delete a version", partial(_remove_marked, fs, vdir))
        log.info("gc %s: deleted step %d", objstore.redact(url, storage_options), step)
    return GcResult([v.step for v in versions if v.step not in doomed], doomed)


def remote_versions(url: str, storage_options: dict[str, object] | None = None) -> list[VersionInfo]:
    """VersionInfo of every committed version of a remote tier."""
    from ckpt.restore.tiers import RemoteTier

    return _remote_versions(RemoteTier(url, storage_options))


def _remote_versions(tier: RemoteTier) -> list[VersionInfo]:
    versions = []
    for c in tier.committed():
        try:
            m = tier.manifest(c.step)
            versions.append(VersionInfo(c.step, m.created, True, bool(m.meta.get("milestone"))))
        except Exception:  # noqa: BLE001
            versions.append(VersionInfo(c.step, 0.0, False))
    return versions


def _finish_interrupted(fs: object, prefix: str) -> None:
    try:
        names = fs.ls(prefix, detail=False)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return
    for d in names:
        if fs.exists(objstore.join(d, DELETING)):  # type: ignore[attr-defined]
            _remove_marked(fs, d)
            log.info("gc: finished an interrupted deletion of %s", os.path.basename(d.rstrip("/")))


def _mark(fs: Any, vdir: str) -> bool:
    """Write the `.deleting` marker; False if another GC (another node's replicator) is
    deleting the directory at this very moment, which made the write fail."""
    try:
        objstore.put_durable(fs, objstore.join(vdir, DELETING), b"")
    except (FileNotFoundError, FileExistsError):  # the directory or the temp file came and went
        return False
    return True


def _remove_marked(fs: Any, vdir: str) -> None:
    """Delete a version directory that carries the `.deleting` marker: the manifest first
    (the version is no longer listed), the marker last. A GC killed at any point leaves a
    marked directory that the next GC finishes (never one that looks like an upload in
    progress), and GCs racing on one version (every node's replicator collects the shared
    remote) find files already deleted by the other, which is no error."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(objstore.join(vdir, MANIFEST_NAME))
    try:
        rest = [p for p in fs.find(vdir) if p.rstrip("/").rsplit("/", 1)[-1] != DELETING]
    except FileNotFoundError:
        rest = []
    try:
        if rest:
            fs.rm(rest)  # one batch where the store has batch deletes
    except FileNotFoundError:
        for p in rest:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(p)
    fault_point("gc-mid-remove")
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(objstore.join(vdir, DELETING))
    try:
        fs.rm(vdir, recursive=True)  # what is left: the empty directories of a local filesystem
    except (FileNotFoundError, IsADirectoryError):
        pass  # gone, or made again meanwhile by another GC's marker (that GC finishes)
    except OSError as e:  # something new in it: another GC's marker, or an upload (left alone)
        if e.errno != errno.ENOTEMPTY:
            raise
