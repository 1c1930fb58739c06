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
import time
from pathlib import Path

import torch

from ckpt import Checkpointer, Shard
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.gc import collect, collect_abandoned
from ckpt.replicator.policy import KeepLast, KeepMilestones, Union
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import read_status
from ckpt.store import versions
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed
from tests._dist import Ctx, launch
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]

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
    return sorted(n for n in os.listdir(remote.removeprefix("file://")) if n.startswith("v"))


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
    states = {str(s): e.remote.state for s, e in read_status(root0).versions.items() if e.remote is not None}
    assert set(states.values()) == {"waiting for other nodes"}, states
    node1.run_once()  # commits every version on the remote, then deletes all but the last two
    assert _remote_dirs(remote) == [versions.version_dirname(s) for s in (5, 6)]
    assert versions.committed_steps(root1) == [5, 6]
    for _ in range(2):
        node0.run_once()
    assert versions.committed_steps(root0) == [5, 6], "node 0's retention is stuck"
    assert _remote_dirs(remote) == [versions.version_dirname(s) for s in (5, 6)], "parts of deleted versions came back"
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
        collect(open_tier(remote), KeepLast(2))
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
        collect(open_tier(remote), KeepLast(2))  # finishes whatever carries a marker
        base = Path(remote.removeprefix("file://"))
        left = {p.relative_to(base).parts[0] for p in base.rglob("*") if p.is_file()}
        assert left == {versions.version_dirname(s) for s in (23, 24)}  # (a racing mkdir may leave an empty one)


def test_remote_gc_killed_mid_deletion_leaves_only_trash(tmp_path: Path) -> None:
    """A GC of a `file://` remote (a local directory: deletions rename into `.trash/`)
    killed between unpublishing a version and deleting its files leaves it unlisted and in
    the trash; the next GC empties the trash."""
    remote = _remote_with_versions(tmp_path, 3)
    env = {**os.environ, "CKPT_FAULT": "gc-mid-delete", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "gc", remote, "--keep-last", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    trash = Path(remote.removeprefix("file://"), versions.TRASH_NAME)
    assert [p.name.split(".")[0] for p in trash.iterdir()] == [versions.version_dirname(1)]
    assert [c.step for c in committed(open_tier(remote))] == [2, 3]
    collect(open_tier(remote), KeepLast(1))
    assert _remote_dirs(remote) == [versions.version_dirname(3)]
    assert list(trash.iterdir()) == []


def test_remote_retention_with_fewer_versions_than_it_keeps(tmp_path: Path) -> None:
    """The crash harness's "LOST: remote step 2: deleted, but retention keeps it (known
    newer: [3, 5, 6])": with 3 versions on the remote, keep-last 4 kept only the newest
    (a negative slice start), so the daemon's GC deleted two versions it keeps. Replayed
    pass by pass: one save, one replicator pass (upload, then the remote GC)."""
    root, remote = tmp_path / "root", f"file://{tmp_path / 'remote'}"
    policy = Union((KeepLast(4), KeepMilestones(10)))  # `ckpt replicate --remote-keep-last 4 --milestone-every 10`
    rep = Replicator([str(root)], ReplicatorConfig(remote=remote, remote_policy=policy))
    with Checkpointer(root) as ck:
        for step in range(1, 7):
            ck.save(step, {"w": torch.full((16,), float(step)), "step": step})
            ck.wait()
            rep.run_once()
            held = [c.step for c in committed(open_tier(remote))]
            assert held == list(range(max(1, step - 3), step + 1)), (step, held)


def _abandoned_upload(root: Path, remote: Path, step: int, files: int) -> Path:
    """What a replicator killed mid-upload leaves on the remote: some of the version's
    files, no manifest (copied from the source as the upload would have)."""
    src = root / versions.version_dirname(step)
    dest = remote / versions.version_dirname(step)
    chunks = sorted(p for p in src.rglob("c.*") if p.is_file())[:files]
    for p in chunks:
        target = dest / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(p.read_bytes())
    return dest


def test_abandoned_uploads_are_collected_once_provably_abandoned(tmp_path: Path) -> None:
    """An upload that never completes (its replicator died and its version was deleted
    since) is collected by the remote's GC, but only once nothing was written there for the
    abandon age: a young one may be a live upload. (The clock is the only thing mocked.)"""
    remote = _remote_with_versions(tmp_path, 3)
    remote_dir = Path(remote.removeprefix("file://"))
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(9, {"a": torch.full((64,), 9.0), "b": torch.arange(32) * 9, "step": 9})
    leftover = _abandoned_upload(root, remote_dir, 9, files=1)
    tier = open_tier(remote)
    assert collect_abandoned(tier, 3600) == []  # just written: it may be in progress
    assert leftover.exists()
    assert collect_abandoned(tier, 3600, dry_run=True, clock=lambda: time.time() + 7200) == [9]
    assert collect_abandoned(tier, 3600, clock=lambda: time.time() + 7200) == [9]
    assert not leftover.exists()
    assert [c.step for c in committed(tier)] == [1, 2, 3]  # committed versions are never touched
    r = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "gc", remote, "--keep-last", "5", "--abandoned-after", "3600"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0 and "abandoned" not in r.stdout, r.stdout + r.stderr


def test_a_collector_and_a_committer_exclude_each_other(tmp_path: Path) -> None:
    """A GC collecting an abandoned upload of step 1 holds the version's commit claim: the
    replicator that comes back to finish that upload meanwhile does not commit it (its
    manifest would name files the GC is deleting); once the GC is done, the next pass
    uploads everything again and commits a version that verifies and restores bitwise."""
    root, remote_dir = tmp_path / "root", tmp_path / "remote"
    remote = f"file://{remote_dir}"
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.arange(32) * 3, "step": 1}
    with Checkpointer(root) as ck:
        ck.save(1, state)
    leftover = _abandoned_upload(root, remote_dir, 1, files=1)
    claim = leftover / versions.COMMIT_CLAIM
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_DELAY": "gc-abandoned:0:4"}
    gc = subprocess.Popen(
        [sys.executable, "-m", "ckpt.cli", "gc", remote, "--keep-last", "5", "--abandoned-after", "0.001"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (claim.exists() and claim.read_bytes() == b"gc"):  # the GC has claimed it, deletes nothing yet
        assert gc.poll() is None and time.monotonic() < deadline, gc.communicate()
        time.sleep(0.01)
    rep = Replicator([str(root)], ReplicatorConfig(remote=remote))
    entry = rep.run_once()[str(root)].versions[1]
    assert entry.remote is not None and entry.remote.state != "verified", entry
    assert not (leftover / "manifest.json").exists()
    out, _ = gc.communicate(timeout=60)
    assert gc.returncode == 0 and "abandoned upload(s): [1]" in out, out
    assert not leftover.exists()
    entry = rep.run_once()[str(root)].versions[1]
    assert entry.remote is not None and entry.remote.state == "verified", entry
    check = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "verify", remote], env=env, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    got = {"a": torch.zeros(4096), "b": torch.zeros(32, dtype=torch.int64), "step": 0}
    with Checkpointer(tmp_path / "fresh", tiers=[remote]) as ck:
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
