"""Committing a copied version at a destination, the manifest last.

A *replica* destination (a copy of one source root on another disk) commits as soon as
its part is complete: its root.json lists the source's writer ranks. The *shared*
destination (the remote every node uploads to) gathers every node's part: each node
records its part (`parts/<i>.json`), and whichever node finds the parts covering every
rank commits.

Committing on the shared remote: claim the version with a create-only `.commit` holding
the save_id (a collector of abandoned uploads claims it with "gc", so the two exclude each
other); then, with the claim held, check that nothing is being deleted there and that
every chunk the manifest names is present at its size (what was checked before the claim
may have been collected since). A replica has one writer and no collector: no claim, and
its files stay exactly the source's. Then root.json; then the manifest, create-only. A
version at a destination is complete or invisible.
"""

from __future__ import annotations

import json
import logging

from ckpt.replicator.transfer import Transfer, missing_files, part_sizes
from ckpt.store.errors import ManifestError, StoppedError
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, parse_manifest
from ckpt.store.rank_file import rank_file_path
from ckpt.store.tier import Tier, join_key
from ckpt.store.versions import COMMIT_CLAIM, DELETING_MARKER, RootInfo, read_root_info, version_dirname

__all__ = ["GC_CLAIM", "clear_to_send", "committed_info", "publish", "publish_waiting"]

log = logging.getLogger("ckpt.replicator")
GC_CLAIM = b"gc"
PARTS = "parts"


def committed_info(tier: Tier, step: int) -> RootInfo | None:
    """The destination's root info if the version is committed there, else None."""
    name = version_dirname(step)
    if not tier.exists(join_key(name, MANIFEST_NAME)):
        return None
    return read_root_info(tier, step)


def _covered(tier: Tier, name: str, save_id: str) -> set[int]:
    """The ranks the recorded parts of this save cover."""
    covered: set[int] = set()
    for part in tier.listdir(join_key(name, PARTS)):
        try:
            doc = json.loads(tier.get(join_key(name, PARTS, part)))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("save_id") == save_id and isinstance(doc.get("writers"), list):
            covered |= {w for w in doc["writers"] if type(w) is int}
    return covered


def _claim(tier: Tier, name: str, save_id: str) -> bool:
    """Hold the version's commit claim for this save; False if a collector or another
    save of the same step holds it."""
    key = join_key(name, COMMIT_CLAIM)
    try:
        tier.put_if_absent(key, save_id.encode())
        return True
    except FileExistsError:
        try:
            holder = tier.get(key)
        except FileNotFoundError:  # released meanwhile (a collector finished): next pass
            return False
        return holder == save_id.encode()  # ours (a retried write, or another node of this save)


def _other_save_committed(tier: Tier, name: str, save_id: str) -> bool:
    """Whether the destination holds this step committed by another save (its manifest's save_id)."""
    try:
        return parse_manifest(tier.get(join_key(name, MANIFEST_NAME))).save_id != save_id
    except FileNotFoundError:
        return False
    except ManifestError:
        return True


def _part_key(name: str, part_index: int) -> str:
    return join_key(name, PARTS, f"{part_index}.json")


