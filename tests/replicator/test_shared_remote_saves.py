"""Two nodes' uploads to one shared remote, with a step saved twice and copies in flight.
Versions come from a real 2-rank gloo job, each rank on its own root (its own node); each
node runs its own replicator, driven here pass by pass, to a file:// remote. Each test
failed before its fix."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer, Shard
from ckpt.replicator import publish as publish_module
from ckpt.replicator import service
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepLast
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import read_status
from ckpt.store import versions
from ckpt.store._fsspec import FsspecTier
from ckpt.store.rank_file import rank_file_path
from ckpt.store.tier import open_tier
from tests._dist import Ctx, launch
from tests._states import assert_bitwise


def save_step_one(ctx: Ctx, base: str, value: float, overwrite: bool) -> None:
    piece = torch.full((4, 8), value + ctx.rank)
    with Checkpointer(f"{base}/node{ctx.rank}") as ck:
        ck.save(1, {"w": Shard(piece, (8, 8), (4 * ctx.rank, 0))}, overwrite=overwrite)


def save_steps(ctx: Ctx, base: str, steps: list[int]) -> None:
    with Checkpointer(f"{base}/node{ctx.rank}") as ck:
        for step in steps:
            ck.save(step, {"w": Shard(torch.full((4, 8), float(step + ctx.rank)), (8, 8), (4 * ctx.rank, 0))})


def _save(tmp_path: Path, value: float, *, overwrite: bool = False) -> None:
    job = tmp_path / f"job{value:g}"
    _, failures = launch(__file__, "save_step_one", 2, job, base=str(tmp_path), value=value, overwrite=overwrite)
    assert not failures, failures


def _restored(fresh: Path, url: str, storage_options: Any = None) -> torch.Tensor:
    state = {"w": torch.zeros(8, 8)}
    with Checkpointer(fresh, tiers=[url], storage_options=storage_options) as ck:
        assert ck.restore(state) == 1
    return state["w"]


def test_a_step_saved_again_while_its_upload_is_in_flight_never_commits_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 has sent its files of step 1's first save but not yet recorded its part; the
    step is saved again. Node 0 sends its files of the new save over its files of the first
    (same names, same sizes) and pauses before it records its new part; node 1 then records
    its part of the first save and commits it. Before, the commit checked sizes alone: the
    remote held step 1 committed with node 0's chunks from the other save (`ckpt verify`:
    bad chunks), and the new save was never uploaded ('holds step 1 from another save')."""
    _save(tmp_path, 1.0)
    remote = f"file://{tmp_path / 'remote'}"
    config = ReplicatorConfig(remote=remote)
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)
    node0.run_once()  # its part of the first save: sent and recorded; waits for node 1's

    paused: list[tuple[Any, ...]] = []
    real = service.publish

    def pause(*args: Any) -> bool:
        paused.append(args)
        return False

    monkeypatch.setattr(service, "publish", pause)
    node1.run_once()  # its files of the first save are there, its part not recorded yet
    _save(tmp_path, 10.0, overwrite=True)
    node0.run_once()  # the new save: sent, and paused before its part record
    monkeypatch.setattr(service, "publish", real)
    real(*paused[0])  # node 1 goes on with the first save: records its part and commits if it can

    node0.run_once()
    node1.run_once()
    assert versions.committed_steps(remote) == [1]
    assert versions.read_manifest(remote, 1).save_id == versions.read_manifest(str(tmp_path / "node0"), 1).save_id
    want = torch.cat([torch.full((4, 8), 10.0), torch.full((4, 8), 11.0)])
    assert_bitwise(_restored(tmp_path / "fresh", remote), want)


