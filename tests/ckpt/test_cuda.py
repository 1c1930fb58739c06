"""CUDA staging: pinned host buffers, non-blocking copies on a side stream, CUDA RNG.

Runs only where CUDA exists; elsewhere these tests are reported as skipped.
"""

from __future__ import annotations

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
        assert ck._arena.buffer is not None and ck._arena.buffer.is_pinned()
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
