"""Faults on the replicating node's own disks stop only what they touch: a file of an old
version that fails to read on the source fails that version's copies, and the newer
versions still reach every destination in the same pass (real files, the I/O error
raised where the local tier reads, as tests/restore/test_read_errors.py does)."""

from __future__ import annotations

import errno
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.placement import source_label
from ckpt.replicator.policy import KeepLast
from ckpt.replicator.service import Replicator
from ckpt.store import _local as local
from ckpt.store.versions import committed_steps
from tests._disks import two_disks
from tests._dist import can_isolate, in_private_mounts


def _saved(root: Path) -> None:
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": {"w": torch.full((4096,), float(step))}, "step": step})


def test_an_unreadable_file_of_an_old_version_does_not_stop_the_newer_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1's chunk fails every read (a bad sector): its copy fails, and is tried again on
    every pass; steps 2 and 3 are copied (before: the destination counted as failed for the
    pass, so no newer version reached it on any pass)."""
    src, other = two_disks(tmp_path)
    _saved(src)
    real = local._FileHandle.read_into
    reads = []

    def read_into(self: Any, offset: int, out: memoryview) -> None:
        if "v000000000001/state/model/w/c" in self._key:
            reads.append(self._key)
            raise OSError(errno.EIO, "Input/output error", self._key)
        real(self, offset, out)

    monkeypatch.setattr(local._FileHandle, "read_into", read_into)
    rep = Replicator([str(src)], ReplicatorConfig(replicas=2, replica_roots=(str(other),)))
    for _ in range(2):
        copies = rep.run_once()[str(src)]
        states = {step: [c.state for c in v.copies.values()] for step, v in sorted(copies.versions.items())}
        assert states == {1: ["failed"], 2: ["verified"], 3: ["verified"]}, states
        assert "cannot read" in next(iter(copies.versions[1].copies.values())).error
    assert len(reads) >= 2  # tried on each pass
    assert committed_steps(str(other / "replicas" / source_label(str(src)))) == [2, 3]
    assert committed_steps(str(src)) == [1, 2, 3]


def test_a_replica_disk_that_fails_reads_does_not_stop_the_remote(tmp_path: Path) -> None:
    """The replica disk's marker read fails with a real EIO (a link to /proc/self/mem): its
    copies of the new versions fail, still required (the source keeps them through a GC),
    and the remote gets them in the same pass (before: the pass stopped at the marker, and
    no version reached the remote while that disk failed)."""
    import os

    from click.testing import CliRunner

    from ckpt.cli import main as cli_main
    from ckpt.replicator.status import read_status

    src, other = two_disks(tmp_path)
    remote = f"file://{tmp_path}/remote"
    with Checkpointer(src) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((64,), float(step))})
    args = ["replicate", str(src), "--once", "--replicas", "2", "--replica-root", str(other), "--to", remote]
    assert CliRunner().invoke(cli_main, args).exit_code == 0
    with Checkpointer(src) as ck:
        for step in (3, 4):
            ck.save(step, {"w": torch.full((64,), float(step))})
    marker = tmp_path / "disk1" / ".ckpt-disk"
    marker.unlink()
    os.symlink("/proc/self/mem", marker)  # reading it: EIO
    run = CliRunner().invoke(cli_main, args)
    assert run.exit_code == 3, run.output
    assert committed_steps(remote) == [1, 2, 3, 4]
    status = read_status(str(src))
    assert status is not None
    assert [c.state for c in status.versions[4].copies.values()] == ["failed"]
    swept = CliRunner().invoke(cli_main, ["gc", str(src), "--keep-last", "1"])
    assert swept.exit_code == 0, swept.output
    assert committed_steps(str(src)) == [3, 4], swept.output  # 3 and 4 have no replica copy yet


def test_replicate_once_exits_3_when_a_version_could_not_be_read(tmp_path: Path) -> None:
    """Step 2's manifest holds a flipped byte: steps 1 and 3 are copied, and `--once` exits
    3 naming step 2 (before: exit 0, as if every committed version had been copied)."""
    from click.testing import CliRunner

    from ckpt.cli import main as cli_main
    from tests._damage import flip_byte

    src, other = two_disks(tmp_path)
    _saved(src)
    flip_byte(src / "v000000000002" / "manifest.json", 40)
    run = CliRunner().invoke(
        cli_main, ["replicate", str(src), "--once", "--replicas", "2", "--replica-root", str(other)]
    )
    assert run.exit_code == 3, run.output
    assert "step 2" in run.output, run.output
    assert committed_steps(str(other / "replicas" / source_label(str(src)))) == [1, 3]


@pytest.mark.skipif(not can_isolate(), reason="needs root, unshare(1) and mount namespaces")
@pytest.mark.parametrize("keep_last", [1, 3])
def test_a_full_source_disk_is_replicated_and_then_freed(tmp_path: Path, keep_last: int) -> None:
    """The source root's disk (a real 2 MiB tmpfs) is full: three 400 kB versions and a
    filler file. `ckpt replicate --once --keep-last 1` copies every version to the remote
    and then deletes the two older ones. Before, its journal's write beside the root failed
    with ENOSPC, that failure was taken for the remote's, nothing was copied, so nothing
    counted as copied and nothing was freed: a full disk stayed full. With `--keep-last 3`
    nothing is freed, and the run still succeeds (its status, unwritten, is a warning)."""
    disk, remote = tmp_path / "disk", tmp_path / "remote"
    disk.mkdir()
    script = textwrap.dedent(
        f"""
        import errno, json, torch
        from click.testing import CliRunner
        from ckpt import Checkpointer
        from ckpt.cli import main
        from ckpt.store.versions import committed_steps
        src = {str(disk / "src")!r}
        with Checkpointer(src) as ck:
            for step in (1, 2, 3):
                ck.save(step, {{"w": torch.full((100_000,), float(step))}})
        try:
            with open({str(disk / "filler")!r}, "wb") as f:
                while True:
                    f.write(bytes(4096))
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        run = CliRunner().invoke(main, ["replicate", src, "--once", "--to", "file://{remote}", "--keep-last", "{keep_last}"])
        print(json.dumps({{"code": run.exit_code, "remote": committed_steps("file://{remote}"),
                          "source": committed_steps(src), "output": run.output[-2000:]}}))
        """
    )
    out = in_private_mounts(f"mount -t tmpfs -o size=2m tmpfs {disk}", script)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["remote"] == [1, 2, 3], got
    assert got["source"] == [3] if keep_last == 1 else [1, 2, 3], got
    assert got["code"] == 0, got


def test_a_replica_root_on_a_node_that_is_down_does_not_stop_the_others(tmp_path: Path) -> None:
    """Three copies: one on another node's root through a URL (ftp://, that node down: its
    connection refused, so the tier does not even open) and one on a local disk. The local
    copy is made and the remote one fails, still required: the source keeps the version
    through a GC (before: the pass failed at the URL root, and no copy was made anywhere)."""
    from tests.s3_server import free_port

    src, other = two_disks(tmp_path)
    with Checkpointer(src) as ck:
        ck.save(1, {"w": torch.arange(10.0)})
    down = f"ftp://127.0.0.1:{free_port()}/r"
    config = ReplicatorConfig(replicas=3, replica_roots=(down, str(other)), local_policy=KeepLast(1))
    rep = Replicator([str(src)], config)
    status = rep.run_once()[str(src)]
    states = {url.split(":")[0]: c.state for url, c in status.versions[1].copies.items()}
    assert states == {"ftp": "failed", str(other / "replicas" / source_label(str(src))): "verified"}, states
    assert rep.errors and "ftp://127.0.0.1" in rep.errors[0], rep.errors
    assert committed_steps(str(other / "replicas" / source_label(str(src)))) == [1]
    with Checkpointer(src) as ck:
        ck.save(2, {"w": torch.arange(10.0) + 2})
    rep.run_once()
    assert committed_steps(str(src)) == [1, 2]  # neither has its third copy


def test_a_version_a_gc_deletes_during_the_pass_is_no_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's retention deletes step 1 (for real) just after the pass listed it: that is
    nothing to copy, not a failure, and `--once` exits 0 (it exited 3, "not replicated")."""
    from click.testing import CliRunner

    from ckpt.cli import main as cli_main
    from ckpt.replicator import service
    from ckpt.store.versions import delete_version

    src, other = two_disks(tmp_path)
    _saved(src)
    real = service.read_root_info

    def deleted_meanwhile(tier: Any, step: int) -> Any:
        if step == 1 and 1 in committed_steps(str(src)):
            delete_version(str(src), 1)
        return real(tier, step)

    monkeypatch.setattr(service, "read_root_info", deleted_meanwhile)
    run = CliRunner().invoke(
        cli_main, ["replicate", str(src), "--once", "--replicas", "2", "--replica-root", str(other)]
    )
    assert run.exit_code == 0, run.output
    assert committed_steps(str(other / "replicas" / source_label(str(src)))) == [2, 3]
