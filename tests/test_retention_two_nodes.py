"""Retention with several nodes sharing one remote: regressions the crash harness found
(tests/crash_harness.py). Each failed before its fix.

In the first test the versions are saved by a real 2-rank gloo job, each rank on its own
root (its own node); each node runs its own replicator (driven here pass by pass), and a
version reaches the remote only once both nodes' parts are there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from ckpt import Checkpointer, Shard
from ckpt.replicator.core import Replicator, ReplicatorConfig, read_status
from ckpt.replicator.gc import gc_remote
from ckpt.replicator.policy import KeepLast
from ckpt.restore.tiers import RemoteTier
from ckpt.store import commit
from tests._dist import Ctx, launch

STEPS = 6


def save_on_two_nodes(ctx: Ctx, base: str) -> None:
    piece = torch.full((4, 8), float(ctx.rank))
    with Checkpointer(f"{base}/node{ctx.rank}") as ck:
        for step in range(1, STEPS + 1):
            piece += 1
            ck.save(step, {"w": Shard(piece, (8, 8), (4 * ctx.rank, 0)), "step": step})


def _nodes(tmp_path: Path) -> tuple[str, str, str]:
    launch(__file__, "save_on_two_nodes", 2, tmp_path / "job", base=str(tmp_path))
    return str(tmp_path / "node0"), str(tmp_path / "node1"), f"file://{tmp_path / 'remote'}"


def _remote_dirs(remote: str) -> list[str]:
    return sorted(os.listdir(remote.removeprefix("file://")))


def test_a_node_behind_the_remote_gc_does_not_keep_its_versions_forever(tmp_path: Path) -> None:
    """Node 0 uploads its parts first ("waiting for other nodes"); node 1 completes them,
    and the remote's retention deletes the old ones at once. Node 0 must then count them
    as done instead of uploading its part of deleted versions again and again: those parts
    never become whole versions, so its local copies would never be redundant and local
    retention would never delete them (its disk fills up), and the remote would collect
    directories without a manifest."""
    root0, root1, remote = _nodes(tmp_path)
    config = ReplicatorConfig(remote=remote, local_policy=KeepLast(2), remote_policy=KeepLast(2), interval_s=0.1)
    node0, node1 = Replicator([root0], config), Replicator([root1], config)
    node0.run_once()
    states = {s: e["remote"]["state"] for s, e in read_status(root0)["versions"].items()}
    assert set(states.values()) == {"waiting for other nodes"}, states
    node1.run_once()  # commits every version on the remote, then deletes all but the last two
    assert _remote_dirs(remote) == [commit.version_dirname(s) for s in (5, 6)]
    assert commit.committed_steps(root1) == [5, 6]
    for _ in range(2):
        node0.run_once()
    assert commit.committed_steps(root0) == [5, 6], "node 0's retention is stuck"
    assert _remote_dirs(remote) == [commit.version_dirname(s) for s in (5, 6)], "parts of deleted versions came back"
    for node, root in ((node0, root0), (node1, root1)):
        assert node.redundant_steps(root) == {5, 6}


# -- GC of the shared remote -------------------------------------------------------------------


def _remote_with_versions(tmp_path: Path, n: int) -> str:
    root, remote = tmp_path / "root", f"file://{tmp_path / 'remote'}"
    with Checkpointer(root) as ck:
        for step in range(1, n + 1):
            ck.save(step, {"a": torch.full((64,), float(step)), "b": torch.arange(32) * step, "step": step})
    Replicator([str(root)], ReplicatorConfig(remote=remote)).run_once()
    assert len(_remote_dirs(remote)) == n
    return remote


def _gc_into(remote: str, errors: list[BaseException]) -> None:
    try:
        gc_remote(remote, KeepLast(2))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_remote_gcs_racing_on_the_same_versions(tmp_path: Path) -> None:
    """Every node's replicator collects the shared remote, so GCs run at once on the same
    versions: a file another GC deleted first is no error, and no files are left in a
    directory with neither manifest nor `.deleting` marker (it would look like an upload in
    progress and stay forever)."""
    for attempt in range(3):
        remote = _remote_with_versions(tmp_path / str(attempt), 24)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_gc_into, args=(remote, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors
        gc_remote(remote, KeepLast(2))  # finishes whatever carries a marker
        base = Path(remote.removeprefix("file://"))
        left = {p.relative_to(base).parts[0] for p in base.rglob("*") if p.is_file()}
        assert left == {commit.version_dirname(s) for s in (23, 24)}  # (a racing mkdir may leave an empty one)


def test_remote_gc_killed_while_removing_files_leaves_the_marker(tmp_path: Path) -> None:
    """A remote GC killed after deleting some files must leave the `.deleting` marker (it is
    removed last), so the next GC finishes the deletion."""
    remote = _remote_with_versions(tmp_path, 3)
    env = {**os.environ, "CKPT_FAULT": "gc-mid-remove", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "gc", remote, "--keep-last", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    first = Path(remote.removeprefix("file://"), commit.version_dirname(1))
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert files == [".deleting"], files  # the manifest and the data are gone, the marker stays
    assert [c.step for c in RemoteTier(remote).committed()] == [2, 3]
    gc_remote(remote, KeepLast(1))
    assert _remote_dirs(remote) == [commit.version_dirname(3)]
