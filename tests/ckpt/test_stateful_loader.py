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
the third. Then `ckpt.DistributedSampler` with workers on 2, then 3, then 1 rank in one
epoch; and a first save whose commit goes on while the process forks (workers starting).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from ckpt import Checkpointer, DistributedSampler
from tests._dist import REPO

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


def test_distributed_sampler_with_workers_goes_on_across_world_sizes() -> None:
    """The README's rule for a plain DataLoader with workers, `sampler.position` = the samples
    the loop consumed this epoch, holds across world sizes: 48 samples in batches of 4, 2
    ranks take 2 batches each, then 3 ranks 1 batch each, then 1 rank the rest. Each rank
    restores what ck.restore gives it (saved rank r % world: the sampler and the loop's
    count of the epoch's samples) and sets the position from its count before saving.
    Every sample of the epoch is seen exactly once."""
    data = _data(48)
    seen: list[int] = []
    saved: list[dict[str, Any]] = []
    for world, batches in ((2, 2), (3, 1), (1, None)):
        states = []
        for rank in range(world):
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=4)
            consumed = 0
            if saved:
                mine = saved[rank % len(saved)]
                sampler.load_state_dict(mine["sampler"])
                consumed = mine["consumed"]
            sampler.set_epoch(0)
            loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
            for i, (index, _) in enumerate(loader):
                seen += index.tolist()
                consumed += len(index)
                if i + 1 == batches:
                    break
            sampler.position = consumed  # the workers prefetched ahead of the loop
            states.append(json.loads(json.dumps({"sampler": sampler.state_dict(), "consumed": consumed})))
        saved = states
    assert sorted(seen) == list(range(48)), f"repeated or skipped: {sorted(seen)}"


# A process's first save, then processes forked while it commits, alive until killed: the
# DataLoader workers of a loop that goes on meanwhile. JSON: whether the commit ended first.
_FORKED_DURING_COMMIT = """
import json, os, signal, sys, threading, time
import torch
from ckpt import Checkpointer

children = []
with Checkpointer(sys.argv[1]) as ck:
    ck.save(1, {"x": torch.zeros(4)})
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and ck.latest_step() != 1:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ck.wait(), done.set()), daemon=True)
    waiter.start()
    committed = done.wait(15)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    waiter.join()
print(json.dumps({"committed": committed, "forks": len(children)}))
"""


def test_a_commit_does_not_wait_for_processes_forked_meanwhile(tmp_path: Path) -> None:
    """A loop that forks DataLoader workers while its first save commits in the background:
    the commit must not wait for them (it did when the commit thread ran git for the
    manifest's provenance, whose pipes a child forked meanwhile inherited; the loop, waiting
    in its next save, then never ended the epoch that would end the workers). The race is
    timing-dependent: three fresh processes (each process runs git once)."""
    for attempt in range(3):
        out = subprocess.run(
            [sys.executable, "-c", _FORKED_DURING_COMMIT, str(tmp_path / f"root{attempt}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["committed"], f"attempt {attempt}: the commit waited for the {result['forks']} forked processes"