def test_a_node_leaves_the_temp_files_of_other_nodes_uploads_alone(tmp_path: Path) -> None:
    """Node 0 sends its part while node 1 sends its own; a pass that sends cleans up the temp
    files of copies that never finished. Before, it deleted every temp file under the
    version, node 1's copies in flight too: node 1's uploads failed ('vanished while it was
    copied'), and went on failing while node 0 waited (each waiting pass sent again)."""
    _save(tmp_path, 1.0)
    remote = tmp_path / "remote"
    node0 = Replicator([str(tmp_path / "node0")], ReplicatorConfig(remote=f"file://{remote}"))
    version = remote / versions.version_dirname(1)
    in_flight = version / f"{rank_file_path(1)}.tmp-{uuid.uuid4().hex}"  # node 1's, being written
    in_flight_doc = version / f"state/zarr.json.tmp-{uuid.uuid4().hex}"  # every part holds it: node 1's?
    stale = version / f"{rank_file_path(0)}.tmp-{uuid.uuid4().hex}"  # node 0's, of a copy cut off
    for path in (in_flight, in_flight_doc, stale):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partly written")
    node0.run_once()  # sends its part
    node0.run_once()  # waits
    assert in_flight.exists() and in_flight_doc.exists()
    assert not stale.exists()
    assert versions.committed_steps(str(remote)) == []
    assert sorted(os.listdir(version / "parts")) == ["0.json"]
    assert open_tier(str(remote)).exists(f"{versions.version_dirname(1)}/{rank_file_path(0)}")


def test_a_version_another_nodes_remote_gc_deleted_is_not_uploaded_again(tmp_path: Path) -> None:
    """Node 1 completed steps 1 and 2 on the remote; node 0 completed step 3, and its GC of
    the remote (keep the last 2) deleted step 1. Node 1's local GC then found its verified
    remote copy of step 1 gone: before, it marked it failed and uploaded its part again, a
    directory that never gets a manifest (node 0 counts step 1 done), and kept step 1
    locally past its policy. Gone by the remote's own policy, it is expired there."""
    remote = tmp_path / "remote"
    config = ReplicatorConfig(remote=f"file://{remote}", local_policy=KeepLast(3), remote_policy=KeepLast(2))
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)

    def save(*steps: int) -> None:
        _, failures = launch(__file__, "save_steps", 2, tmp_path / f"job{steps[0]}", base=str(tmp_path), steps=steps)
        assert not failures, failures

    save(1, 2)
    node0.run_once()
    node1.run_once()  # completes 1 and 2
    save(3)
    node1.run_once()
    node0.run_once()  # completes 3; its remote GC deletes 1
    assert versions.committed_steps(f"file://{remote}") == [2, 3]
    save(4)
    sent = node1.bytes_sent
    node1.run_once()  # its local GC deletes 1, its part of 4 goes up
    assert versions.committed_steps(str(tmp_path / "node1")) == [2, 3, 4]
    assert not (remote / versions.version_dirname(1)).exists()
    entry = read_status(str(tmp_path / "node1")).versions
    assert 1 not in entry
    part4 = sum(f.stat().st_size for f in (tmp_path / "node1" / versions.version_dirname(4)).rglob("*") if f.is_file())
    assert node1.bytes_sent - sent <= part4, (node1.bytes_sent - sent, part4)


