"""What `ckpt ls` shows of a root: one row per version, with the replicator's status.

Every version directory gets a row, whatever state it is in: a manifest that cannot be
read (a failing disk, a store that does not answer) marks that row `unreadable` and the
listing goes on; one that fails its checks, or a version directory that lost its manifest
(store.versions.damaged_entries), marks it `damaged`. On a local root, the tmp
directories a dead writer left are listed as `incomplete` (a live writer's are saves in
flight, not versions).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ckpt._peer_status import peer_dirs, read_peer_status
from ckpt._timings import summarize
from ckpt.replicator.status import REMOTE_DONE, CopyState, read_status
from ckpt.store import commit
from ckpt.store.errors import CkptError, CorruptVersionError, TierUnavailableError, VersionNotFoundError
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest
from ckpt.store.root import writer_active
from ckpt.store.tier import Tier, join_key, open_tier
from ckpt.store.versions import (
    committed_steps,
    damaged_entries,
    full_steps,
    read_manifest,
    read_root_info,
    root_info_verdict,
    version_dirname,
)

__all__ = ["Row", "version_rows"]

Status = Literal["committed", "partial", "damaged", "unreadable", "incomplete"]
STATUS_HELP = {
    "partial": "this root holds some ranks' chunks; the other ranks' are on other roots",
    "damaged": "its manifest fails its checks, or it has none, or its root.json (gc removes it once retention does not keep it; a save of its step replaces it)",
    "unreadable": "its manifest or root.json could not be read",
    "incomplete": "a save that never committed (removed when a writer opens the root)",
}


@dataclass(frozen=True)
class Row:
    step: int
    status: Status
    detail: str = ""  # why damaged or unreadable; the directory of an incomplete save
    time: float | None = None  # commit time
    bytes: int | None = None
    world_size: int | None = None
    arrays: int | None = None
    writers_here: tuple[int, ...] = ()
    milestone: bool = False
    keys: tuple[str, ...] | None = None  # the top-level keys it holds, when not every key (params-only)
    partial: bool | None = None  # a params-only version (None: not recorded, or no manifest read)
    timings: dict[str, Any] = field(default_factory=dict)  # per phase: median, max and its rank (ckpt._timings)
    copies: dict[str, CopyState] | None = None  # the replicator's copies (None: no replicator ran)
    peers: dict[int, str] | None = None  # its peer copies by target root: "verified" or "failed" (ckpt._peers)
    remote: CopyState | None = None
    replicate_s: dict[str, float] = field(default_factory=dict)  # per copy: commit to verified
    lag_s: float | None = None  # commit to remote verified (or to now)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["writers_here"] = list(self.writers_here)
        doc["keys"] = None if self.keys is None else list(self.keys)
        return doc


def _timings(m: Manifest) -> dict[str, Any]:
    got = m.meta.get("timings")
    if isinstance(got, list):  # written before the summary: a row per rank
        return summarize(got, m.created)
    return dict(got) if isinstance(got, dict) else {}


def _committed_row(tier: Tier, step: int, m: Manifest) -> Row:
    info = read_root_info(tier, step)
    writers = info.writers if info is not None else ()
    whole = all(w in writers for w in range(m.world_size))
    return Row(
        step,
        "committed" if whole else "partial",
        time=m.created,
        bytes=m.total_bytes,
        world_size=m.world_size,
        arrays=len(m.arrays),
        writers_here=writers,
        milestone=bool(m.meta.get("milestone")),
        keys=m.keys,
        partial=m.partial,
        timings=_timings(m),
    )


def _only_some_keys(rows: list[Row]) -> list[Row]:
    """Rows keep `keys` only where they are params-only versions (store.versions.full_steps)."""
    read = [r for r in rows if r.keys is not None or r.partial is not None]
    full = full_steps(read)
    return [r if r.keys is None or r.step not in full else replace(r, keys=None) for r in rows]


def _with_status(row: Row, root: str, save_id: str, created: float) -> Row:
    try:
        status = read_status(root)
    except (CkptError, OSError):  # shown without its copies; a GC refuses to run on it
        return row
    entry = None if status is None else status.versions.get(row.step)
    if status is None or entry is None or entry.save_id != save_id:
        return row
    # the copies on the destinations the replicator requires now: those the GC counts
    copies = {u: c for u, c in entry.copies.items() if status.replicas is None or u in status.replicas}
    done = [*copies.items(), *([("remote", entry.remote)] if entry.remote is not None else [])]
    replicate_s = {dest: round(c.at - created, 3) for dest, c in done if c.state == "verified"}
    lag = None
    if entry.remote is not None:
        until = entry.remote.at if entry.remote.state in REMOTE_DONE else time.time()  # done: lag no longer grows
        lag = round(max(0.0, until - created), 3)
    return Row(**{**row.__dict__, "copies": copies, "remote": entry.remote, "replicate_s": replicate_s, "lag_s": lag})


def peer_copies_held(root: str) -> dict[str, list[int]]:
    """The peer copies this root's disk holds for other roots: source root's id -> steps."""
    return {source: committed_steps(open_tier(path)) for source, path in peer_dirs(root).items()}


def version_rows(tier: Tier) -> list[Row]:
    """Every version of the tier, oldest first (see the module docstring)."""
    rows = []
    root = tier.local_path("")
    peer_status = {} if root is None else read_peer_status(root)
    for step in committed_steps(tier):
        try:
            m = read_manifest(tier, step)
        except VersionNotFoundError:
            continue  # deleted (GC) since the listing
        except CorruptVersionError as e:
            rows.append(Row(step, "damaged", str(e)))
            continue
        except (TierUnavailableError, OSError) as e:
            rows.append(Row(step, "unreadable", str(e)))
            continue
        row = _committed_row(tier, step, m)
        if not row.writers_here and not tier.exists(join_key(version_dirname(step), MANIFEST_NAME)):
            continue  # GC unpublished it between the manifest and the root info: gone, not partial
        if not row.writers_here:  # its root info as a restore judges it: damaged, or unreadable
            verdict = root_info_verdict(tier, step)
            if isinstance(verdict, OSError):
                rows.append(Row(step, "unreadable", f"{ROOT_INFO_NAME}: {verdict.strerror or verdict}"))
                continue
            if isinstance(verdict, str):
                rows.append(Row(step, "damaged", verdict))
                continue
        if root is not None:
            row = _with_status(row, root, m.save_id, m.created)
            row = replace(row, peers=peer_status.get(step))
        rows.append(row)
    rows += [Row(d.step, "damaged", d.why) for d in damaged_entries(tier)]
    if root is not None and not writer_active(root):
        rows += [Row(p.step, "incomplete", p.dirname) for p in commit.prepared_versions(root)]
    return sorted(_only_some_keys(rows), key=lambda r: r.step)
