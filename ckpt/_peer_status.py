"""What a root records of its peer copies (ckpt._peers), read by retention and `ckpt ls`
without importing torch."""

from __future__ import annotations

import json
import os

from ckpt.store.fsio import replace_durable
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps

__all__ = ["PEER_STATUS", "peer_dir", "read_peer_status", "record_peer_copies", "verified_peer_steps"]

PEER_STATUS = ".ckpt-peers.json"


def peer_dir(root: str, source: int) -> str:
    return os.path.join(root, "replicas", f"peer-{source}")


def _status_path(root: str) -> str:
    return os.path.join(root, PEER_STATUS)


def read_peer_status(root: str) -> dict[int, dict[int, str]]:
    """step -> {target root: "verified" | the failure}, as the sender recorded it."""
    try:
        with open(_status_path(root)) as f:
            doc = json.load(f)
        return {int(s): {int(t): str(v) for t, v in d.items()} for s, d in doc.get("steps", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def verified_peer_steps(root: str, copies: int) -> set[int]:
    """Steps whose peer copies are all verified."""
    return {s for s, d in read_peer_status(root).items() if sum(v == "verified" for v in d.values()) >= copies}


def record_peer_copies(root: str, step: int, results: dict[int, str]) -> None:
    """Record how `step`'s peer copies went (atomically: retention reads it meanwhile); the
    steps no longer on the root are forgotten."""
    status = read_peer_status(root)
    status[step] = results
    present = set(committed_steps(open_tier(root))) | {step}
    doc = {"steps": {str(s): {str(t): v for t, v in status[s].items()} for s in sorted(status) if s in present}}
    replace_durable(_status_path(root), json.dumps(doc).encode())
