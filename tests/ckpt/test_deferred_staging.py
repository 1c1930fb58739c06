"""Deferred staging: save() returns before the copy, and the checkpoint still holds the
values of the save() call, bitwise, or the save fails and nothing is committed."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from ckpt import Checkpointer, Shard
from tests._dist import Ctx, launch
from tests._states import assert_bitwise, bitwise_diff


def _trained(width: int = 1024, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, width)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, grads: bool = True) -> None:
    model(torch.randn(32, model[0].in_features)).square().mean().backward()
    opt.step()
    if grads:
        model(torch.randn(32, model[0].in_features)).square().mean().backward()  # grads for the next step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()["state"]})


@pytest.mark.parametrize("overlap", [False, True], ids=["copy-then-write", "overlap_writes"])
def test_optimizer_step_right_after_save_waits_and_the_checkpoint_is_exact(tmp_path: Path, overlap: bool) -> None:
    model, opt = _trained(width=2048)  # ~50 MB of parameters and moments: the copy takes a while
    expected = _snapshot(model, opt)
    with Checkpointer(tmp_path, deferred_staging=True, overlap_writes=overlap) as ck:
        ck.save(1, {"model": model, "optim": opt})
        opt.step()  # at once: the step pre-hook must hold it until the copy has ended
        _train_step(model, opt)  # forward changes the BatchNorm buffers: they were copied in save()
        ck.wait()
        stats = ck.stats()[-1]
        assert stats.stage_s <= stats.staged_s <= stats.total_s
        after = _snapshot(model, opt)
        fresh, fresh_opt = _trained(width=2048, seed=1)
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 1
    assert_bitwise(_snapshot(fresh, fresh_opt), expected)
    assert not torch.equal(after["model"]["0.weight"], expected["model"]["0.weight"])  # training moved on


@contextlib.contextmanager
def _copy_held_back(ck: Checkpointer) -> Iterator[None]:
    """Keep the commit thread busy, so the deferred copy of the save() in the block has
    surely not started when the block changes the state (no timing luck involved)."""
    hold = threading.Event()
    ck._saver._committer.submit(hold.wait)
    try:
        yield
    finally:
        hold.set()


@pytest.mark.parametrize("overlap", [False, True], ids=["copy-then-write", "overlap_writes"])
def test_in_place_change_before_the_copy_ends_fails_the_save(tmp_path: Path, overlap: bool) -> None:
    """With overlap_writes the torn chunk is written to the tmp directory before the check
    fails: the commit must still not happen."""
    w = torch.nn.Parameter(torch.randn(1024, 1024))
    opt = torch.optim.SGD([w], lr=0.1)
    state = {"w": w, "optim": opt}  # the optimizer owns w: w is deferred
    with Checkpointer(tmp_path, deferred_staging=True, overlap_writes=overlap) as ck:
        ck.save(1, state)
        ck.wait()
        saved = w.detach().clone()
        with _copy_held_back(ck):
            ck.save(2, state)
            with torch.no_grad():
                w[0, 0] += 1  # by hand, without wait_staged(): the copy could be torn
        with pytest.raises(ckpt.StagingRaceError, match=r"state\['w'\] changed in place"):
            ck.wait()
        assert ck.steps() == [1]
        with _copy_held_back(ck):
            ck.save(3, state)
        assert ck.wait_staged() >= 0.0
        with torch.no_grad():
            w[0, 0] += 1  # after wait_staged() the state is free to change
        ck.wait()
        assert ck.steps() == [1, 3]
        out = torch.nn.Parameter(torch.zeros_like(w))
        ck.restore({"w": out, "optim": torch.optim.SGD([out], lr=0.1)}, step=1)
        assert_bitwise(out, saved, "w at step 1")
        ck.restore({"w": out, "optim": torch.optim.SGD([out], lr=0.1)}, step=3)
        changed = saved.clone()
        changed[0, 0] += 1
        assert_bitwise(out, changed, "w at step 3")


def test_what_no_guarded_optimizer_owns_is_copied_before_save_returns(tmp_path: Path) -> None:
    """Buffers, NumPy arrays, and the tensors of an optimizer the checkpointer does not
    know (here fused: its kernels bump no version counter) are copied eagerly."""
    arr = np.arange(1 << 20, dtype=np.float32)
    model, _ = _trained(width=2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    _train_step(model, opt)
    expected = _snapshot(model, opt)
    head = torch.nn.Linear(8, 8)  # a second optimizer, in the state: its tensors are deferred
    head_opt = torch.optim.Adam(head.parameters())
    with Checkpointer(tmp_path, deferred_staging=True) as ck:
        with _copy_held_back(ck):
            ck.save(
                1,
                {
                    "arr": arr,
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "head": head,
                    "head_optim": head_opt,
                },
            )
            arr += 1  # NumPy keeps no version counter
            _train_step(model, opt)  # forward changes the BatchNorm statistics; a fused step the rest
        ck.wait()
        out_model, _ = _trained(width=2048, seed=2)
        out_opt = torch.optim.SGD(out_model.parameters(), lr=0.1, momentum=0.9, fused=True)
        out = {
            "arr": np.zeros_like(arr),
            "model": out_model,
            "optim": out_opt,
            "head": torch.nn.Linear(8, 8),
            "head_optim": None,
        }
        out["head_optim"] = torch.optim.Adam(out["head"].parameters())
        ck.restore(out)
    assert (out["arr"] == arr - 1).all()
    assert_bitwise(_snapshot(out_model, out_opt), expected)


def test_guard_covers_an_optimizer_the_state_holds_only_as_a_dict(tmp_path: Path) -> None:
    model, opt = _trained(width=2048)
    expected = _snapshot(model, opt)
    with Checkpointer(tmp_path, deferred_staging=True) as ck:
        ck.guard(opt)
        ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        opt.step()
        ck.wait()
        fresh, fresh_opt = _trained(width=2048, seed=1)
        ck.restore({"model": fresh, "optim": fresh_opt})
    assert_bitwise(_snapshot(fresh, fresh_opt), expected)


class _Wrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass that skips its __init__
    and steps the optimizer it wraps."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    @property
    def param_groups(self) -> list:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.optimizer.state

    def state_dict(self) -> dict:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(sd)

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        return self.optimizer.step(closure)


def test_a_wrapped_optimizer_is_guarded_through_the_one_it_wraps(tmp_path: Path) -> None:
    model, inner = _trained(width=2048)
    opt = _Wrapper(inner)
    expected = _snapshot(model, inner)
    with Checkpointer(tmp_path, deferred_staging=True) as ck:
        with _copy_held_back(ck):
            ck.save(1, {"model": model, "optim": opt})
        opt.step()  # the inner optimizer's hook holds it until the copy has ended
        ck.wait()
        assert ck.stats()[-1].staged_s > ck.stats()[-1].stage_s  # its tensors were deferred
        fresh, fresh_inner = _trained(width=2048, seed=1)
        ck.restore({"model": fresh, "optim": _Wrapper(fresh_inner)})
    assert_bitwise(_snapshot(fresh, fresh_inner), expected)


def test_a_leaf_no_longer_owned_is_copied_before_save_returns_in_the_same_layout(tmp_path: Path) -> None:
    """Saves of one layout whose deferred leaves change: the second save's optimizer owns
    w1 alone, so w2 is copied in save() and may change as soon as it returns."""
    w1, w2 = torch.nn.Parameter(torch.randn(512, 512)), torch.nn.Parameter(torch.randn(512, 512))
    with Checkpointer(tmp_path, deferred_staging=True, capture_rng=False) as ck:
        ck.save(1, {"w1": w1, "w2": w2, "optim": torch.optim.SGD([w1, w2], lr=0.1)})  # both deferred
        ck.wait()
        saved = w2.detach().clone()
        with _copy_held_back(ck):
            ck.save(2, {"w1": w1, "w2": w2, "optim": torch.optim.SGD([w1], lr=0.1)})
            with torch.no_grad():
                w2.add_(1)  # not deferred any more: copied already
        ck.wait()
        assert ck.steps() == [1, 2]
        out = {"w1": torch.zeros(512, 512), "w2": torch.zeros(512, 512), "optim": None}
        out["optim"] = torch.optim.SGD([out["w1"]], lr=0.1)
        ck.restore(out, step=2)
    assert_bitwise(out["w2"], saved, "w2 at step 2")
    assert_bitwise(out["w1"], w1.detach(), "w1 at step 2")


def test_an_optimizer_of_an_earlier_save_does_not_defer_this_saves_tensors(tmp_path: Path) -> None:
    model, adam = _trained(width=2048)
    with Checkpointer(tmp_path, deferred_staging=True) as ck:
        ck.save(1, {"model": model, "optim": adam})  # hooks adam, which owns the parameters
        ck.wait()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)  # adam replaced
        _train_step(model, sgd)
        expected = _snapshot(model, sgd)
        with _copy_held_back(ck):
            ck.save(2, {"model": model.state_dict(), "optim": sgd.state_dict()})  # sgd unknown: all eager
            sgd.step()  # neither waits nor bumps a counter
        ck.wait()
        fresh, _ = _trained(width=2048, seed=1)
        fresh_sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9, fused=True)
        ck.restore({"model": fresh, "optim": fresh_sgd}, step=2)
    assert_bitwise(_snapshot(fresh, fresh_sgd), expected)
    del adam


def test_a_wait_interrupted_by_a_signal_still_waits_at_the_next_save(tmp_path: Path) -> None:
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    w = torch.randn(1024, 1024)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Checkpointer(tmp_path) as ck:
            with _copy_held_back(ck):
                ck.save(1, {"w": w})
                signal.setitimer(signal.ITIMER_REAL, 0.2)
                with pytest.raises(Interrupted):
                    ck.wait()  # a SIGTERM handler would raise SystemExit here
            ck.save(2, {"w": w + 1})  # must wait for step 1 before reusing the staging buffer
            ck.wait()
            assert ck.steps() == [1, 2] and [s.step for s in ck.stats()] == [1, 2]
            out = {"w": torch.zeros_like(w)}
            ck.restore(out, step=1)
            assert_bitwise(out, {"w": w})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_deferred_staging_and_bounded_staging_are_refused_together() -> None:
    with pytest.raises(ValueError, match="deferred_staging"):
        ckpt.CheckpointerConfig(deferred_staging=True, max_staging_bytes=1 << 20)


def race_on_one_rank(ctx: Ctx, root: str) -> dict:
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    model, opt = _trained(width=1024)  # replicated: the same values on every rank
    mesh = init_device_mesh("cpu", (ctx.world,))
    with Checkpointer(root, deferred_staging=True) as ck:
        expected = _snapshot(model, opt)
        ck.save(1, {"model": model, "optim": opt, "rank": ctx.rank})
        opt.step()  # guarded on every rank
        ck.wait()
        ctx.check(ck.steps() == [1], f"step 1 committed: {ck.steps()}")
        piece = torch.nn.Parameter(torch.randn(1024, 1024))
        dt = torch.nn.Parameter(distribute_tensor(torch.zeros(2048, 64), mesh, [DShard(0)]))
        sgd = torch.optim.SGD([piece, dt], lr=0.1)
        ck.guard(sgd)  # held weakly, as long as the training loop holds the optimizer
        for what in ("shard", "dtensor", "both"):
            w = Shard(piece, (2048, 1024), (1024 * ctx.rank, 0))
            with _copy_held_back(ck):
                # "both": the DTensor first, so the error must name it first (the leaves' order)
                ck.save(2, {"dt": dt, "w": w} if what == "both" else {"w": w, "dt": dt})
                if ctx.rank == 1:
                    with torch.no_grad():
                        if what != "dtensor":
                            piece[7, 7] = 0.0
                        if what != "shard":
                            dt.add_(1.0)  # bumps the DTensor's counter, not its local tensor's
            try:
                ck.wait()
                ctx.check(False, f"{what}: a change on rank 1 during the copy must fail the save everywhere")
            except ckpt.CkptError as e:
                key = {"shard": "state['w']", "dtensor": "state['dt']", "both": "state['dt'], state['w']"}[what]
                ctx.check(f"{key} changed in place" in str(e), f"{what}: the error says what: {e}")
                ctx.check(ctx.rank == 1 or "rank 1" in str(e), f"{what}: rank 0's error names rank 1: {e}")
        ctx.check(ck.steps() == [1], f"step 1 stays the newest: {ck.steps()}")
        fresh, fresh_opt = _trained(width=1024, seed=9)
        ck.restore({"model": fresh, "optim": fresh_opt, "rank": None}, step=1)
        got = _snapshot(fresh, fresh_opt)
        diffs = bitwise_diff(got["model"], expected["model"], "model")
        ctx.check(not diffs, f"the restored model is the one saved: {diffs[:3]}")
    return {}


def test_a_race_on_one_rank_fails_the_save_on_all(tmp_path: Path) -> None:
    _, failures = launch(__file__, "race_on_one_rank", 2, tmp_path / "job", root=str(tmp_path / "root"))
    assert not failures, failures


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_deferred_copy_reads_the_values_of_the_save_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 4096, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    expected = _snapshot(model, opt)
    with Checkpointer(tmp_path, deferred_staging=True) as ck:
        ck.save(1, {"model": model, "optim": opt})
        for _ in range(3):  # kernels queued behind save() on the main stream overlap the copy
            model(x).square().mean().backward()
        opt.step()
        ck.wait()
        assert ck._saver._arena.buffer is not None and ck._saver._arena.buffer.is_pinned()
        fresh = copy.deepcopy(model)
        fresh_opt = torch.optim.Adam(fresh.parameters())
        fresh(x).sum().backward()
        fresh_opt.step()
        ck.restore({"model": fresh, "optim": fresh_opt})
    assert_bitwise(_snapshot(fresh, fresh_opt), expected)
