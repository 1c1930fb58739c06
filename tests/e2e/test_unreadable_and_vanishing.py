"""Disks that fail under a running job, for real, in a private mount namespace (unshare -m, as root).

1. The root dies mid-save: it is an ext4 filesystem on a loop device, and the kernel is told to
   shut it down (FS_IOC_SHUTDOWN, what xfstests uses to simulate a dead disk: every read and
   write fails with EIO from then on) while a save is writing. Later the mount goes away and a
   plain file takes the root's place (ENOTDIR). The save fails with TierUnavailableError,
   restore comes from the replica on the other disk, `ckpt ls`/`verify` print one error line
   and exit 3, and the replica and the remote keep every committed version. Before that, one
   version directory alone becomes unreadable (its files on a second ext4 that dies): restore
   reads its chunks from the replica and `ckpt verify` names each unreadable chunk (exit 3:
   an I/O error is no proof of damage).
2. A replica disk vanishes mid-copy: the replicator copies a version onto a tmpfs that is lazily
   unmounted (umount -l) in the middle. It reports the error, still uploads to the remote,
   commits nothing half-copied, leaves the source alone, and finishes once the disk is back.
3. The replica's directory is deleted mid-copy (no namespace needed): the copy is completed,
   what was deleted is sent again, and the replica is committed only whole.
6. A dead disk with nothing else to read: `ckpt restore` and `inspect` exit 3 (an I/O
   error), not 1 (damage).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer
from ckpt.replicator.placement import source_label
from ckpt.store import versions
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]

COMMON = """
import fcntl, json, os, struct, subprocess, sys, time
import torch
from tests._states import bitwise_diff

def state_for(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.arange(100) * step, "step": step}

def blank():
    return {"w": torch.zeros(512, 1024), "b": torch.zeros(100, dtype=torch.int64), "step": 0}

def same(got, step):
    return not bitwise_diff(got, state_for(step))

def report(tag, fn):
    try:
        print(tag, "ok", fn(), flush=True)
    except Exception as e:
        print(tag, type(e).__name__, getattr(e, "errno", None), str(e).replace(chr(10), " "), flush=True)
