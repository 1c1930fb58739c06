"""CUDA staging: pinned host buffers, non-blocking copies on a side stream, CUDA RNG.

Runs only where CUDA exists; elsewhere these tests are reported as skipped.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from ckpt import Checkpointer
from tests._states import assert_bitwise

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "bf16": torch.randn(1000, 7, device="cuda").to(torch.bfloat16)}


def test_cuda_round_trip_and_save_returns_after_copies(tmp_path):
    src = _state()
    expected = {k: v.detach().cpu().clone() for k, v in src["model"].state_dict().items()}
    torch.cuda.manual_seed_all(7)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, src)
        # save() returned: the optimizer may change parameters at once without affecting the checkpoint
        with torch.no_grad():
            for p in src["model"].parameters():
                p.add_(1.0)
        assert ck._saver._arena.buffer is not None and ck._saver._arena.buffer.is_pinned()
    after_save = torch.randn(3, device="cuda")
    dst = _state()
    with torch.no_grad():
        for p in dst["model"].parameters():
            p.zero_()
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(dst) == 1
    assert all(v.is_cuda for v in dst["model"].state_dict().values())
    assert_bitwise(dst["model"].state_dict(), expected, "model")  # compared on the CPU
    assert_bitwise(dst["bf16"], src["bf16"], "bf16")
    assert_bitwise(torch.randn(3, device="cuda"), after_save, "CUDA RNG draw")  # CUDA RNG restored


def test_a_state_that_moves_between_devices_restores_bitwise_and_frees_the_old_buffer(tmp_path):
    """The same shapes on the CPU, then on the GPU, then on the CPU again: a new layout each
    time (the staging buffer is pinned for CUDA sources, and a layout's slots keep views of
    it), every save restores bitwise, and the unpinned buffer is not kept alive."""
    g = torch.Generator().manual_seed(3)
    cpu = {f"t{i}": torch.randn(64, generator=g) for i in range(50)}
    states = {1: cpu, 2: {k: (v + 1).cuda() for k, v in cpu.items()}, 3: {k: v + 2 for k, v in cpu.items()}}
    with Checkpointer(tmp_path, keep_last=None) as ck:
        ck.save(1, states[1])
        ck.wait()
        first = ck._saver._arena.buffer
        assert first is not None and not first.is_pinned()
        unpinned = weakref.ref(first)
        del first
        ck.save(2, states[2])
        ck.wait()
        assert ck._saver._arena.buffer is not None and ck._saver._arena.buffer.is_pinned()
        assert unpinned() is None  # no slot's view holds the unpinned buffer
        ck.save(3, states[3])
        ck.wait()
        for step, state in states.items():
            out = {k: torch.zeros(64) for k in state}
            assert ck.restore(out, step=step) == step
            assert_bitwise(out, {k: v.cpu() for k, v in state.items()}, f"step {step}")
