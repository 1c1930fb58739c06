"""What `pip install ckpt` puts into site-packages: one top-level package, `ckpt`, with
store/, restore/ and replicator/ inside it as ckpt.store, ckpt.restore, ckpt.replicator."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_wheel_holds_only_ckpt_at_the_top_level(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("ckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    metadata = {t for t in top if t.endswith(".dist-info")}
    assert len(metadata) == 1 and top - metadata == {"ckpt"}, top
    for module in ("ckpt/store/manifest.py", "ckpt/restore/locate.py", "ckpt/replicator/service.py", "ckpt/py.typed"):
        assert module in names, module
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]
