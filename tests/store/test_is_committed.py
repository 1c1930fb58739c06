"""is_committed(root, step): save()'s check for an existing version, from that version's
directory alone, agrees with committed_steps() on every kind of entry a root can hold."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ckpt import Checkpointer
from ckpt.store.manifest import MANIFEST_NAME
from ckpt.store.versions import DELETING_MARKER, committed_steps, is_committed, version_dirname


def test_is_committed_agrees_with_committed_steps(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Checkpointer(root, keep_last=10) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
        ck.wait()
    (root / version_dirname(2) / DELETING_MARKER).write_bytes(b"")  # its deletion was decided
    (root / version_dirname(3) / MANIFEST_NAME).unlink()  # a torn version: no manifest
    os.symlink(root / version_dirname(1), root / version_dirname(4))  # a link named like a version
    (root / version_dirname(5)).write_bytes(b"")  # a file named like one
    (root / version_dirname(6)).mkdir()  # an empty directory
    assert committed_steps(root) == [1]
    assert [s for s in range(8) if is_committed(root, s)] == [1]
