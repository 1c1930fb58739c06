"""Retention judges every retained version after each commit; what it learns of a manifest
is kept by the manifest's bytes, so a version is parsed once, not once a pass, and a
manifest whose bytes change is judged afresh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt._retention as retention_mod
import ckpt.store.versions as versions_mod
from ckpt import Checkpointer
from ckpt.replicator.gc import judge
from ckpt.store.tier import open_tier
from ckpt.store.versions import version_dirname
from tests._manifests import crafted


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 8), float(step)), "b": torch.arange(5) + step, "step": step}


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps whose manifests store.versions parses (a spy: the real parser runs)."""
    seen: list[int] = []
    real = versions_mod.parse_manifest

    def spy(raw: bytes) -> Any:
        m = real(raw)
        seen.append(m.step)
        return m

    monkeypatch.setattr(versions_mod, "parse_manifest", spy)
    return seen


def test_retention_parses_no_manifest_this_process_committed(tmp_path: Path, parses: list[int]) -> None:
    with Checkpointer(tmp_path, keep_last=2, keep_every=4) as ck:
        for s in range(1, 10):
            ck.save(s, _state(s), milestone=s == 3)
    assert [v.step for v in judge(open_tier(str(tmp_path)))[0]] == [3, 4, 8, 9]
    assert parses == [], parses


def test_a_manifest_whose_bytes_change_is_judged_again(tmp_path: Path, parses: list[int]) -> None:
    with Checkpointer(tmp_path) as ck:
        for s in (1, 2, 3):
            ck.save(s, _state(s))
    tier = open_tier(str(tmp_path))
    before = {v.step: v for v in judge(tier)[0]}
    assert all(v.intact and not v.tagged for v in before.values()) and parses == []

    path = tmp_path / version_dirname(2) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["meta"]["milestone"] = True
    path.write_bytes(crafted(doc))  # still valid, now a milestone
    damaged = tmp_path / version_dirname(3) / "manifest.json"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # fails its manifest_xxh3
    damaged.write_bytes(bytes(raw))

    after = {v.step: v for v in judge(tier)[0]}
    assert after[1] == before[1]
    assert after[2].intact and after[2].tagged
    assert after[3].intact is False
    assert sorted(parses) == [2]  # 3 fails its checksum before it parses into a manifest


def test_retention_measures_a_versions_size_once_per_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[str] = []
    real = retention_mod._tree_bytes

    def spy(path: str) -> int:
        walks.append(path)
        return real(path)

    monkeypatch.setattr(retention_mod, "_tree_bytes", spy)
    with Checkpointer(tmp_path, keep_last=1) as ck:
        for s in range(1, 6):
            ck.save(s, _state(s))
        ck.save(6, {**_state(6), "extra": torch.zeros(3)})  # another layout
    assert [Path(p).name for p in walks] == [version_dirname(1), version_dirname(6)]
