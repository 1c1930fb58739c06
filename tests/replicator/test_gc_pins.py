"""GC and readers: pinned versions survive GC; a GC killed mid-delete leaves nothing half-listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ckpt import Checkpointer
from ckpt.replicator.gc import collect
from ckpt.replicator.policy import KeepLast
from ckpt.store import pins, versions
from ckpt.store.versions import as_tier
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]


def _versions(root: Path, n: int) -> None:
    with Checkpointer(root) as ck:
        for step in range(1, n + 1):
            ck.save(step, {"w": torch.full((1000,), float(step))})


def test_gc_skips_a_version_a_reader_holds(tmp_path: Path) -> None:
    _versions(tmp_path, 4)
    with pins.pin_version(as_tier(str(tmp_path)), 2):
        result = collect(as_tier(str(tmp_path)), KeepLast(1))
    assert result.deleted == [1, 3] and versions.committed_steps(str(tmp_path)) == [2, 4]
    assert pins.pinned_steps(as_tier(str(tmp_path))) == set()  # released
    assert collect(as_tier(str(tmp_path)), KeepLast(1)).deleted == [2]


def test_gc_killed_mid_delete_leaves_no_half_deleted_version(tmp_path: Path) -> None:
    _versions(tmp_path, 3)
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_FAULT="gc-mid-delete")
    out = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "gc", str(tmp_path), "--keep-last", "1"], env=env, capture_output=True
    )
    assert out.returncode == -9
    assert versions.committed_steps(str(tmp_path)) == [2, 3]  # step 1 is gone from the listing, not half there
    assert any((tmp_path / ".trash").iterdir())  # its files wait in the trash
    for step in (2, 3):
        state = {"w": torch.zeros(1000)}
        with Checkpointer(tmp_path) as ck:  # opening empties the trash
            assert ck.restore(state, step=step) == step
        assert_bitwise(state, {"w": torch.full((1000,), float(step))}, f"step {step}")
    assert not any((tmp_path / ".trash").iterdir())


def test_two_gcs_deleting_the_same_version_both_succeed(tmp_path: Path) -> None:
    """A daemon's GC and a `ckpt gc` may pick the same version (found by the crash harness:
    the second rename failed with FileNotFoundError and `ckpt gc` exited 1)."""
    _versions(tmp_path, 2)
    versions.delete_version(str(tmp_path), 1)
    versions.delete_version(str(tmp_path), 1)  # already gone: not an error
    assert versions.committed_steps(str(tmp_path)) == [2]


def test_a_version_the_replicator_copies_is_held_against_gc(tmp_path: Path, monkeypatch: Any) -> None:
    """A copy reads the source version's files for as long as it takes: a GC (the
    Checkpointer's retention, `ckpt gc`) must not delete it, nor retire it as a spare tree
    that the next save overwrites in place, meanwhile (found by review: the replicator read
    without a pin)."""
    import ckpt.replicator.service as service
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.service import Replicator

    root, remote = tmp_path / "root", tmp_path / "remote"
    _versions(root, 2)
    seen: list[tuple[int, bool]] = []
    real = service.copy_files

    def copy_files(t: Any, progress: Any = None) -> Any:
        with pins.deleting(as_tier(str(root)), t.step) as free:  # what a GC asks before deleting
            seen.append((t.step, free))
        return real(t) if progress is None else real(t, progress)

    monkeypatch.setattr(service, "copy_files", copy_files)
    status = Replicator([str(root)], ReplicatorConfig(remote=f"file://{remote}")).run_once()[str(root)]
    assert seen == [(1, False), (2, False)]
    assert all(v.remote is not None and v.remote.state == "verified" for v in status.versions.values())
    assert pins.pinned_steps(as_tier(str(root))) == set()  # released
    assert collect(as_tier(str(root)), KeepLast(1)).deleted == [1]
