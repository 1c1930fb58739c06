"""A holder whose hand-off plan fails (restore.handoff.plan_sends raising) must fail the
restore on every rank promptly, not leave the other holders' sends unmatched."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=20)


def failing_holder_job(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt
    import ckpt.restore.execute as execute

    arrays, rows = 24, 8
    full = {
        f"a{i:02d}": torch.arange(4 * rows * 16, dtype=torch.float32).reshape(4 * rows, 16) + i for i in range(arrays)
    }

    def part(k: int) -> dict[str, Any]:
        return {
            n: ckpt.Shard(t[k * rows : (k + 1) * rows].clone(), tuple(t.shape), (k * rows, 0)) for n, t in full.items()
        }

    out: dict[str, Any] = {}
    with ckpt.Checkpointer(f"{base}/node{ctx.rank // 2}", timeout=TIMEOUT) as ck:
        ck.save(1, {"m": part(ctx.rank)})
        ck.wait()
        if ctx.rank == 3:  # this holder cannot plan its sends (e.g. MemoryError): it answers nothing

            def boom(*a: Any, **k: Any) -> Any:
                raise MemoryError("planning the sends")

            execute.plan_sends = boom
        other = (ctx.rank + 2) % 4  # each rank takes the other node's rows: it asks ranks 2 and 3 (or 0 and 1)
        target = {
            "m": {n: ckpt.Shard(torch.zeros(rows, 16), tuple(t.shape), (other * rows, 0)) for n, t in full.items()}
        }
        t0 = time.monotonic()
        try:
            ck.restore(target, step=1)
            out["err"] = None
        except Exception as e:  # noqa: BLE001
            out["err"] = f"{type(e).__name__}: {e}"[:300]
        out["seconds"] = time.monotonic() - t0
    return out


def test_a_holder_that_cannot_plan_fails_the_restore_promptly_on_every_rank(tmp_path: Path) -> None:
    results, failures = launch(THIS, "failing_holder_job", 4, tmp_path, timeout=240, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["err"] is not None, (rank, r)
        # Well under the group's 20 s timeout: no send left waiting for a receive never posted.
        assert r["seconds"] < 10, (rank, r)
        assert "Timed out" not in r["err"] and "timeout" not in r["err"].lower(), (rank, r)
