"""GC by the records beside a root, and what it does when it cannot trust them.

1. The replicator's status (`.replicator/status.json`) or the peer-copy record
   (`.ckpt-peers.json`) that cannot be read (a directory in its place) or does not parse:
   the Checkpointer's retention pass and `ckpt gc` delete nothing (`ckpt gc` exits 3 with
   one line), never reading it as "no replicator" or "no peer copies", under which the
   copies would not be required. `ckpt ls` still lists the versions; a replicator starts
   its status anew.
2. A step saved again (overwrite=True) after its copies were verified: the copies are of
   the old save, so the new one is kept until it has its own.
3. Replica GC keeps the copy of a version the source no longer holds while the remote's
   copy is damaged: the replica holds the last good one.
4. keep_last=N with the newest version damaged keeps N versions a restore can use.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt._peer_status import PEER_STATUS, record_peer_copies
from ckpt._retention import Retention
from ckpt.cli import main as cli_main
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.gc import collect, judge
from ckpt.replicator.placement import source_label
from ckpt.replicator.policy import KeepLast, VersionInfo
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import CopyState, Status, VersionStatus, read_status, status_path, write_status
from ckpt.store import versions
from ckpt.store.tier import open_tier
from ckpt.store.versions import as_tier
from tests._disks import two_disks
from tests._states import assert_bitwise, blank


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(16, dtype=torch.float32) * step, "step": step}


def retention_pass(root: Path, keep_last: int) -> None:
    r = Retention(as_tier(str(root)), str(root), KeepLast(keep_last))
    try:
        r._run()  # one pass, on this thread
    finally:
        r.close()


def gc(root: Path, keep_last: int) -> Any:
    return CliRunner().invoke(cli_main, ["gc", str(root), "--keep-last", str(keep_last)])


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


# -- 1. records that cannot be read ------------------------------------------------------------


def _replicated_status(root: Path) -> None:
    """Steps 1-3 saved; a replicator that requires one copy has verified step 1's only."""
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
    status = Status(required_copies=1)
    for step in (1, 2, 3):
        m = versions.read_manifest(str(root), step)
        copy = CopyState("verified" if step == 1 else "pending", time.time())
        status.versions[step] = VersionStatus(m.save_id, m.created, {"/disk1/replica": copy})
    write_status(str(root), status)


def _unreadable(path: Path, how: str) -> None:
    path.unlink()
    if how == "directory":  # open() fails: EISDIR, as an I/O error would
        path.mkdir()
        (path / "x").write_text("x")
    else:
        path.write_bytes(b'{"versions": {"1": ')  # torn: not JSON


def test_status_read_as_written(tmp_path: Path) -> None:
    """The control: step 2 is kept (its copy is pending), step 1 goes."""
    _replicated_status(tmp_path)
    retention_pass(tmp_path, 1)
    assert versions.committed_steps(str(tmp_path)) == [2, 3]


@pytest.mark.parametrize("how", ["directory", "torn"])
def test_unreadable_status_deletes_nothing(tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    _replicated_status(tmp_path)
    _unreadable(Path(status_path(str(tmp_path))), how)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        retention_pass(tmp_path, 1)
    assert versions.committed_steps(str(tmp_path)) == [1, 2, 3]
    assert "retention pass failed" in caplog.text and "status.json" in caplog.text

    out = gc(tmp_path, 1)
    assert out.exit_code == 3, out.output
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("ckpt: error: ") and "status.json" in out.stderr
    assert versions.committed_steps(str(tmp_path)) == [1, 2, 3]

    ls = CliRunner().invoke(cli_main, ["ls", str(tmp_path), "--json"])
    assert ls.exit_code == 0, ls.output
    assert [r["step"] for r in json.loads(ls.stdout)] == [1, 2, 3]


def test_replicator_starts_anew_on_an_unreadable_status(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d0, d1 = two_disks(tmp_path)
    with Checkpointer(d0) as ck:
        ck.save(1, state(1))
    Path(status_path(str(d0))).parent.mkdir(parents=True)
    _unreadable_dir = Path(status_path(str(d0)))
    _unreadable_dir.mkdir()
    with caplog.at_level(logging.WARNING, logger="ckpt.replicator"):
        rep = Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),)))
    assert "cannot be read, so it starts anew" in caplog.text
    _unreadable_dir.rmdir()  # the disk is back: its first pass writes a status of its own
    rep.run_once()
    status = read_status(str(d0))
    assert status is not None and [c.state for c in status.versions[1].copies.values()] == ["verified"]


