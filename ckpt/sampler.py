"""`DistributedSampler`: torch's sampler, resumable mid-epoch.

The index order is exactly torch.utils.data.DistributedSampler's; on top, the sampler
counts the indices it has handed out in the current epoch, so `state_dict()` records
(epoch, seed, position) and a resumed run continues with the very next sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data import DistributedSampler as _TorchSampler

from store.errors import ReshardError, StateMismatchError

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchSampler):  # type: ignore[type-arg]
    """Drop-in for `torch.utils.data.DistributedSampler` with a resumable position.

    The position counts indices handed to the DataLoader. With `num_workers=0` that is
    exactly what the training loop consumed. A loader with workers prefetches ahead: set
    `sampler.position` to the number of samples the loop actually consumed in this epoch
    before saving.
    """

    def __init__(
        self,
        dataset: Dataset,  # type: ignore[type-arg]
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.position = 0  # indices of this epoch already handed out on this rank
        self._resume_from = 0

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        else:
            indices = list(range(len(self.dataset)))  # type: ignore[arg-type]
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * -(-padding // len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start, self._resume_from = self._resume_from, 0
        self.position = start
        for index in self._indices()[start:]:
            self.position += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for a new epoch; setting the epoch a resumed sampler is already in keeps its position."""
        if epoch != self.epoch:
            self.position = 0
            self._resume_from = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "position": self.position,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = len(self.dataset)  # type: ignore[arg-type]
        if state["dataset_len"] != size:
            raise StateMismatchError(f"sampler was saved over {state['dataset_len']} samples, the dataset has {size}")
        if state["num_replicas"] != self.num_replicas:
            raise ReshardError(
                f"sampler was saved with num_replicas={state['num_replicas']}, now {self.num_replicas}; "
                "resuming on another world size needs the restore layer's resharding"
            )
        self.epoch = state["epoch"]
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.drop_last = state["drop_last"]
        self.position = self._resume_from = state["position"]