def test_a_node_waiting_on_the_remote_lists_the_part_records_not_the_version(
    tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0's part of step 1 waits on S3 for node 1's. Before, each of node 0's passes
    listed every file of the version three times (the files of every node's part: at
    thousands of nodes, millions of objects per pass per waiting node). Now a waiting pass
    reads the parts' records alone; the commit, when node 1's part comes, lists once."""
    _save(tmp_path, 1.0)
    config = ReplicatorConfig(remote=s3.url, storage_options=s3.options)
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)
    node0.run_once()
    listed: list[str] = []
    real_find = FsspecTier.find

    def find(self: FsspecTier, prefix: str) -> Any:
        listed.append(prefix)
        return real_find(self, prefix)

    monkeypatch.setattr(FsspecTier, "find", find)
    for _ in range(3):
        node0.run_once()
    assert read_status(str(tmp_path / "node0")).versions[1].remote.state == "waiting for other nodes"  # type: ignore[union-attr]
    assert listed == []
    node1.run_once()
    assert versions.committed_steps(open_tier(s3.url, storage_options=s3.options)) == [1]
    want = torch.cat([torch.full((4, 8), 1.0), torch.full((4, 8), 2.0)])
    assert_bitwise(_restored(tmp_path / "fresh", s3.url, s3.options), want)


def test_a_part_whose_files_vanished_is_sent_again_though_its_node_waits(tmp_path: Path) -> None:
    """A waiting node no longer lists its part's files each pass: when some vanish from the
    remote (a lifecycle rule, a wiped bucket), the committer finds them missing and
    withdraws that part's record, and its node sends the part in full on its next pass."""
    _save(tmp_path, 1.0)
    remote = tmp_path / "remote"
    config = ReplicatorConfig(remote=f"file://{remote}")
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)
    node0.run_once()
    (remote / versions.version_dirname(1) / rank_file_path(0)).unlink()
    node0.run_once()  # waiting: it does not look
    node1.run_once()  # the committer: finds node 0's rank file missing
    assert versions.committed_steps(str(remote)) == []
    assert sorted(os.listdir(remote / versions.version_dirname(1) / "parts")) == ["1.json"]
    node0.run_once()  # sends its part in full, and commits
    assert versions.committed_steps(str(remote)) == [1]
    want = torch.cat([torch.full((4, 8), 1.0), torch.full((4, 8), 2.0)])
    assert_bitwise(_restored(tmp_path / "fresh", f"file://{remote}"), want)


def test_a_shared_document_missing_at_commit_is_sent_again_by_the_committer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both nodes' parts are recorded (node 1 found the claim busy once), and then a
    zarr.json document every part holds vanishes from the remote. The committer finds it
    missing; no part's chunks name it, so the committer's own record is withdrawn and it
    sends its part in full. (A first version of the waiting pass withdrew no record: every
    node went on waiting, and the version never committed.)"""
    _save(tmp_path, 1.0)
    remote = tmp_path / "remote"
    config = ReplicatorConfig(remote=f"file://{remote}")
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)
    node0.run_once()
    busy = [True]
    real_claim = publish_module._claim

    def claim(*args: Any) -> bool:
        if busy:
            return not busy.pop()  # (held by a collector, say)
        return real_claim(*args)

    monkeypatch.setattr(publish_module, "_claim", claim)
    node1.run_once()  # its part recorded, its commit put off
    assert sorted(os.listdir(remote / versions.version_dirname(1) / "parts")) == ["0.json", "1.json"]
    (remote / versions.version_dirname(1) / "state" / "w" / "zarr.json").unlink()
    for _ in range(2):
        node0.run_once()
        node1.run_once()
    assert versions.committed_steps(str(remote)) == [1]
    want = torch.cat([torch.full((4, 8), 1.0), torch.full((4, 8), 2.0)])
    assert_bitwise(_restored(tmp_path / "fresh", f"file://{remote}"), want)


def test_a_claim_left_by_a_save_that_can_no_longer_commit_does_not_hold_up_the_next(tmp_path: Path) -> None:
    """A committer of step 1's first save claimed it and then found a part's record gone
    (its node was sending the step's new save) or died: its claim stays. The new save's
    nodes see that the first save's records no longer cover every rank, so it can never
    commit: they remove its claim and go on. Before, nothing removed it (without a remote
    policy, no collector ever runs) and the new save was never committed there."""
    _save(tmp_path, 1.0)
    remote = tmp_path / "remote"
    config = ReplicatorConfig(remote=f"file://{remote}")
    node0, node1 = Replicator([str(tmp_path / "node0")], config), Replicator([str(tmp_path / "node1")], config)
    node0.run_once()
    first = versions.read_manifest(str(tmp_path / "node0"), 1).save_id
    (remote / versions.version_dirname(1) / versions.COMMIT_CLAIM).write_bytes(first.encode())
    _save(tmp_path, 10.0, overwrite=True)
    for _ in range(2):
        node0.run_once()
        node1.run_once()
    assert versions.committed_steps(str(remote)) == [1]
    assert versions.read_manifest(str(remote), 1).save_id != first
    want = torch.cat([torch.full((4, 8), 10.0), torch.full((4, 8), 11.0)])
    assert_bitwise(_restored(tmp_path / "fresh", f"file://{remote}"), want)
