"""The checkpointer's view of torch.distributed: its own gloo groups, or one process.

Two groups keep the threads apart: `ctl` is used only from the training thread (in
save/restore), `data` only from the background commit thread, so collectives of one
never interleave with the other's. Training's own group (NCCL or gloo) is never used.

The steady state is built from O(1)-byte all-reduces (`any`, `reduce_max`): a Python
object is all-gathered to every rank (O(world) bytes each, O(world^2) in all) only on a
path that is rare (a failure to report). Each Comm counts its
calls by kind (`calls`), for the tests and benchmarks that hold the save to that.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckpt.store.errors import CkptError, CollectiveError, CorruptVersionError, RankFailures

__all__ = ["Comm", "make_comm", "make_comms", "subgroup", "destroy_comms", "describe_error"]


def describe_error(e: BaseException) -> str:
    """An error as the other ranks learn it (exceptions do not cross ranks: text does)."""
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _transport(world: int, what: str) -> Iterator[None]:
    """torch.distributed's own failure (a plain RuntimeError from gloo: a peer's connection
    reset, a timeout) as the documented CollectiveError."""
    try:
        yield
    except CkptError:
        raise
    except RuntimeError as e:
        if type(e) is not RuntimeError and not isinstance(e, dist.DistError):
            raise  # out of memory, recursion...: not the transport's
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"ckpt's group of {world} ranks failed in {what} on rank {rank} (another rank died or "
            f"hung past the timeout, or the network broke): {describe_error(e)}"
        ) from e


class Comm:
    """Collectives over one group, or trivial ones when there is a single process."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.calls: Counter[str] = Counter()  # collective and point-to-point calls made, by kind
        self.messages = 0  # point-to-point messages posted by exchanges (sent and received)

    @staticmethod
    def solo() -> Comm:
        """The collectives of a single process (the CLI, exports)."""
        return Comm(None, 0, 1)

    def agree(self, error: BaseException | None) -> None:
        """Collective: every rank learns every rank's failure, and if any rank failed, every
        rank raises, so none is left waiting in a later collective.

        A rank that failed raises its own error. The others raise CorruptVersionError if any
        rank found damage (so a restore falls back to an older version on every rank
        together), else RankFailures; both carry every failed rank's cause (`causes`).
        """
        if not self.any(error is not None):  # the usual case: one all-reduce of an int
            return
        mine = None if error is None else (isinstance(error, CorruptVersionError), describe_error(error))
        views = self.all_gather(mine)
        causes = {r: v[1] for r, v in enumerate(views) if v is not None}
        if not causes:
            return
        corrupt = any(v[0] for v in views if v is not None)
        if error is not None and (isinstance(error, CorruptVersionError) or not corrupt):
            raise error
        summary = str(RankFailures(causes))
        if corrupt:
            raise CorruptVersionError(summary, causes=causes)
        raise RankFailures(causes)

    def all_gather(self, obj: Any) -> list[Any]:
        self.calls["all_gather"] += 1
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        with _transport(self.world, "an all-gather"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_to_all(self, parts: Sequence[Any]) -> list[Any]:
        """parts[r] to rank r (None: nothing); returns what each rank sent this one (None
        where it sent nothing). The sizes go in one all-to-all (an int64 per rank pair), then
        the parts that are not empty, point to point: a rank receives only what is meant for
        it, where an all-gather would hand every rank every part, padded to the longest."""
        self.calls["all_to_all"] += 1
        if len(parts) != self.world:
            raise ValueError(f"all_to_all takes one part per rank: {len(parts)} for {self.world} ranks")
        if self.world == 1:
            return [parts[0]]
        data = [
            b"" if p is None or r == self.rank else pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
            for r, p in enumerate(parts)
        ]
        sizes = torch.empty(self.world, dtype=torch.int64)
        with _transport(self.world, "an all-to-all"):
            dist.all_to_all_single(sizes, torch.tensor([len(d) for d in data], dtype=torch.int64), group=self.group)
        bufs = {r: torch.empty(int(n), dtype=torch.uint8) for r, n in enumerate(sizes.tolist()) if n}
        sends = [(r, 0, torch.frombuffer(bytearray(d), dtype=torch.uint8)) for r, d in enumerate(data) if d]
        self.exchange(sends, [(r, 0, b) for r, b in bufs.items()])
        out: list[Any] = [None] * self.world
        out[self.rank] = parts[self.rank]
        for r, b in bufs.items():
            out[r] = pickle.loads(b.numpy().tobytes())  # a part this job's own rank pickled, as all_gather does
        return out

    def all_gather_int(self, value: int) -> list[int]:
        """One int64 from every rank, to every rank: a fixed-size tensor (8 bytes per rank),
        no pickling."""
        self.calls["all_gather"] += 1
        if self.world == 1:
            return [value]
        out = torch.empty(self.world, dtype=torch.int64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.12
        with _transport(self.world, "an all-gather"):
            gather(out, torch.tensor([value], dtype=torch.int64), group=self.group)
        return [int(v) for v in out.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set: one all-reduce of a single int (no pickling, O(1)
        bytes per rank), cheap enough to call every training step."""
        return bool(self.reduce_max([int(flag)])[0])

    def reduce_max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum over the ranks of a few int64 values: one all-reduce of
        a fixed-size tensor, O(1) bytes per rank whatever the world size."""
        self.calls["all_reduce"] += 1
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64)
        with _transport(self.world, "an all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any] | None:
        """To rank 0; others get None."""
        self.calls["gather"] += 1
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        with _transport(self.world, "a gather"):
            dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.calls["broadcast"] += 1
        if self.world == 1:
            return obj
        box = [obj if self.rank == src else None]
        with _transport(self.world, "a broadcast"):
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def exchange(
        self, sends: Sequence[tuple[int, int, torch.Tensor]], recvs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Point-to-point: send each (peer, tag, tensor) and receive into each (peer, tag,
        tensor), all posted at once, then waited for (no pair of ranks can block each other)."""
        self.start_exchange(sends, recvs)()

    def start_exchange(
        self, sends: Sequence[tuple[int, int, torch.Tensor]], recvs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> Callable[[], None]:
        """exchange(), posted now; the function returned waits for it (call it once)."""
        self.calls["p2p"] += 1
        self.messages += len(sends) + len(recvs)
        if self.world == 1:
            if sends or recvs:
                raise ValueError("a single process has no peer to exchange with")
            return lambda: None
        with _transport(self.world, "a point-to-point exchange"):
            works = [dist.irecv(t, src=peer, group=self.group, tag=tag) for peer, tag, t in recvs]
            works += [dist.isend(t, dst=peer, group=self.group, tag=tag) for peer, tag, t in sends]

        def wait() -> None:
            with _transport(self.world, "a point-to-point exchange"):
                for w in works:
                    if w is not None:
                        w.wait()

        return wait

    def send_bytes(self, data: bytes, dsts: Sequence[int], tag: int) -> None:
        """Point-to-point: the same bytes to each of `dsts` (a length, then the payload)."""
        self.calls["p2p"] += 1
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        with _transport(self.world, "a send"):
            works = [dist.isend(size, dst=d, group=self.group, tag=tag) for d in dsts]
            works += [dist.isend(payload, dst=d, group=self.group, tag=tag + 1) for d in dsts if data]
            for w in works:
                if w is not None:
                    w.wait()

    def recv_bytes(self, src: int, tag: int) -> bytes:
        """What send_bytes sent this rank."""
        self.calls["p2p"] += 1
        size = torch.empty(1, dtype=torch.int64)
        with _transport(self.world, "a receive"):
            dist.recv(size, src=src, group=self.group, tag=tag)
            n = int(size.item())
            if not n:
                return b""
            payload = torch.empty(n, dtype=torch.uint8)
            dist.recv(payload, src=src, group=self.group, tag=tag + 1)
        return payload.numpy().tobytes()

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        self.calls["broadcast"] += 1
        if self.world > 1:
            with _transport(self.world, "a broadcast"):
                dist.broadcast(tensor, src=src, group=self.group)


def make_comm(timeout: timedelta) -> Comm:
    """A gloo communicator of the whole job; collective when torch.distributed is initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Comm(None, 0, 1)
    world = dist.get_world_size()
    with _transport(world, "its creation"):
        group = dist.new_group(backend="gloo", timeout=timeout)
    return Comm(group, dist.get_rank(), world)


def make_comms(timeout: timedelta) -> tuple[Comm, Comm]:
    """(ctl, data) communicators: the data exchanges of a save's writers run on a group of
    their own, beside the control collectives."""
    return make_comm(timeout), make_comm(timeout)


def subgroup(ranks: Sequence[int], timeout: timedelta) -> Comm | None:
    """A gloo group of `ranks` (collective: every rank of the job calls it); this rank's
    Comm in it, None if it is not a member. Its point-to-point calls name peers by their
    rank in the job."""
    members = sorted(ranks)
    with _transport(len(members), "its creation"):
        group = dist.new_group(ranks=members, backend="gloo", timeout=timeout)
    me = dist.get_rank()
    return Comm(group, members.index(me), len(members)) if me in members else None


def destroy_comms(*comms: Comm) -> None:
    """Free the groups' gloo connections (best effort: the job may be tearing down)."""
    for c in comms:
        if c.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(c.group)
            except (RuntimeError, ValueError):
                pass
            c.group = None
