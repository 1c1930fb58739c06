"""Garbage collection of versions on any tier, crash-safe, and only of what it can judge.

Each committed version is judged by reading its manifest: one that parses and validates
is intact; one that fails its checksum or does not parse is damaged. Any other failure
(a timeout, a 503 SlowDown, an I/O error) proves nothing: that version is kept, and so
is the newest version proven intact, and the result lists it under `unjudged` (`ckpt gc`
then exits non-zero). The policy (replicator.policy) then says what else may go; the
deletion itself is store.versions' (unpublish first, then delete), under the readers'
pins of store.pins.

On the shared remote, version directories without a manifest are uploads in progress,
left alone, until they are provably abandoned: nothing written there for
`abandon_after_s` (a live replicator rewrites its part record every pass), no deletion
marker, and the collector wins the version's create-only commit claim, so no node can
commit it while it is deleted (replicator.publish checks again under that claim).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ckpt.replicator.policy import Policy, VersionInfo, plan_deletions
from ckpt.replicator.publish import GC_CLAIM
from ckpt.store.errors import (
    CkptError,
    CorruptVersionError,
    RootLockedError,
    TierUnavailableError,
    UnsupportedSchemaError,
    VersionNotFoundError,
)
from ckpt.store.faults import fault_delay, fault_point
from ckpt.store.manifest import MANIFEST_NAME
from ckpt.store.pins import deleting, pinned_steps
from ckpt.store.rank_file import rank_file_path
from ckpt.store.root import ROOT_ID_NAME, RootLock
from ckpt.store.tier import Tier, join_key
from ckpt.store.versions import (
    COMMIT_CLAIM,
    DELETING_MARKER,
    RootInfo,
    committed_steps,
    damaged_entries,
    delete_damaged,
    delete_uncommitted,
    delete_version,
    finish_deletions,
    parse_version_dirname,
    read_manifest,
    read_manifest_facts,
    root_info_verdict,
    version_dirname,
)

__all__ = ["GcResult", "judge", "collect", "collect_abandoned", "collect_damaged", "note_whole", "spare_candidate"]

log = logging.getLogger("ckpt.replicator")


@dataclass(frozen=True)
class GcResult:
    kept: list[int]
    deleted: list[int]
    unjudged: dict[int, str] = field(default_factory=dict)  # versions that could not be read, and why (all kept)
    abandoned: list[int] = field(default_factory=list)  # uncommitted upload directories collected
    damaged: list[int] = field(default_factory=list)  # entries named like versions that are none, collected


def judge(tier: Tier, redundant: Mapping[int, str | None] | None = None) -> tuple[list[VersionInfo], dict[int, str]]:
    """VersionInfo of every committed version of `tier`, and the ones that could not be
    read (intact None), with why. `redundant`: steps whose required copies are verified,
    each with the save_id of the save they are copies of (None: of any save of the step);
    a version that is another save of the step has none yet. None: copies are not required."""
    ok = redundant
    versions, unjudged = [], {}
    for step in committed_steps(tier):
        try:
            m = read_manifest_facts(tier, step)
        except VersionNotFoundError:
            continue  # deleted (another GC) since the listing
        except (TierUnavailableError, OSError, UnsupportedSchemaError) as e:  # no proof of damage
            unjudged[step] = f"{type(e).__name__}: {e}"
            log.warning("gc %s: step %d cannot be read, kept: %s", tier.location, step, e)
            versions.append(VersionInfo(step, 0.0, None, False, ok is None or step in ok))
            continue
        except CorruptVersionError:  # proven: a checksum or parse failure
            versions.append(VersionInfo(step, 0.0, False, False, ok is None or step in ok))
            continue
        # Its root info, as a restore's listing judges it: a version without a valid one
        # cannot be chosen, so it is no intact version to keep in place of older ones; nor is
        # one whose files are not all there. A save found whole once (or written whole by
        # this process) is not judged again (a pass judges every version).
        seen = (_place(tier), step, m.save_id)
        try:
            info = True if seen in _VALID_ROOT_INFO else root_info_verdict(tier, step)
        except TierUnavailableError as e:
            info = e
        if isinstance(info, OSError):
            unjudged[step] = f"{type(info).__name__}: {info}"
            log.warning("gc %s: step %d's root info cannot be read, kept: %s", tier.location, step, info)
            versions.append(VersionInfo(step, m.created, None, m.milestone, ok is None or step in ok))
            continue
        if isinstance(info, str):
            if not _still_published(tier, step, m.save_id):
                continue  # unpublished, or replaced by an overwrite, since its manifest was read: not damage
            versions.append(VersionInfo(step, m.created, False, m.milestone, ok is None or step in ok))
            continue
        if isinstance(info, RootInfo) and seen not in _WRITTEN_WHOLE:  # (not yet judged: its files too)
            try:
                gap = _files_out_of_place(tier, step, set(info.writers))
            except VersionNotFoundError:
                continue  # deleted (another GC) since the listing
            except (CkptError, OSError) as e:  # no proof of damage
                unjudged[step] = f"{type(e).__name__}: {e}"
                log.warning("gc %s: step %d's files cannot be examined, kept: %s", tier.location, step, e)
                versions.append(VersionInfo(step, m.created, None, m.milestone, ok is None or step in ok))
                continue
            if gap is not None:
                if not _still_published(tier, step, m.save_id):
                    continue  # unpublished, or replaced by an overwrite, meanwhile: not damage
                log.warning("gc %s: step %d is damaged, %s", tier.location, step, gap)
                versions.append(VersionInfo(step, m.created, False, m.milestone, ok is None or step in ok))
                continue
        _remember(seen)
        copied = ok is None or (step in ok and ok[step] in (None, m.save_id))
        versions.append(VersionInfo(step, m.created, True, m.milestone, copied, m.keys, m.partial))
    # A version directory that lost its manifest is a damaged version (its chunks are still
    # there): the policy judges it as such (keep_last counts it), not deleted at sight.
    judged = {v.step for v in versions}
    for d in damaged_entries(tier):
        if d.lost_manifest and d.step not in judged:
            versions.append(VersionInfo(d.step, 0.0, False, False, ok is None or d.step in ok))
    versions.sort(key=lambda v: v.step)
    return versions, unjudged


# (tier, step, save id) whose root info was judged valid and files found in place: judged
# once per save, not once a pass; and those whose files this process wrote whole (note_whole).
_VALID_ROOT_INFO: OrderedDict[tuple[str, int, str], None] = OrderedDict()
_WRITTEN_WHOLE: OrderedDict[tuple[str, int, str], None] = OrderedDict()
_VALID_LOCK = threading.Lock()
_VALID_KEPT = 4096


def _place(tier: Tier) -> str:
    local = tier.local_path("")
    return tier.location if local is None else os.path.realpath(local)


def _remember(seen: tuple[str, int, str], into: OrderedDict[tuple[str, int, str], None] = _VALID_ROOT_INFO) -> None:
    with _VALID_LOCK:
        into[seen] = None
        into.move_to_end(seen)
        while len(into) > _VALID_KEPT:
            into.popitem(last=False)


def note_whole(root: str, step: int, save_id: str) -> None:
    """A version this process has just written whole under the local root `root`: judge
    takes its files as checked, without reading its manifest again (its root info is read
    once, as any version's)."""
    _remember((os.path.realpath(root), step, save_id), _WRITTEN_WHOLE)


def _files_out_of_place(tier: Tier, step: int, writers: set[int]) -> str | None:
    """On a local tier, what keeps the version's files from being all there as its manifest
    says (a chunk or rank file of this root missing, of another size, or not a regular
    file); None where they are, or the tier is no local one. Sizes only, a stat per file:
    the bytes are `ckpt verify`'s. A version whose chunks are gone is no version to delete
    older ones for (its manifest alone made it intact)."""
    top = tier.local_path(version_dirname(step))
    if top is None:
        return None
    manifest = read_manifest(tier, step)
    files = [(rank_file_path(r), -1) for r in sorted(writers)] if manifest.rank_files else []
    for array in manifest.arrays.values():
        for chunk in array.iter_chunks():
            if chunk.inline is None and chunk.writer in writers:
                files.append((array.chunk_path(chunk), chunk.nbytes))
    for rel, size in files:
        try:
            st = os.lstat(os.path.join(top, rel))
        except FileNotFoundError:
            return f"{rel} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{rel} is no regular file"
        if size >= 0 and st.st_size != size:
            return f"{rel} holds {st.st_size} bytes, the manifest says {size}"
    return None


def spare_candidate(tier: Tier, policy: Policy, redundant: Mapping[int, str | None] | None = None) -> int | None:
    """The oldest version `policy` would delete that is intact, judged now: the tree a save
    may overwrite in place (store.spare); a damaged one (a chunk path that is a link or a
    directory) would fail that save. None: no such version."""
    judged = judge(tier, redundant)
    doomed = collect(tier, policy, redundant=redundant, dry_run=True, versions=judged).deleted
    whole = {v.step for v in judged[0] if v.intact}
    return min((s for s in doomed if s in whole), default=None)


def _still_published(tier: Tier, step: int, save_id: str) -> bool:
    """Whether the save whose manifest judge read is still the committed one of `step`."""
    try:
        return read_manifest_facts(tier, step).save_id == save_id
    except (CkptError, OSError):
        return False


def collect(
    tier: Tier,
    policy: Policy,
    *,
    redundant: Mapping[int, str | None] | None = None,
    pinned: Iterable[int] = (),
    dry_run: bool = False,
    abandon_after_s: float | None = None,
    versions: tuple[list[VersionInfo], dict[int, str]] | None = None,
    confirm: Callable[[int], bool] | None = None,
) -> GcResult:
    """Delete what `policy` does not keep (see policy.plan_deletions for what is never
    deleted). `versions`: judge(tier, redundant), if the caller has it already. With
    `abandon_after_s`, also collect abandoned uploads (the shared remote). `confirm(step)`,
    just before a version is deleted: False keeps it (its copies are not where `redundant`
    says)."""
    if not dry_run:
        finish_deletions(tier)
    judged, unjudged = judge(tier, redundant) if versions is None else versions
    pins = set(pinned) | pinned_steps(tier)  # versions a restore is reading right now
    doomed = plan_deletions(judged, policy, pinned=pins, require_redundant=redundant is not None)
    lost = {d.step for d in damaged_entries(tier) if d.lost_manifest} if any(not v.intact for v in judged) else set()
    doomed_lost = {s for s in doomed if s in lost}  # collected with the other damaged entries
    doomed = [s for s in doomed if s not in lost]
    deleted = list(doomed) if dry_run else []
    for step in [] if dry_run else doomed:
        if confirm is not None and not confirm(step):
            continue
        with deleting(tier, step) as free:  # a reader may have pinned it since
            if not free:
                log.info("gc %s: step %d is being read; kept", tier.location, step)
                continue
            delete_version(tier, step)
        deleted.append(step)
        log.info("gc %s: deleted step %d", tier.location, step)
    abandoned = [] if abandon_after_s is None else collect_abandoned(tier, abandon_after_s, dry_run=dry_run)
    damaged = collect_damaged(tier, dry_run=dry_run, lost=doomed_lost)
    gone = set(deleted) | set(damaged)
    return GcResult([v.step for v in judged if v.step not in gone], deleted, unjudged, abandoned, damaged)


def collect_damaged(tier: Tier, *, dry_run: bool = False, lost: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Delete the entries of a local root named like versions that are none (see
    versions.damaged_entries): files and links, and of the version directories that lost
    their manifest those of `lost` (the policy's to keep or not), holding the root's lock:
    never while a writer holds it (a running job replaces such an entry when it saves that
    step). The steps collected."""
    root = tier.local_path("")
    if root is None or not os.path.exists(os.path.join(root, ROOT_ID_NAME)):
        return []  # only a Checkpointer's root: its lock is what a writer takes (a replica or remote has none)
    if not any(not d.lost_manifest or d.step in lost for d in damaged_entries(tier)):
        return []  # the usual case: no lock taken, so no writer opening the root meets it
    lock = RootLock(root)
    try:
        lock.acquire()  # no writer opens the root (and publishes one of those steps) meanwhile
    except (RootLockedError, OSError):
        return []  # a writer holds it, or the lock file cannot be made (a read-only root)
    try:
        out = []
        for entry in damaged_entries(tier):
            if entry.lost_manifest and entry.step not in lost:
                continue
            if dry_run or delete_damaged(tier, entry):
                out.append(entry.step)
                what = "would remove" if dry_run else "removed"
                log.info("gc %s: %s %s (%s)", tier.location, what, entry.name, entry.why)
        return out
    finally:
        lock.release()


def collect_abandoned(
    tier: Tier, abandon_after_s: float, *, dry_run: bool = False, clock: Callable[[], float] = time.time
) -> list[int]:
    """Delete version directories without a manifest in which nothing was written for
    `abandon_after_s`, under the commit claim; the steps collected."""
    now = clock()
    out = []
    committed = set(committed_steps(tier))
    for name in tier.listdir(""):
        step = parse_version_dirname(name)
        if step is None or step in committed:
            continue
        objects = tier.find(name)
        if not objects or any(o.key.rsplit("/", 1)[-1] in (MANIFEST_NAME, DELETING_MARKER) for o in objects):
            continue  # committed since, or a deletion finish_deletions completes
        newest = max(o.mtime for o in objects)
        if newest <= 0 or now - newest < abandon_after_s:
            continue  # in progress (or its age is unknown)
        if dry_run:
            out.append(step)
            continue
        claim = join_key(name, COMMIT_CLAIM)
        listed = {o.key: (o.size, o.mtime) for o in objects if o.key != claim}
        previous: bytes | None = None
        try:
            tier.put_if_absent(claim, GC_CLAIM)
        except FileExistsError:
            # Take over only a claim that was in the listing, as old as the rest (its
            # committer died, or another collector holds it): one made since the listing is
            # a live committer's, which this collector must not overwrite.
            if claim not in {o.key for o in objects}:
                continue
            try:
                previous = tier.get(claim)
            except FileNotFoundError:
                continue
            tier.put(claim, GC_CLAIM)
        # A committer writes its part record before it reads the claim: one that came back
        # between the listing and this claim has written something since. Then back off,
        # and hand the claim back as it was.
        now_there = {o.key: (o.size, o.mtime) for o in tier.find(name) if o.key != claim}
        if now_there != listed or tier.exists(join_key(name, MANIFEST_NAME)):
            if previous is None:
                tier.delete(claim)
            elif previous != GC_CLAIM:
                tier.put(claim, previous)
            continue  # written or committed since the listing: not abandoned
        fault_delay("gc-abandoned")  # claimed, nothing deleted yet
        fault_point("gc-abandoned")
        delete_uncommitted(tier, name)
        out.append(step)
        log.info("gc %s: collected an abandoned upload of step %d (idle %.0f s)", tier.location, step, now - newest)
    return out