"""


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.arange(100) * step, "step": step}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(512, 1024), "b": torch.zeros(100, dtype=torch.int64), "step": 0}


def _can_mount(fstype: str) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    if fstype == "ext4" and (shutil.which("mkfs.ext4") is None or not os.path.exists("/dev/loop-control")):
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


def _run_in_namespace(shell: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"rc {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr[-6000:]}"
    return out


def _lines(out: str, tag: str) -> list[str]:
    return [line[len(tag) + 1 :] for line in out.splitlines() if line.startswith(tag + " ")]


def _tree_digest(top: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(top):
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(top))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- 1. the root dies ------------------------------------------------------------------------------

ROOT_DIES = COMMON + textwrap.dedent(
    """
    import ckpt
    from ckpt import Checkpointer
    from ckpt.replicator.placement import source_label
    from ckpt.replicator.status import read_status

    base = sys.argv[1]
    d0, d1 = base + "/disk0/ckpt", base + "/disk1/ckpt"
    remote = "file://" + base + "/remote"
    replica = d1 + "/replicas/" + source_label(d0)

    def shutdown(mount_point):  # the filesystem dies: EIO from now on
        fd = os.open(mount_point, os.O_RDONLY)
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))  # FS_IOC_SHUTDOWN, FSOP_GOING_FLAGS_NOLOGFLUSH
        os.close(fd)

    def replicated(steps):
        status = read_status(d0)
        v = status.versions if status is not None else {}
        return all(
            s in v
            and v[s].remote is not None
            and v[s].remote.state == "verified"
            and [c.state for c in v[s].copies.values()] == ["verified"]
            for s in steps
        )

    def cli(*args):  # a real `ckpt` process
        out = subprocess.run([sys.executable, "-m", "ckpt.cli", *args], capture_output=True, text=True)
        print("CLI", args[0], out.returncode, repr(out.stderr), flush=True)
        return out

    def cli_here(*args):  # the same command in this process (quicker)
        from click.testing import CliRunner
        from ckpt.cli import main
        out = CliRunner().invoke(main, list(args))
        print("CLI", args[0], out.exit_code, repr(out.stderr), flush=True)
        return out

    def restore():
        got = blank()
        step = ck.restore(got)
        return step, same(got, step)

    ck = Checkpointer([d0, d1], replicate_to=remote, split_bytes=1 << 19)
    for s in (1, 2, 3):
        ck.save(s, state_for(s))
        ck.wait()
    deadline = time.time() + 60
    while not replicated((1, 2, 3)) and time.time() < deadline:
        time.sleep(0.05)
    print("REPLICATED", replicated((1, 2, 3)), flush=True)

    # one version directory becomes unreadable: its state/ moves onto a second ext4 that dies
    v2state = d0 + "/v000000000002/state"
    subprocess.run(["mount", "-o", "loop", base + "/v2.img", base + "/v2disk"], check=True)
    subprocess.run(["cp", "-a", v2state, base + "/v2disk/state"], check=True)
    subprocess.run(["mount", "--bind", base + "/v2disk/state", v2state], check=True)
    shutdown(base + "/v2disk")

    def restore_2():
        got = blank()
        return ck.restore(got, step=2), same(got, 2)

    report("RESTORE_V2", restore_2)  # chunk by chunk from the replica
    out = cli_here("verify", d0, "--step", "2")
    print("VERIFY_V2", [line for line in out.stdout.splitlines() if "UNREADABLE" in line or "BAD" in line], flush=True)
    out = cli_here("ls", d0, "--json")
    print("LS_V2", [r["step"] for r in json.loads(out.stdout)], flush=True)

    # the disk dies while step 4 is being written (each chunk write waits 1 s first)
    os.environ["CKPT_DELAY"] = "write:0:1.0"
    ck.save(4, state_for(4))
    deadline = time.time() + 30  # until the writers are in (its directories exist before any data)
    while not any(n.startswith("v000000000004.tmp-") for n in os.listdir(d0)):
        assert time.time() < deadline, "step 4 never started writing"
        time.sleep(0.01)
    shutdown(base + "/disk0")
    report("WAIT4", ck.wait)
    del os.environ["CKPT_DELAY"]
    report("SAVE5", lambda: (ck.save(5, state_for(5)), ck.wait()))
    report("RESTORE_EIO", restore)
    out = cli("ls", d0, "--json")
    print("LS_EIO", [(r["step"], r["status"], r["detail"][-40:]) for r in json.loads(out.stdout)], flush=True)
    cli("verify", d0)
    out = cli_here("restore", d0, "--tier", replica, "--to", base + "/out1")
    print("EXPORT_EIO", out.stdout.strip(), flush=True)

    # the mount is gone and a plain file stands where the root was
    subprocess.run(["umount", "-l", base + "/disk0"], check=True)
    os.makedirs(base + "/disk0", exist_ok=True)
    open(d0, "w").close()
    report("RESTORE_ENOTDIR", restore)
    report("SAVE6", lambda: (ck.save(6, state_for(6)), ck.wait()))
    cli_here("ls", d0)
    cli_here("verify", d0)
    out = cli_here("restore", d0, "--tier", replica, "--to", base + "/out2")
    print("EXPORT_ENOTDIR", out.stdout.strip(), flush=True)
    report("CLOSE", ck.close)
    """
)


@pytest.mark.skipif(not _can_mount("ext4"), reason="needs root, unshare -m and loop-mounted ext4")
def test_root_dies_mid_save(tmp_path: Path) -> None:
    for d in ("disk0", "disk1", "remote"):
        (tmp_path / d).mkdir()
    (tmp_path / "disk1" / ".ckpt-disk").write_text("disk1")
    image = tmp_path / "disk0.img"
    for img, size in ((image, 96 << 20), (tmp_path / "v2.img", 16 << 20)):
        with open(img, "wb") as f:
            f.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    (tmp_path / "v2disk").mkdir()
    script = tmp_path / "child.py"
    script.write_text(ROOT_DIES)
    out = _run_in_namespace(
        f"mount -o loop {image} {tmp_path}/disk0 && echo disk0 > {tmp_path}/disk0/.ckpt-disk && "
        f"cd {REPO} && PYTHONPATH={REPO} exec {sys.executable} {script} {tmp_path}"
    ).stdout
    d0 = f"{tmp_path}/disk0/ckpt"
    assert _lines(out, "REPLICATED") == ["True"], out

    # an unreadable version directory: restore reads its chunks from the replica; verify names
    # every unreadable chunk and zarr document below it (exit 3, not damage); ls still lists
    # it (its manifest is readable)
    assert _lines(out, "RESTORE_V2") == ["ok (2, True)"], out
    bad = ast.literal_eval(_lines(out, "VERIFY_V2")[0])
    assert all("UNREADABLE" in line and "Input/output error" in line for line in bad), out
    named = sorted(line.split(": ")[1].removeprefix("UNREADABLE ") for line in bad)
    assert named == ["state/b/c.0", "state/b/zarr.json", "state/w/c.0.0", "state/w/zarr.json", "state/zarr.json"], out
    assert _lines(out, "LS_V2") == ["[1, 2, 3]"], out

    # the save in flight and the next one fail with the documented error, errno kept
    wait4 = _lines(out, "WAIT4")[0]
    assert wait4.startswith("TierUnavailableError 5 ") and "step 4" in wait4 and "Input/output error" in wait4, out
    save5 = _lines(out, "SAVE5")[0]
    assert save5.startswith("TierUnavailableError 5 ") and "step 5" in save5, out
    assert _lines(out, "SAVE6")[0].startswith("TierUnavailableError 20 "), out  # ENOTDIR
    # restore comes from the replica on the other disk (and the remote), bitwise
    assert _lines(out, "RESTORE_EIO") == ["ok (3, True)"], out
    assert _lines(out, "RESTORE_ENOTDIR") == ["ok (3, True)"], out
    # ls and verify on the broken root: one readable line on stderr, exit 3 (not 0, not a traceback)
    cli = [
        (line.split(" ")[0], int(line.split(" ")[1]), ast.literal_eval(line.split(" ", 2)[2]))
        for line in _lines(out, "CLI")
    ]
    assert [(cmd, rc) for cmd, rc, _ in cli] == [
        ("verify", 3),
        ("ls", 0),
        ("ls", 0),
        ("verify", 3),
        ("restore", 0),
        ("ls", 3),
        ("verify", 3),
        ("restore", 0),
    ], out
    cli = cli[2:]
    for cmd, rc, err in cli:
        if rc:
            assert err.startswith(("ckpt: error: ", "3 unreadable files ")) and err.count("\n") == 1, (cmd, err)
    # ls lists every version of the dead disk, each marked unreadable, saying why
    listed = ast.literal_eval(_lines(out, "LS_EIO")[0])
    assert [s for s, _, _ in listed] == [1, 2, 3] and all(st == "unreadable" for _, st, _ in listed), listed
    assert all("manifest.json: Input/output error" in why for _, _, why in listed), listed
    # verify names each version whose manifest fails to read (UNREADABLE, on stdout) and sums them up
    assert cli[1][2] == "3 unreadable files (I/O errors: run it again)\n", cli[1]
    assert "is not a directory" in cli[3][2] and "is not a directory" in cli[4][2]
    # `ckpt restore ROOT --tier REPLICA` reads past the broken root
    assert _lines(out, "EXPORT_EIO")[0].startswith("restored step 3 "), out
    assert _lines(out, "EXPORT_ENOTDIR")[0].startswith("restored step 3 "), out
    assert "not a directory; reading the other tiers" in cli[5][2]
    assert _lines(out, "CLOSE")[0].startswith("ok"), out

    # nothing committed elsewhere is lost, and nothing of the failed saves got out
    replica = tmp_path / "disk1" / "ckpt" / "replicas" / source_label(d0)
    assert versions.committed_steps(str(replica)) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "remote").iterdir() if p.name.startswith("v")) == [
        f"v{s:012d}" for s in (1, 2, 3)
    ]
    for out_dir in ("out1", "out2"):
        assert versions.committed_steps(str(tmp_path / out_dir)) == [3]
    for step in (1, 2, 3):
        for tiers in ([str(replica)], [f"file://{tmp_path / 'remote'}"]):
            got = _blank()
            with Checkpointer(tmp_path / "fresh", tiers=tiers) as ck:
                assert ck.restore(got, step=step) == step
            assert_bitwise(got, state_for(step), f"step {step} from {tiers}")
    got = _blank()
    with Checkpointer(tmp_path / "out2") as ck:
        assert ck.restore(got) == 3
    assert_bitwise(got, state_for(3), "step 3 from out2")


# -- 2. a replica disk vanishes mid-copy ----------------------------------------------------------

DISK_VANISHES = COMMON + textwrap.dedent(
    """
    import signal
    from click.testing import CliRunner
    from ckpt import Checkpointer
    from ckpt.cli import main as cli
    from ckpt.replicator.placement import source_label
    from ckpt.replicator.status import read_status
    from ckpt.store import versions

    base = sys.argv[1]
    src, disk1 = base + "/disk0/ckpt", base + "/disk1"
    remote = "file://" + base + "/remote"
    replica, hidden = disk1 + "/replicas/" + source_label(src), base + "/hidden/replicas/" + source_label(src)

    def wait_for(what, cond, timeout=30):
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def copy_state(step):
        status = read_status(src)
        entry = status.versions.get(step) if status is not None else None
        return [c.state for c in entry.copies.values()] if entry is not None else []

    def updated():
        status = read_status(src)
        return status.updated if status is not None else None

    def files(top):
        return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs)

    def big():  # 32 files of 512 KiB
        return {f"t{i}": torch.arange(1 << 17, dtype=torch.float32) + i for i in range(32)}

    with Checkpointer(src) as ck:
        ck.save(1, state_for(1))
        ck.save(2, {**state_for(2), "big": big()})
    before = {s: files(src + f"/v{s:012d}") for s in (1, 2)}
    log = open(base + "/daemon.log", "w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ckpt.cli", "replicate", src, "--replicas", "2", "--replica-root", disk1,
         "--to", remote, "--bwlimit", "8", "--interval", "0.2"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        part = replica + "/v000000000002/state/big"
        wait_for("the copy of step 2 to start", lambda: len(files(part)) >= 4)
        subprocess.run(["umount", "-l", disk1], check=True)  # the disk is gone, mid-copy
        print("VANISHED", flush=True)
        wait_for("the remote copy of step 2", lambda: os.path.isfile(base + "/remote/v000000000002/manifest.json"))
        wait_for("the failure in the status", lambda: copy_state(2) == ["failed"])
        print("STATUS_GONE", copy_state(1), copy_state(2), flush=True)
        # nothing half-copied is committed: not on the lost disk, not below its mount point
        print("COMMITTED_ON_LOST_DISK", versions.committed_steps(hidden), flush=True)
        print("COMMITTED_BELOW_MOUNT", versions.committed_steps(replica), flush=True)
        listing = CliRunner().invoke(cli, ["ls", hidden, "--json"])
        print("LS_LOST_DISK", listing.exit_code, [r["step"] for r in json.loads(listing.stdout)], flush=True)
        # a few more passes while the disk is away (each pass ends by writing the status)
        seen = {updated()}
        wait_for("3 more replicator passes", lambda: seen.add(updated()) or len(seen) > 3)
        subprocess.run(["mount", "--bind", base + "/hidden", disk1], check=True)  # it comes back
        wait_for("the copy of step 2 after the disk came back", lambda: copy_state(2) == ["verified"])
        print("STATUS_BACK", copy_state(1), copy_state(2), flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        print("DAEMON_RC", daemon.wait(timeout=60), flush=True)
    print("COMMITTED_BACK", versions.committed_steps(replica), flush=True)
    check = CliRunner().invoke(cli, ["verify", replica])
    print("VERIFY_REPLICA", check.exit_code, flush=True)
    print("SOURCE_SAME", {s: files(src + f"/v{s:012d}") for s in (1, 2)} == before, flush=True)
    extra = {s: sorted(set(files(replica + f"/v{s:012d}")) ^ set(before[s])) for s in (1, 2)}
    print("REPLICA_FILES_DIFFER", extra, flush=True)
    got = {**blank(), "big": {k: torch.zeros_like(v) for k, v in big().items()}}
    with Checkpointer(base + "/fresh", tiers=[replica]) as ck:
        step = ck.restore(got)
    ok = not bitwise_diff(got, {**state_for(2), "big": big()})
    print("RESTORED_FROM_REPLICA", step, ok, flush=True)
    """
)


@pytest.mark.skipif(not _can_mount("tmpfs"), reason="needs root and unshare -m to mount a tmpfs")
def test_replica_disk_vanishes_mid_copy(tmp_path: Path) -> None:
    for d in ("disk0", "disk1", "hidden", "remote"):
        (tmp_path / d).mkdir()
    (tmp_path / "disk0" / ".ckpt-disk").write_text("disk0")
    script = tmp_path / "driver.py"
    script.write_text(DISK_VANISHES)
    # disk1 is a tmpfs with its own marker; `hidden` keeps it alive (and reachable) once unmounted
    out = _run_in_namespace(
        f"mount -t tmpfs -o size=64m tmpfs {tmp_path}/disk1 && echo disk1 > {tmp_path}/disk1/.ckpt-disk && "
        f"mount --bind {tmp_path}/disk1 {tmp_path}/hidden && "
        f"cd {REPO} && PYTHONPATH={REPO} exec {sys.executable} {script} {tmp_path}"
    ).stdout
    log = (tmp_path / "daemon.log").read_text()
    where = f"{out}\n--- daemon log\n{log[-4000:]}"
    assert "VANISHED" in out.splitlines(), where
    # it says what happened, once, and goes on with the remote
    assert _lines(out, "STATUS_GONE") == ["['verified'] ['failed']"], where
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert len(errors) == 1, where
    assert "copy of step 2 to" in errors[0] and "the other copies go on" in errors[0] and "is gone" in errors[0]
    assert "Traceback" not in log, where
    # nothing half-copied counts as committed, wherever the path leads
    assert _lines(out, "COMMITTED_ON_LOST_DISK") == ["[1]"], where
    assert _lines(out, "COMMITTED_BELOW_MOUNT") == ["[]"], where
    assert _lines(out, "LS_LOST_DISK") == ["0 [1]"], where
    # back: the copy completes, verified, bitwise, without stray files; the source is untouched
    assert _lines(out, "STATUS_BACK") == ["['verified'] ['verified']"], where
    assert _lines(out, "DAEMON_RC") == ["0"], where
    assert _lines(out, "COMMITTED_BACK") == ["[1, 2]"], where
    assert _lines(out, "VERIFY_REPLICA") == ["0"], where
    assert _lines(out, "SOURCE_SAME") == ["True"], where
    assert _lines(out, "REPLICA_FILES_DIFFER") == ["{1: [], 2: []}"], where
    assert _lines(out, "RESTORED_FROM_REPLICA") == ["2 True"], where
    assert versions.committed_steps(str(tmp_path / "remote")) == [1, 2]
    with Checkpointer(tmp_path / "fresh", tiers=[f"file://{tmp_path / 'remote'}"]) as ck:
        got = _blank()
        assert ck.restore(got, step=1) == 1
    assert_bitwise(got, state_for(1), "step 1 from the remote")


def test_replica_directory_deleted_mid_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The replica's directory is deleted while a version is copied into it (an operator's
    rm -rf, a cleanup job): the copy does not count what was deleted as copied, the version
    is committed there only complete, and it reads back bitwise."""
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.service import Replicator
    from ckpt.replicator.status import read_status
    from ckpt.store.versions import committed

    for d in ("disk0", "disk1"):
        (tmp_path / d).mkdir()
        (tmp_path / d / ".ckpt-disk").write_text(d)
    src = tmp_path / "disk0" / "ckpt"
    big = {f"t{i}": torch.arange(1 << 17, dtype=torch.float32) + i for i in range(24)}  # 24 files of 512 KiB
    with Checkpointer(src) as ck:
        ck.save(1, {**state_for(1), "big": big})
    before = _tree_digest(src / "v000000000001")
    rep = Replicator([str(src)], ReplicatorConfig(replicas=2, replica_roots=(str(tmp_path / "disk1"),), bwlimit_mbps=8))
    replica = tmp_path / "disk1" / "replicas" / source_label(str(src))
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(rep.run_once()))
    thread.start()
    deadline = time.time() + 60
    while len(list((replica / "v000000000001").rglob("c.0"))) < 4:
        assert time.time() < deadline and thread.is_alive(), "the copy did not start"
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="ckpt.replicator"):
        # mid-copy; the replicator keeps writing into it, so an rmtree can meet a file created
        # meanwhile (ENOTEMPTY): delete until the directory is gone, as an operator's rm -rf would
        for _ in range(50):
            try:
                shutil.rmtree(tmp_path / "disk1" / "replicas")
                break
            except OSError:
                continue
        thread.join(timeout=120)
    assert done, "run_once did not return"
    assert any("are gone; sending them again" in r.getMessage() for r in caplog.records), caplog.text
    status = read_status(str(src))
    assert status is not None
    copies = status.versions[1].copies
    assert [c.state for c in copies.values()] == ["verified"], copies
    assert [c.step for c in committed(str(replica))] == [1]
    assert _tree_digest(replica / "v000000000001") == before  # every file, byte for byte, nothing more
    assert _tree_digest(src / "v000000000001") == before
    got = {**_blank(), "big": {k: torch.zeros_like(v) for k, v in big.items()}}
    with Checkpointer(tmp_path / "fresh", tiers=[str(replica)]) as ck:
        assert ck.restore(got) == 1
    assert_bitwise(got, {**state_for(1), "big": big}, "step 1 from the replica")


