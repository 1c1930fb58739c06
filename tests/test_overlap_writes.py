"""overlap_writes: the writers take each chunk as soon as save() has copied it. The
version must still hold the values of the save() call, bitwise, and a copy that fails
part-way must fail the commit with the chunks already written left uncommitted."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import Checkpointer
from tests._dist import Ctx, launch


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


def _assert_bitwise(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert expected.keys() == got.keys()
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == got[k].dtype and v.shape == got[k].shape, k
            assert torch.equal(v, got[k]), k
        else:
            assert v == got[k], k


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
    _assert_bitwise(expected, _flat(target))


def test_copy_then_write_when_overlap_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELAY", "stage:0:0.02")
    with Checkpointer(tmp_path, overlap_writes=False) as ck:
        ck.save(1, _state(1))
        ck.wait()
        s = ck.stats()[-1]
        assert s.first_write_s is not None and s.first_write_s > s.stage_s, s


def test_an_interrupted_copy_fails_the_commit_and_keeps_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    state = _state(1)
    expected = _flat(state)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Checkpointer(tmp_path, overlap_writes=True) as ck:
            ck.save(1, state)
            ck.wait()
            monkeypatch.setenv("CKPT_DELAY", "stage:0:0.1")  # the copy of step 2 takes ~1 s
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C, while the writers write step 2
            with pytest.raises(KeyboardInterrupt):
                ck.save(2, _state(2))
            with pytest.raises(ckpt.CkptError, match="interrupted by KeyboardInterrupt"):
                ck.wait()
            assert ck.steps() == [1]
            monkeypatch.delenv("CKPT_DELAY")
            ck.save(3, _state(3))  # the root takes new saves
            ck.wait()
            assert ck.steps() == [1, 3]
            target = _state(4)
            assert ck.restore(target, step=1) == 1
        _assert_bitwise(expected, _flat(target))
        assert not list(tmp_path.glob("*.tmp-*")), "the failed save's chunks must be removed"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True], ids=["copy-then-write", "overlap_writes"])
def test_an_interrupt_after_the_copy_still_ends_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Ctrl-C between the end of the copy and save()'s return: the commit must not wait
    forever for a copy that save() will never report as done."""
    state = _state(1)
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        with Checkpointer(tmp_path, overlap_writes=overlap) as ck:
            ck.save(1, state)
            ck.wait()
            monkeypatch.setenv("CKPT_DELAY", "after-stage:0:5")  # save() lingers after its copy
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                ck.save(2, _state(2))
            monkeypatch.delenv("CKPT_DELAY")
            with pytest.raises(ckpt.CkptError, match="interrupted by KeyboardInterrupt"):
                ck.wait()
            ck.save(3, _state(3))
            ck.wait()
            assert ck.steps() == [1, 3]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_interrupted_copy_leaves_no_lane_writing_into_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's two lanes balanced by bytes: one large chunk on save()'s thread, many small
    ones on the pool's. Ctrl-C while save() waits for the pool's lane must not leave that lane
    copying step 2's bytes into the buffer the next save (another layout) stages into."""
    small = 16384
    state2 = {"a": torch.full((1 << 20,), 2.0), **{f"b{i}": torch.full((small,), 2.0) for i in range(10)}}
    state3 = {"a": torch.full(((1 << 20) + 10 * small,), 3.0)}
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        with Checkpointer(tmp_path, overlap_writes=True, capture_rng=False) as ck:
            ck.save(1, state2)
            ck.wait()
            monkeypatch.setenv("CKPT_DELAY", "stage:0:0.1")  # the pool's lane: ten chunks, 1 s
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                ck.save(2, state2)
            with pytest.raises(ckpt.CkptError, match="interrupted"):
                ck.wait()
            monkeypatch.setenv("CKPT_DELAY", "write:0:0.6")  # a slow disk: a stray lane has time
            ck.save(3, state3)
            ck.wait()
            out = {"a": torch.zeros_like(state3["a"])}
            assert ck.restore(out, step=3) == 3
        assert torch.equal(out["a"], state3["a"]), f"values seen: {out['a'].unique().tolist()}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def interrupted_on_one_rank(ctx: Ctx, root: str, deferred: bool) -> dict:
    """Ctrl-C on rank 1 during save()'s own copy (with deferred staging: of the tensors it
    copies before returning): every rank's save fails promptly, and the next one commits."""
    import os
    import time
    from datetime import timedelta

    ws = [torch.nn.Parameter(torch.randn(4096)) for _ in range(4)]
    opt = torch.optim.SGD(ws, lr=0.1)
    own = ckpt.Shard(torch.randn(4096), (4096 * ctx.world,), (4096 * ctx.rank,))  # no optimizer's: copied in save()
    state = {"w": ws, "optim": opt, "own": own}
    out: dict[str, Any] = {}
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        with Checkpointer(root, deferred_staging=deferred, timeout=timedelta(seconds=30)) as ck:
            ck.save(1, state)
            ck.wait()
            if ctx.rank == 1:
                os.environ["CKPT_DELAY"] = "stage:1:1"
                signal.setitimer(signal.ITIMER_REAL, 0.3)
            t = time.perf_counter()
            try:
                ck.save(2, state)
                out["save"] = "returned"
            except KeyboardInterrupt:
                out["save"] = "KeyboardInterrupt"
            os.environ.pop("CKPT_DELAY", None)
            try:
                ck.wait()
                out["wait"] = "ok"
            except ckpt.CkptError as e:
                out["wait"] = type(e).__name__
            ctx.check(time.perf_counter() - t < 15, f"the failure took {time.perf_counter() - t:.1f}s to reach every rank")
            ck.save(3, state)
            ck.wait()
            out["steps"] = ck.steps()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return out


@pytest.mark.parametrize("deferred", [False, True], ids=["save-copies-all", "deferred_staging"])
def test_an_interrupt_on_one_rank_fails_the_save_on_all(tmp_path: Path, deferred: bool) -> None:
    results, failures = launch(
        __file__, "interrupted_on_one_rank", 2, tmp_path, root=str(tmp_path / "root"), deferred=deferred
    )
    assert failures == []
    assert [r["save"] for r in results] == ["returned", "KeyboardInterrupt"]
    assert all(r["wait"] in ("RankFailures", "CkptError") for r in results), results
    assert all(r["steps"] == [1, 3] for r in results), results


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
        ctx.check(torch.equal(out["dt"].full_tensor(), full), "dtensor differs")
        ctx.check(torch.equal(out["rep"], state["rep"]), "replicated tensor differs")
        ctx.check(torch.equal(out["own"].local_tensor, torch.full((77,), float(ctx.rank))), "hand-sharded tensor differs")
    return {"ok": True}


def test_overlapped_writes_on_two_ranks(tmp_path: Path) -> None:
    results, failures = launch(__file__, "overlapped_on_ranks", 2, tmp_path, root=str(tmp_path / "root"))
    assert failures == [] and results == [{"ok": True}] * 2