def _peer_copied(root: Path) -> None:
    """Steps 1-3 saved; the peer copies of step 1 are verified, 2's and 3's failed."""
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
    record_peer_copies(str(root), 1, {1: "verified"}, everywhere=True)
    record_peer_copies(str(root), 2, {1: "failed: timeout"}, everywhere=False)
    record_peer_copies(str(root), 3, {1: "failed: timeout"}, everywhere=False)


def test_peer_record_read_as_written(tmp_path: Path) -> None:
    """The control: step 1, the newest with its peer copies verified, is kept."""
    _peer_copied(tmp_path)
    retention_pass(tmp_path, 1)
    assert versions.committed_steps(str(tmp_path)) == [1, 2, 3]


@pytest.mark.parametrize("how", ["directory", "torn"])
def test_unreadable_peer_record_deletes_nothing(tmp_path: Path, how: str) -> None:
    _peer_copied(tmp_path)
    _unreadable(tmp_path / PEER_STATUS, how)
    retention_pass(tmp_path, 1)
    assert versions.committed_steps(str(tmp_path)) == [1, 2, 3]
    out = gc(tmp_path, 1)
    assert out.exit_code == 3 and PEER_STATUS in out.stderr, out.output
    assert versions.committed_steps(str(tmp_path)) == [1, 2, 3]


# -- 2. a step saved again ---------------------------------------------------------------------


def test_copies_of_an_overwritten_save_do_not_count(tmp_path: Path) -> None:
    d0, d1 = two_disks(tmp_path)
    replica = str(d1 / "replicas" / source_label(str(d0)))
    with Checkpointer(d0) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
    Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),))).run_once()
    old = versions.read_manifest(str(d0), 2).save_id
    with Checkpointer(d0) as ck:  # step 2 saved again: a rerun from step 1
        ck.save(2, state(42), overwrite=True)
    status = read_status(str(d0))
    assert status is not None and status.versions[2].save_id == old  # no replicator pass since
    assert versions.read_root_info(replica, 2).save_id == old  # no copy of the new save anywhere

    out = gc(d0, 1)
    assert out.exit_code == 0, out.output
    assert versions.committed_steps(str(d0)) == [2, 3]  # step 1 (copied) goes, the new step 2 stays
    target = blank(state(42))
    with Checkpointer(tmp_path / "reader", tiers=[str(d0)]) as reader:
        assert reader.restore(target, step=2) == 2
    assert_bitwise(target, state(42))


