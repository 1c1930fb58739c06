"""`DistributedSampler`: torch's sampler, resumable mid-epoch, also on another world size.

The index order is exactly torch.utils.data.DistributedSampler's; on top, the sampler
counts the indices it has handed out in the current epoch, so `state_dict()` records
(epoch, seed, position) and a resumed run continues with the very next sample.

Resharding: within an epoch, the samples form one list, the epoch's padded permutation
for the world size the epoch started with. Rank r of R takes every R-th element of the
part not yet consumed when the current layout began (`segment_start`). After each rank
has taken `position - segment_offset` samples of the layout, the first
`segment_start + (position - segment_offset) * R` elements are consumed, so a job resumed
on R' ranks splits exactly the rest over its ranks: none repeated, none skipped (the last
round may give some ranks one sample fewer). The position goes on counting from the saved
rank's across the change (the new layout begins at `segment_offset`, the saved
position), as the loop's own count of the epoch's samples, restored from the same rank, does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data import DistributedSampler as _TorchSampler

from ckpt.store.errors import StateMismatchError

__all__ = ["DistributedSampler"]


# What every saved state holds (the segment keys came later: older states lack them).
_SAVED = ("epoch", "seed", "position", "num_replicas", "rank", "shuffle", "drop_last", "dataset_len")


class DistributedSampler(_TorchSampler):  # type: ignore[type-arg]
    """Drop-in for `torch.utils.data.DistributedSampler` with a resumable position.

    The position counts indices handed to the DataLoader in this epoch, those before the
    restore included (across world sizes: those of the saved rank it restored from). With
    `num_workers=0` that is exactly what the training loop consumed. A loader with workers
    prefetches ahead: set `sampler.position` to the number of samples the loop actually
    consumed in this epoch (its own count, restored with the sampler) before saving.
    `len()` is an epoch at the current world size, also while a resumed epoch yields its rest.
    """

    def __init__(
        self,
        dataset: Dataset,  # type: ignore[type-arg]
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        even_after_reshard: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        # After resuming on another world size, split the rest of the epoch exactly (some ranks
        # may get one sample fewer), or, with this flag, pad like torch (drop_last: truncate)
        # so every rank runs the same number of steps, which collective training steps need.
        self.even_after_reshard = even_after_reshard
        self.position = 0  # indices of this epoch already handed out on this rank (and the saved rank)
        self._resume_from = 0
        self._segment_start = 0  # elements of the epoch list consumed before the current layout
        self._segment_world = self.num_replicas  # the world size that padded the epoch list
        self._segment_offset = 0  # the position at which the current layout began
        self._pending = False  # a restored position the next pass goes on from (later passes start over)

    def _epoch_list(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        world = self._segment_world
        if self.drop_last and n % world:
            total = (n // world) * world
        else:
            total = -(-n // world) * world
        if not self.drop_last:
            padding = total - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * -(-padding // len(indices)))[:padding]
        return indices[:total]

    def _epoch_list_for(self, epoch: int) -> list[int]:
        """The whole epoch's padded index list (all ranks), as this sampler's layout would see it."""
        saved, self.epoch = self.epoch, epoch
        try:
            return self._epoch_list()
        finally:
            self.epoch = saved

    def _indices(self) -> list[int]:
        rest = self._epoch_list()[self._segment_start :]
        resharded = self._segment_start > 0 or self._segment_world != self.num_replicas
        if resharded and self.even_after_reshard and rest and len(rest) % self.num_replicas:
            if self.drop_last:
                rest = rest[: len(rest) - len(rest) % self.num_replicas]
            else:
                short = self.num_replicas - len(rest) % self.num_replicas
                rest = rest + (rest * -(-short // len(rest)))[:short]
        return rest[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if not self._pending:  # a pass of its own: the whole epoch, in this world's layout (as torch)
            self._resume_from = self._segment_start = self._segment_offset = 0
            self._segment_world = self.num_replicas
        self._pending = False
        start, self._resume_from = self._resume_from, 0
        self.position = start
        for index in self._indices()[start - self._segment_offset :]:
            self.position += 1
            yield index

    def __len__(self) -> int:
        # An epoch's length at this layout, also while a resumed or resharded epoch yields only
        # its rest: loops size every epoch by the len() they read once (Lightning's batch count).
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for a new epoch; setting the epoch a resumed sampler is already in keeps its position."""
        if epoch != self.epoch:
            self.position = self._resume_from = self._segment_start = self._segment_offset = 0
            self._segment_world = self.num_replicas
            self._pending = False
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 0:
            raise ValueError(
                f"sampler.position must be the number of samples this rank's loop consumed in the epoch, an int "
                f">= 0, not {self.position!r}"
            )
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "position": self.position,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "segment_start": self._segment_start,
            "segment_world": self._segment_world,
            "segment_offset": self._segment_offset,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lacking = [k for k in _SAVED if k not in state]
        if lacking:
            raise StateMismatchError(f"not a ckpt.DistributedSampler's state: it lacks {lacking}")
        size = len(self.dataset)  # type: ignore[arg-type]
        if state["dataset_len"] != size:
            raise StateMismatchError(f"sampler was saved over {state['dataset_len']} samples, the dataset has {size}")
        self.epoch = state["epoch"]
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.drop_last = state["drop_last"]
        # torch sized the epoch in __init__ from the constructor's drop_last: size it for the saved one.
        if self.drop_last and size % self.num_replicas:
            self.num_samples = (size - self.num_replicas) // self.num_replicas + 1
        else:
            self.num_samples = -(-size // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        start = state.get("segment_start", 0)
        world = state.get("segment_world", state["num_replicas"])
        offset = state.get("segment_offset", 0)
        self.position = self._resume_from = state["position"]
        self._pending = True
        if state["num_replicas"] == self.num_replicas and state["rank"] == self.rank:
            self._segment_start, self._segment_world, self._segment_offset = start, world, offset
        else:
            # Another layout: what all old ranks consumed is a prefix of the epoch list.
            self._segment_start = start + (state["position"] - offset) * state["num_replicas"]
            self._segment_world = world
            self._segment_offset = state["position"]
        if self._segment_start == 0:  # nothing of the epoch consumed: torch's layout for this world
            self._segment_world = self.num_replicas
