"""What a root records of its peer copies (ckpt._peers), and the retention rule that
follows from it, read by every GC of the root (the Checkpointer's retention, a replicator
daemon's, `ckpt gc`) and by `ckpt ls`, without importing torch.

The rule: while a root makes peer copies, the newest version whose peer copies are all
verified, on every root (the leaders agree after each round), is kept, and every newer
one. After a node's loss that version is whole on the survivors (their own parts, and the
lost node's as peer copies; the same rule keeps it on every root). A step whose own copies
were verified while another root's failed does not count: after that other node's loss
its part of the step is missing, and this root must still hold an older version whole. A
root whose copier stopped for good (a peer stopped answering) keeps that version alone
past its other rules; one that a job without peer copies opened since is judged by its
other rules alone, until a job with peer copies opens it again.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

from ckpt.store.errors import CkptError
from ckpt.store.fsio import replace_durable
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps, delete_version

__all__ = [
    "PEER_STATUS",
    "peer_dir",
    "peer_dirs",
    "read_peer_status",
    "record_peer_copies",
    "record_peers_stopped",
    "forget_peer_copies",
    "resume_peer_copies",
    "forget_peer_step",
    "drop_overwritten_copies",
    "verified_peer_steps",
    "peer_redundant",
    "with_peer_rule",
]

PEER_STATUS = ".ckpt-peers.json"


_PEER_NAME = re.compile(r"^peer-([0-9a-f]{32}|\d+)$")  # a root's identity; a root's index, as older ckpt named them


def peer_dir(root: str, source: str) -> str:
    """Where `root`'s disk keeps the peer copies of the root whose identity
    (store.root.root_id) is `source`: named by the disk, not by its place in the job, so a
    job whose nodes come in another order, or fewer, never mixes two roots' copies."""
    return os.path.join(root, "replicas", f"peer-{source}")


def peer_dirs(root: str) -> dict[str, str]:
    """Every directory of peer copies on `root`'s disk: source -> path."""
    base = os.path.join(root, "replicas")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return {}
    return {m.group(1): os.path.join(base, name) for name in names if (m := _PEER_NAME.match(name))}


def _status_path(root: str) -> str:
    return os.path.join(root, PEER_STATUS)


def _read(root: str, *, strict: bool = False) -> dict[str, object]:
    """The root's record ({} where there is none). `strict`, for the retention rule: a
    record that cannot be read raises OSError, and one that does not parse CkptError,
    never reading as none (the rule would then not apply, and a GC would delete what the
    peer copies need). Leniently, for its writers and `ckpt ls`: as none; a writer then
    writes it anew, and what it loses only holds more back."""
    path = _status_path(root)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}
    except OSError:
        if strict:
            raise
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        if strict:
            raise CkptError(f"the peer-copy record {path} does not parse: {e}") from None
        return {}
    if not isinstance(doc, dict):
        if strict:
            raise CkptError(f"the peer-copy record {path} is not a JSON object")
        return {}
    return doc


def _steps(doc: dict[str, object]) -> dict[int, dict[int, str]]:
    steps = doc.get("steps", {})
    if not isinstance(steps, dict):
        return {}
    try:
        return {int(s): {int(t): str(v) for t, v in d.items()} for s, d in steps.items()}
    except (AttributeError, ValueError, TypeError):
        return {}


def _partial(doc: dict[str, object]) -> set[int]:
    """Steps whose round failed on another root (this root's own copies may be verified)."""
    steps = doc.get("partial", [])
    return {s for s in steps if isinstance(s, int)} if isinstance(steps, list) else set()


def _verified(doc: dict[str, object]) -> set[int]:
    copies = doc.get("copies")
    partial = _partial(doc)
    return {
        s
        for s, d in _steps(doc).items()
        if d
        and s not in partial
        and sum(v == "verified" for v in d.values()) >= (copies if isinstance(copies, int) else len(d))
    }


def read_peer_status(root: str) -> dict[int, dict[int, str]]:
    """step -> {target root: "verified" | the failure}, as the sender recorded it ({} where
    the record cannot be read)."""
    return _steps(_read(root))


