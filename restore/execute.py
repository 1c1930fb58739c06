"""Reading a version's chunks into the tensors of the current ranks, for any layout: the
I/O half of a restore (restore.reshard plans what to read).

Only the rows of each chunk that overlap a destination are read. With verification on,
whole checksummed blocks are read and checked; with it off, exactly the needed rows (and,
for a split along dim 1, only the needed span of each row). From a disk, chunks of 1 MiB
and more are read with O_DIRECT, in windows of consecutive blocks, into one aligned
buffer per reader thread (_WINDOW), checked there and copied out; elsewhere (tmpfs, a
remote store, small chunks) extra memory is one block per reader thread, or none when a
block lands contiguously in a destination tensor and is read straight into it; a block
at the edge of a destination's rows puts those rows straight into it and the rest in
that buffer. A small chunk file that is one checksum's worth of bytes is read whole in one
open (_read_whole), the full path taking it over on anything unexpected.

A chunk is read from the first source that holds a good copy (restore.sources). A chunk
that no source of this rank holds (ranks do not share filesystems) is read by a rank that
holds it and sent point to point to the ranks that need it, over the checkpointer's gloo
group (restore.handoff plans who sends what).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from ckpt.restore.handoff import Ask, ChunkKey, Holders, Incoming, Outgoing, ask_holders, incoming, plan_sends
from ckpt.restore.reshard import (
    Block,
    Box,
    ChunkRead,
    Request,
    block_at,
    block_count,
    blocks,
    direct_rows,
    overlap,
    plan_reads,
    row_bytes,
)
from ckpt.restore.sources import Source, SourcesUnreachable, from_first_good
from ckpt.restore.torch_dtypes import ZARR_TO_TORCH
from ckpt.store.chunk_read import check_digest, open_checked, open_chunk, read_direct_exact, read_exact
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import CkptError, CorruptVersionError, TierUnavailableError
from ckpt.store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES
from ckpt.store.host_arrays import host_array, host_bytes, host_memory
from ckpt.store.lanes import LIGHT_BYTES, run_lanes
from ckpt.store.manifest import ArrayEntry, ChunkEntry, Manifest
from ckpt.store.tier import ReadHandle

__all__ = ["ReadRequest", "ReadsUnreached", "load_arrays", "full_tensor", "Comm"]

log = logging.getLogger("ckpt")
PACK_BYTES = LIGHT_BYTES  # chunks below it travel in packs (see _packed)
# Bytes a holder reads, and a rank receives, per round of the hand-off (two in flight); a
# packed chunk counts its aligned slot (_travels).
SEND_ROUND_BYTES = 64 << 20


class Comm(Protocol):
    """The collectives a restore uses (ckpt._dist.Comm provides them; Comm.solo() for one process)."""

    rank: int
    world: int

    def all_gather(self, obj: Any) -> list[Any]: ...
    def all_to_all(self, parts: Sequence[Any]) -> list[Any]: ...
    def any(self, flag: bool) -> bool: ...
    def reduce_max(self, values: Sequence[int]) -> list[int]: ...
    def exchange(
        self, sends: Sequence[tuple[int, int, torch.Tensor]], recvs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None: ...


# Not frozen (a restore makes one per tensor, and a frozen dataclass sets each field through
# object.__setattr__); never changed once made. eq=False: its fields hold tensors and a Box,
# so nothing compares one (it hashes by identity).
@dataclass(eq=False, slots=True)
class ReadRequest:
    array: ArrayEntry
    dest: torch.Tensor  # a plain local tensor, filled in place
    offsets: tuple[int, ...]  # where dest starts in the global array
    box: Box = field(init=False)  # where dest lies in the global array
    dest_bytes: memoryview | None = field(init=False, repr=False)
    """dest's bytes where chunk rows can be read straight into it: a contiguous CPU tensor
    of the array's type, not empty (see _direct); else None. Made here, on the thread that makes the
    request, before any reader starts: torch's view gives up the GIL, and a reader thread
    that made it would queue behind the other readers to get it back."""

    def __post_init__(self) -> None:
        d = self.dest
        self.box = Box.at(self.offsets, d.shape)
        ok = (
            d.dim() > 0
            and d.numel() > 0  # (nothing is read into an empty one, and memoryview refuses to cast it)
            and d.is_cpu
            and d.dtype == ZARR_TO_TORCH[self.array.data_type]
            and d.is_contiguous()
            and d.stride(-1) == 1  # a (1,)-shaped tensor may be "contiguous" with another stride
            and not d.is_conj()  # (whose bytes torch will not view as uint8)
            and not d.is_neg()
        )
        self.dest_bytes = host_memory(d) if ok else None


def _place(piece: torch.Tensor, origin: Sequence[int], req: ReadRequest) -> None:
    """Copy the part of `piece` (a box of the global array starting at `origin`) inside req.dest."""
    if not origin:  # 0-d
        req.dest.copy_(piece.reshape(()))
        return
    dest = req.box
    ov = overlap(Box.at(origin, piece.shape), dest)
    if ov is None:
        return
    src = piece[tuple(slice(a - o, b - o) for a, b, o in zip(ov.lo, ov.hi, origin))]
    _copy_into(req.dest[tuple(slice(a - d, b - d) for a, b, d in zip(ov.lo, ov.hi, dest.lo))], src)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for CPU tensors of one dtype, as numpy's copy of same-sized integers:
    one thread, the GIL released. torch's copy_ runs on its intra-op threads, and with the
    reader threads of several ranks on few cores those spin against each other (the
    middle rank of a 2->3 restore on 2 cores: 0.9 s per restore in copy_, 0.05 s here)."""
    as_int = _SAME_SIZE_INT.get(src.element_size())
    if (
        as_int is None
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or dst.dtype != src.dtype
        or dst.is_conj()  # (views whose values are not their bytes: copy_ writes what reads back right)
        or dst.is_neg()
        or src.is_conj()
        or src.is_neg()
    ):
        dst.copy_(src)
        return
    np.copyto(host_array(dst.view(as_int)), host_array(src.view(as_int)), casting="no")


