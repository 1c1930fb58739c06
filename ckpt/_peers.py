"""Peer copies: each root's part of every committed version, kept on K other nodes' disks,
sent over the job's own process group (`Checkpointer(..., peer_copies=K)`).

A node that dies takes its disks' part of every version with it; a replacement starts
empty. With peer copies, root i's part also lives in `<root j>/replicas/peer-<id>/` (id:
root i's identity, its `.ckpt-root-id`) for the K roots j = i + k * peer_stride (mod the
number of roots), each on another node (a root's node: its leader's rank //
LOCAL_WORLD_SIZE). The directory is named by the source's disk, not by its index in the
job: a later job whose nodes come in another order, or fewer, never mixes two roots'
copies in one directory, and the copies of a root that is no longer a source here are
deleted as this root's own versions of their steps are. Restore lists every
`replicas/*` directory of a rank's disks as a tier, so after a node's loss the ranks of
the nodes holding its part read it and send the chunks over the group to the ranks that
need them, as they do for any chunk on another node's root: no remote, no shared
filesystem.

The roots' leaders form a gloo group of their own, and each runs a thread. After commits
(collective, so every leader sees the same steps), one round at a time: the leaders agree
on the newest committed step (older ones still queued are skipped alike, but for the
milestones retention keeps for good, copied once no newer step waits), each streams
its version directory to its targets in pieces (bandwidth-capped, `peer_bwlimit_mbps`)
and receives its sources' directories into `replicas/peer-<id>/.incoming/`, verifies every
file against the manifest's checksums (store.verify), publishes it as `v<step>` (rename,
fsync, like a commit) and acknowledges. A copy counts once acknowledged verified: the
sender records it in `<root>/.ckpt-peers.json`, and no GC of the root deletes the newest
version whose peer copies are all verified, nor a newer one (ckpt._peer_status).
Peer copies are pruned by the Checkpointer's retention policy.

The thread runs at the job's own CPU priority. A lowered one (nice) slows training: the
thread holds its process's GIL except inside calls that release it (reads, writes,
hashing, gloo), and when it is starved of CPU while holding it, the training thread of
its process waits (bench/peers.py: nice +10 cost 1.09-1.20x a training step's time,
nice 0 1.05-1.09x).

A peer that stops answering fails the round after the group's timeout; the thread logs it
and stops copying (the process group cannot be trusted after a timeout); the versions it
did not copy stay on their own roots and the job goes on.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ckpt._dist import Comm
from ckpt._peer_status import forget_peer_step, peer_dir, peer_dirs, record_peer_copies, record_peers_stopped
from ckpt._roots import node_of
from ckpt.replicator.gc import collect, note_whole, spare_candidate
from ckpt.replicator.policy import Policy
from ckpt.store import commit
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CkptError, CorruptVersionError
from ckpt.store.faults import fault_delay
from ckpt.store.fsio import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    end_at,
    fsync_dir,
    fsync_dirs,
    fsync_files,
    makedirs,
    open_new,
    set_direct,
    write_all,
)
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, parse_manifest
from ckpt.store.pins import deleting
from ckpt.store.rank_file import RANKS_DIR
from ckpt.store.removal import remove_tree
from ckpt.store.root import root_id
from ckpt.store.spare import drop, retire, spares, take
from ckpt.store.tier import open_tier
from ckpt.store.verify import ChunkProblem, ExpectedChunk, expected_chunks
from ckpt.store.versions import committed_steps, delete_version, read_root_info, version_dirname

__all__ = ["PeerPlan", "plan_peers", "PeerCopier"]

log = logging.getLogger("ckpt")
PIECE = 8 << 20  # bytes per message of a version's stream
_HEADER, _BODY, _ACK = 1 << 28, 2 << 28, 3 << 28  # tag bases of a round's phases


@dataclass(frozen=True)
class PeerPlan:
    """Who copies to whom: root indices, and each root's leader (its rank in the job)."""

    me: int
    leaders: tuple[int, ...]
    targets: tuple[int, ...]
    sources: tuple[int, ...]


