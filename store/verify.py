"""Recomputing every checksum of the part of a version a tier holds (`ckpt verify`, tests).

A file is read as a restore reads it (store.rereads): one that fails its checksum or an I/O
error is read twice more before it counts. An I/O error on every read is reported as
`unreadable`, apart from damage: it proves nothing about the bytes."""

from __future__ import annotations

import json
import math
import os
import posixpath
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from ckpt.store.chunk_read import READ_BLOCK, open_checked, read_chunk, read_exact
from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import CorruptVersionError
from ckpt.store.manifest import ArrayEntry, Manifest
from ckpt.store.rank_file import RankFiles, rank_file_path
from ckpt.store.rereads import reread, unproven_damage
from ckpt.store.tier import Tier, join_key
from ckpt.store.versions import version_dirname
from ckpt.store.zarr_meta import ArrayNode, array_document, group_paths

__all__ = ["ChunkProblem", "ExpectedChunk", "expected_chunks", "verify_chunks", "verify_documents"]


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    array: str  # "" for a rank file
    path: str
    reason: str
    unreadable: bool = False  # an I/O error on every read, not proven damage


@dataclass(frozen=True, slots=True)
class ExpectedChunk:
    """A chunk file of a version and the digest its bytes must have."""

    array: str
    path: str  # relative to the version's directory
    nbytes: int
    block_bytes: int  # the digest's block size (ChunkHasher); 0: one block
    xxh3: str