# -- 5. a replica disk that is not mounted when the replicator starts ----------------------------

NOT_MOUNTED = COMMON + textwrap.dedent(
    """
    from ckpt import Checkpointer
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.service import Replicator
    from ckpt.replicator.status import read_status

    base = sys.argv[1]
    src, disk1 = base + "/disk0/ckpt", base + "/disk1"
    config = ReplicatorConfig(replicas=2, replica_roots=(disk1,))

    def copy_states(status, step):
        return [(c.state, c.error) for c in status.versions[step].copies.values()]

    with Checkpointer(src) as ck:
        ck.save(1, state_for(1))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", disk1], check=True)
    status = Replicator([src], config).run_once()[src]  # the first start: the disk is there
    print("FIRST", [s for s, _ in copy_states(status, 1)], flush=True)
    subprocess.run(["umount", disk1], check=True)  # a reboot, and the disk is not mounted back
    with Checkpointer(src) as ck:
        ck.save(2, state_for(2))
    status = Replicator([src], config).run_once()[src]  # a new replicator process, the same source
    print("UNMOUNTED", copy_states(status, 2), flush=True)
    print("BELOW_MOUNT_POINT", sorted(os.listdir(disk1)), flush=True)
    """
)


@pytest.mark.skipif(not _can_mount("tmpfs"), reason="needs root and unshare -m to mount a tmpfs")
def test_a_replica_disk_not_mounted_at_start_is_not_written(tmp_path: Path) -> None:
    """A replicator (re)started while its replica disk is not mounted finds the empty mount
    point, on the root filesystem, in its place: that is not the disk the copies were on.
    The copy is reported failed, saying so, and nothing is written below the mount point."""
    for d in ("disk0", "disk1"):
        (tmp_path / d).mkdir()
    (tmp_path / "disk0" / ".ckpt-disk").write_text("disk0")
    script = tmp_path / "driver.py"
    script.write_text(NOT_MOUNTED)
    out = _run_in_namespace(f"cd {REPO} && PYTHONPATH={REPO} exec {sys.executable} {script} {tmp_path}").stdout
    assert _lines(out, "FIRST") == ["['verified']"], out
    (unmounted,) = _lines(out, "UNMOUNTED")
    assert unmounted.startswith("[('failed', ") and "is gone" in unmounted, out
    assert _lines(out, "BELOW_MOUNT_POINT") == ["[]"], out