def plan_peers(
    root_groups: Sequence[Sequence[int]], me: int, copies: int, stride: int, hosts: Sequence[str] | None = None
) -> PeerPlan:
    """Root i sends to i + k * stride (k = 1..copies), mod the roots; ValueError unless every
    pair of roots lies on two nodes and the copies of a root go to distinct roots. A rank's
    node: its host name where `hosts` (every rank's) is given, else node_of."""
    n = len(root_groups)
    leaders = tuple(g[0] for g in root_groups)
    node: list[int | str] = [hosts[r] if hosts is not None else node_of(r) for r in leaders]
    if copies >= n:
        raise ValueError(f"peer_copies={copies} needs more roots than that; the job has {n}")
    for i in range(n):
        to = [(i + k * stride) % n for k in range(1, copies + 1)]
        if len(set(to)) != copies or i in to:
            raise ValueError(f"peer_stride={stride} sends root {i}'s copies to roots {to}: not {copies} others")
        same = [t for t in to if node[t] == node[i]]
        if same:
            raise ValueError(
                f"peer copies of root {i} (node {node[i]!r}) would go to root {same[0]} on the same node; "
                "set LOCAL_WORLD_SIZE, one root per node ({node} in the root), or peer_stride"
            )
    targets = tuple((me + k * stride) % n for k in range(1, copies + 1))
    sources = tuple((me - k * stride) % n for k in range(1, copies + 1))
    return PeerPlan(me, leaders, targets, sources)


def _files(version: str) -> list[tuple[str, int]]:
    out = []
    for dirpath, _, names in os.walk(version):
        for name in names:
            path = os.path.join(dirpath, name)
            out.append((os.path.relpath(path, version), os.path.getsize(path)))
    out.sort(key=lambda f: (not _is_head(f[0]), f[0]))  # the receiver learns the digests first
    return out


def _is_head(rel: str) -> bool:
    """The files that say what the others must hold: the manifest, the root's record, rank files."""
    return rel in (MANIFEST_NAME, ROOT_INFO_NAME) or rel.startswith(RANKS_DIR + "/")


def _layout(files: Sequence[tuple[str, int]]) -> tuple[list[int], int]:
    """Each file's offset in the stream, and the stream's length. A file that O_DIRECT may
    write starts on a DIRECT_ALIGN boundary (pieces are whole blocks and their buffers
    page-aligned, so every part of it arrives aligned); small files are packed."""
    offsets, end = [], 0
    for _, size in files:
        if size >= DIRECT_MIN_BYTES:
            end = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
        offsets.append(end)
        end += size
    return offsets, end


def _aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned buffer (O_DIRECT writes straight from it)."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


