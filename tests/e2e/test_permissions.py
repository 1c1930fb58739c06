"""Permissions: nothing ckpt creates is world-writable, even under umask 0.

A save (nested state, so chunk files sit several directories deep), the replicator run by
the Checkpointer (a copy on a second disk and a `file://` remote), a restore that fetches
from the remote into its cache, `ckpt restore --to DIR` (from the root and from the remote
through the XDG cache), `--to-torch`, `--to-safetensors` (into a directory not there yet),
`ckpt replicate --once` to another `file://` remote and `ckpt gc` all run in one child
process with umask 0; then every file and directory under the test's directory is checked
for the o+w bit.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import os, sys
    import torch
    from ckpt import Checkpointer
    from ckpt.replicator.placement import source_label
    from tests._states import assert_bitwise

    base = sys.argv[1]
    os.umask(0)
    d0, d1 = base + "/disk0/ckpt", base + "/disk1/ckpt"
    remote = "file://" + base + "/remote"

    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"model": {"enc": {"layer0": {"w": torch.randn(64, 33, generator=g)}}, "b": torch.arange(7.0) * step},
                "optim": {"m": torch.randn(40, generator=g)}, "step": step}

    with Checkpointer([d0, d1], replicate_to=remote, split_bytes=4096) as ck:
        for step in (1, 2):
            ck.save(step, state(step))
    # a restore that reads only the remote
    got = {"model": {"enc": {"layer0": {"w": torch.zeros(64, 33)}}, "b": torch.zeros(7)},
           "optim": {"m": torch.zeros(40)}, "step": 0}
    with Checkpointer(base + "/fresh", tiers=[remote]) as ck:
        assert ck.restore(got) == 2
    assert_bitwise(got, state(2), "step 2 from the remote")
    replica = base + "/disk1/ckpt/replicas/" + source_label(d0)
    print("REPLICA", replica)

    # the CLI, in this process (so under umask 0 too)
    from click.testing import CliRunner
    from ckpt.cli import main
    for args in (
        ["restore", d0, "--to", base + "/export/a"],
        ["restore", remote, "--step", "1", "--to", base + "/export/b"],
        ["restore", d0, "--to-torch", base + "/export/s.pt"],
        ["restore", d0, "--to-safetensors", base + "/export/hf/model", "--max-shard-size", "4KB"],
        ["replicate", d0, "--to", "file://" + base + "/remote2", "--once"],
        ["gc", d0, "--keep-last", "1"],
    ):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 0, (args, out.output, out.exception)
    """
)


def _world_writable(top: Path) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                continue
            if mode & 0o002:
                bad.append(f"{oct(stat.S_IMODE(mode))} {os.path.relpath(path, top)}")
    return bad


def test_nothing_created_is_world_writable_under_umask_0(tmp_path: Path) -> None:
    base = tmp_path / "w"
    base.mkdir()
    for disk in ("disk0", "disk1"):  # two disks for placement (a marker above each)
        (base / disk).mkdir()
        (base / disk / ".ckpt-disk").write_text(disk)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, str(script), str(base)], env=env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    replica = next(line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("REPLICA "))
    assert Path(replica, "v000000000002", "manifest.json").is_file()
    assert (base / "remote" / "v000000000002" / "manifest.json").is_file()

    # the walk covers what every step created: make sure each step did create something
    for made in (
        "disk0/ckpt/v000000000002/state",
        "export/a/v000000000002/state",
        "export/b/v000000000001",
        "export/s.pt",
        "export/hf/model/model.safetensors.index.json",
        "remote2/v000000000002/state",
    ):
        assert (base / made).exists(), made
    assert _world_writable(base) == []