_PIECE = 1 << 20  # bytes per read: copies out of the page cache run ~1.5x faster in 1 MiB than in 4 MiB pieces here


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(host_bytes(t))  # type: ignore[arg-type]


class _Bounce(threading.local):
    buf: torch.Tensor | None = None
    flat: memoryview | None = None  # buf's bytes, sliced without torch's per-call cost (~5 us)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.flat = None
        return self.buf[:nbytes]

    def view(self, nbytes: int) -> memoryview:
        """get(nbytes) as a memoryview."""
        if self.flat is None or len(self.flat) < nbytes:
            self.get(nbytes)
            assert self.buf is not None
            self.flat = _byte_view(self.buf).cast("B")
        return self.flat[:nbytes]


_bounce = _Bounce()

_WINDOW = 16 << 20  # bytes of blocks per O_DIRECT read: one read keeps several device requests in flight


class _Window(threading.local):
    """A reader thread's page-aligned buffer for O_DIRECT reads: _WINDOW bytes of blocks and
    the partial DIRECT_ALIGN blocks on either side of them."""

    buf: torch.Tensor | None = None
    view: memoryview | None = None

    def get(self) -> tuple[torch.Tensor, memoryview]:
        if self.buf is None or self.view is None:
            size = _WINDOW + 2 * DIRECT_ALIGN
            raw = torch.empty(size + DIRECT_ALIGN, dtype=torch.uint8)
            skip = -raw.data_ptr() % DIRECT_ALIGN
            self.buf = raw[skip : skip + size]
            self.view = _byte_view(self.buf).cast("B")
        return self.buf, self.view

    def release(self) -> None:
        """Free this thread's buffer (a pool's threads free theirs as they end; the thread
        that called load_arrays may have read too, and lives on)."""
        self.buf = self.view = None


_window = _Window()


def _typed(raw: torch.Tensor, array: ArrayEntry, rows: int) -> torch.Tensor:
    shape = array.chunk_shape or (1,)
    return raw.view(ZARR_TO_TORCH[array.data_type]).view((rows, *shape[1:]))


def _inline(array: ArrayEntry, chunk: ChunkEntry, verify: bool) -> torch.Tensor:
    raw = bytes.fromhex(chunk.inline or "")
    if verify and xxhash.xxh3_64_hexdigest(raw) != chunk.xxh3:
        raise CorruptVersionError(f"{array.name}: inline value fails its checksum", path=array.path)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return t.view(ZARR_TO_TORCH[array.data_type]).reshape((1,) * len(array.shape))


def _bytes_of(out: torch.Tensor | memoryview) -> memoryview:
    return out if isinstance(out, memoryview) else _byte_view(out).cast("B")


def _read(handle: ReadHandle, out: torch.Tensor | memoryview, offset: int, where: str) -> None:
    view = _bytes_of(out)
    for start in range(0, len(view), _PIECE):
        read_exact(handle, view[start : start + _PIECE], offset + start, where)


def _read_block(handle: ReadHandle, block: Block, out: torch.Tensor | memoryview, where: str, verify: bool) -> None:
    view = _bytes_of(out)
    if not verify:
        _read(handle, view, block.offset, where)
        return
    _read_parts(handle, block, (view,), where)


def _read_parts(handle: ReadHandle, block: Block, parts: Sequence[memoryview], where: str) -> None:
    """A block read into consecutive `parts` (together its bytes, in file order) and checked."""
    if len(parts) == 1 and len(parts[0]) <= _PIECE:  # one read (most chunks of a state are small)
        read_exact(handle, parts[0], block.offset, where)
        _check_block(xxhash.xxh3_64_hexdigest(parts[0]), block, where)
        return
    hasher = xxhash.xxh3_64()  # streamed: each piece is hashed while it is still in the CPU cache
    offset = block.offset
    for view in parts:
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            read_exact(handle, piece, offset + start, where)
            hasher.update(piece)
        offset += len(view)
    _check_block(hasher.hexdigest(), block, where)


def _split_block(
    block: Block, direct: tuple[int, int], scratch: memoryview, dest: Callable[[tuple[int, int]], memoryview], rb: int
) -> list[memoryview]:
    """A block that `direct` rows cover in part, as the parts to read it into: its rows
    inside `direct` straight into the destination (`dest(rows)`), the others into
    `scratch`, so only the rows the destination does not take cost a second copy."""
    (b0, b1), (lo, hi) = block.rows, (max(block.rows[0], direct[0]), min(block.rows[1], direct[1]))
    parts = [scratch[: (lo - b0) * rb]] if lo > b0 else []
    parts.append(dest((lo, hi)))
    if hi < b1:
        parts.append(scratch[(hi - b0) * rb : block.nbytes])
    return parts


def _check_block(got: str, block: Block, where: str) -> None:
    """CorruptVersionError unless a block's bytes hashed to its digest (the message is made
    only then: this runs for every block of a restore)."""
    if got != block.xxh3:
        check_digest(got, block.xxh3, f"chunk {where} rows {block.rows} fail their checksum", where)


def _origin(chunk: ChunkEntry, row: int) -> list[int]:
    return [chunk.offsets[0] + row, *chunk.offsets[1:]] if chunk.offsets else []


def _direct(array: ArrayEntry, chunk: ChunkEntry, req: ReadRequest) -> tuple[int, int] | None:
    """reshard.direct_rows, where req.dest can take the bytes (ReadRequest.dest_bytes)."""
    if req.dest_bytes is None:
        return None
    return direct_rows(array, chunk, req.box)


def _dest_bytes(req: ReadRequest, chunk: ChunkEntry, rows: tuple[int, int], rb: int) -> torch.Tensor:
    """The bytes of req.dest that chunk-local rows [rows) fill (see _direct)."""
    start = (chunk.offsets[0] + rows[0] - req.offsets[0]) * rb
    return req.dest.reshape(-1).view(torch.uint8)[start : start + (rows[1] - rows[0]) * rb]


