"""Placement: copies go to distinct disks only, including a peer's disk through an fsspec URL."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ckpt import Checkpointer
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.placement import disk_id
from ckpt.replicator.service import Replicator
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed
from tests._states import assert_bitwise


def test_copies_never_share_a_disk_and_a_peer_url_works(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / ".ckpt-disk").write_text(d)
    src = tmp_path / "a" / "ckpt"
    same_disk = tmp_path / "a" / "elsewhere"
    peer = f"file://{tmp_path / 'b' / 'peer'}"
    assert disk_id(str(same_disk)) == disk_id(str(src)) != disk_id(peer)
    state = {"w": torch.randn(300, 300), "step": 5}
    with Checkpointer(src) as ck:
        ck.save(5, state)
    rep = Replicator([str(src)], ReplicatorConfig(replicas=2, replica_roots=(str(same_disk), peer)))
    status = rep.run_once()[str(src)].versions[5]
    assert list(status.copies) == [f"{peer}/replicas/{rep._replica_dests(str(src))[0].url.rsplit('/', 1)[-1]}"]
    assert all(c.state == "verified" for c in status.copies.values())
    assert not same_disk.exists()  # never a second copy on the source's disk
    copy_root = next((tmp_path / "b" / "peer" / "replicas").iterdir())
    assert [c.step for c in committed(str(copy_root))] == [5]
    assert [c.step for c in committed(open_tier(f"file://{copy_root}"))] == [5]
    shutil.rmtree(src)  # the source disk is lost: restore from the peer's copy
    got = {"w": torch.zeros(300, 300), "step": 0}
    with Checkpointer(tmp_path / "fresh", tiers=[str(copy_root)]) as ck:
        assert ck.restore(got) == 5
    assert_bitwise(got, state)
