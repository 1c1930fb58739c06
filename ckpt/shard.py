"""`Shard`: an explicit piece of a global tensor, for hand-sharded code (Megatron, ZeRO)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    """This rank's piece of a global tensor.

    `local_tensor` is the piece, `global_shape` the whole tensor's shape and `offsets`
    where the piece starts in it. Pieces of different ranks may have uneven sizes but
    must not overlap, and together must cover the global tensor; ranks holding the same
    piece are treated as replicas and the piece is written once.
    """

    local_tensor: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        if not isinstance(self.local_tensor, torch.Tensor):
            raise TypeError("Shard.local_tensor must be a torch.Tensor")
        shape, offsets = tuple(self.global_shape), tuple(self.offsets)
        local = tuple(self.local_tensor.shape)
        if not (len(shape) == len(offsets) == len(local)):
            raise ValueError(f"Shard: global_shape {shape}, offsets {offsets} and local shape {local} differ in rank")
        for o, s, g in zip(offsets, local, shape):
            if o < 0 or o + s > g:
                raise ValueError(f"Shard: piece {offsets}+{local} does not fit in global shape {shape}")
