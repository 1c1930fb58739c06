"""Per-rank RNG state (Python `random`, NumPy's global generator, torch CPU, every CUDA
device) as JSON: no pickle, exact bit patterns."""

from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "seed_new_rank"]

log = logging.getLogger("ckpt")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached).hex(),
        },
        "torch": _b64(torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    keys = np.frombuffer(base64.b64decode(npst["keys"]), dtype="<u4").astype(np.uint32)
    np.random.set_state((npst["name"], keys, npst["pos"], npst["has_gauss"], float.fromhex(npst["cached_gaussian"])))
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("checkpoint has RNG state for %d CUDA devices, this process sees %d", len(cuda), n)
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_unb64(s), device=i)


def seed_new_rank(save_id: str, rank: int) -> None:
    """Seed every generator of a rank the checkpoint has no RNG state for.

    The seed is xxh3_64 of "<save_id>:<rank>": deterministic for a given checkpoint and
    rank (a rerun of the same restore draws the same numbers), and different per rank.
    """
    import xxhash

    seed = xxhash.xxh3_64_intdigest(f"{save_id}:{rank}".encode())
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed % 2**63)
