"""The main job in a reduced form: kill a rank, resume on 3 ranks, match the reference bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_resumes_bit_exactly_on_another_world_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt.demo", "--dir", str(tmp_path), "--steps", "12", "--every", "3", "--kill-at", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the resumed run is bit-exact" in out.stdout
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    resumed = json.loads((tmp_path / "resumed" / "rank2.json").read_text())
    assert resumed["world"] == 3 and resumed["resumed_from"] in (3, 6)  # a version before the kill
    ref = json.loads((tmp_path / "ref" / "rank0.json").read_text())["losses"]
    assert all(ref[k] == v for k, v in resumed["losses"].items())
    # the resumed run saved with deferred staging: each copy ended after its save() returned
    assert resumed["stats"] and all(s["staged_s"] > s["stage_s"] for s in resumed["stats"])
    # the replicator copied to the other disk and the remote
    assert any((tmp_path / "disk1" / "ckpt" / "replicas").iterdir())
    assert any(p.name.startswith("v") for p in (tmp_path / "remote").iterdir())
