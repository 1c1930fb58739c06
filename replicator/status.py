"""What the replicator has done for a source root: a status file beside the root
(`.replicator/status.json`), read by `ckpt ls`, `ckpt gc` and the next replicator start.

It records, per committed version, the state of each copy and of the remote upload, and
the replicator's requirements (how many replica copies, whether a remote), so that the
one rule of "fully replicated" (`redundant_steps`) gives the same answer to the
replicator's own GC and to `ckpt gc`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ckpt.store.errors import CkptError
from ckpt.store.fsio import makedirs_within, replace_durable

__all__ = [
    "STATE_DIR",
    "State",
    "CopyState",
    "VersionStatus",
    "Status",
    "REMOTE_DONE",
    "read_status",
    "write_status",
    "redundant_steps",
    "redundant_saves",
    "copies_done",
    "remote_done",
]

STATE_DIR = ".replicator"
State = Literal["verified", "pending", "failed", "waiting for other nodes", "expired"]
"""verified: made and read back; pending: not made yet (the destination was busy being read,
or a pass stopped before it: a Checkpointer's close() at drain_timeout_s); failed: the last
try failed, or was not made because its destination failed earlier in the pass (`error`
says which); waiting for other nodes: this node's part is on the remote; expired: the
remote's retention deleted it. Anything but verified and expired is tried again."""
REMOTE_DONE: frozenset[str] = frozenset({"verified", "expired"})
"""Remote states of a version that need nothing more: its remote copy is verified, or the
remote's retention deleted it (or would delete it on arrival) while this node's part waited."""


@dataclass(frozen=True, slots=True)
class CopyState:
    """One copy (a replica, or the remote upload) of one version."""

    state: State
    at: float  # unix time of the last change
    url: str = ""  # for the remote: which one (credentials scrubbed); a status of another --to does not count
    error: str = ""  # why it failed


@dataclass
class VersionStatus:
    save_id: str
    created: float  # the version's commit time
    copies: dict[str, CopyState] = field(default_factory=dict)  # by destination URL
    remote: CopyState | None = None


@dataclass
class Status:
    """The replicator's record for one source root (only the replicator thread changes it)."""

    versions: dict[int, VersionStatus] = field(default_factory=dict)
    required_copies: int = 0  # replica copies every version needs (distinct disks found)
    remote: str | None = None  # the remote every version must reach, credentials scrubbed
    disks: dict[str, str] = field(default_factory=dict)  # replica root -> its disk identity, once proven
    updated: float = 0.0
    # The destinations of the required copies now (None: written before they were recorded,
    # every verified copy counts): a copy on a replica root no longer configured counts for
    # nothing, or a GC would delete a version whose only copy went with a dead disk.
    replicas: list[str] | None = None


def _copy_doc(c: CopyState) -> dict[str, Any]:
    return {k: v for k, v in (("state", c.state), ("at", c.at), ("url", c.url), ("error", c.error)) if v != ""}


def _copy(doc: Any) -> CopyState | None:
    if not isinstance(doc, dict) or doc.get("state") not in (
        "verified",
        "pending",
        "failed",
        "waiting for other nodes",
        "expired",
    ):
        return None
    at = doc.get("at", 0.0)
    return CopyState(
        doc["state"],
        float(at) if isinstance(at, (int, float)) else 0.0,
        str(doc.get("url", "")),
        str(doc.get("error", "")),
    )


def to_json(status: Status) -> dict[str, Any]:
    return {
        "updated": status.updated,
        "required_copies": status.required_copies,
        "remote": status.remote,
        "disks": status.disks,
        "replicas": status.replicas,
        "versions": {
            str(step): {
                "save_id": v.save_id,
                "created": v.created,
                "copies": {url: _copy_doc(c) for url, c in v.copies.items()},
                "remote": None if v.remote is None else _copy_doc(v.remote),
            }
            for step, v in sorted(status.versions.items())
        },
    }


def from_json(doc: Any) -> Status:
    """The status a file holds; what does not parse is left out (the replicator redoes it)."""
    if not isinstance(doc, dict):
        return Status()
    versions: dict[int, VersionStatus] = {}
    for step, v in (doc.get("versions") or {}).items():
        if not (isinstance(step, str) and step.isdigit() and isinstance(v, dict) and isinstance(v.get("save_id"), str)):
            continue
        copies = {u: c for u, c in ((u, _copy(d)) for u, d in (v.get("copies") or {}).items()) if c is not None}
        created = v.get("created", 0.0)
        versions[int(step)] = VersionStatus(
            v["save_id"], float(created) if isinstance(created, (int, float)) else 0.0, copies, _copy(v.get("remote"))
        )
    disks = doc.get("disks")
    required = doc.get("required_copies")
    remote = doc.get("remote")
    replicas = doc.get("replicas")
    return Status(
        versions,
        required if type(required) is int else 0,
        remote if isinstance(remote, str) else None,
        {str(k): str(v) for k, v in disks.items()} if isinstance(disks, dict) else {},
        float(doc.get("updated") or 0.0),
        [str(u) for u in replicas] if isinstance(replicas, list) else None,
    )


def status_path(root: str) -> str:
    return os.path.join(root, STATE_DIR, "status.json")


def read_status(root: str) -> Status | None:
    """The status of a source root; None where no replicator has written one. A status
    that cannot be read raises OSError (an I/O error, a directory in its place), and one
    that is not JSON raises CkptError: neither reads as "no replicator ran", under which a
    GC would require no copies."""
    path = status_path(root)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        return from_json(json.loads(raw))
    except (ValueError, RecursionError) as e:
        raise CkptError(f"the replicator's status {path} does not parse: {e}") from None


def write_status(root: str, status: Status) -> None:
    status.updated = time.time()
    path = status_path(root)
    makedirs_within(root, os.path.dirname(path))
    # Never torn: a torn status would read as "no replicator ran", and ckpt gc would require no copies.
    replace_durable(path, json.dumps(to_json(status)).encode())


def copies_done(status: Status, v: VersionStatus) -> bool:
    """Whether the version has at least `required_copies` verified replica copies, on the
    destinations the replicator requires now."""
    now = None if status.replicas is None else set(status.replicas)
    verified = sum(1 for url, c in v.copies.items() if c.state == "verified" and (now is None or url in now))
    return verified >= status.required_copies


def remote_done(status: Status, v: VersionStatus) -> bool:
    """Whether the version needs nothing more from the remote: none is required, or its copy
    on *this* remote is verified (or expired there)."""
    return status.remote is None or (
        v.remote is not None and v.remote.state in REMOTE_DONE and v.remote.url == status.remote
    )


def redundant_saves(status: Status) -> dict[int, str]:
    """Steps whose required copies all exist, verified, each with the save those copies are
    of (a step saved again since is another save, with none yet): at least
    `required_copies` verified replica copies, and the remote's copy verified (or expired
    there) where a remote is required. The one rule, for the replicator's GC and for
    `ckpt gc` alike."""
    return {step: v.save_id for step, v in status.versions.items() if copies_done(status, v) and remote_done(status, v)}


def redundant_steps(status: Status) -> set[int]:
    """The steps of redundant_saves."""
    return set(redundant_saves(status))
