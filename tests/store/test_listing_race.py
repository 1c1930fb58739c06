"""A version a GC deletes while a restore lists the tier is gone, not damaged: the listing
saw its manifest, then its root.json was no longer there because the whole directory had
been moved into the trash (the deletion's first step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer, VersionNotFoundError
from ckpt.store._local import LocalTier
from ckpt.store.manifest import ROOT_INFO_NAME
from ckpt.store.versions import delete_version, listing, version_dirname


class _DeletedWhileListed(LocalTier):
    """A root on which a GC deletes `step` (for real: the rename into the trash, then the
    files) at the instant the listing asks for the step's root.json."""

    def __init__(self, root: str, step: int) -> None:
        super().__init__(root)
        self.step, self.deleted = step, False

    def get(self, key: str) -> bytes:
        if key == f"{version_dirname(self.step)}/{ROOT_INFO_NAME}" and not self.deleted:
            self.deleted = True
            delete_version(LocalTier(self.root), self.step)
        return super().get(key)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with Checkpointer(tmp_path / "root", capture_rng=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    return tmp_path / "root"


def test_a_version_deleted_while_listed_is_not_listed_as_damaged(root: Path) -> None:
    """Before, the step came back among the committed steps without a root.json (damaged)."""
    tier = _DeletedWhileListed(str(root), 2)
    candidates, nameless, unreadable = listing(tier)
    assert tier.deleted and [c.step for c in candidates] == [1, 3]
    assert nameless == [] and unreadable == {}


def test_a_restore_of_a_step_deleted_while_listed_is_version_not_found(root: Path) -> None:
    """Before, restore(step=2) raised CorruptVersionError ("step 2 is damaged ... root.json is
    missing or damaged; not starting from scratch") where the step had only been deleted."""
    with Checkpointer(root / "reader", tiers=[_DeletedWhileListed(str(root), 2)], capture_rng=False) as ck:
        with pytest.raises(VersionNotFoundError):
            ck.restore({"w": torch.zeros(4)}, step=2)
        got = {"w": torch.zeros(4)}
        assert ck.restore(got) == 3 and torch.equal(got["w"], torch.full((4,), 3.0))
