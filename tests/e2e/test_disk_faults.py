"""A full disk: the save fails with a clear error, leaves nothing partial, and training
saves again once space returns. Runs the writer on a small tmpfs in a private mount
namespace (unshare -m), as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, sys
    import torch, ckpt
    from ckpt import Checkpointer
    from tests._states import bitwise_diff
    root = sys.argv[1] + "/ckpt"
    filler = sys.argv[1] + "/filler"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(1000.0)})
        ck.wait()
        ck.save(2, {"w": torch.ones(4_000_000)})  # 16 MB on an 8 MB disk
        try:
            ck.wait()
            print("NO-ERROR")
        except ckpt.TierUnavailableError as e:
            print("ERROR", e.errno, str(e).replace(chr(10), " "))
        print("STEPS", ck.steps())
        print("ENTRIES", sorted(n for n in os.listdir(root) if n.startswith("v")))
        state = {"w": torch.zeros(1000)}
        print("RESTORED", ck.restore(state), not bitwise_diff(state, {"w": torch.arange(1000.0)}))
        os.unlink(filler)  # space returns
        ck.save(3, {"w": torch.ones(1_000_000)})
        ck.wait()
        print("STEPS", ck.steps())
    """
)


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root and unshare -m to mount a small tmpfs")
def test_disk_full_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cmd = (
        f"mount -t tmpfs -o size=8m tmpfs {mnt} && "
        f"dd if=/dev/zero of={mnt}/filler bs=1M count=3 status=none && "
        f"PYTHONPATH={REPO} exec {sys.executable} {script} {mnt}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    error = next(line for line in lines if line.startswith(("ERROR", "NO-ERROR")))
    assert error.startswith("ERROR 28") and "No space left on device" in error and "step 2" in error
    steps = [line for line in lines if line.startswith("STEPS")]
    assert steps == ["STEPS [1]", "STEPS [1, 3]"]
    assert "ENTRIES ['v000000000001']" in lines  # no partial version left behind
    assert "RESTORED 1 True" in lines
