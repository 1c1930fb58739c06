"""Schema 3's per-rank files on real multi-rank jobs: each rank's tree, RNG and chunk
digests live beside its chunks, on its own root, and a rank restoring on another node
(whose disks hold other ranks' files) gets its tree and RNG sent by a rank that holds
them. The manifest stays O(arrays + ranks).

Real gloo jobs of 2 ranks, each with its own root (no shared filesystem); the restore
swaps the roots, so every rank's own files are on the other rank's disk.
"""

from __future__ import annotations

import datetime
import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _state(rank: int, step: int) -> dict[str, Any]:
    import ckpt

    full = torch.arange(60, dtype=torch.float32).reshape(12, 5) * (step + 1)
    return {
        "w": ckpt.Shard(full[6 * rank : 6 * rank + 6].clone(), (12, 5), (6 * rank, 0)),
        "mine": {"rank": rank, "step": step, "cursor": 1000 * rank + step},  # differs per rank
    }


def save_job(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt

    random.seed(100 + ctx.rank)
    torch.manual_seed(200 + ctx.rank)
    with ckpt.Checkpointer(f"{base}/disk{ctx.rank}", timeout=TIMEOUT) as ck:
        ck.save(3, _state(ctx.rank, 3))
        ck.wait()
    return {"next": random.random(), "torch": torch.rand(1).item()}  # what a restore must reproduce


def restore_job(ctx: Any, base: str, swap: bool) -> dict[str, Any]:
    import ckpt

    state = _state(ctx.rank, 0)
    state["mine"] = {"rank": -1, "step": -1, "cursor": -1}
    disk = 1 - ctx.rank if swap else ctx.rank
    with ckpt.Checkpointer(f"{base}/disk{disk}", timeout=TIMEOUT) as ck:
        step = ck.restore(state)
    assert isinstance(state["w"], ckpt.Shard)
    return {
        "step": step,
        "mine": state["mine"],
        "w": state["w"].local_tensor.tolist(),
        "next": random.random(),
        "torch": torch.rand(1).item(),
    }


def test_a_rank_on_another_node_gets_its_tree_and_rng(tmp_path: Path) -> None:
    base = str(tmp_path)
    saved, failures = launch(THIS, "save_job", 2, tmp_path / "save", base=base)
    assert not failures, failures
    for rank in (0, 1):  # each rank's file is on its own disk only
        version = tmp_path / f"disk{rank}" / "v000000000003"
        assert sorted(p.name for p in (version / "ranks").iterdir()) == [f"{rank}.json"]
        doc = json.loads((version / "ranks" / f"{rank}.json").read_bytes())
        assert doc["tree"]["mine"] == {"rank": rank, "step": 3, "cursor": 1000 * rank + 3}
    # Swapped disks: rank 0 sees only rank 1's files and chunks, and rank 1 only rank 0's.
    got, failures = launch(THIS, "restore_job", 2, tmp_path / "swapped", base=base, swap=True)
    assert not failures, failures
    for rank in (0, 1):
        r = got[rank]
        assert r["step"] == 3
        assert r["mine"] == {"rank": rank, "step": 3, "cursor": 1000 * rank + 3}, r["mine"]
        want = (torch.arange(60, dtype=torch.float32).reshape(12, 5) * 4)[6 * rank : 6 * rank + 6]
        assert torch.equal(torch.tensor(r["w"]), want)
        assert (r["next"], r["torch"]) == (saved[rank]["next"], saved[rank]["torch"]), "its own RNG"


def test_a_damaged_rank_file_falls_back_to_the_older_version(tmp_path: Path) -> None:
    """A rank file that fails its checksum on the only disk that holds it: the version is
    damaged on every rank together, and the older one is restored."""
    import ckpt
    from ckpt.store.errors import CorruptVersionError

    root = tmp_path / "root"
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(3), "n": 1})
        ck.save(2, {"w": torch.full((3,), 2.0), "n": 2})
        ck.wait()
    path = root / "v000000000002" / "ranks" / "0.json"
    path.write_bytes(path.read_bytes().replace(b'"n":2', b'"n":7'))
    state = {"w": torch.zeros(3), "n": 0}
    with ckpt.Checkpointer(root) as ck:
        assert ck.restore(state) == 1
        assert state["n"] == 1 and torch.equal(state["w"], torch.ones(3))
        try:
            ck.restore(state, step=2)
        except CorruptVersionError as e:
            assert "ranks/0.json" in str(e) and "checksum" in str(e)
        else:
            raise AssertionError("a damaged rank file must not be restored")


def save_two_job(ctx: Any, base: str) -> None:
    import ckpt

    with ckpt.Checkpointer(f"{base}/disk{ctx.rank}", timeout=TIMEOUT) as ck:
        for step in (1, 2):
            ck.save(step, _state(ctx.rank, step))
            ck.wait()


def test_a_manifest_damaged_on_one_rank_s_disk_comes_from_a_rank_with_a_good_copy(tmp_path: Path) -> None:
    """Step 2's manifest fails its checksum on rank 0's disk only; rank 1's copy is good, as
    is every chunk and rank file. The restore gets step 2 on both ranks, rank 0 with the
    manifest rank 1 sends. Before, rank 0's damaged copy failed the version on every rank,
    and both fell back to step 1. Damaged on both disks, the version is passed over."""
    base = str(tmp_path)
    _, failures = launch(THIS, "save_two_job", 2, tmp_path / "save", base=base)
    assert not failures, failures
    manifest = tmp_path / "disk0" / "v000000000002" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[raw.index(b'"created":') + 11] ^= 1  # one bit of a digit
    manifest.write_bytes(bytes(raw))
    got, failures = launch(THIS, "restore_job", 2, tmp_path / "one", base=base, swap=False)
    assert not failures, failures
    for rank in (0, 1):
        r = got[rank]
        assert r["step"] == 2, r
        assert r["mine"] == {"rank": rank, "step": 2, "cursor": 1000 * rank + 2}, r["mine"]
        want = (torch.arange(60, dtype=torch.float32).reshape(12, 5) * 3)[6 * rank : 6 * rank + 6]
        assert torch.equal(torch.tensor(r["w"]), want)
    assert manifest.read_bytes() == bytes(raw), "the damaged copy is left as it is (ckpt verify reports it)"
    other = tmp_path / "disk1" / "v000000000002" / "manifest.json"
    other.write_bytes(bytes(raw))
    got, failures = launch(THIS, "restore_job", 2, tmp_path / "both", base=base, swap=False)
    assert not failures, failures
    assert [got[r]["step"] for r in (0, 1)] == [1, 1]