def _dest_view(req: ReadRequest, chunk: ChunkEntry, rows: tuple[int, int], rb: int) -> memoryview:
    """_dest_bytes as a memoryview, to read into."""
    start = (chunk.offsets[0] + rows[0] - req.offsets[0]) * rb
    flat = req.dest_bytes
    assert flat is not None  # _direct said so
    return flat[start : start + (rows[1] - rows[0]) * rb]


def _read_from(
    src: Source, array: ArrayEntry, chunk: ChunkEntry, rows: tuple[int, int], reqs: list[ReadRequest], verify: bool
) -> None:
    """Read what `reqs` need of one chunk (chunk-local `rows`) from one source."""
    verify = verify or src.always_verify
    key = src.key(array, chunk)
    where = f"{src.name}/{key}"
    handle = open_checked(src.tier, key, chunk.nbytes, chunk.xxh3)
    try:
        rb = row_bytes(array)
        direct = _direct(array, chunk, reqs[0]) if len(reqs) == 1 else None
        if not verify and direct is not None:  # exactly the needed rows, straight into the destination
            _read(handle, _dest_view(reqs[0], chunk, direct, rb), direct[0] * rb, where)
            return
        if not verify:
            _read_unverified(handle, array, chunk, reqs, rows, where)
            return
        todo = blocks(array, chunk, rows)
        if _windowed(src, chunk, todo, verify):

            def land(block: Block, piece: torch.Tensor) -> None:
                if _inside(block, direct):
                    _copy_into(_dest_bytes(reqs[0], chunk, block.rows, rb), piece)
                    return
                typed = _typed(piece, array, block.rows[1] - block.rows[0])
                for r in reqs:
                    _place(typed, _origin(chunk, block.rows[0]), r)

            _read_windows(handle, todo, where, land, functools.partial(_partly_needed, chunk, reqs))
            return
        if direct is not None and direct[0] <= todo[0].rows[0] and todo[-1].rows[1] <= direct[1]:
            _read_checked(handle, todo, _dest_view(reqs[0], chunk, (todo[0].rows[0], todo[-1].rows[1]), rb), where)
            return
        for block in todo:
            if _inside(block, direct):  # read (and check) it in place
                _read_block(handle, block, _dest_view(reqs[0], chunk, block.rows, rb), where, verify)
                continue
            if direct is not None and block.rows[0] < direct[1] and direct[0] < block.rows[1]:
                # A block at the edge of this rank's rows (a reshard): those rows go straight
                # into place, the rest (read only to check the block) into the bounce buffer
                # (its cached view: a tensor's view costs ~10 us a block, more on a busy core).
                dest = functools.partial(_dest_view, reqs[0], chunk, rb=rb)
                _read_parts(handle, block, _split_block(block, direct, _bounce.view(block.nbytes), dest, rb), where)
                continue
            raw = _bounce.get(block.nbytes)
            _read_block(handle, block, raw, where, verify)
            piece = _typed(raw, array, block.rows[1] - block.rows[0])
            for r in reqs:
                _place(piece, _origin(chunk, block.rows[0]), r)
    finally:
        handle.close()


def _read_whole(
    src: Source, manifest: Manifest, array: ArrayEntry, chunk: ChunkEntry, req: ReadRequest, verify: bool
) -> bool:
    """Read a small chunk file whose digest is the xxh3 of its bytes (one block), and whose
    rows this rank needs land contiguously in req.dest, in one open, read and close from
    `src`, a tier of local files; check it and put its rows in place. True once they are.

    A restore reads hundreds of these (a bias, a norm's weight, or part of one after a
    reshard): 13.5 us each here against 18 by the full path (one reader, 4 KB chunks on
    tmpfs). The whole file is checked, whatever rows the rank needs.

    False, with those bytes of req.dest undefined, where anything differs from that or the
    read fails in any way: the full path (from_first_good) then reads the chunk again and
    reports what is wrong; a digest that does not match is logged, as a re-read is."""
    if not src.tier.capabilities.local_files or array.digest_block_bytes(chunk):
        return False
    rows = _direct(array, chunk, req)
    if rows is None:
        return False
    rb = row_bytes(array)
    whole = rows[0] == 0 and rows[1] * rb == chunk.nbytes  # the file is exactly those rows: read in place
    out = _dest_view(req, chunk, rows, rb) if whole else _bounce.view(chunk.nbytes)
    try:
        resolved = src.resolve(manifest, array, chunk)
        key = src.key(array, resolved)
        handle = src.tier.open_read(key)
        try:
            if handle.size != resolved.nbytes:
                return False
            handle.read_into(0, out)
        finally:
            handle.close()
    except Exception:  # noqa: BLE001 - the full path reads it again, and says what failed
        return False
    if verify or src.always_verify:
        got = xxhash.xxh3_64_hexdigest(out)
        if got != resolved.xxh3:
            log.warning(
                "chunk %s/%s fails its checksum (xxh3 %s, recorded %s); reading it again",
                src.name,
                key,
                got,
                resolved.xxh3,
            )
            return False
    if not whole:
        _dest_view(req, chunk, rows, rb)[:] = out[rows[0] * rb : rows[1] * rb]
    return True


def _read_checked(handle: ReadHandle, todo: Sequence[Block], out: memoryview, where: str) -> None:
    """Consecutive blocks read into `out` (their bytes, from the first block's offset) and
    each checked: a whole chunk landing in its tensor, the usual large read of a restore,
    in one loop rather than a call chain per 1 MiB block."""
    base = todo[0].offset
    for block in todo:
        lo = block.offset - base
        piece = out[lo : lo + block.nbytes]
        if block.nbytes > _PIECE:
            _read_parts(handle, block, (piece,), where)
            continue
        read_exact(handle, piece, block.offset, where)
        _check_block(xxhash.xxh3_64_hexdigest(piece), block, where)


