"""Per-rank RNG state (Python `random`, NumPy's global generator, torch CPU, every CUDA
device) as JSON: no pickle, exact bit patterns."""

from __future__ import annotations

import base64
import binascii
import logging
import random
from typing import Any, NamedTuple

import numpy as np
import torch

from ckpt.store.errors import ManifestError

__all__ = ["capture_rng", "check_rng", "restore_rng", "seed_new_rank"]

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


class _Rng(NamedTuple):
    """A saved RNG state decoded, each part as its generator's setter takes it."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: torch.Tensor
    cuda: list[torch.Tensor]


def _decoded(state: dict[str, Any]) -> _Rng:
    """The parts of a saved RNG state, each checked by a throwaway generator of its kind
    (the setters refuse what they cannot use); ManifestError where one is malformed."""
    try:
        py, npst = state["python"], state["numpy"]
        keys = np.frombuffer(base64.b64decode(npst["keys"], validate=True), dtype="<u4").astype(np.uint32)
        out = _Rng(
            (py["version"], tuple(py["state"]), py["gauss"]),
            (npst["name"], keys, npst["pos"], npst["has_gauss"], float.fromhex(npst["cached_gaussian"])),
            _unb64(state["torch"]),
            [_unb64(s) for s in state.get("cuda") or []],
        )
        random.Random().setstate(out.python)
        np.random.RandomState().set_state(out.numpy)
        torch.Generator().set_state(out.torch)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError, binascii.Error) as e:
        raise ManifestError(f"the saved RNG state is malformed: {type(e).__name__}: {e}") from None
    return out


def check_rng(state: dict[str, Any]) -> None:
    """ManifestError unless restore_rng can restore `state`: asked before anything is
    restored, on every rank alike."""
    _decoded(state)


def restore_rng(state: dict[str, Any]) -> None:
    rng = _decoded(state)
    random.setstate(rng.python)
    np.random.set_state(rng.numpy)
    torch.set_rng_state(rng.torch)
    if rng.cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(rng.cuda):
            log.warning("checkpoint has RNG state for %d CUDA devices, this process sees %d", len(rng.cuda), n)
        for i, s in enumerate(rng.cuda[:n]):
            torch.cuda.set_rng_state(s, device=i)


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
