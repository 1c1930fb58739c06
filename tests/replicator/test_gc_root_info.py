"""GC judges a version's root.json as a restore's listing does (a version without a valid
one cannot be chosen), without taking a version an overwrite is replacing for damage, and
without reading a save's root.json again on every pass. Real roots and files."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt.replicator.gc as gc
from ckpt import Checkpointer
from ckpt._cli_policies import gc_policy
from ckpt._listing import version_rows
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps, read_manifest, version_dirname


def _root(root: Path, *steps: int, seed: int = 0) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((4,), float(s + seed))})


def test_a_version_an_overwrite_replaces_while_it_is_judged_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overwrite publishes without RENAME_EXCHANGE (NFS): the old v3 aside, then the new
    one in place. judge read v3's manifest before and its root.json between the renames:
    the first version of the root.json check called the new save damaged and deleted it."""
    root, other = tmp_path / "root", tmp_path / "other"
    _root(root, 1, 2, 3)
    _root(other, 3, seed=100)  # the overwrite's new save of step 3
    new_save = read_manifest(str(other), 3).save_id
    assert new_save != read_manifest(str(root), 3).save_id
    v3 = root / version_dirname(3)
    real = gc.root_info_verdict

    def between_the_renames(tier: Any, step: int) -> Any:
        if step != 3:
            return real(tier, step)
        os.rename(v3, tmp_path / "aside")
        try:
            return real(tier, step)
        finally:
            os.rename(other / version_dirname(3), v3)

    monkeypatch.setattr(gc, "root_info_verdict", between_the_renames)
    policy, _said = gc_policy(None, None, (), True)  # --all-but-milestones: the newest intact alone is kept
    gc.collect(open_tier(str(root)), policy)
    assert 3 in committed_steps(str(root)), os.listdir(root)
    assert read_manifest(str(root), 3).save_id == new_save


def test_a_save_s_root_json_is_read_once_over_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    _root(root, 1, 2, 3)
    tier = open_tier(str(root))
    reads: collections.Counter[str] = collections.Counter()
    real = type(tier).get

    def get(self: Any, key: str) -> bytes:
        reads[key.rsplit("/", 1)[-1]] += 1
        return real(self, key)

    monkeypatch.setattr(type(tier), "get", get)
    for _ in range(3):
        judged, _unjudged = gc.judge(tier)
        assert [v.intact for v in judged] == [True, True, True]
    assert reads["root.json"] <= 3, reads


def test_ls_calls_a_root_json_it_cannot_read_unreadable_not_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read error is no proof of damage: gc keeps such a version, a restore lists it as
    unreadable; ls said damaged (which gc removes)."""
    root = tmp_path / "root"
    _root(root, 1, 2)
    tier = open_tier(str(root))
    real = type(tier).get

    def get(self: Any, key: str) -> bytes:
        if key == f"{version_dirname(2)}/root.json":
            raise PermissionError(13, "Permission denied", key)
        return real(self, key)

    monkeypatch.setattr(type(tier), "get", get)
    rows = {r.step: r for r in version_rows(tier)}
    assert rows[1].status == "committed" and rows[2].status == "unreadable", rows