def test_judge_matches_copies_to_their_save(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
    ids = {s: versions.read_manifest(str(tmp_path), s).save_id for s in (1, 2)}
    tier = open_tier(str(tmp_path))
    got = {v.step: v.redundant for v in judge(tier, {1: ids[1], 2: "another save"})[0]}
    assert got == {1: True, 2: False}
    got = {v.step: v.redundant for v in judge(tier, {1: None})[0]}  # None: any save of the step
    assert got == {1: True, 2: False}


# -- 3. replica GC and the remote's copy -------------------------------------------------------


def test_replica_kept_while_the_remotes_copy_is_damaged(tmp_path: Path) -> None:
    """(One the remote cannot read right now: test_flaky_s3.py, with a 503 on S3.)"""
    d0, d1 = two_disks(tmp_path)
    remote = tmp_path / "remote"
    remote.mkdir()
    replica = str(d1 / "replicas" / source_label(str(d0)))
    config = dict(replicas=2, replica_roots=(str(d1),), remote=f"file://{remote}")
    with Checkpointer(d0) as ck:
        for step in range(1, 5):
            ck.save(step, state(step))
    Replicator([str(d0)], ReplicatorConfig(**config)).run_once()  # type: ignore[arg-type]
    assert versions.committed_steps(replica) == versions.committed_steps(str(remote)) == [1, 2, 3, 4]
    flip_byte(remote / versions.version_dirname(1) / "manifest.json")
    assert {v.step: v.intact for v in judge(open_tier(f"file://{remote}"))[0]}[1] is False

    versions.delete_version(str(d0), 1)  # by hand: the replica's copy is the last good one
    Replicator([str(d0)], ReplicatorConfig(**config, local_policy=KeepLast(2))).run_once()  # type: ignore[arg-type]
    assert 1 in versions.committed_steps(replica)
    target = blank(state(1))
    with Checkpointer(tmp_path / "reader", tiers=[replica]) as reader:
        assert reader.restore(target, step=1) == 1
    assert_bitwise(target, state(1))


# -- 4. keep_last and damaged versions ---------------------------------------------------------


def test_keep_last_counts_versions_a_restore_can_use(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, state(step))
    flip_byte(tmp_path / versions.version_dirname(4) / "manifest.json")
    result = collect(as_tier(str(tmp_path)), KeepLast(2))
    assert result.deleted == [1]
    assert versions.committed_steps(str(tmp_path)) == [2, 3, 4]  # 2 and 3 intact, 4 kept as before


def test_keep_last_policy_with_damaged_versions() -> None:
    vs = [VersionInfo(s, float(s), intact=s not in (4, 6)) for s in range(1, 7)]
    assert KeepLast(2).keep(vs) == {3, 5, 6}  # the newest 2, and the newest 2 not damaged
    assert KeepLast(2, of="full").keep(vs) == {3, 5, 6}
    assert KeepLast(0).keep(vs) == set()
    assert KeepLast(2).keep([VersionInfo(s, intact=None) for s in (1, 2, 3)]) == {2, 3}  # unread: may be intact


def test_copies_on_a_replica_root_no_longer_configured_do_not_count(tmp_path: Path) -> None:
    """The disk of a replica root dies, and the replicator is pointed at another one, where
    copies fail for now: the dead root's verified copies no longer count, and `ckpt gc`
    keeps every version (before: it deleted steps 1 and 2, which were then nowhere else)."""
    import shutil
    import subprocess

    roots = []
    for name in ("disk0", "disk1", "disk2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".ckpt-disk").write_text(name)
        roots.append(tmp_path / name / "ckpt")
    src, first, second = roots
    with Checkpointer(src) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
    run = CliRunner().invoke(
        cli_main, ["replicate", str(src), "--once", "--replicas", "2", "--replica-root", str(first)]
    )
    assert run.exit_code == 0, run.output
    shutil.rmtree(tmp_path / "disk1")
    second.mkdir()
    subprocess.run(["chattr", "+i", str(second)], check=True)  # nothing can be made there, even as root
    try:
        run = CliRunner().invoke(
            cli_main, ["replicate", str(src), "--once", "--replicas", "2", "--replica-root", str(second)]
        )
        assert run.exit_code == 3, run.output
        swept = gc(src, 1)
        assert swept.exit_code == 0, swept.output
        assert versions.committed_steps(str(src)) == [1, 2, 3], swept.output
        listed = CliRunner().invoke(cli_main, ["ls", str(src), "--json"])  # as the GC counts them
        rows = json.loads(listed.output)
        assert [[c["state"] for c in r["copies"].values()] for r in rows] == [["failed"]] * 3, listed.output
    finally:
        subprocess.run(["chattr", "-i", str(second)], check=False)
