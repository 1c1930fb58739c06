"""Garbage collection of versions, per tier, crash-safe.

Local roots: a version is unpublished with one rename into the root's trash (then the
root is fsynced) before its files are deleted, so a GC killed at any point leaves no
half-deleted version that still looks committed; the trash is emptied on the next open.
Remote (fsspec) tiers have no rename: a `.deleting` marker is written, then the manifest
is removed (the version is invisible from then on), then the rest; a later GC finishes
any directory that carries the marker. Directories without a manifest or a marker are
uploads in progress and are left alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from replicator.policy import Policy, VersionInfo, plan_deletions
from store import commit, objstore
from store.faults import fault_point
from store.manifest import MANIFEST_NAME

__all__ = ["GcResult", "gc_local", "gc_remote", "local_versions"]

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
) -> GcResult:
    versions = local_versions(root, redundant)
    pins = set(pinned) | commit.pinned_steps(root)  # versions a restore is reading right now
    doomed = plan_deletions(versions, policy, pinned=pins, require_redundant=redundant is not None)
    for step in [] if dry_run else doomed:
        fault_point("gc-delete")
        commit.delete_version(root, step)
        log.info("gc %s: deleted step %d", root, step)
    return GcResult([v.step for v in versions if v.step not in doomed], doomed)


def gc_remote(
    url: str, policy: Policy, *, storage_options: dict[str, object] | None = None, dry_run: bool = False
) -> GcResult:
    from restore.tiers import RemoteTier

    tier = RemoteTier(url, storage_options)
    fs, prefix = tier.fs, tier.prefix
    if not dry_run:
        tier._call("finish interrupted deletions", lambda: _finish_interrupted(fs, prefix))
    versions = []
    for c in tier.committed():
        try:
            m = tier.manifest(c.step)
            versions.append(VersionInfo(c.step, m.created, True, bool(m.meta.get("milestone"))))
        except Exception:  # noqa: BLE001
            versions.append(VersionInfo(c.step, 0.0, False))
    doomed = plan_deletions(versions, policy, require_redundant=False)
    for step in [] if dry_run else doomed:
        vdir = objstore.join(prefix, commit.version_dirname(step))
        tier._call("mark a deletion", partial(objstore.put_durable, fs, objstore.join(vdir, DELETING), b""))
        fault_point("gc-delete")
        tier._call("delete a manifest", partial(fs.rm_file, objstore.join(vdir, MANIFEST_NAME)))  # invisible now
        tier._call("delete a version", partial(fs.rm, vdir, recursive=True))
        log.info("gc %s: deleted step %d", objstore.redact(url, storage_options), step)
    return GcResult([v.step for v in versions if v.step not in doomed], doomed)


def _finish_interrupted(fs: object, prefix: str) -> None:
    try:
        names = fs.ls(prefix, detail=False)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return
    for d in names:
        if fs.exists(objstore.join(d, DELETING)):  # type: ignore[attr-defined]
            try:
                fs.rm_file(objstore.join(d, MANIFEST_NAME))  # type: ignore[attr-defined]
            except FileNotFoundError:
                pass
            fs.rm(d, recursive=True)  # type: ignore[attr-defined]
            log.info("gc: finished an interrupted deletion of %s", os.path.basename(d.rstrip("/")))
