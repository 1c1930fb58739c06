"""overlap_writes: the writers take each chunk as soon as save() has copied it. The
version must still hold the values of the save() call, bitwise, and a copy that fails
part-way must fail the commit with the chunks already written left uncommitted."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import Checkpointer
from tests._dist import Ctx, launch
from tests._states import assert_bitwise, bitwise_diff


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 100))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    g = torch.Generator().manual_seed(seed)
    return {
        "model": model,
        "optim": opt,
        "half": torch.randn(333, 7, generator=g).half(),
        "ints": torch.arange(10_001, dtype=torch.int64) * (seed + 1),
        "view": torch.randn(64, 96, generator=g)[::2, 5:],  # not contiguous
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(float(seed)),
        "step": seed,
    }


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if hasattr(v, "state_dict"):
            sd = v.state_dict()
            if "state" in sd:  # optimizer
                for i, s in sd["state"].items():
                    for n, t in s.items():
                        out[f"{k}.{i}.{n}"] = t.clone()
            else:
                out.update({f"{k}.{n}": t.clone() for n, t in sd.items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def test_writes_overlap_the_copy_and_the_version_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELAY", "stage:0:0.02")  # a slow copy: the writers wait for chunks
    state = _state(1)
    expected = _flat(state)
    with Checkpointer(tmp_path, overlap_writes=True) as ck:
        ck.save(1, state)
        ck.wait()
        s = ck.stats()[-1]
        assert s.first_write_s is not None and s.first_write_s < s.stage_s, s  # written while copying
        target = _state(2)
        assert ck.restore(target) == 1
    assert_bitwise(_flat(target), expected)


def test_copy_then_write_when_overlap_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELAY", "stage:0:0.02")
    with Checkpointer(tmp_path, overlap_writes=False) as ck:
        ck.save(1, _state(1))
        ck.wait()
        s = ck.stats()[-1]
        assert s.first_write_s is not None and s.first_write_s > s.stage_s, s


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt (CKPT_INTERRUPT sends a real one at a fault point)."""
    previous = signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# Where save() is interrupted (store/faults.py, CKPT_INTERRUPT): in the copy, right after
# the copy's second lane was started, after the copy, and right after the commit was queued.
POINTS = ["stage:0:3", "lane-started:0:1", "after-stage:0:1", "queued:0:1"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True], ids=["copy-then-write", "overlap_writes"])
@pytest.mark.parametrize("point", POINTS)
def test_an_interrupted_save_fails_or_commits_exactly_and_the_next_save_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: None, overlap: bool, point: str
) -> None:
    """Ctrl-C anywhere in save() after the ranks' collectives: save() re-raises it, the
    commit neither hangs nor runs twice, and no copy lane outlives save(). The copy's two
    lanes are balanced by bytes (one large chunk on save()'s thread, ten small ones on the
    pool's), so a stray lane would write step 2's bytes into the buffer step 3 (another
    layout) is staged in, and step 3 would be committed wrong."""
    small = 65536  # 256 KiB: chunks this small or smaller stay on save()'s thread
    state2 = {"a": torch.full((1 << 20,), 2.0), **{f"b{i}": torch.full((small,), 2.0) for i in range(10)}}
    state3 = {"a": torch.full(((1 << 20) + 10 * small,), 3.0)}
    with Checkpointer(tmp_path, overlap_writes=overlap, capture_rng=False) as ck:
        ck.save(1, state2)
        ck.wait()
        monkeypatch.setenv("CKPT_DELAY", "stage:0:0.05")  # a slow copy: the other lane is at work
        monkeypatch.setenv("CKPT_INTERRUPT", point)
        with pytest.raises(KeyboardInterrupt):
            ck.save(2, state2)
        monkeypatch.delenv("CKPT_INTERRUPT")
        try:
            ck.wait()
        except ckpt.CkptError as e:
            assert "interrupted by KeyboardInterrupt" in str(e)
        # Only a copy that was over, and reported done, before the interruption may commit.
        committed_ok = [[1], [1, 2]] if point == "queued:0:1" and not overlap else [[1]]
        assert ck.steps() in committed_ok
        monkeypatch.setenv("CKPT_DELAY", "write:0:0.3")  # a slow disk: a stray lane has time
        ck.save(3, state3)
        ck.wait()
        assert ck.steps()[-1] == 3
        out = {"a": torch.zeros_like(state3["a"])}
        assert ck.restore(out, step=3) == 3
        assert_bitwise(out, state3, "step 3")  # a stray lane would leave step 2's 2.0s
        before = {k: torch.zeros_like(v) for k, v in state2.items()}
        assert ck.restore(before, step=1) == 1
        assert_bitwise(before, state2, "step 1")
    assert not list(tmp_path.glob("*.tmp-*")), "the failed save's chunks must be removed"


