"""Readers while a job writes and GC deletes: a consistent view, always.

A writer process commits step after step; the replicator thread of its Checkpointer applies
keep-last-3 every 50 ms. Meanwhile `ckpt ls`, `ckpt restore --to` and `ckpt verify` run as
real processes, and a library reader restores the newest version and older listed ones.
Checked: ls lists only committed versions (no save in flight, no deleted leftover), verify
and restore never trip over a version GC deletes under them (pins), nothing prints a
traceback, and every restore is bitwise the state saved at the step it reports.

Also: a GC frozen mid-deletion (SIGSTOP) blocks no reader; and one replicator per root —
`ckpt replicate` is refused while a Checkpointer's replicator thread or another `ckpt
replicate` runs on that root.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer, VersionNotFoundError
from ckpt.cli import main as cli
from ckpt.store import pins, versions
from ckpt.store.versions import as_tier
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]
KEEP = 3


def state_for(step: int) -> dict[str, Any]:
    """What the writer saves at `step`: 48 tensors of 64 KiB (many files: copies take a while)."""
    g = torch.Generator().manual_seed(step)
    return {"t": {f"p{i}": torch.randn(16384, generator=g) for i in range(48)}, "step": step}


def _blank() -> dict[str, Any]:
    return {"t": {f"p{i}": torch.zeros(16384) for i in range(48)}, "step": 0}


WRITER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from ckpt import Checkpointer
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.policy import KeepLast

    root, stop = sys.argv[1], sys.argv[2]
    gc = ReplicatorConfig(local_policy=KeepLast(int(sys.argv[3])), interval_s=0.05)
    with Checkpointer(root, replication=gc) as ck:
        step = 0
        while not os.path.exists(stop):
            step += 1
            ck.save(step, state_for(step))
            if step == 1:
                ck.wait()
                print("ready", flush=True)
            time.sleep(0.05)  # a training step
        print("saved", step, flush=True)
    """
)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "ckpt.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_readers_see_a_consistent_set_while_writing_and_gc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    stop = tmp_path / "stop"
    script = tmp_path / "writer.py"
    header = "from __future__ import annotations\nfrom typing import Any\nimport torch\n\n"
    script.write_text(header + inspect.getsource(state_for) + WRITER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writer = subprocess.Popen(
        [sys.executable, str(script), str(root), str(stop), str(KEEP)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    warnings = _Warnings()
    logging.getLogger("ckpt").addHandler(warnings)
    problems: list[str] = []
    exported: list[tuple[Path, int]] = []
    restored: list[int] = []
    gone: list[int] = []
    cli_done = threading.Event()
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read() if writer.stderr else ""

        # one replicator per root: the writer's replicator thread holds the root
        second = _cli("replicate", str(root), "--once")
        assert second.returncode == 3, second.stdout + second.stderr
        assert second.stderr.strip().splitlines()[-1] == f"ckpt: error: another replicator is running on {root}"
        assert "Traceback" not in second.stderr

        def cli_reader() -> None:
            started = time.monotonic()
            try:  # rounds of ls, restore, verify: at least one, more while under 20 s (at most 4)
                for i in range(4):
                    if i and time.monotonic() - started > 20:
                        break
                    ls = _cli("ls", str(root), "--json")
                    if ls.returncode != 0 or "Traceback" in ls.stderr:
                        problems.append(f"ls: rc {ls.returncode}: {ls.stderr[-2000:]}")
                        continue
                    rows = json.loads(ls.stdout)
                    bad = [r for r in rows if r.get("status") != "committed"]
                    if bad or not rows:
                        problems.append(f"ls listed {bad or 'nothing'}")
                    out = tmp_path / f"export{i}"
                    rs = _cli("restore", str(root), "--to", str(out))
                    m = re.search(r"restored step (\d+) ", rs.stdout)
                    if rs.returncode != 0 or not m or rs.stderr.count("\n") > 1 or "not intact" in rs.stderr:
                        problems.append(f"restore: rc {rs.returncode}: {rs.stdout[-500:]} {rs.stderr[-2000:]}")
                    else:
                        exported.append((out, int(m.group(1))))
                    vf = _cli("verify", str(root))
                    if vf.returncode != 0 or "BAD" in vf.stdout or vf.stderr:
                        problems.append(f"verify: rc {vf.returncode}: {vf.stdout[-1000:]} {vf.stderr[-2000:]}")
            finally:
                cli_done.set()

        thread = threading.Thread(target=cli_reader)
        thread.start()
        rng = random.Random(7)
        with Checkpointer(tmp_path / "reader", tiers=[str(root)]) as ck:
            for _ in range(400):
                if cli_done.is_set():
                    break
                got = _blank()
                step = ck.restore(got)  # the newest
                assert step is not None
                assert_bitwise(got, state_for(step), f"restore() (step {step})")
                restored.append(step)
                listed = versions.committed_steps(str(root))
                assert listed, "GC must never delete the newest version"
                older = rng.choice(listed)
                got = _blank()
                try:
                    assert ck.restore(got, step=older) == older
                    assert_bitwise(got, state_for(older), f"restore(step={older})")
                except VersionNotFoundError:
                    # only because GC deleted it after the listing
                    assert older not in versions.committed_steps(str(root)), f"step {older} is listed but not found"
                    gone.append(older)
                time.sleep(0.05)  # leave the CPUs to the others now and then
        thread.join(timeout=300)
    finally:
        logging.getLogger("ckpt").removeHandler(warnings)
        stop.touch()
        try:
            out, err = writer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            writer.send_signal(signal.SIGKILL)
            out, err = writer.communicate()
    assert writer.returncode == 0, err[-4000:]
    saved = int(out.split()[-1])
    assert not problems, "\n".join(problems)
    assert not [m for m in warnings.messages if "not intact" in m or "unavailable" in m], warnings.messages
    assert exported and len(restored) >= 5, (exported, restored)
    assert saved >= 3 * KEEP, f"only {saved} saves: GC had little to do"
    assert min(restored) < max(restored), "the writer should have moved on while the readers read"
    for out_dir, step in exported:
        got = _blank()
        with Checkpointer(out_dir) as ck:
            assert ck.restore(got) == step
        assert_bitwise(got, state_for(step), f"ckpt restore --to {out_dir.name} (step {step})")
    assert versions.committed_steps(str(root)) == list(range(saved - KEEP + 1, saved + 1))


@pytest.mark.timeout(120)
def test_a_second_replicator_daemon_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(10.0)})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    remote = f"file://{tmp_path / 'remote'}"
    first = subprocess.Popen(
        [sys.executable, "-m", "ckpt.cli", "replicate", str(root), "--to", remote, "--interval", "0.1"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not (tmp_path / "remote" / "v000000000001" / "manifest.json").exists():
            assert time.time() < deadline and first.poll() is None, "the first daemon did not replicate"
            time.sleep(0.05)
        second = _cli("replicate", str(root), "--to", remote, "--once")
        assert second.returncode == 3, second.stdout + second.stderr
        assert second.stderr.strip().splitlines()[-1] == f"ckpt: error: another replicator is running on {root}"
        assert "Traceback" not in second.stderr
        # a Checkpointer with a replicator thread is refused too, and leaves the root free
        with pytest.raises(Exception) as info:
            Checkpointer(root, replicate_to=remote)
        assert type(info.value).__name__ == "RootLockedError" and "another replicator" in str(info.value)
        with Checkpointer(root) as ck:  # without replication the root is free to use
            assert ck.steps() == [1]
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0


FROZEN_GC = """
import os, signal, sys
from ckpt.store import pins, versions
from ckpt.store.versions import as_tier
root = sys.argv[1]
with pins.deleting(as_tier(root), 1) as free:  # what replicator.gc.collect does around each deletion
    print("marked", free, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-deletion (a debugger, ^Z, a cgroup freeze)
    versions.delete_version(root, 1)
print("deleted", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_gc_frozen_mid_deletion_blocks_no_reader(tmp_path: Path) -> None:
    """A GC stopped (SIGSTOP) while it deletes a version holds no lock that readers wait
    on: they take that version as gone and go on with the others."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, state_for(step))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    gc = subprocess.Popen(
        [sys.executable, "-c", FROZEN_GC, str(root)], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert gc.stdout is not None and gc.stdout.readline().strip() == "marked True"
        deadline = time.time() + 30
        while open(f"/proc/{gc.pid}/stat").read().split(")")[1].split()[0] != "T":
            assert time.time() < deadline, "the GC process did not stop"
            time.sleep(0.01)
        verify = CliRunner().invoke(cli, ["verify", str(root)])  # would hang if readers waited for the GC
        assert verify.exit_code == 0, verify.output
        assert verify.stdout.splitlines()[0].startswith("step 2: ok") and "step 1" not in verify.stdout
        export = CliRunner().invoke(cli, ["restore", str(root), "--step", "1", "--to", str(tmp_path / "out")])
        assert export.exit_code == 3 and "step 1 is being deleted" in export.stderr, export.output
        with Checkpointer(tmp_path / "reader", tiers=[str(root)]) as ck:
            with pytest.raises(VersionNotFoundError):
                ck.restore(_blank(), step=1)
            got = _blank()
            assert ck.restore(got, step=2) == 2
            assert_bitwise(got, state_for(2), "restore(step=2)")
    finally:
        gc.send_signal(signal.SIGCONT)
        out, _ = gc.communicate(timeout=60)
    assert gc.returncode == 0 and out.strip() == "deleted"
    assert versions.committed_steps(str(root)) == [2, 3]
    assert pins.pinned_steps(as_tier(str(root))) == set() and os.listdir(root / ".pins") == []