def _partly_needed(chunk: ChunkEntry, reqs: list[ReadRequest], block: Block) -> bool:
    """Whether no one of `reqs` needs every byte of the block (its rows of the chunk's
    extent, across the whole chunk in the other dimensions): the rest is some other
    rank's, on a reshard."""
    if not chunk.offsets:
        return False
    lo, hi = chunk.offsets[0] + block.rows[0], chunk.offsets[0] + min(block.rows[1], chunk.shape[0])
    for r in reqs:
        box = r.box
        if box.lo[0] <= lo and hi <= box.hi[0]:
            if all(
                b_lo <= o and o + n <= b_hi
                for b_lo, b_hi, o, n in zip(box.lo[1:], box.hi[1:], chunk.offsets[1:], chunk.shape[1:])
            ):
                return False
    return True


def _inside(block: Block, direct: tuple[int, int] | None) -> bool:
    """Whether the whole block lands contiguously in the destination (rows `direct`, see _direct)."""
    return direct is not None and direct[0] <= block.rows[0] and block.rows[1] <= direct[1]


def _read_windows(
    handle: ReadHandle,
    todo: list[Block],
    where: str,
    land: Callable[[Block, torch.Tensor], None],
    shared: Callable[[Block], bool] | None = None,
) -> None:
    """Blocks (each at most _WINDOW bytes) read with O_DIRECT, in windows of consecutive ones,
    into the reader's aligned buffer; each checked there, then given to land(block, its
    bytes) to copy out. A disk read so moves no page-cache pages: a buffered read allocates
    one per 4 KiB and copies it again: 2.9 GB cold took 0.8-1.3 CPU s so, 2.2-3.8 buffered
    (the dev machine).

    A block that `shared` names (one this rank needs only part of, whose other rows
    another rank of the machine reads too) is read through the page cache instead, so
    that the device gives its bytes once to both."""
    buf, view = _window.get()
    i = 0
    while i < len(todo):
        if shared is not None and shared(todo[i]):
            block = todo[i]
            read_exact(handle, view[: block.nbytes], block.offset, where, shared=True)
            _check_block(xxhash.xxh3_64_hexdigest(view[: block.nbytes]), block, where)
            land(block, buf[: block.nbytes])
            i += 1
            continue
        start = todo[i].offset // DIRECT_ALIGN * DIRECT_ALIGN
        j = i + 1
        while (
            j < len(todo)
            and _align_up(todo[j].offset + todo[j].nbytes) - start <= len(view)
            and not (shared is not None and shared(todo[j]))
        ):
            j += 1
        need = todo[j - 1].offset + todo[j - 1].nbytes - start
        read_direct_exact(handle, view[: _align_up(need + start) - start], start, need, where)
        window = todo[i:j]
        got = [xxhash.xxh3_64_hexdigest(view[b.offset - start : b.offset - start + b.nbytes]) for b in window]
        if got != [b.xxh3 for b in window]:
            for digest, b in zip(got, window):
                _check_block(digest, b, where)
        # Every block of the window checked: they land as one (their rows consecutive), a
        # copy a window rather than a block.
        first, last = window[0], window[-1]
        run = Block((first.rows[0], last.rows[1]), first.offset, last.offset + last.nbytes - first.offset, "")
        land(run, buf[first.offset - start : first.offset - start + run.nbytes])
        i = j


def _windowed(src: Source, chunk: ChunkEntry, todo: list[Block], verify: bool) -> bool:
    """Whether these blocks are read by _read_windows: checked, from a disk, large enough."""
    return (
        (verify or src.always_verify)
        and src.direct
        and chunk.nbytes >= DIRECT_MIN_BYTES
        and max(b.nbytes for b in todo) <= _WINDOW
    )


def _align_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def _read_unverified(
    handle: ReadHandle, array: ArrayEntry, chunk: ChunkEntry, reqs: list[ReadRequest], rows: tuple[int, int], where: str
) -> None:
    """Exactly the needed rows; for a split along dim 1, only the needed span of each row."""
    shape = array.chunk_shape or (1,)
    rb = row_bytes(array)
    item = itemsize(array.data_type)
    inner = math.prod(shape[2:]) * item if len(shape) > 1 else 0
    c_lo, c_hi = 0, shape[1] if len(shape) > 1 else 0
    if len(shape) > 1 and chunk.offsets:
        c_lo = min(max(r.offsets[1], chunk.offsets[1]) for r in reqs) - chunk.offsets[1]
        c_hi = (
            max(min(r.offsets[1] + r.dest.shape[1], chunk.offsets[1] + chunk.shape[1]) for r in reqs) - chunk.offsets[1]
        )
    span = (c_hi - c_lo) * inner if len(shape) > 1 else rb
    full_rows = span == rb
    step = max(1, (4 << 20) // max(span, 1))
    dtype = ZARR_TO_TORCH[array.data_type]
    for r0 in range(rows[0], rows[1], step):
        r1 = min(rows[1], r0 + step)
        raw = _bounce.get((r1 - r0) * span)
        if full_rows:
            _read(handle, raw, r0 * rb, where)
        else:
            view = _byte_view(raw)
            for i in range(r1 - r0):
                read_exact(handle, view[i * span : (i + 1) * span], (r0 + i) * rb + c_lo * inner, where)
        piece = raw.view(dtype).view((r1 - r0, c_hi - c_lo, *shape[2:]) if len(shape) > 1 else (r1 - r0,))
        origin = _origin(chunk, r0)
        if len(origin) > 1:
            origin[1] += c_lo
        for r in reqs:
            _place(piece, origin, r)


def _from_live(
    sources: Sequence[Source],
    dead: set[str],
    manifest: Manifest,
    array: ArrayEntry,
    chunk: ChunkEntry,
    read: Callable[[Source, ChunkEntry], None],
) -> None:
    """from_first_good over the sources this rank has not found unreachable (`dead`, which
    it adds to, so later reads skip them rather than wait out their retries). A chunk whose
    live copies are all bad while a dead source holds one is unreachable, not lost. The
    reader threads of a rank share `dead`: a set's add and membership test are atomic under
    the GIL, and nothing iterates it."""
    lost = [s.name for s in sources if s.name in dead and s.holds(chunk)] if dead else []
    try:
        from_first_good([s for s in sources if s.name not in dead] if lost else sources, manifest, array, chunk, read)
    except SourcesUnreachable as e:
        dead.update(e.locations)
        raise
    except CorruptVersionError as e:
        if not lost:
            raise
        raise SourcesUnreachable.at(errno.EHOSTUNREACH, f"{e}; {', '.join(lost)} could not be reached", lost) from e


def _first_real(failures: Sequence[BaseException]) -> BaseException:
    """The first failure that is not a source out of reach (damage, a bug), else the first."""
    return next((e for e in failures if not isinstance(e, SourcesUnreachable)), failures[0])


class ReadsUnreached(SourcesUnreachable):
    """Every read of this rank that failed, failed because sources at `locations` could not
    be reached from it, or because every copy of a chunk on its sources was damaged
    (`damaged`: the chunk and what its read raised): those reads fill the requests at
    `requests` (indices into the requests given), which a read without those sources, or
    with those chunks from ranks that have other copies, can get (ckpt._load.read_agreed)."""

    requests: tuple[int, ...] = ()
    damaged: tuple[tuple[ChunkKey, CorruptVersionError], ...] = ()

    @classmethod
    def of(
        cls,
        failures: Sequence[SourcesUnreachable],
        requests: Sequence[int],
        damaged: Sequence[tuple[ChunkKey, CorruptVersionError]] = (),
    ) -> ReadsUnreached:
        found: Sequence[Exception] = [*failures, *(d for _, d in damaged)]
        first = (failures[0].strerror if failures else None) or str(found[0])
        e = cls(
            failures[0].errno if failures else errno.EIO,
            first + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""),
        )
        e.locations = frozenset().union(*(f.locations for f in failures))
        e.requests = tuple(sorted(set(requests)))
        e.damaged = tuple(damaged)
        return e