# -- 6. a dead disk and nothing else to read (found by review, 2026-12-05) ----------------------

DEAD_ROOT_ALONE = COMMON + textwrap.dedent(
    """
    from ckpt import Checkpointer

    base = sys.argv[1]
    root = base + "/disk0/ckpt"
    with Checkpointer(root) as ck:
        for s in (1, 2):
            ck.save(s, state_for(s))
    fd = os.open(base + "/disk0", os.O_RDONLY)
    fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))  # FS_IOC_SHUTDOWN: EIO from now on
    os.close(fd)
    for args in (
        ["restore", root, "--to-torch", base + "/out.pt"],
        ["restore", root, "--step", "2", "--to-torch", base + "/out.pt"],
        ["restore", root, "--to-safetensors", base + "/hf", "--prefix", "w"],
        ["inspect", root],
    ):
        out = subprocess.run([sys.executable, "-m", "ckpt.cli", *args], capture_output=True, text=True)
        print("CLI", json.dumps([" ".join(args[:3]), out.returncode, out.stderr]), flush=True)
    """
)


@pytest.mark.skipif(not _can_mount("ext4"), reason="needs root, unshare -m and loop-mounted ext4")
def test_a_dead_disk_alone_is_an_io_error_not_damage(tmp_path: Path) -> None:
    """Every version's root.json fails with EIO: each version is skipped (the right call for
    one bad file), and with none left the command said `step 2 is damaged` or `no version
    can be chosen (... is missing or damaged)` and exited 1, the code for damage. An I/O
    error is no proof of damage: exit 3, naming the read that failed, and nothing written."""
    (tmp_path / "disk0").mkdir()
    image = tmp_path / "disk0.img"
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    script = tmp_path / "child.py"
    script.write_text(DEAD_ROOT_ALONE)
    out = _run_in_namespace(
        f"mount -o loop {image} {tmp_path}/disk0 && cd {REPO} && PYTHONPATH={REPO} exec {sys.executable} {script} {tmp_path}"
    ).stdout
    runs = [json.loads(line) for line in _lines(out, "CLI")]
    assert len(runs) == 4, out
    for cmd, rc, err in runs:
        lines = err.strip().splitlines()
        assert rc == 3 and "Traceback" not in err, (cmd, rc, err)
        assert lines[-1].startswith("ckpt: error: ") and "cannot be read" in lines[-1], (cmd, lines[-1])
        assert "damaged" not in lines[-1], (cmd, lines[-1])
        assert all(line.startswith("ckpt: warning: ") for line in lines[:-1]), (cmd, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "disk0", "disk0.img"]
