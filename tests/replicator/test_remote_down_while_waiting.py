"""A remote that goes down while this node's part of a version waits there for the other
nodes' parts: the pass that meets it marks the remote failed and goes on with the other
destinations (a second disk), as it does for a remote that fails an upload.

A real 2-rank gloo job, each rank on its own root (two nodes); node 0's replicator copies to
a second disk of its node and uploads to the moto S3 server; node 1 runs none (behind, or
dead), so node 0's uploads wait for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer, Shard
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepLast
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import read_status
from ckpt.store import versions
from tests._disks import two_disks
from tests._dist import Ctx, launch

THIS = __file__


def save_steps(ctx: Ctx, root0: str, root1: str, first: int, last: int) -> None:
    with Checkpointer(root0 if ctx.rank == 0 else root1) as ck:
        for step in range(first, last + 1):
            piece = torch.full((4, 8), float(ctx.rank + step))
            ck.save(step, {"w": Shard(piece, (8, 8), (4 * ctx.rank, 0)), "step": step})


@pytest.mark.parametrize("remote_policy", [None, KeepLast(10)], ids=["no-remote-policy", "remote-keep-last"])
def test_a_remote_down_while_parts_wait_there_does_not_stop_the_other_copies(
    tmp_path: Path, s3: Any, remote_policy: KeepLast | None
) -> None:
    """Before, with a remote policy, the check whether a waiting version had expired on the
    remote listed it outside the pass's handling of remote failures: every pass raised
    TierUnavailableError before the newer versions reached the second disk, and wrote no
    status, for as long as the remote was down."""
    root0, replica = two_disks(tmp_path)
    root1 = tmp_path / "node1"
    _, failures = launch(THIS, "save_steps", 2, tmp_path / "job1", root0=str(root0), root1=str(root1), first=1, last=3)
    assert not failures, failures
    config = ReplicatorConfig(
        replicas=2,
        replica_roots=(str(replica),),
        remote=s3.url,
        storage_options=s3.options,
        remote_policy=remote_policy,
    )
    node0 = Replicator([str(root0)], config)
    node0.run_once()
    status = read_status(str(root0))
    assert {s: v.remote.state for s, v in status.versions.items() if v.remote} == {
        1: "waiting for other nodes",
        2: "waiting for other nodes",
        3: "waiting for other nodes",
    }
    _, failures = launch(THIS, "save_steps", 2, tmp_path / "job2", root0=str(root0), root1=str(root1), first=4, last=5)
    assert not failures, failures
    s3.server.kill()
    try:
        node0.run_once()
        replicas = Path(replica) / "replicas"
        (label,) = [p.name for p in replicas.iterdir()]
        assert versions.committed_steps(str(replicas / label)) == [1, 2, 3, 4, 5]
        status = read_status(str(root0))
        assert sorted(status.versions) == [1, 2, 3, 4, 5]
        assert {status.versions[s].remote.state for s in (4, 5)} == {"failed"}  # type: ignore[union-attr]
    finally:
        s3.server.start()
