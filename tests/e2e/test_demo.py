"""The main job in a reduced form: kill a rank, resume on 3 ranks; lose a node, resume from
its peer copies with no remote; both match the reference bit for bit."""

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
    assert "the resumed runs are bit-exact" in out.stdout
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
    # a node's loss: node 1's ranks killed, its disk replaced; restored from node 0's peer copies
    back = [json.loads((tmp_path / "node-back" / f"rank{r}.json").read_text()) for r in range(4)]
    # (node 1 dies once a peer copy is verified: a version of step 3, 6 or 9)
    assert len({b["resumed_from"] for b in back}) == 1 and back[0]["resumed_from"] in (3, 6, 9, 12)
    assert (
        all(ref[k] == v for k, v in back[0]["losses"].items())
        and len(back[0]["losses"]) == 12 - back[0]["resumed_from"]
    )
    # (node 1's copies, named by its disk's identity: after the loss, the new disk's)
    assert (
        tmp_path
        / "nodes"
        / "node0"
        / "replicas"
        / f"peer-{(tmp_path / 'nodes' / 'node1' / '.ckpt-root-id').read_text()}"
    ).is_dir()
