"""State helpers shared by the tests: the one bitwise comparison of a restored state with
the saved one, a zeroed restore target shaped like a state, and saving a few steps.

`bitwise_diff(got, want)` is the comparison; `assert_bitwise` raises on what it finds.
Tensors (DTensors, NumPy arrays and NumPy scalars too) are equal when dtype, shape and
every byte are: -0.0 differs from 0.0, a NaN equals only a NaN with the same payload.
Dicts need the same keys, lists and tuples the same length and type; any other value must
have the same type and compare `==`, except a float NaN, which equals a NaN, and -0.0,
which differs from 0.0. `torch.equal` is not used on values: it calls -0.0 equal to 0.0
and a NaN unequal to itself.

Subprocesses may import this module too (`from tests._states import bitwise_diff`) when
the repository root is on their PYTHONPATH; it needs only torch and NumPy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s elements in row-major order, as a 1-D uint8 tensor on the CPU.

    Works for 0-d tensors, views, non-contiguous and conjugated tensors, and every dtype
    (bool, bfloat16, float8, complex). A DTensor gives its local piece's bytes.
    """
    if _is_dtensor(t):
        t = t.to_local()
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8)


def bitwise_diff(got: Any, want: Any, where: str = "state") -> list[str]:
    """Every place where `got` is not bit for bit `want`, as "where: what" lines (none: equal)."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        return _tensor_diff(got, want, where)
    if isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
        return _array_diff(got, want, where)
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            return [f"{where}: {type(got).__name__}, expected a mapping"]
        if set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"]
        return [d for k in want for d in bitwise_diff(got[k], want[k], f"{where}[{k!r}]")]
    if type(got) is not type(want):
        return [f"{where}: {type(got).__name__} {got!r:.80} vs {type(want).__name__} {want!r:.80}"]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} vs {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in bitwise_diff(g, w, f"{where}[{i}]")]
    if isinstance(want, np.generic):
        same = got.dtype == want.dtype and got.tobytes() == want.tobytes()
    elif isinstance(want, float):
        same = (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)
        )
    else:
        same = bool(got == want)
    return [] if same else [f"{where}: {got!r:.80} vs {want!r:.80}"]


def assert_bitwise(got: Any, want: Any, where: str = "state") -> None:
    """Raise AssertionError naming every difference `bitwise_diff` finds."""
    diffs = bitwise_diff(got, want, where)
    assert not diffs, (
        "restored state differs from the saved one:\n  "
        + "\n  ".join(diffs[:20])
        + (f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else "")
    )


def blank(state: Any) -> Any:
    """A restore target shaped like `state`: tensors zeroed, other leaves None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    return None


def save_steps(root: Path | str, states: Mapping[int, Any], **config: Any) -> list[int]:
    """Save each state at its step with one Checkpointer on `root`; the steps it then lists."""
    from ckpt import Checkpointer

    with Checkpointer(root, **config) as ck:
        for step, state in states.items():
            ck.save(step, state)
        ck.wait()
        return ck.steps()


def draw_rng() -> list[Any]:
    """One draw from each generator the checkpointer restores (Python, NumPy, torch CPU)."""
    return [
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 1 << 30, size=2).tolist(),
        raw_bytes(torch.rand(4)).tolist(),
        raw_bytes(torch.randn(3, dtype=torch.float64)).tolist(),
    ]


# -- internals ----------------------------------------------------------------------------------


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor"


def _tensor_diff(got: Any, want: Any, where: str) -> list[str]:
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return [f"{where}: {type(got).__name__} vs {type(want).__name__}"]
    if _is_dtensor(got) or _is_dtensor(want):
        if not (_is_dtensor(got) and _is_dtensor(want)):
            return [f"{where}: {type(got).__name__} vs {type(want).__name__}"]
        if tuple(got.placements) != tuple(want.placements) or got.device_mesh.shape != want.device_mesh.shape:
            return [
                f"{where}: DTensor placements {tuple(got.placements)} on mesh {tuple(got.device_mesh.shape)} "
                f"vs {tuple(want.placements)} on mesh {tuple(want.device_mesh.shape)}"
            ]
        if got.shape != want.shape:
            return [f"{where}: global shape {list(got.shape)} vs {list(want.shape)}"]
        return _tensor_diff(got.to_local(), want.to_local(), f"{where} (local piece)")
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"]
    a, b = raw_bytes(got), raw_bytes(want)
    if torch.equal(a, b):  # uint8: equal means equal bytes
        return []
    first = int((a != b).nonzero()[0]) // max(got.element_size(), 1)
    try:
        g, w = (x.detach().cpu().reshape(-1)[first].item() for x in (got, want))
        values = f" ({g!r} vs {w!r})"
    except (RuntimeError, TypeError):  # a dtype without .item()
        values = ""
    return [f"{where}: bytes differ, first at element {first}{values}"]


def _array_diff(got: Any, want: Any, where: str) -> list[str]:
    if not (isinstance(got, np.ndarray) and isinstance(want, np.ndarray)):
        return [f"{where}: {type(got).__name__} vs {type(want).__name__}"]
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"]
    if want.dtype.hasobject:  # object arrays hold pointers: compare the elements
        return bitwise_diff(got.tolist(), want.tolist(), where)
    if got.tobytes() == want.tobytes():  # tobytes: row-major, whatever the strides
        return []
    return [f"{where}: bytes differ"]