@pytest.mark.timeout(120)
def test_an_interrupt_while_save_writes_a_bounded_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: None
) -> None:
    """max_staging_bytes: save() writes all but the last batch itself (run_lanes); Ctrl-C
    there fails the save, and no writer lane is left reading the buffer."""
    state = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    with Checkpointer(tmp_path, max_staging_bytes=3 << 20, capture_rng=False) as ck:
        ck.save(1, state)
        ck.wait()
        monkeypatch.setenv("CKPT_INTERRUPT", "write:0:2")
        with pytest.raises(KeyboardInterrupt):
            ck.save(2, {k: v + 1 for k, v in state.items()})
        monkeypatch.delenv("CKPT_INTERRUPT")
        with pytest.raises(ckpt.CkptError, match="interrupted by KeyboardInterrupt"):
            ck.wait()
        assert ck.steps() == [1]
        ck.save(3, {k: v + 3 for k, v in state.items()})
        ck.wait()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(out, step=3) == 3
        assert_bitwise(out, {k: v + 3 for k, v in state.items()}, "step 3")
    assert not list(tmp_path.glob("*.tmp-*"))


def interrupted_on_one_rank(ctx: Ctx, root: str, deferred: bool, point: str) -> dict:
    """Ctrl-C on rank 1 in save() (with deferred staging: while it copies what it copies
    before returning): every rank's save ends promptly, alike, and the next one commits."""
    import os
    import time
    from datetime import timedelta

    ws = [torch.nn.Parameter(torch.randn(4096)) for _ in range(4)]
    opt = torch.optim.SGD(ws, lr=0.1)
    own = ckpt.Shard(torch.randn(4096), (4096 * ctx.world,), (4096 * ctx.rank,))  # no optimizer's: copied in save()
    state = {"w": ws, "optim": opt, "own": own}
    out: dict[str, Any] = {}
    previous = signal.signal(signal.SIGINT, _interrupt)
    try:
        with Checkpointer(root, deferred_staging=deferred, timeout=timedelta(seconds=30)) as ck:
            ck.save(1, state)
            ck.wait()
            if ctx.rank == 1:
                os.environ["CKPT_INTERRUPT"] = point
            t = time.perf_counter()
            try:
                ck.save(2, state)
                out["save"] = "returned"
            except KeyboardInterrupt:
                out["save"] = "KeyboardInterrupt"
            os.environ.pop("CKPT_INTERRUPT", None)
            try:
                ck.wait()
                out["wait"] = "ok"
            except ckpt.CkptError as e:
                out["wait"] = type(e).__name__
            took = time.perf_counter() - t
            ctx.check(took < 15, f"the save took {took:.1f}s to end on every rank")
            ck.save(3, state)
            ck.wait()
            out["steps"] = ck.steps()
    finally:
        signal.signal(signal.SIGINT, previous)
    return out


@pytest.mark.parametrize(
    "point",
    ["stage:1:1", "queued:1:1", "stage:1:1,fail-save:1:1"],
    ids=["in-copy", "queued", "twice: in the copy, then in save()'s failure handler"],
)
@pytest.mark.parametrize("deferred", [False, True], ids=["save-copies-all", "deferred_staging"])
def test_an_interrupt_on_one_rank_ends_the_save_on_all(tmp_path: Path, deferred: bool, point: str) -> None:
    results, failures = launch(
        __file__, "interrupted_on_one_rank", 2, tmp_path, root=str(tmp_path / "root"), deferred=deferred, point=point
    )
    assert failures == []
    assert [r["save"] for r in results] == ["returned", "KeyboardInterrupt"]
    assert results[0]["steps"] == results[1]["steps"], results
    if point.startswith("stage"):  # interrupted in the copy (and again while failing): it must fail
        assert all(r["wait"] in ("RankFailures", "CkptError") for r in results), results
        assert results[0]["steps"] == [1, 3], results
    else:  # queued after the copy: it may commit, alike on both ranks
        assert results[0]["steps"] in ([1, 3], [1, 2, 3]), results


def overlapped_on_ranks(ctx: Ctx, root: str) -> dict:
    import os

    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world,))
    torch.manual_seed(0)  # the same full tensors on every rank
    full = torch.randn(1000, 300)
    state = {
        "dt": distribute_tensor(full, mesh, [DShard(0)]),
        "rep": torch.randn(4096, 33),
        "own": ckpt.Shard(torch.full((77,), float(ctx.rank)), (77 * ctx.world,), (77 * ctx.rank,)),
    }
    with Checkpointer(root, overlap_writes=True) as ck:
        os.environ["CKPT_DELAY"] = "stage:1:0.05"  # rank 1 copies slowly; rank 0 writes meanwhile
        ck.save(1, state)
        ck.wait()
        os.environ.pop("CKPT_DELAY")
        ctx.check(ck.steps() == [1], f"steps {ck.steps()}")
        out = {
            "dt": distribute_tensor(torch.zeros(1000, 300), mesh, [DShard(0)]),
            "rep": torch.zeros(4096, 33),
            "own": ckpt.Shard(torch.zeros(77), (77 * ctx.world,), (77 * ctx.rank,)),
        }
        ck.restore(out)
        ctx.check(not bitwise_diff(out["dt"].full_tensor(), full), "dtensor differs")
        ctx.check(not bitwise_diff(out["rep"], state["rep"]), "replicated tensor differs")
        ctx.check(not bitwise_diff(out["own"].local_tensor, state["own"].local_tensor), "hand-sharded tensor differs")
    return {"ok": True}


def test_overlapped_writes_on_two_ranks(tmp_path: Path) -> None:
    results, failures = launch(__file__, "overlapped_on_ranks", 2, tmp_path, root=str(tmp_path / "root"))
    assert failures == [] and results == [{"ok": True}] * 2
