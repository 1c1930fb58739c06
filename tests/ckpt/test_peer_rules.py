"""The rules of peer copies that need no job: where copies go, and that retention keeps a
version until its peer copies are verified (the jobs: tests/e2e/test_peer_copies.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer
from ckpt._peer_status import PEER_STATUS, verified_peer_steps
from ckpt._peers import plan_peers
from ckpt._retention import Retention
from ckpt.replicator.policy import KeepLast
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps


def test_peer_plans_refuse_copies_on_the_same_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="same node"):
        plan_peers([(0,), (1,), (4,), (5,)], 0, 1, 1)  # roots 0 and 1 share node 0
    plan = plan_peers([(0,), (1,), (4,), (5,)], 0, 1, 2)  # a stride of 2 crosses nodes
    assert plan.targets == (2,) and plan.sources == (2,) and plan.leaders == (0, 1, 4, 5)
    plan = plan_peers([(0,), (4,), (8,)], 1, 2, 1)
    assert plan.targets == (2, 0) and plan.sources == (0, 2)
    with pytest.raises(ValueError, match="more roots"):
        plan_peers([(0, 1), (4, 5)], 0, 2, 1)


def _status(root: Path, verified: dict[int, str]) -> None:
    doc = {"steps": {str(s): {"1": v} for s, v in verified.items()}}
    (root / PEER_STATUS).write_text(json.dumps(doc))


def _retained(root: Path, verified: dict[int, str]) -> list[int]:
    _status(root, verified)
    tier = open_tier(str(root))
    retention = Retention(tier, str(root), KeepLast(1), peer_copies=1)
    retention.committed(3)
    retention.close()
    return committed_steps(tier)


def test_retention_keeps_the_newest_version_a_node_loss_leaves_whole(tmp_path: Path) -> None:
    """keep_last=1, steps 1-3: the newest version whose peer copies are verified and every
    newer one are kept (after a node's loss the newest such version is the one the
    survivors hold whole: their own parts, and the lost node's as peer copies)."""
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    assert verified_peer_steps(str(tmp_path), 1) == set()
    assert _retained(tmp_path, {1: "verified", 2: "failed"}) == [1, 2, 3]
    assert _retained(tmp_path, {1: "verified", 2: "verified"}) == [2, 3]
    assert _retained(tmp_path, {1: "verified", 2: "verified", 3: "verified"}) == [3]


def test_retention_without_peer_copies_deletes_by_the_policy(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    tier = open_tier(str(tmp_path))
    retention = Retention(tier, str(tmp_path), KeepLast(1))
    retention.committed(3)
    retention.close()
    assert committed_steps(tier) == [3]
