"""A root whose disk goes away (unmounted: its mount point is then an empty directory of the
disk below) is not made again there, by the replicator's or a reader's bookkeeping or by
the job's next save: the status, a copy's journal, a pin and a save's tree need the root
to exist, and fail (or, for a pin, hold nothing) where it does not. On the old code each
of them made the root again, on whatever disk lay below, and a test that put a file in
its place afterwards found a directory there
(tests/e2e/test_unreadable_and_vanishing.py::test_root_dies_mid_save)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer
from ckpt.replicator.placement import Destination
from ckpt.replicator.status import Status, read_status, write_status
from ckpt.replicator.transfer import journal_for
from ckpt.store.errors import TierUnavailableError
from ckpt.store.pins import pin_version
from ckpt.store.tier import open_tier


def _gone(tmp_path: Path) -> Path:
    """A root that existed and was written to, then vanished with its disk."""
    root = tmp_path / "disk0" / "ckpt"
    root.mkdir(parents=True)
    write_status(str(root), Status())
    assert read_status(str(root)) is not None
    shutil.rmtree(root)
    return root


def test_the_status_of_a_vanished_root_is_not_written_below_it(tmp_path: Path) -> None:
    root = _gone(tmp_path)
    with pytest.raises(FileNotFoundError):
        write_status(str(root), Status())
    assert not root.exists()


def test_a_journal_of_a_vanished_root_is_not_saved_below_it(tmp_path: Path) -> None:
    root = _gone(tmp_path)
    dest = Destination(str(tmp_path / "disk1" / "replica"), "replica", open_tier(str(tmp_path / "disk1" / "replica")))
    journal = journal_for(str(root / ".replicator"), dest, 3, "ab" * 16)
    journal.add("state/w/c.0")
    journal.save()  # a warning (kept in memory), never the root made again below its path
    assert not root.exists()


def test_a_pin_on_a_vanished_root_holds_nothing_and_makes_nothing(tmp_path: Path) -> None:
    root = _gone(tmp_path)
    with pin_version(open_tier(str(root)), 3) as still_there:
        assert still_there  # as on a store that keeps no pins: the reader's checks find it gone
    assert not root.exists()


def test_a_journal_and_a_status_of_a_root_that_is_there_are_written(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_status(str(root), Status())
    dest = Destination(str(tmp_path / "replica"), "replica", open_tier(str(tmp_path / "replica")))
    journal = journal_for(str(root / ".replicator"), dest, 3, "ab" * 16)
    journal.add("state/w/c.0")
    journal.save()
    assert journal_for(str(root / ".replicator"), dest, 3, "ab" * 16).done == {"state/w/c.0"}
    assert read_status(str(root)) is not None


def test_a_save_into_a_vanished_root_fails_and_makes_nothing(tmp_path: Path) -> None:
    """The job's own save, too: it fails with TierUnavailableError (ENOENT) where it made the
    root again on the old code, and committed a version there that the disk's return would hide."""
    root = tmp_path / "disk0" / "ckpt"
    with Checkpointer(str(root), keep_last=2) as ck:
        ck.save(1, {"w": torch.ones(1000)})
        ck.wait()
        shutil.rmtree(root)
        with pytest.raises(TierUnavailableError) as got:
            ck.save(2, {"w": torch.ones(1000)})
            ck.wait()
        assert got.value.errno == errno.ENOENT and "step 2" in str(got.value)
        assert not root.exists()
        root.mkdir()  # (the disk is back, empty: the Checkpointer closes on it)