def expected_chunks(
    tier: Tier, step: int, manifest: Manifest, writers: set[int] | None = None
) -> Iterator[ExpectedChunk | ChunkProblem]:
    """Every chunk file of the version a tier should hold, with its digest, or the problem
    that leaves its digest unknown; inline chunks (in the manifest) are checked here.

    `writers` limits it to the files of those ranks (the part a tier holds). Since schema 3
    each writer's rank file holds its chunks' digests: a bad (or unreadable) rank file is a
    problem, and so is each of its chunks.
    """
    book = RankFiles(tier)
    bad_ranks: dict[int, bool] = {}  # rank -> whether its file is unreadable (not proven bad)
    if manifest.rank_files:
        for rank in range(manifest.world_size):
            if writers is not None and rank not in writers:
                continue
            try:
                reread(partial(book.get, step, manifest, rank), unproven_damage)
            except CorruptVersionError as e:
                bad_ranks[rank] = e.io_error
                yield ChunkProblem("", rank_file_path(rank), str(e), e.io_error)
    for array in manifest.arrays.values():
        for chunk in array.iter_chunks():
            if writers is not None and chunk.writer not in writers:
                continue
            path = array.chunk_path(chunk)
            if chunk.inline is None and chunk.writer in bad_ranks:
                unreadable = bad_ranks[chunk.writer]
                why = f"its digests are in the {'unreadable' if unreadable else 'bad'} {rank_file_path(chunk.writer)}"
                yield ChunkProblem(array.name, path, why, unreadable)
                continue
            try:
                chunk = book.resolve(step, manifest, array, chunk)
                if chunk.inline is not None:
                    read_chunk(tier, step, array, chunk, memoryview(bytearray(len(chunk.inline) // 2)))
                    continue
            except CorruptVersionError as e:
                yield ChunkProblem(array.name, path, str(e), e.io_error)
                continue
            yield ExpectedChunk(array.name, path, chunk.nbytes, array.digest_block_bytes(chunk), chunk.xxh3)


def verify_chunks(tier: Tier, step: int, manifest: Manifest, writers: set[int] | None = None) -> Iterator[ChunkProblem]:
    """Recompute every checksum (streaming, one small buffer); yield each bad file.

    `writers` limits the check to the files of those ranks (the part a tier holds); a
    chunk whose rank file is bad is reported with it (its digests are unknown).
    """
    view = memoryview(bytearray(READ_BLOCK))
    for expected in expected_chunks(tier, step, manifest, writers):
        if isinstance(expected, ChunkProblem):
            yield expected
            continue
        try:
            reread(partial(_check_chunk, tier, step, expected, view), unproven_damage)
        except CorruptVersionError as e:
            yield ChunkProblem(expected.array, expected.path, str(e), e.io_error)


def _check_chunk(tier: Tier, step: int, expected: ExpectedChunk, view: memoryview) -> None:
    """Read one chunk file whole, streaming through `view`; CorruptVersionError if it is
    bad (with both digests on a mismatch, so it is read again)."""
    key = join_key(version_dirname(step), expected.path)
    where = os.path.join(tier.location, key)
    hasher = ChunkHasher(expected.block_bytes)
    handle = open_checked(tier, key, expected.nbytes, expected.xxh3)
    try:
        for start in range(0, expected.nbytes, READ_BLOCK):
            piece = view[: min(READ_BLOCK, expected.nbytes - start)]
            read_exact(handle, piece, start, where)
            hasher.update(piece)
    finally:
        handle.close()
    got = hasher.hexdigest()
    if got != expected.xxh3:
        raise CorruptVersionError(
            f"xxh3 {got} != manifest {expected.xxh3}", path=where, expected=expected.xxh3, actual=got
        )


_DOC = "zarr.json"
_UNSAID = ("attributes", "storage_transformers")  # an array document's parts the manifest does not say


def verify_documents(tier: Tier, step: int, manifest: Manifest) -> Iterator[ChunkProblem]:
    """The zarr.json files by which zarr-python and tensorstore open the version (a restore
    reads the manifest alone): the root group's, naming the step, every group's above an
    array, and every array's, saying what the manifest says of it. Each is read as a chunk
    is: one that fails is read twice more, and one no read of which succeeds is unreadable."""
    for group in group_paths(a.path for a in manifest.arrays.values()):
        yield from _check_document(tier, step, group, None)
    for array in manifest.arrays.values():
        yield from _check_document(tier, step, array.path, array)


def _check_document(tier: Tier, step: int, path: str, array: ArrayEntry | None) -> Iterator[ChunkProblem]:
    rel = posixpath.join(path, _DOC) if path else _DOC
    name = "" if array is None else array.name
    try:
        reread(partial(_read_document, tier, step, rel, path, array), unproven_damage)
    except CorruptVersionError as e:
        yield ChunkProblem(name, rel, str(e), e.io_error)
    except FileNotFoundError:
        yield ChunkProblem(name, rel, "missing (zarr-python and tensorstore open the version by it)")
    except OSError as e:  # a store's refusal or a local I/O error: no proof of damage
        yield ChunkProblem(name, rel, f"cannot be read: {e}", unreadable=True)


def _read_document(tier: Tier, step: int, rel: str, path: str, array: ArrayEntry | None) -> None:
    """CorruptVersionError where the document does not say what it must."""
    key = join_key(version_dirname(step), rel)
    where = os.path.join(tier.location, key)
    try:
        raw = tier.get(key)
    except OSError as e:
        if isinstance(e, FileNotFoundError) or not tier.capabilities.local_files:
            raise
        raise CorruptVersionError(f"{where} cannot be read: {e.strerror or e}", path=where, io_error=True) from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CorruptVersionError(f"{where} is not a JSON document", path=where, actual="unparsable") from None
    if not isinstance(doc, dict):
        raise CorruptVersionError(f"{where} is not a zarr v3 document", path=where, actual="other")
    if array is not None:
        want = {k: v for k, v in array_document(ArrayNode.of(array), {}).items() if k not in _UNSAID}
        got = {k: doc.get(k) for k in want}
        wrong = sorted(k for k in want if got[k] != want[k] and not _same_fill(k, array.data_type, got[k], want[k]))
        if wrong:
            raise CorruptVersionError(
                f"{where} says {', '.join(f'{k}={got[k]!r}' for k in wrong)}, the manifest "
                f"{', '.join(f'{k}={want[k]!r}' for k in wrong)}",
                path=where,
                actual="other",
            )
        return
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise CorruptVersionError(f"{where} is not a zarr v3 group's document", path=where, actual="other")
    attributes = doc.get("attributes")
    if not path and not (isinstance(attributes, dict) and attributes.get("ckpt") == {"step": step}):
        raise CorruptVersionError(f"{where} names another step than {step}: {attributes!r}", path=where, actual="other")


_FLOATS = {"float16": "<e", "float32": "<f", "float64": "<d"}
_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _same_fill(field: str, data_type: str, got: object, want: object) -> bool:
    """Whether two fill_values of a float array are one value: zarr-python, annotating an
    array, writes the one ckpt gives as the hex of its bits ("0x399d4952") as a decimal."""
    fmt = _FLOATS.get(data_type)
    if field != "fill_value" or fmt is None:
        return False
    bits = _bits(fmt, got)
    return bits is not None and bits == _bits(fmt, want)


def _bits(fmt: str, value: object) -> bytes | None:
    if isinstance(value, str) and value.startswith("0x"):
        try:
            raw = bytes.fromhex(value[2:])[::-1]
        except ValueError:
            return None
        return raw if len(raw) == struct.calcsize(fmt) else None
    if isinstance(value, str):
        value = _SPECIAL.get(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return struct.pack(fmt, value)
    except (OverflowError, struct.error):
        return None