def _records_save(tier: Tier, key: str, save_id: str) -> bool:
    """Whether the part record at `key` is there and names this save."""
    try:
        doc = json.loads(tier.get(key))
    except (FileNotFoundError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("save_id") == save_id


def publish_waiting(t: Transfer, writers: list[int], part_index: int) -> bool | None:
    """A pass over a version whose part this node sent and recorded in an earlier pass, on
    the shared remote: it rewrites its record (a live upload, to the collector of abandoned
    ones) and reads the parts' records; it commits once they cover every rank. None where
    its record is gone or names another save (a committer found files of the part missing
    and withdrew it, or the step was saved again): the part is to be sent in full.
    Waiting this way costs a listing of the records (one per node), not of the version's
    files (one per chunk of every node): at thousands of nodes, every node but the last
    waits on every version."""
    tier, name, m = t.dest.tier, t.name, t.manifest
    key = _part_key(name, part_index)
    if not _records_save(tier, key, m.save_id):
        return None
    tier.put(key, json.dumps({"save_id": m.save_id, "writers": sorted(writers)}).encode())
    if not _covered(tier, name, m.save_id) >= set(range(m.world_size)):
        return False
    return publish(t, writers, part_index, part_sizes(t.source, t.step))


def _withdraw_parts(t: Transfer, missing: list[str], part_index: int) -> None:
    """The records of the parts whose files are missing, withdrawn: their nodes send those
    parts in full (listing what is there) on their next pass. A file every part holds (the
    zarr.json documents) is this node's to send."""
    tier, name, m = t.dest.tier, t.name, t.manifest
    writers = {a.chunk_path(c): c.writer for a in m.arrays.values() for c in a.iter_chunks() if c.inline is None}
    writers.update({rank_file_path(r): r for r in range(len(m.rank_files))})
    parts = {m.root_of(writers[rel]) if rel in writers else part_index for rel in missing}
    for part in sorted(parts):
        key = _part_key(name, part)
        if _records_save(tier, key, m.save_id):
            log.warning("%s: withdrawing part %d's record: it is sent again in full", t.where(), part)
            tier.delete(key)


def clear_to_send(t: Transfer, part_index: int) -> bool:
    """Whether this node may send its part of the save to the shared remote now. The step's
    directory there may hold another save of the step (the source saved it again): this
    node's part record of that save is withdrawn first, as its files are about to hold this
    save's bytes. Then no committer of that save passes its check of the records (a
    committer claims, then checks): one that claimed before shows in the claim, and
    nothing is sent while it may be committing over the files this upload would change,
    unless that save's records no longer cover every rank. Then it can never commit (this
    node's part is not among them, and never will be): its claim is stale, left by a
    committer that found a record withdrawn, and it is removed. A committer of it that
    checked the records before the withdrawal finds the claim gone after writing its
    manifest, and unpublishes. Nothing is sent while a collector holds the claim."""
    tier, name, save_id = t.dest.tier, t.name, t.manifest.save_id
    key = _part_key(name, part_index)
    if tier.exists(key) and not _records_save(tier, key, save_id):
        log.info("%s: withdrawing this node's part record of another save of step %d", t.where(), t.step)
        tier.delete(key)
    claim = join_key(name, COMMIT_CLAIM)
    try:
        holder = tier.get(claim)
    except FileNotFoundError:
        return True
    if holder == save_id.encode():
        return True
    if holder != GC_CLAIM and not _covered(tier, name, holder.decode(errors="replace")) >= set(
        range(t.manifest.world_size)
    ):
        log.info("%s: removing the stale commit claim of another save of step %d", t.where(), t.step)
        tier.delete(claim)
        return True
    log.warning("%s: another save of step %d or a collector holds it; not sent now", t.where(), t.step)
    return False


def _still_ours(tier: Tier, name: str, save_id: str) -> bool:
    try:
        return tier.get(join_key(name, COMMIT_CLAIM)) == save_id.encode()
    except FileNotFoundError:
        return False


def publish(t: Transfer, writers: list[int], part_index: int, sizes: dict[str, int]) -> bool:
    """Commit the copied part; True once the destination holds the version committed (a
    replica: this part), False while other nodes' parts are missing or the destination is
    busy (collected, or another save of the step). `sizes`: the files copy_files sent."""
    tier, name, m = t.dest.tier, t.name, t.manifest
    if t.dest.kind == "shared":
        part = json.dumps({"save_id": m.save_id, "writers": sorted(writers)}).encode()
        tier.put(_part_key(name, part_index), part)
        if not _covered(tier, name, m.save_id) >= set(range(m.world_size)):
            return False  # other nodes' parts are still on their way; whoever completes the set commits
        holders = tuple(range(m.world_size))
    else:
        holders = tuple(sorted(writers))
    if t.dest.kind == "shared" and not _claim(tier, name, m.save_id):
        log.warning("%s: held by a collector or another save of step %d; not committed now", t.where(), t.step)
        return False
    return _commit(t, holders, part_index, sizes)


def _commit(t: Transfer, holders: tuple[int, ...], part_index: int, sizes: dict[str, int]) -> bool:
    tier, name, m = t.dest.tier, t.name, t.manifest
    # With the claim held nothing is collected here: what the checks find stays.
    if tier.exists(join_key(name, DELETING_MARKER)):
        return False
    if t.dest.kind == "shared" and not _covered(tier, name, m.save_id) >= set(range(m.world_size)):
        return False
    expected = dict(sizes)
    held = set(holders)
    expected.update(
        {
            a.chunk_path(c): c.nbytes
            for a in m.arrays.values()
            for c in a.iter_chunks()
            if c.inline is None and c.writer in held
        }
    )
    expected.update({rank_file_path(r): ref.size for r, ref in enumerate(m.rank_files) if r in held})
    missing = missing_files(tier, t.step, expected)
    if missing:
        log.warning(
            "%s: %d file(s) missing at commit time (%s...); sent again next pass", t.where(), len(missing), missing[0]
        )
        for rel in missing:
            t.journal.discard(rel)
        t.journal.save()
        if t.dest.kind == "shared":
            _withdraw_parts(t, missing, part_index)
        return False
    t.dest.check_disk()
    if _other_save_committed(tier, name, m.save_id):
        # Never rewrite root.json under another save's manifest: it would name this save.
        log.warning("%s already holds step %d from another save; not replaced", t.dest.tier.location, t.step)
        return False
    tier.put(
        join_key(name, ROOT_INFO_NAME),
        RootInfo(m.save_id, t.step, m.world_size, holders, m.keys, m.created, m.partial).to_json(),
    )
    if t.stop.is_set():
        raise StoppedError(f"stopped before committing {t.where()}")
    try:
        tier.put_if_absent(join_key(name, MANIFEST_NAME), m.to_json())
    except FileExistsError:
        try:
            existing = parse_manifest(tier.get(join_key(name, MANIFEST_NAME)))
        except ManifestError:
            existing = None
        if existing is None or existing.save_id != m.save_id:
            log.warning("%s already holds step %d from another save; not replaced", t.dest.tier.location, t.step)
            return False
    else:
        if t.dest.kind == "shared" and not _still_ours(tier, name, m.save_id):
            # A collector took the claim over while this committer was between its checks
            # and the manifest (a pause longer than the abandon age): it may be deleting
            # the files the manifest names. Unpublish; the next pass sends what is missing.
            log.warning("%s: the commit claim was taken over; step %d unpublished", t.where(), t.step)
            tier.delete(join_key(name, MANIFEST_NAME))
            return False
    tier.sync(name)
    t.journal.remove()
    return True