def _hand_off(
    comm: Comm,
    manifest: Manifest,
    remote: Sequence[ChunkKey],
    reach: frozenset[int],
    lost: frozenset[int],
    damaged: Mapping[ChunkKey, CorruptVersionError],
    sharing: frozenset[int],
) -> tuple[list[Outgoing], list[Incoming], int, BaseException | None]:
    """Collective: this rank's part of the hand-off (restore.handoff): the chunks it sends and
    receives, the number of rounds (the same on every rank), and its error (a chunk it
    needs that no rank reaches). What each rank reaches (a few ranges a rank) goes to every
    rank; what it asks goes to the holders it asks only. A chunk `damaged` on this rank's
    copies is asked of a rank outside `sharing` (the ranks that read those same copies);
    where there is none, its damage stands."""
    holders = Holders.gather(comm, reach, lost)

    def writer_of(key: ChunkKey) -> int:
        return manifest.arrays[key[0]].chunk_at(key[1]).writer

    error: BaseException | None = None
    asks, unheld = ask_holders([k for k in remote if k not in damaged], writer_of, holders.of, comm.rank)
    if damaged:
        elsewhere = ask_holders(
            [k for k in remote if k in damaged],
            writer_of,
            lambda w: [r for r in holders.of(w) if r not in sharing],
            comm.rank,
        )
        for holder, keys in elsewhere[0].items():
            asks.setdefault(holder, []).extend(keys)
        if elsewhere[1]:
            error = damaged[elsewhere[1][0]]
    if unheld:
        name, index = unheld[0]
        where = f"{name} chunk {list(index)}" + (f" (and {len(unheld) - 1} more)" if len(unheld) > 1 else "")
        # A damaged chunk no rank has another copy of stands (it proves the version bad).
        if holders.lost_by_any(writer_of(unheld[0])):
            error = error or TierUnavailableError(errno.EHOSTUNREACH, f"{where}: no rank reaches a copy")
        else:
            error = error or CorruptVersionError(f"{where} is on no reachable root")
    budget = max(1, SEND_ROUND_BYTES // max(1, len(asks)))  # its receive buffers: one round's bytes in all
    asked = comm.all_to_all([Ask(budget, asks[r]) if r in asks else None for r in range(comm.world)])
    sends: list[Outgoing] = []
    answers: list[list[tuple[int, int]] | None] = [None] * comm.world
    try:
        sends, answers = plan_sends(
            asked,
            lambda k: _travels(manifest.arrays[k[0]].chunk_at(k[1])),
            SEND_ROUND_BYTES,
            lambda k: _packed(manifest.arrays[k[0]].chunk_at(k[1])),
        )
    except Exception as e:  # noqa: BLE001 - this rank still answers (nothing: its askers fail) and joins the rounds
        error = error or e
    got = comm.all_to_all(answers)
    recvs, mismatch = incoming(asks, got)
    error = error or mismatch
    mine = 1 + max([o.round for o in sends] + [i.round for i in recvs], default=-1)
    return sends, recvs, comm.reduce_max([mine])[0], error


def full_tensor(array: ArrayEntry) -> torch.Tensor:
    """A fresh CPU tensor for an array the live state has no tensor for."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if array.nbytes > physical:
        raise CorruptVersionError(f"{array.name}: {array.nbytes} bytes exceed this machine's memory", path=array.path)
    return torch.empty(tuple(array.shape), dtype=ZARR_TO_TORCH[array.data_type])


def load_arrays(
    comm: Comm,
    sources: Sequence[Source],
    manifest: Manifest,
    requests: Sequence[ReadRequest],
    *,
    verify: bool = True,
    threads: int = 4,
    cores: int | None = None,
    unreachable: set[str] | None = None,
    damaged: Mapping[ChunkKey, CorruptVersionError] | None = None,
    sharing: frozenset[int] = frozenset(),
    report_damage: bool = False,
    avoid_lost: bool = False,
) -> tuple[int, ...]:
    """Fill every request. Collective: every rank of `comm` calls it, with its own requests.
    Returns the indices of the requests that chunks sent by other ranks filled (in part).
    Raises this rank's first read failure; the caller agrees on failures across ranks. If
    every read of this rank that failed (its own, or one it made to send to another rank)
    failed on sources it could not reach, that is ReadsUnreached. `unreachable`: the
    locations of sources this rank could not reach earlier in the restore: left out, and
    added to as reads find more. With `avoid_lost` (a second read of the version), the
    chunks of a saved rank with a copy there come from ranks that reach it (not from
    another copy here, which may be the bad one that sent this rank there); a chunk no rank
    reaches is then unreachable, not lost. A first read (of an older version, say) reads
    the copies here: none of them has failed yet. A round of
    chunks sent between ranks that one rank could not prepare (a buffer it could not
    allocate) is sent by none: that rank raises, and the others return with those
    requests unfilled, for the caller's agreement to fail them with its cause. With
    `report_damage`, a chunk whose every copy on this rank's sources was damaged makes
    ReadsUnreached too (its `damaged`); read again with those chunks as `damaged`, they
    come from a rank outside `sharing` (the ranks that read the same copies) that holds
    another copy.

    `threads` read this rank's chunks; at most `cores` where every source read first is in
    memory (tmpfs): there a read is a copy, and readers beyond the cores only contend for
    them and for the GIL (1.5 GB on 2 cores: 0.19 s with 2 readers, 0.22 s with 4), and one
    reader takes the small chunks (store.lanes.LIGHT_BYTES) while the others read the large."""
    error: BaseException | None = None
    dead = unreachable if unreachable is not None else set()
    unsent: list[SourcesUnreachable] = []  # failed reads of chunks this rank was to send
    lost = frozenset().union(*(s.writers for s in sources if s.name in dead))
    sources = [s for s in sources if s.name not in dead]
    plan: list[ChunkRead] = []
    try:
        plan = plan_reads(manifest.arrays, [Request(r.array.name, r.box) for r in requests])
    except Exception as e:  # noqa: BLE001 - this rank still joins every collective below, then raises
        error, plan = e, []
    reach = (frozenset().union(*(s.writers for s in sources)) if sources else frozenset()) - (
        lost if avoid_lost else frozenset()
    )
    bad = damaged or {}
    remote = sorted(
        (p.name, p.index)
        for p in plan
        if p.chunk.inline is None and (p.chunk.writer not in reach or (p.name, p.index) in bad)
    )
    by_key = {(p.name, p.index): p for p in plan} if remote else {}
    sends: list[Outgoing] = []  # chunks this rank reads for ranks that cannot reach them
    recvs: list[Incoming] = []  # chunks it needs and reaches on none of its sources
    rounds = 0
    if comm.any(bool(remote)):  # some rank cannot reach a chunk it needs (else: one all-reduce)
        sends, recvs, rounds, unheld = _hand_off(comm, manifest, remote, reach, lost, bad, sharing | {comm.rank})
        error = error or unheld
    remote_set = set(remote)
    local: list[ChunkRead] = [p for p in plan if (p.name, p.index) not in remote_set] if remote else list(plan)
    local.sort(key=lambda p: -p.chunk.nbytes)  # largest first: no lone big read at the end
    first: dict[int, list[tuple[str, ChunkEntry]]] = {}  # per source (by position): the chunks it is read first for
    for p in local:
        at = _first_source(sources, p.chunk)
        if at is not None:
            first.setdefault(at, []).append((p.name, p.chunk))
    # The chunks this rank reads to send (the hand-off): their files' metadata read ahead
    # too, or each send's open walks a cold directory tree behind the data reads.
    passing = {i: list(reads) for i, reads in first.items()}
    for o in sends:
        chunk = manifest.arrays[o.key[0]].chunk_at(o.key[1])
        at = _first_source(sources, chunk)
        if at is not None:
            passing.setdefault(at, []).append((o.key[0], chunk))
    # Each source read first holds a read pass (Tier.reading) until every read of this rank is done.
    with contextlib.ExitStack() as passes:
        for i, reads in passing.items():
            passes.enter_context(sources[i].tier.reading(_keys(sources[i], manifest, reads)))
        solo = 0
        if first and all(sources[i].tier.in_memory() for i in first):
            if cores is not None:
                threads = min(threads, cores)
            # Small chunks (the tail of `local`) on one reader: there a read is a quick copy,
            # and readers competing for the GIL at every system call cost more than it.
            solo = sum(1 for p in local if p.chunk.nbytes < LIGHT_BYTES)

        stop = threading.Event()  # the rounds raised: the reads left are not made

        def read(p: ChunkRead) -> None:
            if stop.is_set():
                raise CkptError("not read: the hand-off's rounds failed")
            array, chunk = manifest.arrays[p.name], p.chunk
            reqs = [requests[i] for i in p.requests]
            if chunk.inline is not None:  # in the manifest: a rank whose node was replaced holds no tier of it
                piece = _inline(array, chunk, verify=True)
                for r in reqs:
                    _place(piece, chunk.offsets, r)
                return
            # Not once a source is out of reach: which copy comes first is then the full path's call.
            if chunk.nbytes < LIGHT_BYTES and len(reqs) == 1 and not dead:
                src = next((s for s in sources if chunk.writer in s.writers), None)
                if src is not None and _read_whole(src, manifest, array, chunk, reqs[0], verify):
                    return
            _from_live(
                sources, dead, manifest, array, chunk, lambda s, c: _read_from(s, array, c, p.rows, reqs, verify)
            )

        # Chunks some rank cannot reach (a node replaced with empty disks, a world-size change
        # with a root per node): the holder each asker picked (restore.handoff) reads it once,
        # verified, and sends it point to point to the ranks that asked, in its rounds of
        # bounded bytes; every rank takes part in every round. This rank's own reads go on
        # meanwhile, on their own thread.
        own: list[tuple[list[Any], list[tuple[int, Exception]]]] = []
        reader = threading.Thread(
            target=lambda: own.append(run_lanes(local, read, max(1, threads), name="ckpt-read", solo=solo))
        )
        if rounds:
            reader.start()
        # Two rounds in flight: the next one is read while this one is sent.
        sends_in: list[list[Outgoing]] = [[] for _ in range(rounds)]
        recvs_in: list[list[Incoming]] = [[] for _ in range(rounds)]
        for o in sends:
            sends_in[o.round].append(o)
        for inc in recvs:
            recvs_in[inc.round].append(inc)
        # The send lanes live through every round: a lane's buffers (its O_DIRECT window)
        # are faulted in once, not again for each round's fresh threads.
        lanes = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-send")
        prepare = functools.partial(_prepare_round, sources, manifest, requests, by_key, lanes)
        # A round that raises (a peer gone from the group) is raised only once this rank's
        # own reads have stopped writing into the state (the caller may read another
        # version into it); the reads not begun by then are not made.
        try:
            with lanes, ThreadPoolExecutor(1, thread_name_prefix="ckpt-send-ahead") as ahead:
                nxt = ahead.submit(prepare, sends_in[0], recvs_in[0], verify, threads, dead) if rounds else None
                for k in range(rounds):
                    if nxt is None:
                        break
                    rnd: _Round | None = None
                    try:
                        rnd = nxt.result()
                    except Exception as e:  # noqa: BLE001 - outside the read lanes (a buffer not allocated)
                        error = error or e
                    more = rnd is not None and k + 1 < rounds
                    nxt = (
                        ahead.submit(prepare, sends_in[k + 1], recvs_in[k + 1], verify, threads, dead) if more else None
                    )
                    # One all-reduce a round: a rank that has no part to send or receive in it
                    # must not leave the others waiting in the exchange until the timeout. No
                    # rank sends it or any later round; the caller's agreement names the cause.
                    if comm.any(rnd is None):
                        break
                    assert rnd is not None
                    failure = _finish_round(comm, rnd)
                    if isinstance(failure, SourcesUnreachable):  # what it sent in their place was zeros
                        dead.update(failure.locations)
                        unsent.append(failure)
                    else:
                        error = error or failure
        except BaseException:
            stop.set()
            raise
        finally:
            if rounds:
                reader.join()
        if not rounds:
            try:
                reader.run()
            finally:
                _window.release()
    _, failed = own[0] if own else ([], [(0, CkptError("this rank's reads were interrupted"))])
    received = sorted({i for key in remote for i in by_key[key].requests})
    if error is None and own:
        unreached = [e for _, e in failed if isinstance(e, SourcesUnreachable)]
        # damage of every copy of a chunk file on this rank's sources (not of an inline value)
        here = [
            ((local[i].name, local[i].index), e)
            for i, e in failed
            if report_damage and isinstance(e, CorruptVersionError) and local[i].chunk.inline is None
        ]
        if len(unreached) + len(here) < len(failed):
            error = _first_real([e for _, e in failed])  # in the plan's order (largest chunk first)
        elif unreached or unsent or here:
            # Read again without those sources, those chunks from ranks with other copies,
            # and what came from other ranks (a holder that could not read a chunk sent
            # zeros, and says so only in its own error).
            again = [r for i, _ in failed for r in local[i].requests] + received
            error = ReadsUnreached.of(unreached + unsent, again, here)
    elif failed and error is None:
        error = failed[0][1]
    if error is not None:
        raise error
    return tuple(received)


def _first_source(sources: Sequence[Source], chunk: ChunkEntry) -> int | None:
    """The position of the source a chunk file is read from first (None: an inline value, or
    a chunk this rank reaches on no source)."""
    if chunk.inline is not None:
        return None
    return next((i for i, s in enumerate(sources) if chunk.writer in s.writers), None)


def _keys(src: Source, manifest: Manifest, reads: Sequence[tuple[str, ChunkEntry]]) -> Iterator[str]:
    """The keys of `reads` (array name, chunk) on `src`, made as a read pass asks for them
    (a pass in memory does not)."""
    return (src.key(manifest.arrays[name], chunk) for name, chunk in reads)


@dataclass
class _Round:
    """One round of chunks sent by their holders to the ranks that cannot reach them."""

    sends: list[tuple[int, int, torch.Tensor]]
    recvs: list[tuple[int, int, torch.Tensor]]
    places: list[tuple[torch.Tensor, ArrayEntry, ChunkEntry, list[ReadRequest]]]  # received, not yet in place
    error: BaseException | None = None


def _prepare_round(
    sources: Sequence[Source],
    manifest: Manifest,
    requests: Sequence[ReadRequest],
    by_key: Mapping[ChunkKey, ChunkRead],
    lanes: ThreadPoolExecutor,
    outgoing: Sequence[Outgoing],
    arriving: Sequence[Incoming],
    verify: bool,
    threads: int,
    dead: set[str],
) -> _Round:
    """This rank's part of a round: the chunks it holds, read (verified) into send buffers,
    and receive buffers for the chunks it needs (the destination itself where a chunk that
    travels alone lands there whole and contiguous). Small chunks (_packed) travel in
    packs: one message a round for each set of ranks they go to. A holder that cannot read a chunk still sends it
    (what it could not read as zeros) so that no rank waits; its error fails the version on every rank."""
    sends: list[tuple[int, int, torch.Tensor]] = []
    reads: list[tuple[ArrayEntry, ChunkEntry, range, torch.Tensor]] = []
    recvs: list[tuple[int, int, torch.Tensor]] = []
    places: list[tuple[torch.Tensor, ArrayEntry, ChunkEntry, list[ReadRequest]]] = []
    packs: dict[int, list[Outgoing]] = {}  # per message: the small chunks that share it
    for out in outgoing:
        array = manifest.arrays[out.key[0]]
        chunk = array.chunk_at(out.key[1])
        if _packed(chunk):
            packs.setdefault(out.tag, []).append(out)
            continue
        parts = blocks(array, chunk)
        buf = torch.empty(_file_bytes(array, chunk), dtype=torch.uint8)  # every byte read into it, or zeroed below
        for span in _spans(len(parts), threads):  # a span: read in file order through one open file
            lo, hi = parts[span[0]], parts[span[-1]]
            reads.append((array, chunk, span, buf[lo.offset : hi.offset + hi.nbytes]))
        sends += [(r, out.tag, buf) for r in out.to]
    for tag, outs in packs.items():  # one message to the ranks they all go to (restore.handoff.plan_sends)
        keys = sorted(o.key for o in outs)
        pack, slots = _pack(manifest, keys, torch.zeros)  # its gaps leave this rank as zeros
        for key, slot in zip(keys, slots):
            array = manifest.arrays[key[0]]
            chunk = array.chunk_at(key[1])
            reads.append((array, chunk, range(block_count(array, chunk)), slot))
        sends += [(r, tag, pack) for r in outs[0].to]
    unpacked: dict[tuple[int, int], list[Incoming]] = {}  # per (holder, tag): the small chunks of a message
    for inc in arriving:
        array = manifest.arrays[inc.key[0]]
        chunk = array.chunk_at(inc.key[1])
        if _packed(chunk):
            unpacked.setdefault((inc.holder, inc.tag), []).append(inc)
            continue
        mine = [requests[i] for i in by_key[inc.key].requests]
        rows = (0, (array.chunk_shape or (1,))[0])
        if len(mine) == 1 and _direct(array, chunk, mine[0]) == rows:
            recvs.append((inc.holder, inc.tag, _dest_bytes(mine[0], chunk, rows, row_bytes(array))))
            continue
        buf = torch.empty(_file_bytes(array, chunk), dtype=torch.uint8)
        recvs.append((inc.holder, inc.tag, buf))
        places.append((buf, array, chunk, mine))
    for (holder, tag), incs in unpacked.items():
        keys = sorted(inc.key for inc in incs)
        pack, slots = _pack(manifest, keys, torch.empty)
        recvs.append((holder, tag, pack))
        for key, slot in zip(keys, slots):
            array = manifest.arrays[key[0]]
            places.append((slot, array, array.chunk_at(key[1]), [requests[i] for i in by_key[key].requests]))

    def read(item: tuple[ArrayEntry, ChunkEntry, range, torch.Tensor]) -> None:
        array, chunk, span, out = item
        _from_live(
            sources,
            dead,
            manifest,
            array,
            chunk,
            functools.partial(_blocks, array=array, span=span, out=out, verify=verify),
        )

    _, failed = run_lanes(reads, read, max(1, threads), pool=lanes)
    for i, _ in failed:  # sent as zeros: no stale memory leaves this rank
        reads[i][3].zero_()
    return _Round(sends, recvs, places, _first_real([e for _, e in failed]) if failed else None)


def _file_bytes(array: ArrayEntry, chunk: ChunkEntry) -> int:
    """The bytes of a chunk file, as its blocks lay them out (what travels between ranks)."""
    return sum(b.nbytes for b in blocks(array, chunk))


_PACK_ALIGN = 64  # each chunk in a pack starts at a multiple: its bytes are viewed as its dtype in place


def _slot(nbytes: int) -> int:
    """The bytes a chunk of `nbytes` takes in a pack."""
    return -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN


def _travels(chunk: ChunkEntry) -> int:
    """The bytes a chunk takes in a round of the hand-off: in a pack, its aligned slot."""
    return _slot(chunk.nbytes) if _packed(chunk) else chunk.nbytes


def _pack(
    manifest: Manifest, keys: Sequence[ChunkKey], make: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A message of small chunks (`keys`, in key order) and each chunk's slot in it, laid out
    alike by the holder and the receiver from the manifest alone."""
    sizes = [_file_bytes(manifest.arrays[name], manifest.arrays[name].chunk_at(index)) for name, index in keys]
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += _slot(n)
    pack = make(at, dtype=torch.uint8)
    return pack, [pack[a : a + n] for a, n in zip(starts, sizes)]


def _packed(chunk: ChunkEntry) -> bool:
    """Whether a chunk sent between ranks travels in one message with the other small chunks
    its holder sends to the same set of ranks that round (restore.handoff.plan_sends), not
    as a message of its own: both sides decide it from the manifest alone."""
    return chunk.nbytes < PACK_BYTES


def _finish_round(comm: Comm, rnd: _Round) -> BaseException | None:
    """Send and receive the round, then put what landed in buffers in place; the first error."""
    comm.exchange(rnd.sends, rnd.recvs)
    error = rnd.error
    for buf, array, chunk, mine in rnd.places:
        try:
            for block in blocks(array, chunk):
                piece = _typed(buf[block.offset : block.offset + block.nbytes], array, block.rows[1] - block.rows[0])
                for r in mine:
                    _place(piece, _origin(chunk, block.rows[0]), r)
        except Exception as e:  # noqa: BLE001 - raised after the rounds, as the caller does
            error = error or e
    return error


def _spans(count: int, lanes: int) -> list[range]:
    """0..count in at most `lanes` runs of consecutive indices, as even as can be."""
    n = max(1, min(count, lanes))
    return [range(count * k // n, count * (k + 1) // n) for k in range(n)] if count else []


def _blocks(src: Source, chunk: ChunkEntry, array: ArrayEntry, span: range, out: torch.Tensor, verify: bool) -> None:
    """Blocks `span` of a chunk (with its digests, from `src`) into `out`, which starts at the
    first of them: one open file read in order (so the kernel's readahead follows it, or
    in O_DIRECT windows from a disk)."""
    where = f"{src.name}/{src.key(array, chunk)}"
    todo = [block_at(array, chunk, i) for i in span]
    base = todo[0].offset
    handle = open_chunk(src.tier, src.step, array, chunk)
    try:
        if _windowed(src, chunk, todo, verify):
            _read_windows(
                handle,
                todo,
                where,
                lambda b, piece: _copy_into(out[b.offset - base : b.offset - base + b.nbytes], piece),
            )
            return
        for block in todo:
            at = block.offset - base
            _read_block(handle, block, out[at : at + block.nbytes], where, verify or src.always_verify)
    finally:
        handle.close()