def verified_peer_steps(root: str) -> set[int]:
    """Steps whose peer copies are all verified (OSError or CkptError where the record
    cannot be read)."""
    return _verified(_read(root, strict=True))


def peer_redundant(root: str) -> set[int] | None:
    """The root's steps the peer-copy rule lets a GC delete: those older than the newest
    step whose peer copies are verified. Once its copier stopped for good (a peer stopped
    answering: most often the node loss the rule is for), every step but that one: newer
    ones will have no verified copies, and that one is what the survivors restore. None
    when the rule does not apply (no peer copies are made of this root, or none verified
    before the stop). A record that cannot be read raises (OSError, CkptError): the GC
    pass fails, and the next one tries again."""
    doc = _read(root, strict=True)
    if not doc:
        return None
    newest = max(_verified(doc), default=-1)
    steps = committed_steps(open_tier(root))
    if doc.get("stopped"):
        return None if newest < 0 else {s for s in steps if s != newest}
    return {s for s in steps if s < newest}


def with_peer_rule(root: str, redundant: Mapping[int, str | None] | None) -> dict[int, str | None] | None:
    """`redundant` (what the root's other rules let a GC delete, step -> the save whose
    copies exist, None for any; None: anything) narrowed by the peer-copy rule: the one
    place every GC of a local root applies it."""
    peers = peer_redundant(root)
    if peers is None:
        return None if redundant is None else dict(redundant)
    if redundant is None:
        return dict.fromkeys(peers)
    return {s: save for s, save in redundant.items() if s in peers}


def _write(root: str, doc: dict[str, object]) -> None:
    replace_durable(_status_path(root), json.dumps(doc).encode())


def record_peer_copies(root: str, step: int, results: dict[int, str], *, everywhere: bool) -> None:
    """Record how `step`'s peer copies went (atomically: retention reads it meanwhile), and
    whether every root's copies of it were verified (`everywhere`); the steps no longer on
    the root are forgotten."""
    doc = _read(root)
    status = _steps(doc)
    status[step] = results
    present = set(committed_steps(open_tier(root))) | {step}
    steps = {str(s): {str(t): v for t, v in status[s].items()} for s in sorted(status) if s in present}
    partial = sorted(s for s in (_partial(doc) - {step}) | ({step} if not everywhere else set()) if s in present)
    _write(root, {"copies": len(results), "steps": steps, "partial": partial})


def forget_peer_step(root: str, step: int) -> None:
    """`step` was overwritten: the copies recorded are of the save it replaced."""
    doc = _read(root)
    steps = doc.get("steps")
    if isinstance(steps, dict) and steps.pop(str(step), None) is not None:
        _write(root, doc)


def drop_overwritten_copies(root: str, step: int) -> None:
    """`step` is being overwritten on every root (each root prepared it): before this root
    publishes it, delete the copies of the old save this disk holds for other roots, and
    forget this root's own. Once every root has published, no copy of the old save is
    left: beside the new save, the old one whole in copies would make the step ambiguous
    (saved twice) and restore pass over it for an older one."""
    forget_peer_step(root, step)
    for path in peer_dirs(root).values():
        delete_version(path, step)


def record_peers_stopped(root: str, why: str) -> None:
    """The copier stopped for good: the root's versions newer than its newest verified step
    are no longer held back for it."""
    doc = _read(root)
    doc["stopped"] = why
    _write(root, doc)


def resume_peer_copies(root: str) -> None:
    """A job with peer copies opened the root: an earlier job's copier that stopped for good
    no longer turns the rule off, and the copies it verified hold versions back at once
    (not only from this job's first verified round)."""
    doc = _read(root)
    if doc.pop("stopped", None) is not None:
        _write(root, doc)


def forget_peer_copies(root: str) -> None:
    """A job without peer copies opened the root: the rule no longer applies to it."""
    try:
        os.unlink(_status_path(root))
    except FileNotFoundError:
        pass
