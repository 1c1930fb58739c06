"""saved_rank_of's asks for rank files a rank cannot read, with ranks as threads of one
process (a Comm whose collectives meet at a barrier and refuse ranks that make different
ones at one point), so each rank's sources can be set by hand: which ranks reach the store
(rank 0 listed for all of them) and which are cut off from it without knowing yet.

The version is saved by a real gloo job (4 or 6 ranks) into one root, which then stands both for
the store (every rank's files, under its own location) and for the nodes' disks (a Source
naming only that node's writers)."""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from ckpt._dist import Comm
from ckpt._load import saved_rank_of
from ckpt.restore.locate import Located
from ckpt.restore.sources import Source
from ckpt.store._local import LocalTier
from ckpt.store.errors import TierUnavailableError
from ckpt.store.versions import read_manifest
from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def save_job(ctx: Any, root: str) -> None:
    import ckpt

    rows = 2 * ctx.world
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, {"w": ckpt.Shard(torch.full((2, 8), float(ctx.rank)), (rows, 8), (2 * ctx.rank, 0)), "r": ctx.rank})
        ck.wait()


class _CutOff(LocalTier):
    """The store, from a rank whose network path to it is broken."""

    def open_read(self, key: str) -> Any:
        raise TierUnavailableError(errno.EHOSTUNREACH, f"{self.location}/{key}: no route to host")


class _ThreadComm(Comm):
    """Comm's collectives between threads: every call meets the other ranks' at a barrier."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        super().__init__(None, rank, len(shared["slots"]))
        self.s = shared

    def _meet(self, kind: str, obj: Any) -> list[Any]:
        self.calls[kind] += 1
        self.s["slots"][self.rank] = (kind, obj)
        self.s["barrier"].wait(timeout=20)
        out = list(self.s["slots"])
        self.s["barrier"].wait(timeout=20)
        kinds = {k for k, _ in out}
        if len(kinds) > 1:
            raise AssertionError(f"ranks made different collectives: {sorted(kinds)}")
        return [o for _, o in out]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._meet("all_gather", obj)

    def reduce_max(self, values: Any) -> list[int]:
        got = self._meet("all_reduce", list(values))
        return [max(v) for v in zip(*got)]

    def all_to_all(self, parts: Any) -> list[Any]:
        got = self._meet("all_to_all", list(parts))
        return [got[r][self.rank] for r in range(self.world)]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._meet("broadcast", obj)[src]


def _run(
    sources: dict[int, list[Source]], step: int, manifest: Any, wants: dict[int, int] | None = None
) -> dict[int, str]:
    world = len(sources)
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    out: dict[int, str] = {}

    def run(rank: int) -> None:
        located = Located(step, manifest.save_id, tuple(sources[rank]))
        try:
            got = saved_rank_of(_ThreadComm(rank, shared), manifest, located, rank if wants is None else wants[rank])
            out[rank] = "ok" if got is not None and got.tree is not None else f"got {got!r}"
        except BaseException as e:  # noqa: BLE001
            out[rank] = f"{type(e).__name__}: {e}"

    ths = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out


def test_a_holder_cut_off_from_the_store_does_not_call_a_second_file_there_damaged(tmp_path: Path) -> None:
    """Ranks 0 and 2 hold their own rank files on their disks, ranks 1 and 3 (new nodes)
    only on the store, which ranks 1-3 cannot reach; ranks 0 and 2 never read the store, so
    both offer every rank's file. Ranks 1 and 3 ask rank 2 first (1 % 2 == 3 % 2): rank 2
    serves rank 1's file, finds the store out of its reach and leaves it out, then finds
    rank 3's file 'on no reachable tier', which was answered as damage, and every rank
    fell back to an older version, although rank 0 reaches the store and holds both (the
    code before the all-to-all asked rank 0 first for both, and restored this version)."""
    disk, store_ok, store_cut, manifest = _saved(tmp_path, 4)
    every = frozenset(range(4))
    sources = {
        0: [Source(disk, 1, frozenset({0})), Source(store_ok, 1, every)],
        1: [Source(store_cut, 1, every)],
        2: [Source(disk, 1, frozenset({2})), Source(store_cut, 1, every)],
        3: [Source(store_cut, 1, every)],
    }
    out = _run(sources, 1, manifest)
    assert out == {r: "ok" for r in range(4)}, out


def test_the_ranks_a_rank_file_is_asked_of_include_the_lowest_that_reaches_it(tmp_path: Path) -> None:
    """Six ranks: rank 0 (which listed the store, so reaches it) and ranks 1-3 hold their own
    rank files on their disks, and only rank 0 reaches the store; ranks 4 and 5 (a new node)
    have theirs on the store alone. Rank 5 asked ranks 1, 2 and 3 (its rotation among the
    four holders), all cut off, and the restore failed (TierUnavailableError); the code
    before the all-to-all asked rank 0 first and restored it."""
    disk, store_ok, store_cut, manifest = _saved(tmp_path, 6)
    every = frozenset(range(6))
    sources = {
        0: [Source(disk, 1, frozenset({0})), Source(store_ok, 1, every)],
        **{r: [Source(disk, 1, frozenset({r})), Source(store_cut, 1, every)] for r in (1, 2, 3)},
        **{r: [Source(store_cut, 1, every)] for r in (4, 5)},
    }
    out = _run(sources, 1, manifest)
    assert out == {r: "ok" for r in range(6)}, out


def test_a_rank_whose_own_copy_is_damaged_does_not_offer_it(tmp_path: Path) -> None:
    """Saved by 2 ranks, resumed on 6 (ranks 0, 2, 4 take saved rank 0's file): rank 0's
    disk holds a damaged copy of it, rank 2's a good one, rank 4 (a new node) none. Rank 4
    asked rank 0 first (the lowest holder), which answered 'damaged', and every rank fell
    back to an older version, though rank 2 held a good copy; now rank 0, which found its
    copy damaged, offers it to no one, and rank 4 gets rank 2's."""
    disk, _, _, manifest = _saved(tmp_path, 2)
    bad_dir = tmp_path / "bad"
    shutil.copytree(disk.location, bad_dir)
    f = bad_dir / "v000000000001" / "ranks" / "0.json"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    bad = LocalTier(bad_dir)
    sources = {
        0: [Source(bad, 1, frozenset({0}))],
        1: [Source(disk, 1, frozenset({1}))],
        2: [Source(disk, 1, frozenset({0}))],
        3: [Source(disk, 1, frozenset({1}))],
        4: [],
        5: [Source(disk, 1, frozenset({1}))],
    }
    out = _run(sources, 1, manifest, wants={r: r % 2 for r in range(6)})
    assert out == {r: "ok" for r in range(6)}, out


def _saved(tmp_path: Path, world: int) -> tuple[LocalTier, LocalTier, LocalTier, Any]:
    """A version saved by `world` ranks into one root (the nodes' disks), its copy (the store),
    and the store as seen from a rank cut off from it."""
    root = tmp_path / "saved"
    _, failures = launch(THIS, "save_job", world, tmp_path, timeout=240, root=str(root))
    assert not failures, failures
    store_dir = tmp_path / "store"
    shutil.copytree(root, store_dir)
    disk = LocalTier(root)
    return disk, LocalTier(store_dir), _CutOff(store_dir), read_manifest(disk, 1)
