"""Where the replicator puts copies, and what one version's failure does to the others.

1. Disks are told apart by what they are: an unmarked replica root on the source's device
   (or on the device of a replica already chosen) is no second disk, even though claiming
   it would write a `.ckpt-disk` there, nor is one an older claim marked there; a
   symlinked replica root is judged where it points. /dev/shm is a device of its own here,
   so "another disk" is a real one.
2. A failure that belongs to one version (its source chunk damaged, the remote holding
   another save of its step) fails that version's copy only: the later versions are
   copied in the same pass, and every pass after.
3. Source roots whose paths differ only past the label's length get replica directories
   of their own.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt.cli import main as cli
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.placement import claim_disk, source_label
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import CopyState, Status, VersionStatus, write_status
from ckpt.store import versions
from tests._disks import two_disks


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) * step}


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm: another device than tmp_path's."""
    d = Path("/dev/shm") / f"ckpt-placement-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    if os.stat(d).st_dev == os.stat(tmp_path).st_dev:
        shutil.rmtree(d)
        pytest.skip("/dev/shm is on tmp_path's device here")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def copies(status: Status, step: int) -> dict[str, str]:
    return {url: c.state for url, c in status.versions[step].copies.items()}


# -- 1. distinct disks -------------------------------------------------------------------------


def test_unmarked_replica_roots_are_told_apart_by_device(tmp_path: Path, shm: Path) -> None:
    src = tmp_path / "src"
    same_device = tmp_path / "elsewhere"  # unmarked, on the source's device
    other_a, other_b = shm / "a", shm / "b"  # unmarked, both on /dev/shm
    with Checkpointer(src) as ck:
        ck.save(1, state(1))
    config = ReplicatorConfig(replicas=3, replica_roots=(str(same_device), str(other_a), str(other_b)))
    replicator = Replicator([str(src)], config)
    status = replicator.run_once()[str(src)]
    assert copies(status, 1) == {f"{other_a}/replicas/{source_label(str(src))}": "verified"}
    assert status.required_copies == 1  # three copies asked for, two disks found
    assert not same_device.exists() and not other_b.exists()
    assert versions.committed_steps(str(other_a / "replicas" / source_label(str(src)))) == [1]
    # The copies asked for were not all made: the pass fails (before: no error, `--once` exited 0).
    assert replicator.errors == [f"only 2 distinct disks for 3 copies of {src}"], replicator.errors
    once = CliRunner().invoke(
        cli, ["replicate", str(src), "--replicas", "2", "--replica-root", str(same_device), "--once"]
    )
    assert once.exit_code == 3 and "only 1 distinct disks for 2 copies" in once.output, once.output
    assert not same_device.exists()