class _Stream:
    """A version directory's files read as one stream (laid out by _layout), piece by piece.

    A large file is read with O_DIRECT where the filesystem takes it, straight into the
    (page-aligned) piece: the save wrote it with O_DIRECT, so it is not in the page cache,
    and a buffered read would copy every byte once more and fill the cache with it."""

    def __init__(self, version: str, files: Sequence[tuple[str, int]]) -> None:
        self._version, self._files = version, list(files)
        self._offsets, self.total = _layout(self._files)
        self._i = self._pos = 0
        self._fd = -1
        self._direct = False

    def readinto(self, out: memoryview) -> int:
        """Fill `out` with the stream's next bytes (no copy on the way); how many (fewer at its end)."""
        start = self._pos
        end = min(self.total, start + len(out))
        while self._pos < end:
            rel, size = self._files[self._i]
            off = self._offsets[self._i]
            if self._pos < off:  # the gap before an aligned file
                upto = min(off, end)
                out[self._pos - start : upto - start] = bytes(upto - self._pos)
                self._pos = upto
                continue
            if self._pos == off + size:
                self._close_file()
                self._i += 1
                continue
            if self._fd < 0:
                self._fd = os.open(os.path.join(self._version, rel), os.O_RDONLY | os.O_CLOEXEC)
                self._direct = size >= DIRECT_MIN_BYTES and set_direct(self._fd, True)
            dst = out[self._pos - start : min(end, off + size) - start]
            got = self._read(dst, self._pos - off)
            if not got:
                raise CorruptVersionError(f"{rel} of {self._version} shrank while it was copied to peers")
            self._pos += got
        return end - start

    def _read(self, dst: memoryview, at: int) -> int:
        if self._direct:
            whole = len(dst) - len(dst) % DIRECT_ALIGN
            if whole and not _address(dst) % DIRECT_ALIGN and not at % DIRECT_ALIGN:
                try:
                    return os.preadv(self._fd, [dst[:whole]], at)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
            set_direct(self._fd, False)  # the last partial block, or a device wanting more alignment
            self._direct = False
        return os.preadv(self._fd, [dst], at)

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        self._close_file()


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Sink:
    """Writes a received stream back into files under `base` (O_DIRECT where it can), and
    checks each chunk file against the manifest's digests as it arrives: once the head files
    (manifest, rank files) are in, every later byte is hashed from the buffer it came in,
    never read back."""

    def __init__(self, base: str, step: int, files: Sequence[tuple[str, int]], *, reuse: bool = False) -> None:
        for rel, _ in files:
            if os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
                raise CorruptVersionError(f"a peer sent a file outside its version: {rel!r}")
        self._base, self._step, self._files = base, step, list(files)
        self._reuse = reuse  # `base` is a retired copy's tree: its files are overwritten, not created
        self._offsets, self.total = _layout(self._files)
        self._heads = next((i for i, (rel, _) in enumerate(self._files) if not _is_head(rel)), len(self._files))
        self._i = 0
        self._fd = -1
        self._direct = False  # O_DIRECT is on for the open file
        self._can_direct = True  # the filesystem has not refused it
        self._hasher: ChunkHasher | None = None
        self._expected: dict[str, ExpectedChunk] | None = None
        self._checked: set[str] = set()
        self.paths: list[str] = []
        self.dirs = {base}
        makedirs(base)
        self._drop_extra()  # a reused tree keeps nothing the copy does not send (a stale root.json)

    def write(self, data: memoryview, at: int) -> None:
        """The piece of the stream that starts at offset `at`."""
        end = at + len(data)
        if end > self.total:
            raise CorruptVersionError("a peer sent more bytes than its file list holds")
        while self._i < len(self._files):
            rel, size = self._files[self._i]
            off = self._offsets[self._i]
            if self._fd < 0:
                if off > end or (off == end and size):
                    return
                self._open(rel, size)
            lo, hi = max(at, off), min(end, off + size)
            if hi > lo:
                self._put(data[lo - at : hi - at], lo - off)
            if hi < off + size:
                return
            self._close_file(rel, size)

    def _open(self, rel: str, size: int) -> None:
        path = os.path.join(self._base, rel)
        parent = os.path.dirname(path)
        if parent not in self.dirs:
            makedirs(parent)
            self.dirs.add(parent)
        self._fd = open_new(path, replace=self._reuse)  # a reused file is overwritten in place
        self.paths.append(path)
        self._direct = self._can_direct and size >= DIRECT_MIN_BYTES and set_direct(self._fd, True)
        self._can_direct = self._can_direct and (self._direct or size < DIRECT_MIN_BYTES)
        expected = None if self._expected is None else self._expected.get(rel)
        self._hasher = None if expected is None else ChunkHasher(expected.block_bytes)
        if expected is not None and expected.nbytes != size:
            raise CorruptVersionError(f"{rel} has {size} bytes, the manifest says {expected.nbytes}")

    def _put(self, view: memoryview, offset: int) -> None:
        """`view` into the open file at `offset` (where the file's writes have reached)."""
        if self._hasher is not None:
            self._hasher.update(view)
        whole = len(view) - len(view) % DIRECT_ALIGN if self._direct else 0
        if whole:
            try:
                write_all(self._fd, view[:whole])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                # The device wants more alignment: the page cache then, from where this piece
                # starts (an earlier write of the loop may have gone through).
                os.lseek(self._fd, offset, os.SEEK_SET)
                whole = 0
                self._can_direct = False
            view = view[whole:]
        if len(view) and self._direct:
            set_direct(self._fd, False)  # the file's last partial block, or all of it after EINVAL
            self._direct = False
        write_all(self._fd, view)

    def _close_file(self, rel: str, size: int) -> None:
        if self._reuse:
            end_at(self._fd, size)
        written = os.fstat(self._fd).st_size
        os.close(self._fd)
        self._fd, self._i = -1, self._i + 1
        if written != size:  # the digest is of the bytes received: the file must hold them, no more
            raise CorruptVersionError(f"{rel}: {written} bytes written of {size}")
        if self._hasher is not None:
            expected = self._expected[rel] if self._expected is not None else None
            got = self._hasher.hexdigest()
            if expected is None or got != expected.xxh3:
                raise CorruptVersionError(f"{rel}: xxh3 {got} != manifest {expected and expected.xxh3}")
            self._checked.add(rel)
            self._hasher = None
        if self._i == self._heads:
            self._expect()

    def _expect(self) -> None:
        """The digests every chunk file to come must have (from the manifest and rank files in)."""
        tier = open_tier(os.path.dirname(self._base))
        try:
            with open(os.path.join(self._base, MANIFEST_NAME), "rb") as f:
                manifest = parse_manifest(f.read())
        except FileNotFoundError:
            raise CorruptVersionError(f"the copy of step {self._step} came without its manifest") from None
        info = read_root_info(tier, self._step)
        if manifest.step != self._step or info is None or info.save_id != manifest.save_id:
            raise CorruptVersionError(f"the copy of step {self._step} holds no such version")
        expected: dict[str, ExpectedChunk] = {}
        for e in expected_chunks(tier, self._step, manifest, set(info.writers)):
            if isinstance(e, ChunkProblem):
                raise CorruptVersionError(f"{e.path}: {e.reason}")
            expected[e.path] = e
        self._expected = expected

    def _drop_extra(self) -> None:
        """Of a reused tree, remove what the copy does not hold (the retired version's own files)."""
        if not self._reuse:
            return
        keep = {os.path.join(self._base, rel) for rel, _ in self._files}
        keep_dirs = {self._base}
        for path in keep:
            parent = os.path.dirname(path)
            while parent not in keep_dirs:
                keep_dirs.add(parent)
                parent = os.path.dirname(parent)
        for dirpath, dirnames, names in os.walk(self._base):
            for name in names:
                path = os.path.join(dirpath, name)
                if path not in keep:
                    os.unlink(path)
            gone = [d for d in dirnames if os.path.join(dirpath, d) not in keep_dirs]
            for name in gone:  # nothing of the copy is in it
                remove_tree(os.path.join(dirpath, name))
            dirnames[:] = [d for d in dirnames if d not in gone]

    def verified(self) -> None:
        """CorruptVersionError unless every chunk file the manifest names came, and matched."""
        if self._expected is None:
            raise CorruptVersionError("the copy holds no manifest, root record or rank files")
        missing = sorted(set(self._expected) - self._checked)
        if missing:
            raise CorruptVersionError(f"{len(missing)} chunk files did not come, first {missing[0]}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PeerCopier:
    """The peer-copy thread of one root's leader (see the module docstring)."""

    def __init__(
        self,
        comm: Comm,
        plan: PeerPlan,
        root: str,
        *,
        policy: Policy | None,
        bwlimit_mbps: float | None,
        on_verified: Callable[[int], None] = lambda step: None,
        keep_every: int | None = None,
    ) -> None:
        self._comm, self._plan, self._root, self._policy = comm, plan, root, policy
        self._keep_every = keep_every
        self._rate = None if bwlimit_mbps is None else bwlimit_mbps * 1e6
        self._on_verified = on_verified
        self._cond = threading.Condition()
        self._committed: set[int] = set()
        self._pending = -1  # the newest committed step not yet copied
        self._done = -1  # the step of the last round: older commits are not copied again, unless overwritten
        self._copied: dict[int, str] = {}  # step -> the save id of the version this copier sent
        self._recheck: set[int] = set()  # steps copied whose commit was told again
        self._id = root_id(root)
        self._sources: dict[int, str] = {}  # source root index -> its identity, from its headers
        self._milestones: set[int] = set()  # committed steps saved with milestone=True
        self._settled: set[int] = set()  # committed steps copied, or passed over for good (no milestone)
        self._closing = False
        self._abandoned = False
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-peers", daemon=True)
        self._thread.start()

    def committed(self, step: int, milestone: bool) -> None:
        """A commit of this root, and whether it was saved with milestone=True (the job's
        save, the same on every leader). Again for a step already copied: the thread
        compares the version's save id with the one it copied, and copies an overwrite
        again (the same commit told twice is not copied twice)."""
        with self._cond:
            self._committed.add(step)
            if milestone:
                self._milestones.add(step)
            else:  # (an overwrite of a milestone with a plain save)
                self._milestones.discard(step)
            if step > self._done:
                self._pending = max(self._pending, step)
            elif step in self._copied:
                self._recheck.add(step)
            self._cond.notify_all()

    def _requeue_overwritten(self, step: int) -> None:
        """Queue `step` again if the root's version of it is no longer the one copied."""
        try:
            info = read_root_info(open_tier(self._root), step)
        except (CkptError, OSError) as e:
            log.warning("%s: cannot read step %d to compare with its peer copy: %s", self._root, step, e)
            return
        if info is None or info.save_id == self._copied.get(step):
            return
        forget_peer_step(self._root, step)  # its copies are of the save it replaced: none verified now
        with self._cond:
            self._pending = max(self._pending, step)

    def close(self, timeout: float) -> None:
        """Copy what is committed (every leader does the same), for at most `timeout` s."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: peer copies still running after %.0f s; left behind", self._root, timeout)

    def abandon(self) -> None:
        """Stop the thread without a round (its Checkpointer's open failed, so no other
        leader's copier has a commit to copy either)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            owed = -1  # a milestone a newer round passed over, not copied yet
            while True:
                with self._cond:
                    while (
                        self._pending < 0
                        and owed < 0
                        and not self._recheck
                        and not self._closing
                        and not self._abandoned
                    ):
                        self._cond.wait()
                    if self._abandoned:
                        return
                    recheck, self._recheck = self._recheck, set()
                for step in sorted(recheck):  # every leader decides alike: an overwrite commits on every root
                    self._requeue_overwritten(step)
                with self._cond:
                    mine, closing = self._pending, self._closing
                if mine < 0 and owed < 0 and not closing:  # only a commit told twice
                    continue
                # Every leader takes part in each round: the newest step any has, whether all
                # close, and the newest milestone owed (after the newest steps: they matter most).
                newest, open_, milestone = self._comm.reduce_max([mine, int(not closing), owed])
                if newest < 0:
                    newest = milestone
                if newest < 0:
                    if not open_:
                        return
                    continue
                with self._cond:  # its commit reaches every leader: wait for this one's
                    while newest not in self._committed:
                        self._cond.wait()
                    if self._pending <= newest:
                        self._pending = -1
                    self._done = max(self._done, newest)
                self._round(newest)
                self._settled.add(newest)
                owed = self._owed_milestone()
        except Exception as e:  # noqa: BLE001 - the job goes on; its versions stay on their roots
            self.failed = f"{type(e).__name__}: {e}"
            log.error("%s: peer copies stopped: %s", self._root, self.failed)
            try:
                record_peers_stopped(self._root, self.failed)  # retention no longer waits for them
            except OSError as e2:
                log.error("%s: cannot record that peer copies stopped: %s", self._root, e2)
            for home in peer_dirs(self._root).values():  # no copy will reuse them
                for tree in spares(home):
                    drop(home, tree)

    def _owed_milestone(self) -> int:
        """The newest step committed in this job that a newer round passed over and that
        retention keeps for good (saved with milestone=True, or a multiple of keep_every):
        its copies are owed, or a node's loss would take it. -1: none. Every leader finds
        the same from the job's own facts (its commits, each save's milestone tag: nothing
        read from a root, which one leader may fail to read), or one would wait for a round
        that the others do not start."""
        with self._cond:
            passed = sorted((s for s in self._committed if s < self._done and s not in self._settled), reverse=True)
            for step in passed:
                if step in self._milestones or (self._keep_every is not None and step % self._keep_every == 0):
                    return step
                self._settled.add(step)
        return -1

    def _round(self, step: int) -> None:
        plan, comm = self._plan, self._comm
        version = os.path.join(self._root, version_dirname(step))
        try:
            files = _files(version)
            info = read_root_info(open_tier(self._root), step)
            if info is not None:
                self._copied[step] = info.save_id
                for old in sorted(self._copied)[:-64]:  # the recent steps are the ones overwritten
                    del self._copied[old]
            header = json.dumps({"step": step, "root": self._id, "files": files}).encode()
        except OSError as e:  # still a full round, sending nothing: no peer waits for this one
            log.error("%s: cannot read step %d for its peer copies: %s", self._root, step, e)
            files = []
            header = json.dumps({"step": step, "root": self._id, "files": [], "error": str(e)}).encode()
        # Phase 1: header sizes, then headers.
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in plan.sources}
        comm.exchange(
            [(plan.leaders[t], _HEADER, torch.tensor([len(header)], dtype=torch.int64)) for t in plan.targets],
            [(plan.leaders[s], _HEADER, sizes[s]) for s in plan.sources],
        )
        heads = {s: torch.empty(int(sizes[s].item()), dtype=torch.uint8) for s in plan.sources}
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        comm.exchange(
            [(plan.leaders[t], _HEADER + 1, raw) for t in plan.targets],
            [(plan.leaders[s], _HEADER + 1, heads[s]) for s in plan.sources],
        )
        incoming = {s: json.loads(heads[s].numpy().tobytes()) for s in plan.sources}
        self._sources = {s: str(incoming[s]["root"]) for s in plan.sources}
        self._prune_departed()
        fault_delay("peer-stream", plan.leaders[plan.me])  # tests: the files change once announced
        # Phase 2: the streams, piece by piece (every pair's piece r carries tag _BODY + r).
        stream = _Stream(version, files)
        pieces_out = -(-stream.total // PIECE)
        sinks: dict[int, _Sink] = {}
        errors: dict[int, str] = {}
        for s in plan.sources:
            if "error" in incoming[s]:
                errors[s] = f"root {s} could not send it: {incoming[s]['error']}"
                continue
            home = peer_dir(self._root, self._sources[s])
            base = os.path.join(home, ".incoming", version_dirname(step))
            remove_tree(os.path.dirname(base), ignore_errors=True)  # and what an interrupted round left
            try:
                reuse = take(home, base)
                sinks[s] = _Sink(base, step, [(str(r), int(n)) for r, n in incoming[s]["files"]], reuse=reuse)
            except (CkptError, OSError) as e:
                errors[s] = f"{type(e).__name__}: {e}"
        # Pieces each source sends: from its file list, whether or not its sink could be made.
        totals = {s: _layout([(str(r), int(n)) for r, n in incoming[s]["files"]])[1] for s in plan.sources}
        expected = {s: -(-totals[s] // PIECE) for s in plan.sources}
        started, sent = time.monotonic(), 0
        # One buffer to send from, and two per source to receive into, used in turn: piece
        # r + 1's receive is posted before piece r is written, so every piece lands straight
        # in its buffer (one that came before its receive was posted would be copied twice).
        out_buf = _aligned(PIECE if pieces_out else 0)  # O_DIRECT reads land in it
        in_bufs = {s: [_aligned(PIECE if expected[s] else 0) for _ in range(2)] for s in plan.sources}

        def post(r: int) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
            bufs = {s: in_bufs[s][r % 2][: min(PIECE, totals[s] - r * PIECE)] for s in plan.sources if r < expected[s]}
            return bufs, comm.start_exchange([], [(plan.leaders[s], _BODY + r, b) for s, b in bufs.items()])

        rounds = max([pieces_out, *expected.values()], default=0)
        broken: str | None = None  # this leader's own stream failed: its targets will refuse it
        try:
            receiving = post(0) if rounds else None
            for r in range(rounds):
                n = 0
                if r < pieces_out and broken is None:
                    try:
                        n = stream.readinto(memoryview(out_buf.numpy()))  # type: ignore[arg-type]
                    except (CkptError, OSError) as e:
                        broken = f"{type(e).__name__}: {e}"
                        log.error("%s: reading step %d for its peer copies failed: %s", self._root, step, broken)
                if r < pieces_out and broken is not None:  # the pieces announced, as zeros: their checks fail
                    n = min(PIECE, stream.total - r * PIECE)
                    out_buf[:n].zero_()
                sending = comm.start_exchange(
                    [(plan.leaders[t], _BODY + r, out_buf[:n]) for t in plan.targets if n], []
                )
                assert receiving is not None
                bufs, wait = receiving
                wait()
                receiving = post(r + 1) if r + 1 < rounds else None
                for s, b in bufs.items():
                    if s in sinks and s not in errors:
                        try:
                            sinks[s].write(memoryview(b.numpy()), r * PIECE)  # type: ignore[arg-type]
                        except Exception as e:  # noqa: BLE001 - this copy is refused; the round goes on
                            errors[s] = f"{type(e).__name__}: {e}"
                sending()
                sent += n * len(plan.targets)
                if self._rate is not None:  # the cap: no faster than bwlimit on average
                    ahead = sent / self._rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            stream.close()
            for sink in sinks.values():
                sink.close()
        # Phase 3: verify and publish each received copy; acknowledge.
        acks = {}
        for s in plan.sources:
            ok = s not in errors and self._publish(s, step, sinks[s], errors)
            acks[s] = torch.tensor([int(ok)], dtype=torch.int64)
            if not ok:
                remove_tree(os.path.join(peer_dir(self._root, self._sources[s]), ".incoming"), ignore_errors=True)
        got = {t: torch.zeros(1, dtype=torch.int64) for t in plan.targets}
        comm.exchange(
            [(plan.leaders[s], _ACK, acks[s]) for s in plan.sources],
            [(plan.leaders[t], _ACK, got[t]) for t in plan.targets],
        )
        for s, why in errors.items():
            log.error("%s: the peer copy of root %d's step %d was not kept: %s", self._root, s, step, why)
        results = {t: "verified" if int(got[t].item()) else "failed" for t in plan.targets}
        ours = all(v == "verified" for v in results.values())
        # Every leader alike: the step counts only where every root's copies of it were
        # verified, or a root whose own copies went through would drop the older version
        # that the survivors of another root's node need whole.
        everywhere = not self._comm.reduce_max([int(not ours)])[0]
        try:
            record_peer_copies(self._root, step, results, everywhere=everywhere)
        except (CkptError, OSError) as e:  # retention then keeps the version: safe
            log.error("%s: cannot record step %d's peer copies: %s", self._root, step, e)
        if everywhere:
            self._on_verified(step)
        elif ours:
            log.warning("%s: step %d's peer copies failed on another root; older versions are kept", self._root, step)
        else:
            log.warning("%s: step %d's peer copies: %s", self._root, step, results)

    def _prune_departed(self) -> None:
        """Delete the copies held for roots that are no longer this root's sources (a job on
        other nodes, or in another order) once this root no longer holds their steps: with
        its own part of a step gone, the step is gone from the job's retention."""
        current = set(self._sources.values())
        try:
            departed = {s: p for s, p in peer_dirs(self._root).items() if s not in current}
            own = set(committed_steps(open_tier(self._root))) if departed else set()
        except OSError as e:
            log.warning("%s: cannot list the peer copies held here: %s", self._root, e)
            return
        for source, home in departed.items():
            try:
                tier = open_tier(home)
                for step in committed_steps(tier):
                    if step in own:
                        continue
                    with deleting(tier, step) as free:  # a restore may be reading it
                        if free:
                            delete_version(tier, step)
                if committed_steps(tier):
                    continue
                for tree in spares(home):
                    drop(home, tree)
                remove_tree(home)
                fsync_dir(os.path.dirname(home))
                log.info("%s: deleted the peer copies of root %s, no longer copied here", self._root, source)
            except (CkptError, OSError) as e:  # kept; the next round tries again
                log.warning("%s: pruning the peer copies of root %s failed: %s", self._root, source, e)

    def _publish(self, source: int, step: int, sink: _Sink, errors: dict[int, str]) -> bool:
        home = peer_dir(self._root, self._sources[source])
        incoming = os.path.join(home, ".incoming")
        try:
            sink.verified()
            fsync_files(sink.paths)
            fsync_dirs(sorted(sink.dirs, key=len, reverse=True))
            with open(os.path.join(incoming, version_dirname(step), MANIFEST_NAME), "rb") as f:
                manifest = parse_manifest(f.read())
            tmp_name = commit.tmp_dirname(step, manifest.save_id)
            # Left by a round that failed or died between its rename and its publish (of any
            # step and save: only this copier writes here, and no restore reads a tmp name).
            for left in commit.prepared_versions(home):
                remove_tree(os.path.join(home, left.dirname), ignore_errors=True)
            os.rename(os.path.join(incoming, version_dirname(step)), os.path.join(home, tmp_name))
            fsync_dir(incoming)
            commit.publish(home, tmp_name, step, overwrite=True)
            fsync_dirs([os.path.dirname(home), self._root])  # the first copy made replicas/ and peer-<id>/
            note_whole(home, step, manifest.save_id)  # every file checked as it came: its GC need not stat them
        except Exception as e:  # noqa: BLE001 - not kept; the round goes on to its acknowledgements
            errors[source] = f"{type(e).__name__}: {e}"
            return False
        if self._policy is not None:
            try:
                tier = open_tier(home)
                spare = spare_candidate(tier, self._policy)
                if spare is not None:
                    retire(tier, home, spare)
                collect(tier, self._policy)
            except Exception as e:  # noqa: BLE001 - the copy is kept; pruning waits for the next round
                log.warning("%s: pruning the peer copies of root %d failed: %s", self._root, source, e)
        return True
