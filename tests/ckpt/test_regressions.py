"""Regressions found in review: each failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt
from ckpt import Checkpointer
from ckpt.store import versions
from ckpt.store.manifest import parse_manifest
from ckpt.store.rank_file import parse_rank_file
from tests._manifests import crafted
from tests._states import assert_bitwise


class WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = torch.ones(())

    def get_extra_state(self) -> torch.Tensor:
        return self.scale.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = state.clone()


def test_module_extra_state_goes_through_load_state_dict(tmp_path: Path) -> None:
    src = WithExtraState()
    src.scale = torch.tensor(7.0)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"m": src})
    dst = WithExtraState()
    with Checkpointer(tmp_path) as ck:
        ck.restore({"m": dst})
    assert dst.scale.item() == 7.0
    assert_bitwise(dst.state_dict(), src.state_dict(), "module")


def test_fresh_optimizer_gets_state_only_where_the_checkpoint_has_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(list(used.parameters()) + list(unused.parameters()), lr=0.1)
    used(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"used": used, "unused": unused, "opt": opt})
    used2, unused2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt2 = torch.optim.Adam(list(used2.parameters()) + list(unused2.parameters()), lr=0.1)
    grad = torch.full_like(used2.weight, 3.0)
    used2.weight.grad = grad
    with Checkpointer(tmp_path) as ck:
        ck.restore({"used": used2, "unused": unused2, "opt": opt2})
    assert len(opt2.state) == 2 and all(p in opt2.state for p in used2.parameters())
    assert used2.weight.grad is grad  # the user's gradients are left alone
    assert_bitwise(unused2.state_dict(), unused.state_dict(), "unused")


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1),
        lambda ps: torch.optim.RAdam(ps, lr=0.1, weight_decay=0.1),
    ],
    ids=["adam", "sgd", "adagrad", "radam"],
)
def test_restoring_an_optimizer_alone_leaves_its_parameters_bitwise(tmp_path: Path, make: Any) -> None:
    """A fresh optimizer gets its state from one step at lr=0 on zero gradients; its weight
    decay added inf x 0 = NaN to an inf parameter, and turned -0.0 into 0.0 (found by review:
    harmless where the model is restored in the same call, not where the optimizer is alone)."""
    values = torch.tensor([[1.0, float("inf"), -0.0], [float("-inf"), float("nan"), -2.5]])

    def model() -> torch.nn.Linear:
        m = torch.nn.Linear(3, 2)
        with torch.no_grad():
            m.weight.copy_(values)
            m.bias.copy_(torch.tensor([-0.0, 3.0]))
        return m

    m = model()
    opt = make(list(m.parameters()))
    m.weight.grad, m.bias.grad = torch.ones(2, 3), torch.ones(2)
    opt.step()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"optim": opt})
    m2 = model()
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    opt2 = make(list(m2.parameters()))
    with Checkpointer(tmp_path) as ck:
        ck.restore({"optim": opt2})
    assert_bitwise(m2.state_dict(), before, "parameters")
    assert_bitwise(opt2.state_dict()["state"], opt.state_dict()["state"], "optimizer state")


def test_lbfgs_restores(tmp_path: Path) -> None:
    lin = torch.nn.Linear(3, 1)
    opt = torch.optim.LBFGS(lin.parameters())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = lin(torch.ones(2, 3)).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"lin": lin, "opt": opt})
    lin2 = torch.nn.Linear(3, 1)
    opt2 = torch.optim.LBFGS(lin2.parameters())
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"lin": lin2, "opt": opt2}) == 1
    assert_bitwise(lin2.state_dict(), lin.state_dict(), "lin")
    assert_bitwise(opt2.state_dict(), opt.state_dict(), "LBFGS")


def test_non_contiguous_ndarray_is_restored(tmp_path: Path) -> None:
    src = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": src})
    dst = np.asfortranarray(np.zeros((3, 4)))
    with Checkpointer(tmp_path) as ck:
        ck.restore({"a": dst})
    assert_bitwise(dst, src, "a")


def _manifest(tmp_path: Path) -> dict:
    with Checkpointer(tmp_path / "r") as ck:
        ck.save(1, {"w": torch.randn(4, 3)})
    return json.loads((tmp_path / "r" / versions.version_dirname(1) / "manifest.json").read_bytes())


def test_manifest_without_all_chunks_is_rejected(tmp_path: Path) -> None:
    doc = _manifest(tmp_path)
    doc["arrays"]["w"]["writers"] = []
    with pytest.raises(ckpt.ManifestError, match="cover"):
        parse_manifest(crafted(doc))


def test_deeply_nested_manifest_is_a_manifest_error() -> None:
    with pytest.raises(ckpt.ManifestError):
        parse_manifest(b"[" * 100000 + b"]" * 100000)


def test_malformed_rng_is_rejected(tmp_path: Path) -> None:
    manifest = parse_manifest(crafted(_manifest(tmp_path)))
    rank = json.loads((tmp_path / "r" / versions.version_dirname(1) / "ranks" / "0.json").read_bytes())
    rank["rng"] = {"python": {"state": "x"}}
    with pytest.raises(ckpt.ManifestError, match="RNG"):
        parse_rank_file(json.dumps(rank).encode(), manifest, 0)


def test_numpy_object_array_is_refused_cleanly(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ckpt.UnsupportedStateError, match="bad"):
            ck.save(1, {"bad": np.array(["a", "b"], dtype=object)})
        ck.save(2, {"ok": torch.ones(2)})  # the checkpointer stays usable
        ck.wait()
        assert ck.steps() == [2]


def test_a_step_saved_twice_is_restored_from_the_save_that_holds_the_state(tmp_path: Path) -> None:
    """Two tiers hold step 5 from different saves, whole: the job's full save and a
    params-only one. A strict restore of the full state chooses the save that holds every
    key; its save_id was looked up without the keys filter, where the step had two saves
    (KeyError)."""
    full = {"model": torch.arange(8.0), "optim": {"m": torch.full((8,), 2.0)}}
    with Checkpointer(tmp_path / "a") as ck:
        ck.save(5, full)
    with Checkpointer(tmp_path / "b") as ck:
        ck.save(5, {"model": torch.zeros(8)})
    got = {"model": torch.zeros(8), "optim": {"m": torch.zeros(8)}}
    with Checkpointer(tmp_path / "a", tiers=[str(tmp_path / "b")]) as ck:
        assert ck.restore(got) == 5
    assert_bitwise(got, full)


def test_a_0d_numpy_array_is_saved_and_restored_0d(tmp_path: Path) -> None:
    """Before, a 0-d array was saved as shape (1,) (np.ascontiguousarray makes arrays at least
    1-d): restored into nothing it came back (1,), and into a 0-d tensor it was a
    StateMismatchError. A version saved so still restores into a 0-d array."""
    with Checkpointer(tmp_path / "r", capture_rng=False) as ck:
        ck.save(1, {"best": np.array(0.25), "n": np.array(7, dtype=np.int64)})
        fresh: dict[str, object] = {"best": None, "n": None}
        ck.restore(fresh)
        assert [(np.asarray(v).shape, np.asarray(v).item()) for v in fresh.values()] == [((), 0.25), ((), 7)]
        into = {"best": torch.zeros((), dtype=torch.float64), "n": np.array(0, dtype=np.int64)}
        target_n = into["n"]
        ck.restore(into)
        assert into["best"].shape == () and into["best"].item() == 0.25
        assert into["n"] is target_n and target_n.shape == () and target_n.item() == 7  # in place
    with Checkpointer(tmp_path / "old", capture_rng=False) as ck:
        ck.save(1, {"best": np.array([0.5])})  # what a 0-d array was saved as before
        best = np.array(0.0)
        ck.restore({"best": best})
        assert best.shape == () and best.item() == 0.5