def test_a_root_claimed_on_a_device_a_copy_is_on_is_no_second_disk(
    tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Older code claimed any unmarked root: the `.ckpt-disk` it wrote on the source's device
    (and the disk it recorded in the status, with a copy there), or on an earlier replica's,
    proves no second disk. Such a root is skipped, saying so, and its copy no longer counts."""
    src = tmp_path / "src"
    same_device = tmp_path / "elsewhere"  # claimed by older code, on the source's device
    other_a, other_b = shm / "a", shm / "b"  # other_b claimed by older code, on other_a's device
    with Checkpointer(src) as ck:
        ck.save(1, state(1))
    label = source_label(str(src))
    m = versions.read_manifest(str(src), 1)
    old = Status(required_copies=1, disks={str(same_device): claim_disk(str(same_device))})
    old.versions[1] = VersionStatus(
        m.save_id, m.created, {f"{same_device}/replicas/{label}": CopyState("verified", 1.0)}
    )
    write_status(str(src), old)
    claim_disk(str(other_b))
    config = ReplicatorConfig(replicas=4, replica_roots=(str(same_device), str(other_a), str(other_b)))
    with caplog.at_level(logging.WARNING, logger="ckpt.replicator"):
        status = Replicator([str(src)], config).run_once()[str(src)]
    assert copies(status, 1) == {f"{other_a}/replicas/{label}": "verified"}
    assert status.required_copies == 1 and list(status.disks) == [str(other_a)]
    assert not (other_b / "replicas").exists()
    assert f"{same_device} is on the device of {src}" in caplog.text
    assert f"{other_b} is on the device of {other_a}" in caplog.text


def test_a_symlinked_replica_root_is_on_the_disk_it_points_into(tmp_path: Path) -> None:
    d0, d1 = two_disks(tmp_path)
    target = d0.parent / "elsewhere"  # on disk0, the source's
    target.mkdir()
    link = d1.parent / "link"  # a name on disk1, pointing into disk0
    link.symlink_to(target)
    with Checkpointer(d0) as ck:
        ck.save(1, state(1))
    status = Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(link),))).run_once()[str(d0)]
    assert copies(status, 1) == {}
    assert not (target / "replicas").exists()


# -- 2. one version's failure ------------------------------------------------------------------


def _chunk_files(root: Path, step: int) -> list[Path]:
    m = versions.read_manifest(str(root), step)
    name = versions.version_dirname(step)
    return [root / name / a.chunk_path(c) for a in m.arrays.values() for c in a.iter_chunks() if c.inline is None]


def test_a_damaged_source_version_fails_alone(tmp_path: Path) -> None:
    d0, d1 = two_disks(tmp_path)
    replica = d1 / "replicas" / source_label(str(d0))
    with Checkpointer(d0) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
    chunk = _chunk_files(d0, 1)[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    rep = Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),)))
    for _ in range(2):
        status = rep.run_once()[str(d0)]
        assert list(copies(status, 1).values()) == ["failed"]
        assert "CorruptVersionError" in next(iter(status.versions[1].copies.values())).error
        assert list(copies(status, 2).values()) == ["verified"]
    assert versions.committed_steps(str(replica)) == [2]


def test_a_remote_holding_another_save_of_a_step_fails_that_step_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    remote = tmp_path / "remote"
    config = ReplicatorConfig(remote=f"file://{remote}")
    with Checkpointer(root) as ck:
        ck.save(1, state(1))
    Replicator([str(root)], config).run_once()
    with Checkpointer(root) as ck:
        ck.save(1, state(11), overwrite=True)  # a rerun from step 0, after step 1 was uploaded
        ck.save(2, state(2))
        ck.save(3, state(3))
    rep = Replicator([str(root)], config)
    for _ in range(2):
        status = rep.run_once()[str(root)]
        assert status.versions[1].remote is not None and status.versions[1].remote.state == "failed"
        assert "VersionExistsError" in status.versions[1].remote.error
        assert [status.versions[s].remote.state for s in (2, 3)] == ["verified", "verified"]  # type: ignore[union-attr]
    assert versions.committed_steps(str(remote)) == [1, 2, 3]


# -- 3. labels ---------------------------------------------------------------------------------


def test_long_source_paths_get_replica_directories_of_their_own(tmp_path: Path) -> None:
    for d in ("disk0", "disk1"):
        (tmp_path / d).mkdir()
        (tmp_path / d / ".ckpt-disk").write_text(d)
    deep = tmp_path / "disk0" / ("experiments-" + "x" * 60) / ("sweep-" + "y" * 60) / ("job-" + "z" * 60)
    a, b = deep / "run-a", deep / "run-b"
    assert source_label(str(a)) != source_label(str(b))
    assert len(source_label(str(a))) == 200
    short = tmp_path / "disk0" / "run"
    assert source_label(str(short)).endswith(str(short).strip("/").replace("/", "_"))  # short ones as before
    for root, k in ((a, 1), (b, 2)):
        with Checkpointer(root) as ck:
            ck.save(1, state(k))
    Replicator([str(a), str(b)], ReplicatorConfig(replicas=2, replica_roots=(str(tmp_path / "disk1"),))).run_once()
    saves = {
        versions.read_root_info(str(d), 1).save_id  # type: ignore[union-attr]
        for d in (tmp_path / "disk1" / "replicas").iterdir()
    }
    assert saves == {versions.read_manifest(str(r), 1).save_id for r in (a, b)}


# -- 4. a copy the status does not vouch for ---------------------------------------------------


def test_a_committed_replica_missing_a_file_is_copied_again_after_the_status_is_lost(tmp_path: Path) -> None:
    """Its record lost, a replicator found a committed copy of the same save and counted it
    verified without looking: here one chunk file of it was gone."""
    from ckpt.replicator.status import STATE_DIR

    d0, d1 = two_disks(tmp_path)
    replica = d1 / "replicas" / source_label(str(d0))
    with Checkpointer(d0) as ck:
        ck.save(1, state(1))
    config = ReplicatorConfig(replicas=2, replica_roots=(str(d1),))
    Replicator([str(d0)], config).run_once()
    lost = _chunk_files(replica, 1)[0]
    lost.unlink()
    shutil.rmtree(d0 / STATE_DIR)
    status = Replicator([str(d0)], config).run_once()[str(d0)]
    assert list(copies(status, 1).values()) == ["verified"] and lost.exists()
    target = {"w": torch.zeros(4096)}
    with Checkpointer(tmp_path / "reader", tiers=[str(replica)]) as reader:
        assert reader.restore(target) == 1
    assert torch.equal(target["w"], state(1)["w"])
    inode = os.stat(lost).st_ino
    shutil.rmtree(d0 / STATE_DIR)  # lost again: now the copy is whole, and counts as it is
    status = Replicator([str(d0)], config).run_once()[str(d0)]
    assert list(copies(status, 1).values()) == ["verified"] and os.stat(lost).st_ino == inode
