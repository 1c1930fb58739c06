"""Loaders with worker processes inside a ckpt state resume at their exact position.

torchdata's `StatefulDataLoader` with `num_workers=2` is put in the state as it is (ckpt
saves its `state_dict()`, worker snapshots included, and restores a fresh loader through
`load_state_dict`): a map-style dataset shuffled by the loader's generator, and an
IterableDataset whose per-worker position and generator are its own `state_dict()`
(torchdata calls it in the workers). And `ckpt.DistributedSampler` under a plain torch
DataLoader with `num_workers=2`, where the sampler's position must be set to what the
loop consumed before saving (the workers prefetch ahead of it).

In each case a reference loop records every batch over several epochs; a second loop
saves with `ck.save` after k batches and stops; a fresh loader (fresh dataset, sampler
and generator) restored by `ck.restore` yields exactly the reference's remaining batches
(torch.equal), across the epoch boundaries too. A save follows every batch of the first
two epochs (mid-epoch, at the last batch of an epoch, in a later epoch) and the first of
the third.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from ckpt import Checkpointer, DistributedSampler

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13

EPOCHS = 3
Batch = list[torch.Tensor]


def _same(got: list[Batch], want: list[Batch]) -> bool:
    return len(got) == len(want) and all(
        len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got, want)
    )


class Stream(IterableDataset):  # type: ignore[type-arg]
    """Each worker streams its share of range(n), every item with noise from a generator of
    its own, seeded from (seed, epoch, worker) at the start of an epoch. Its state_dict (the
    worker's: torchdata calls it in the worker) holds the epoch, the position and the
    generator's state; `set_epoch` is called in the main process before each epoch. A
    worker that has streamed its share keeps saying so (position at the end)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch = 0
        self.pos = 0
        self.gen: torch.Generator | None = None
        self._resumed = False  # load_state_dict ran: __iter__ goes on instead of starting over

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(wid, self.n, workers))
        if not self._resumed:
            self.pos = 0
            self.gen = torch.Generator().manual_seed(self.seed * 10_000 + self.epoch * 100 + wid)
        self._resumed = False
        assert self.gen is not None
        while self.pos < len(mine):
            item = mine[self.pos]
            self.pos += 1
            yield torch.tensor([item]), torch.randn(3, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "gen": None if self.gen is None else self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._resumed = state["gen"] is not None  # None: saved before this worker began
        if state["gen"] is not None:
            self.gen = torch.Generator()
            self.gen.set_state(state["gen"])


class Setup:
    """How one kind of loader is built, iterated for an epoch, and saved."""

    def __init__(
        self,
        make: Callable[[], Any],
        per_epoch: int,
        begin_epoch: Callable[[Any, int], None] = lambda loader, epoch: None,
        to_save: Callable[[Any, int], dict[str, Any]] = lambda loader, in_epoch: {"loader": loader},
    ) -> None:
        self.make, self.per_epoch, self.begin_epoch, self.to_save = make, per_epoch, begin_epoch, to_save


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.arange(n), torch.randn(n, 5, generator=g))


def _stateful_map() -> Setup:
    # 30 samples in batches of 4: 8 batches per epoch, the last one of 2.
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            _data(30), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5)
        )

    return Setup(make, per_epoch=8)


def _stateful_in_process() -> Setup:
    # No workers: the order comes from a sampler that owns its generator (torchdata's
    # RandomSampler). A `generator=` given to the loader itself also draws the loader's base
    # seed, which torchdata's state misses when num_workers=0: the order after the next
    # epoch boundary would differ.
    def make() -> StatefulDataLoader:
        data = _data(30)
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(8))
        return StatefulDataLoader(data, batch_size=4, sampler=sampler)

    return Setup(make, per_epoch=8)


def _stateful_iterable() -> Setup:
    # 22 items, 11 per worker in batches of 3 (3, 3, 3, 2): 8 batches per epoch, the workers in turn.
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            Stream(22, seed=3), batch_size=3, num_workers=2, generator=torch.Generator().manual_seed(6)
        )

    def begin_epoch(loader: StatefulDataLoader, epoch: int) -> None:
        loader.dataset.set_epoch(epoch)

    return Setup(make, per_epoch=8, begin_epoch=begin_epoch)


def _distributed_sampler() -> Setup:
    # Rank 1 of 2 over 30 samples: 15 in batches of 4, 4 batches per epoch (the last one of 3).
    def make() -> DataLoader[Any]:
        data: Dataset[Any] = _data(30)
        sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=4)
        return DataLoader(
            data, batch_size=4, sampler=sampler, num_workers=2, generator=torch.Generator().manual_seed(7)
        )

    def begin_epoch(loader: DataLoader[Any], epoch: int) -> None:
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def to_save(loader: DataLoader[Any], in_epoch: int) -> dict[str, Any]:
        # The workers prefetch: the sampler has handed out more indices than the loop consumed.
        sampler: DistributedSampler = loader.sampler  # type: ignore[assignment]
        assert sampler.position >= min(in_epoch * 4, sampler.num_samples)
        sampler.position = min(in_epoch * 4, sampler.num_samples)
        return {"sampler": sampler}

    return Setup(make, per_epoch=4, begin_epoch=begin_epoch, to_save=to_save)


SETUPS = {
    "stateful_map": _stateful_map,
    "stateful_in_process": _stateful_in_process,
    "stateful_iterable": _stateful_iterable,
    "distributed_sampler": _distributed_sampler,
}


def _loop(setup: Setup, loader: Any, first: int, stop: Callable[[int, int], bool] | None = None) -> list[Batch]:
    """Batches after the first `first` ones to the end of the last epoch, or until stop(batches
    so far, batches into the epoch) is True. A resumed loop goes on with the epoch the saving
    loop was in (after its last batch too: the loader then finishes it without a batch)."""
    out: list[Batch] = []
    start_epoch = (first - 1) // setup.per_epoch if first else 0
    step = first
    for epoch in range(start_epoch, EPOCHS):
        setup.begin_epoch(loader, epoch)
        for batch in loader:
            out.append(list(batch))
            step += 1
            if stop is not None and stop(step, step - epoch * setup.per_epoch):
                return out
    return out


@pytest.mark.parametrize("kind", list(SETUPS))
def test_resumes_at_the_exact_batch(tmp_path: Path, kind: str) -> None:
    setup = SETUPS[kind]()
    reference = _loop(setup, setup.make(), 0)
    assert len(reference) == EPOCHS * setup.per_epoch
    assert not _same(reference[: setup.per_epoch], reference[setup.per_epoch : 2 * setup.per_epoch])  # reshuffled
    # after every batch of the first two epochs and the first of the third
    for k in range(1, 2 * setup.per_epoch + 2):
        root = tmp_path / f"k{k}"
        loader = setup.make()
        with Checkpointer(root) as ck:

            def save(step: int, in_epoch: int, loader: Any = loader, ck: Checkpointer = ck, k: int = k) -> bool:
                if step == k:
                    ck.save(step, {**setup.to_save(loader, in_epoch), "step": step})
                return step == k

            head = _loop(setup, loader, 0, stop=save)
        del loader  # its workers go; the resumed loader is a fresh one
        assert _same(head, reference[:k])
        fresh = setup.make()
        state = {**setup.to_save(fresh, 0), "step": 0}
        with Checkpointer(root) as ck:
            assert ck.restore(state) == k
        assert state["step"] == k
        tail = _loop(setup, fresh, k)
        assert _same(tail, reference[k:]), f"{kind}: resumed after {k} batches, the rest differs from the reference"
