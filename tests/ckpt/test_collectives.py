"""What a steady-state save costs in collectives: a few all-reduces of fixed-size tensors,
one gather to rank 0, and the manifest sent to the roots' leaders only.

Before, every save all-gathered a Python tuple from every rank to every rank (O(world^2)
bytes in all), broadcast the whole manifest to every rank (each parsed it), and each of
the two commit agreements all-gathered again. Real gloo jobs of 4 ranks, one root and a
root per simulated node; the counts come from each rank's `Comm.calls`.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)
COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast")


def _calls(ck: Any) -> Counter[str]:
    return ck._ctl.calls + ck._data.calls  # type: ignore[no-any-return]


def count_job(ctx: Any, base: str, per_node: bool) -> dict[str, Any]:
    import ckpt

    root = f"{base}/node{ctx.rank // 2}" if per_node else f"{base}/one"
    torch.manual_seed(ctx.rank)
    cut = [0, 3, 500, 777, 1001][ctx.rank : ctx.rank + 2]  # an arbitrary split: slivers cross ranks
    full = torch.arange(1001 * 8, dtype=torch.float32).reshape(1001, 8)
    state = {
        "shared": torch.ones(64),
        "rows": ckpt.Shard(full[cut[0] : cut[1]].clone(), (1001, 8), (cut[0], 0)),
        "mine": {"step": ctx.rank},
    }
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, state)
        ck.wait()
        for step in (2, 3):  # the same layout again: the steady state
            before = _calls(ck)
            ck.save(step, state)
            ck.wait()
            out[f"steady{step}"] = dict(_calls(ck) - before)
        before = _calls(ck)
        ck.save(4, {**state, "extra": torch.zeros(3)})  # a new layout: planned again
        ck.wait()
        out["relayout"] = dict(_calls(ck) - before)
        target = {
            "shared": torch.zeros(64),
            "rows": ckpt.Shard(torch.zeros(cut[1] - cut[0], 8), (1001, 8), (cut[0], 0)),
        }
        ck.restore(target, step=3, strict=False)
        ctx.check(torch.equal(target["rows"].local_tensor, full[cut[0] : cut[1]]), "rows restored wrong")
    return out


@pytest.mark.parametrize("per_node", [False, True], ids=["one-root", "root-per-node"])
def test_steady_state_save_costs_few_small_collectives(tmp_path: Path, per_node: bool) -> None:
    results, failures = launch(THIS, "count_job", 4, tmp_path, timeout=180, base=str(tmp_path), per_node=per_node)
    assert not failures, failures
    leaders = {0, 2} if per_node else {0}
    for rank, r in enumerate(results):
        for step in ("steady2", "steady3"):
            calls = Counter(r[step])
            assert calls["all_gather"] == 0 and calls["broadcast"] == 0, (rank, step, calls)
            assert sum(calls[k] for k in COLLECTIVES) <= 4, (rank, step, calls)
            # p2p: the sliver exchange (every rank holds a part of a straddling chunk here),
            # and the manifest from rank 0 to the other roots' leaders.
            manifest_p2p = 1 if (rank in leaders and len(leaders) > 1) else 0
            assert calls["p2p"] <= 1 + manifest_p2p, (rank, step, calls)
        assert Counter(r["relayout"])["all_gather"] == 1, (rank, r["relayout"])
