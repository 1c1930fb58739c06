"""A node replaced with empty disks: its part of every version is gone. Restore must say so
(IncompleteVersionError naming the versions, the missing ranks and where it looked), not
return None so that the job silently starts from scratch; an older complete version is
restored in their stead, with a warning; a fresh start happens only when asked for.

Real gloo jobs of 4 ranks on 2 simulated nodes, a root per node. On the old code every
rank's restore returned None.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _state(rank: int, step: int) -> dict[str, Any]:
    import ckpt

    full = torch.arange(40, dtype=torch.float32).reshape(8, 5) + step
    return {"w": ckpt.Shard(full[2 * rank : 2 * rank + 2].clone(), (8, 5), (2 * rank, 0)), "step": step}


def save_job(ctx: Any, base: str, steps: list[int], nodes: list[int]) -> None:
    """Save `steps` to the roots of the ranks on `nodes`; the other ranks' roots get a
    throwaway directory (their node's disk is about to be replaced)."""
    import ckpt

    node = ctx.rank // 2
    root = f"{base}/node{node}" if node in nodes else f"{base}/elsewhere{node}"
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        for step in steps:
            ck.save(step, _state(ctx.rank, step))
        ck.wait()


def restore_job(ctx: Any, base: str, if_incomplete: str) -> dict[str, Any]:
    import ckpt

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ckpt").addHandler(Keep(logging.WARNING))
    state = _state(ctx.rank, 0)
    with ckpt.Checkpointer(f"{base}/node{ctx.rank // 2}", timeout=TIMEOUT) as ck:
        try:
            got = ck.restore(state, if_incomplete=if_incomplete)  # type: ignore[arg-type]
        except ckpt.IncompleteVersionError as e:
            return {"error": str(e), "warnings": records}
    same = got is None or torch.equal(state["w"].local_tensor, _state(ctx.rank, got)["w"].local_tensor)
    return {"step": got, "bitwise": same, "warnings": records}


def test_a_lost_nodes_part_is_named_not_a_silent_fresh_start(tmp_path: Path) -> None:
    base = str(tmp_path)
    _, failures = launch(THIS, "save_job", 4, tmp_path, base=base, steps=[2, 4], nodes=[0, 1])
    assert not failures, failures
    shutil.rmtree(tmp_path / "node1")  # node 1 comes back with an empty disk
    (tmp_path / "node1").mkdir()

    results, failures = launch(THIS, "restore_job", 4, tmp_path, base=base, if_incomplete="raise")
    assert not failures, failures
    for r in results:
        assert "error" in r, r
        assert "step 4 lacks the part of ranks [2, 3]" in r["error"] and "step 2 lacks" in r["error"], r["error"]
        assert str(tmp_path / "node0") in r["error"] and str(tmp_path / "node1") in r["error"], r["error"]
        assert "if_incomplete='fresh'" in r["error"]

    results, failures = launch(THIS, "restore_job", 4, tmp_path, base=base, if_incomplete="fresh")
    assert not failures, failures
    assert [r["step"] for r in results] == [None] * 4


def test_an_older_complete_version_is_restored_with_a_warning(tmp_path: Path) -> None:
    """Step 1 is on both nodes; steps 3 and 5 were saved while node 1's ranks wrote to a disk now gone."""
    base = str(tmp_path)
    _, failures = launch(THIS, "save_job", 4, tmp_path, base=base, steps=[1], nodes=[0, 1])
    assert not failures, failures
    _, failures = launch(THIS, "save_job", 4, tmp_path, base=base, steps=[3, 5], nodes=[0])
    assert not failures, failures
    results, failures = launch(THIS, "restore_job", 4, tmp_path, base=base, if_incomplete="raise")
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(1, True)] * 4, results
    warned = [w for w in results[0]["warnings"] if "lacks the part of ranks [2, 3]" in w]
    assert len(warned) == 2 and "step 5" in warned[0] and "restoring step 1 instead" in warned[0], warned
