"""is_committed(root, step): save()'s check for an existing version, from that version's
directory alone, agrees with committed_steps() on every kind of entry a root can hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer
from ckpt.store.errors import TierUnavailableError
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


def test_only_ascii_digits_name_a_version(tmp_path: Path) -> None:
    """A directory named with other digits (int() reads them) or a trailing newline is no
    version, though it holds a manifest: its step's own directory is named otherwise."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(2)})
        ck.wait()
    for odd in ("v" + "\u0660" * 11 + "\u0662", version_dirname(3) + "\n"):
        (root / odd).mkdir()
        (root / odd / MANIFEST_NAME).write_bytes((root / version_dirname(1) / MANIFEST_NAME).read_bytes())
    assert committed_steps(root) == [1]
    assert [s for s in range(5) if is_committed(root, s)] == [1]


def test_a_root_that_is_a_file_is_an_unavailable_tier_for_both(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"not a directory")
    with pytest.raises(TierUnavailableError):
        committed_steps(root)
    with pytest.raises(TierUnavailableError):
        is_committed(root, 1)
