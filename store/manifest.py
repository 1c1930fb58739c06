"""The manifest: a versioned JSON document that is the contract of a committed version.

It lists every array (dtype, global shape, chunk grid, which rank wrote each chunk) and
provenance. Since schema 3 it stays O(arrays + ranks) at any scale: which rank wrote each
chunk is run-length encoded, and what is per rank and per chunk (chunk digests, the
rank's JSON state tree, its RNG) lives in one file per rank (store.rank_file) that the
manifest covers by size and xxh3. Schemas 1 and 2 (still read) listed every chunk with
its digest and every rank's tree here. Parsing validates everything a reader will act
on, before any file is opened or any buffer is allocated: schema version, array names
(so no path can leave the version), dtypes, shapes and byte counts.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import operator
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import xxhash

from ckpt.store.digest import combine_blocks
from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.errors import CorruptVersionError, ManifestError, UnsupportedSchemaError
from ckpt.store.layout import (
    BLOCK_BYTES,
    CHUNK_SEPARATOR,
    LEGACY_BLOCK_BYTES,
    Sharding,
    WriterRun,
    chunk_file,
    flat_index,
    grid_shape,
)
from ckpt.store.layout import block_rows as expected_block_rows
from ckpt.store.tree_format import tree_problem

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "MAX_NAME_BYTES",
    "ROOT_INFO_NAME",
    "SAVE_ID",
    "ChunkEntry",
    "ArrayEntry",
    "RankEntry",
    "RankRef",
    "Manifest",
    "escape_component",
    "keys_of",
    "parse_manifest",
    "with_checksum",
]

# 2: "." chunk keys; a blocked chunk's xxh3 is the digest of its block digests (store/digest.py)
# 3: run-length encoded writers; digests, trees and RNG in per-rank files (store/rank_file.py)
# 4: checksummed blocks of ~1 MiB (store.layout.BLOCK_BYTES), where they were ~4 MiB
SCHEMA_VERSION = 4
READABLE_SCHEMAS = (1, 2, 3, 4)
MANIFEST_NAME = "manifest.json"
ROOT_INFO_NAME = "root.json"
STATE_PREFIX = "state"
MAX_ARRAY_BYTES = 1 << 48  # 256 TiB: anything larger is a crafted manifest
MAX_NDIM = 32
MAX_WORLD = 1 << 24  # ranks of one job: far beyond any real one
MAX_ROW_BYTES = 1 << 30  # one row of a chunk is the smallest unit a reader buffers
MAX_RANK_FILE = 1 << 30  # bytes of one rank file: anything larger is crafted
MAX_COMPONENT = 128  # characters of one array path component (file names stop at 255 bytes)
# Bytes of an array name (escaped components, ASCII, joined by "/"). Its deepest file under
# a root, "v<12 digits>.tmp-<32 hex>/state/<name>/<chunk file>.<write suffix>", is the name
# plus 58 bytes plus one file name (at most NAME_MAX, 255): with 2048, a root's own path (a
# replica root's embeds its source's) keeps over 1.7 KiB of PATH_MAX (4096). encode_state
# refuses longer ones at save; parsing does not, so a version saved before still restores.
MAX_NAME_BYTES = 2048
_RESERVED = frozenset({"zarr.json"})  # names a group directory holds besides its children
# A safe array name in one match: components of these characters, none "." or ".." and
# none starting "__", joined by single slashes (and no final newline, which "$" allows).
_PART = r"(?!\.\.?(?:/|\Z))(?!__)[A-Za-z0-9_.~%+-]+"
_NAME = re.compile(rf"(?:{_PART}/)*{_PART}")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
_HEXES = re.compile(r"[0-9a-f]*")
_JUST_STR, _JUST_16 = frozenset({str}), frozenset({16})
SAVE_ID = re.compile(r"[0-9a-f]{32}")
"""A save's id: 32 lowercase hex digits (it becomes part of paths: tmp and journal names)."""


@functools.lru_cache(maxsize=1 << 16)  # called for every key of every save
def escape_component(key: str) -> str:
    """A state key as a safe zarr node name: percent-encoded, never '.', '..', '__'-prefixed
    or a name the format uses (zarr.json), and at most MAX_COMPONENT characters: a longer
    one keeps its start and ends in '~' and the xxh3 of the whole (the manifest's tree keeps
    the real key; the array name only has to be unique, which encode_state checks)."""
    out = urllib.parse.quote(key, safe="")
    if out in ("", ".", ".."):
        out = "".join(f"%{ord(c):02X}" for c in out) or "%00"
    if out.startswith("__"):
        out = "%5F" + out[1:]
    if out in _RESERVED:
        out = out.replace(".", "%2E")
    if len(out) > MAX_COMPONENT:
        out = f"{out[: MAX_COMPONENT - 17]}~{xxhash.xxh3_64_hexdigest(out.encode())}"
    return out


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ManifestError(f"array name {name!r} is not a safe relative path", path=name)


def keys_of(value: Any) -> tuple[str, ...] | None:
    """A recorded list of top-level state keys, or None where there is none (or it is not one)."""
    if isinstance(value, list) and all(isinstance(k, str) for k in value):
        return tuple(value)
    return None


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    index: tuple[int, ...]
    writer: int  # the rank that wrote the chunk
    offsets: tuple[int, ...]  # global start of the valid data
    shape: tuple[int, ...]  # valid extent; the file holds the full chunk_shape
    nbytes: int  # file size; 0 when inline
    xxh3: str  # xxh3_64 hex of the file's bytes (or of the inline value); "" until resolved (schema 3)
    inline: str | None = None  # little-endian value bytes as hex, for single-element arrays
    blocks: tuple[str, ...] = ()  # xxh3_64 of each block of `block_rows` rows, when more than one

    @property
    def resolved(self) -> bool:
        """Whether its digests are known (schema 3 keeps them in the writer's rank file)."""
        return bool(self.xxh3)


_RUN_START = operator.attrgetter("start")


# Not frozen (a manifest parse makes one per array, and a frozen dataclass's __init__ sets
# each field through object.__setattr__: ~2 us of ~10 per array); never changed once made,
# and never hashed (`sharding` is a dict).
@dataclass(slots=True)
class ArrayEntry:
    name: str  # escaped components joined by '/'; the zarr path is state/<name>
    data_type: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    replicated: bool
    sharding: dict[str, Any]  # how ranks held it at save: {"pieces", "dims", "uneven", "replicas", "holders"}
    listed: tuple[ChunkEntry, ...] = ()  # schemas 1-2: every chunk, with its digests
    block_rows: int = 0  # rows of dim 0 per checksummed block (0: the chunk is one block)
    schema: int = SCHEMA_VERSION  # of the manifest it came from: chunk keys and digests changed in 2
    runs: tuple[WriterRun, ...] = ()  # schema 3: the chunks' writers in grid order
    run_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # for bisection
    grid: tuple[int, ...] = field(init=False, repr=False, compare=False)  # chunks along each dim

    def __post_init__(self) -> None:
        # Derived once: a restore asks for them per chunk, thousands of times.
        self.run_starts = tuple(map(_RUN_START, self.runs))
        self.grid = _grid(self.shape, self.chunk_shape)

    inline: str | None = None  # schema 3: a single-element array's value (hex), when it has no chunk file
    inline_xxh3: str = ""  # schema 3: the xxh3_64 of the inline value's bytes

    @property
    def path(self) -> str:
        return f"{STATE_PREFIX}/{self.name}"

    @property
    def separator(self) -> str:
        """Of its zarr chunk keys: "c.0.0" since schema 2 (one directory per array), "c/0/0" before."""
        return "/" if self.schema < 2 else CHUNK_SEPARATOR

    def chunk_path(self, chunk: ChunkEntry) -> str:
        return chunk_file(self.path, chunk.index, self.separator)

    def digest_block_bytes(self, chunk: ChunkEntry) -> int:
        """The block size that store.digest.ChunkHasher needs for `chunk`'s xxh3 (0: one block)."""
        if not self.block_rows or chunk.inline is not None or self.schema < 2:
            return 0
        return self.block_rows * math.prod(self.chunk_shape[1:]) * ITEMSIZE[self.data_type]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.data_type]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk file."""
        return math.prod(self.chunk_shape) * ITEMSIZE[self.data_type]

    @property
    def chunk_count(self) -> int:
        return len(self.listed) if self.schema < 3 else sum(r.count for r in self.runs)

    @property
    def stored_bytes(self) -> int:
        """Bytes of its chunk files."""
        if self.schema < 3:
            return sum(c.nbytes for c in self.listed)
        return 0 if self.inline is not None else self.chunk_count * self.chunk_bytes

    def flat(self, index: tuple[int, ...]) -> int:
        """A grid index's position in grid (C) order."""
        return flat_index(index, self.grid)

    def index_of(self, flat: int) -> tuple[int, ...]:
        out = []
        for g in reversed(self.grid):
            flat, i = divmod(flat, g) if g else (flat, 0)
            out.append(i)
        return tuple(reversed(out))

    def writer_of(self, flat: int) -> int:
        """Schema 3: the rank that wrote the chunk at flat grid index `flat`."""
        i = bisect.bisect_right(self.run_starts, flat) - 1
        if i < 0 or flat >= self.runs[i].start + self.runs[i].count:
            raise CorruptVersionError(f"{self.name} has no chunk at flat index {flat}", path=self.path)
        run = self.runs[i]
        return run.first + run.stride * (flat - run.start)

    def chunk_at(self, index: tuple[int, ...]) -> ChunkEntry:
        """The chunk at a grid index (chunks are validated to cover the grid once, in grid order).
        Schema 3: without its digests (Source.resolve / RankFiles.resolve add them)."""
        if self.schema >= 3:
            if len(index) != len(self.shape) or any(not 0 <= i < g for i, g in zip(index, self.grid)):
                raise CorruptVersionError(f"{self.name} has no chunk {list(index)}", path=self.path)
            return self._entry(index, self.writer_of(self.flat(index)))
        flat = self.flat(index)
        if flat < len(self.listed) and self.listed[flat].index == index:
            return self.listed[flat]
        for entry in self.listed:  # a manifest listing them in another order
            if entry.index == index:
                return entry
        raise CorruptVersionError(f"{self.name} has no chunk {list(index)}", path=self.path)

    def _entry(self, index: tuple[int, ...], writer: int) -> ChunkEntry:
        offsets = tuple(map(operator.mul, index, self.chunk_shape))  # (map: a third faster than a generator)
        shape = tuple(map(min, self.chunk_shape, map(operator.sub, self.shape, offsets)))
        if self.inline is not None:
            return ChunkEntry(index, writer, offsets, shape, 0, self.inline_xxh3, self.inline)
        return ChunkEntry(index, writer, offsets, shape, self.chunk_bytes, "")

    def iter_chunks(self) -> Iterator[ChunkEntry]:
        """Every chunk, in grid order (schema 3: without digests)."""
        if self.schema < 3:
            yield from self.listed
            return
        flat = 0
        for run in self.runs:
            for k in range(run.count):
                yield self._entry(self.index_of(flat), run.first + run.stride * k)
                flat += 1

    @property
    def single_inline(self) -> str | None:
        """The value of a single-element array stored without a chunk file."""
        if self.schema >= 3:
            return self.inline
        return self.listed[0].inline if len(self.listed) == 1 else None


@dataclass(frozen=True, slots=True)
class RankEntry:
    """Schemas 1-2: a rank's state in the manifest (schema 3: its rank file)."""

    rank: int
    tree: str  # key into Manifest.trees
    rng: dict[str, Any] | None
    host: str
    root: int  # index of the root group (filesystem) the rank wrote to


@dataclass(frozen=True, slots=True)
class RankRef:
    """Schema 3: a rank file as the manifest covers it."""

    size: int
    xxh3: str


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    save_id: str
    created: float
    world_size: int
    arrays: dict[str, ArrayEntry]
    trees: dict[str, Any]  # schemas 1-2
    ranks: tuple[RankEntry, ...]  # schemas 1-2
    roots: tuple[tuple[int, ...], ...]  # per root group: the ranks whose chunks it holds
    meta: dict[str, Any] = field(default_factory=dict)  # provenance, timings
    schema_version: int = SCHEMA_VERSION  # kept when an older version is copied
    rank_files: tuple[RankRef, ...] = ()  # schema 3: one per rank, in rank order

    @property
    def total_bytes(self) -> int:
        return sum(a.stored_bytes for a in self.arrays.values())

    @property
    def keys(self) -> tuple[str, ...] | None:
        """The top-level keys of the saved state (meta "keys"); None where not recorded
        (versions of older ckpts, which always held the whole state)."""
        return keys_of(self.meta.get("keys"))

    @property
    def partial(self) -> bool | None:
        """Whether it is a params-only version (meta "partial"); None where not recorded
        (versions of older ckpts: store.versions.full_steps judges them by their keys)."""
        got = self.meta.get("partial")
        return got if isinstance(got, bool) else None

    def root_of(self, rank: int) -> int:
        """The index of the root group `rank` wrote to."""
        if self.ranks:
            return self.ranks[rank].root
        return next((i for i, group in enumerate(self.roots) if rank in group), 0)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": "ckpt",
            "schema_version": self.schema_version,
            "step": self.step,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "roots": [list(r) for r in self.roots],
            "meta": self.meta,
        }
        if self.schema_version >= 3:
            doc["ranks"] = [[r.size, r.xxh3] for r in self.rank_files]
            doc["arrays"] = {name: _array_doc_v3(a) for name, a in self.arrays.items()}
        else:
            doc["ranks"] = [
                {"rank": r.rank, "tree": r.tree, "rng": r.rng, "host": r.host, "root": r.root} for r in self.ranks
            ]
            doc["trees"] = self.trees
            doc["arrays"] = {
                name: {
                    "data_type": a.data_type,
                    "shape": list(a.shape),
                    "chunk_shape": list(a.chunk_shape),
                    "replicated": a.replicated,
                    "regions": a.sharding.get("regions", []),
                    "block_rows": a.block_rows,
                    "chunks": [_chunk_doc(c) for c in a.listed],
                }
                for name, a in self.arrays.items()
            }
        return with_checksum(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())


def _array_doc_v3(a: ArrayEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "data_type": a.data_type,
        "shape": list(a.shape),
        "chunk_shape": list(a.chunk_shape),
        "block_rows": a.block_rows,
        "replicated": a.replicated,
        "sharding": a.sharding,
        "writers": [[r.count, r.first, r.stride] for r in a.runs],
    }
    if a.inline is not None:
        doc["inline"] = a.inline
        doc["xxh3"] = a.inline_xxh3
    return doc


def _chunk_doc(c: ChunkEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": list(c.index),
        "writer": c.writer,
        "offsets": list(c.offsets),
        "shape": list(c.shape),
        "nbytes": c.nbytes,
        "xxh3": c.xxh3,
    }
    if c.inline is not None:
        doc["inline"] = c.inline
    if c.blocks:
        doc["blocks"] = list(c.blocks)
    return doc


_INT_MAX = 1 << 62


def _int(v: Any, what: str, lo: int = 0, hi: int = _INT_MAX) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"manifest field {what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


_JUST_INT = {int}  # (bool, a subclass, is refused: type(), not isinstance())


def _ints(v: Any, what: str, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise ManifestError(f"manifest field {what} must be a list of at most {MAX_NDIM} integers")
    out = tuple(v)
    if not out or (set(map(type, out)) == _JUST_INT and lo <= min(out) and max(out) <= _INT_MAX):  # the usual case
        return out
    return tuple(_int(x, what, lo) for x in v)


def block_bytes_of(schema: int) -> int:
    """The target block size of a manifest schema: a reader checks `block_rows` against it."""
    return LEGACY_BLOCK_BYTES if schema < 4 else BLOCK_BYTES


def _parse_array(name: str, doc: Any, world: int, schema: int) -> ArrayEntry:
    if not isinstance(doc, dict):
        raise ManifestError(f"array {name!r} is not an object")
    _check_name(name)
    dtype = doc.get("data_type")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise ManifestError(f"array {name!r} has unsupported data_type {dtype!r}", path=name)
    shape = _ints(doc.get("shape"), f"{name}.shape")
    chunk_shape = _ints(doc.get("chunk_shape"), f"{name}.chunk_shape", lo=1)
    block_rows = _int(doc.get("block_rows", 0), f"{name}.block_rows", 0, chunk_shape[0] if chunk_shape else 0)
    geometry = _geometry(dtype, shape, chunk_shape, block_rows, schema)
    if geometry.problem:
        raise ManifestError(f"array {name!r}: {geometry.problem}", path=name)
    replicated = bool(doc.get("replicated"))
    if schema >= 3:
        head = _Head(name, dtype, shape, chunk_shape, replicated, block_rows, schema)
        return _with_runs(head, geometry, doc, world)
    return _with_listed(ArrayEntry(name, dtype, shape, chunk_shape, replicated, {}, (), block_rows, schema), doc, world)


_grid = functools.lru_cache(maxsize=1 << 12)(grid_shape)  # most arrays share their shapes


class _Geometry(NamedTuple):
    """What an array's type and shapes imply, checked: shared by the many arrays of a
    manifest that have the same ones (every layer of a model), so each is worked out once."""

    problem: str  # what is wrong with them ("" when nothing is)
    grid: tuple[int, ...]  # chunks along each dimension
    chunks: int | None  # chunks the writer runs cover (None: an empty array, at most one)


@functools.lru_cache(maxsize=1 << 12)
def _geometry(
    dtype: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], block_rows: int, schema: int
) -> _Geometry:
    """Of validated integers only (bool is refused before: True would share 1's entry)."""
    grid = _grid(shape, chunk_shape)
    item = ITEMSIZE[dtype]
    problem = ""
    if len(chunk_shape) != len(shape):
        problem = "chunk_shape and shape differ in rank"
    elif any(c > max(s, 1) for c, s in zip(chunk_shape, shape)):  # writers never chunk beyond the extent
        problem = f"chunk_shape {chunk_shape} exceeds the shape {shape}"
    elif math.prod(shape) * item > MAX_ARRAY_BYTES or math.prod(chunk_shape) * item > MAX_ARRAY_BYTES:
        problem = f"shape {shape} is absurdly large"
    elif block_rows != expected_block_rows(chunk_shape, item, block_bytes_of(schema)):
        problem = f"block_rows {block_rows} does not follow from its chunk shape"
    elif chunk_shape and math.prod(chunk_shape[1:]) * item > MAX_ROW_BYTES:
        problem = f"rows of {chunk_shape[1:]} are absurdly large"
    return _Geometry(problem, grid, math.prod(grid) if math.prod(shape) > 0 else None)


class _Head(NamedTuple):
    """An array's validated fields before its writers (schema 3): the ArrayEntry is made once, with them."""

    name: str
    data_type: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    replicated: bool
    block_rows: int
    schema: int


def _check_inline(name: str, inline: Any, dtype: str, shape: tuple[int, ...]) -> None:
    if not isinstance(inline, str) or len(inline) != 2 * ITEMSIZE[dtype] or math.prod(shape) != 1:
        raise ManifestError(f"array {name!r}: malformed inline value", path=name)
    try:
        bytes.fromhex(inline)
    except ValueError:
        raise ManifestError(f"array {name!r}: malformed inline value", path=name) from None


_MAX_RUN = 1 << 48  # chunks in one run: more than any real grid has; a larger count is crafted


@functools.lru_cache(maxsize=1 << 12)
def _writer_run(start: int, count: int, first: int, stride: int) -> WriterRun:
    """One object per run (immutable): most arrays of a manifest have the same few runs."""
    return WriterRun(start, count, first, stride)


def _refuse_run(name: str, run: Any, world: int) -> NoReturn:
    """ManifestError naming what is wrong with a writer run that the parse's one test refused."""
    if type(run) is not list or len(run) != 3:
        raise ManifestError(f"array {name!r}: a writer run is not [count, first, stride]", path=name)
    count = _int(run[0], f"{name}.writers count", 1, _MAX_RUN)
    first = _int(run[1], f"{name}.writers first", 0, world - 1)
    stride = _int(run[2], f"{name}.writers stride", 0, world)
    if first + stride * (count - 1) >= world:
        raise ManifestError(f"array {name!r}: a writer run goes beyond rank {world - 1}", path=name)
    raise AssertionError(f"writer run {run!r} of {name!r} refused without a reason")  # the test and these agree


def _with_runs(head: _Head, geometry: _Geometry, doc: dict[str, Any], world: int) -> ArrayEntry:
    """Schema 3: the writers as runs covering the grid in order, and an inline value."""
    name = head.name
    raw = doc.get("writers")
    if not isinstance(raw, list):
        raise ManifestError(f"array {name!r}: writers must be a list of runs", path=name)
    grid, want = geometry.grid, geometry.chunks
    runs: list[WriterRun] = []
    start = 0
    for run in raw:
        # The usual run in one test, without an error message made per field; else the
        # checks one by one, for the message.
        if type(run) is list and len(run) == 3:
            count, first, stride = run
            if (
                type(count) is int
                and type(first) is int
                and type(stride) is int
                and 1 <= count <= _MAX_RUN
                and 0 <= first
                and 0 <= stride <= world
                and first + stride * (count - 1) < world
            ):
                runs.append(_writer_run(start, count, first, stride))
                start += count
                continue
        _refuse_run(name, run, world)
    if (want is not None and start != want) or (want is None and start > 1):
        raise ManifestError(f"array {name!r}: writers do not cover the grid {list(grid)} exactly once", path=name)
    inline = doc.get("inline")
    digest: Any = ""
    if inline is not None:
        _check_inline(name, inline, head.data_type, head.shape)
        digest = doc.get("xxh3")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise ManifestError(f"array {name!r}: its inline value has a malformed xxh3", path=name)
    sharding = doc.get("sharding", {})
    if not isinstance(sharding, dict):
        raise ManifestError(f"array {name!r}: sharding must be an object", path=name)
    h = head  # built whole, not with dataclasses.replace: a third of a parse per array
    return ArrayEntry(
        name=h.name,
        data_type=h.data_type,
        shape=h.shape,
        chunk_shape=h.chunk_shape,
        replicated=h.replicated,
        sharding=sharding,
        block_rows=h.block_rows,
        schema=h.schema,
        runs=tuple(runs),
        inline=inline,
        inline_xxh3=digest,
    )


def check_chunk_digests(array: ArrayEntry, index: Any, digest: Any, blocks: Any) -> tuple[str, tuple[str, ...]]:
    """A chunk file's digests as a manifest (schemas 1-2) or a rank file (3) records them,
    validated: well-formed, as many blocks as the rule gives, and the xxh3 of the blocks'
    digests (schema 2 on)."""
    name = array.name
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise ManifestError(f"array {name!r}: chunk {index} has a malformed xxh3", path=name)
    if array.block_rows and not blocks:
        raise ManifestError(f"array {name!r}: chunk {index} lacks its block checksums", path=name)
    if blocks:
        want = -(-array.chunk_shape[0] // array.block_rows) if array.block_rows and array.shape else 0
        # (checked together, not a match per digest: a restore checks one per MiB)
        if (
            not isinstance(blocks, list)
            or len(blocks) != want
            or set(map(type, blocks)) != _JUST_STR
            or set(map(len, blocks)) != _JUST_16
            or not _HEXES.fullmatch("".join(blocks))
        ):
            raise ManifestError(f"array {name!r}: chunk {index} has malformed block checksums", path=name)
        if array.schema >= 2 and combine_blocks(blocks) != digest:
            raise ManifestError(f"array {name!r}: chunk {index}'s xxh3 does not match its blocks", path=name)
    return digest, tuple(blocks or ())


def _with_listed(head: ArrayEntry, doc: dict[str, Any], world: int) -> ArrayEntry:
    """Schemas 1-2: every chunk listed with its digests."""
    name, shape, chunk_shape = head.name, head.shape, head.chunk_shape
    grid = list(head.grid)
    chunks = []
    raw_chunks = doc.get("chunks")
    if not isinstance(raw_chunks, list):
        raise ManifestError(f"array {name!r}: chunks must be a list", path=name)
    for c in raw_chunks:
        if not isinstance(c, dict):
            raise ManifestError(f"array {name!r}: chunk is not an object", path=name)
        index = _ints(c.get("index"), f"{name}.chunk.index")
        if len(index) != len(shape) or any(i >= g for i, g in zip(index, grid)):
            raise ManifestError(f"array {name!r}: chunk index {index} is outside the grid {grid}", path=name)
        offsets = _ints(c.get("offsets"), f"{name}.chunk.offsets")
        cshape = _ints(c.get("shape"), f"{name}.chunk.shape")
        expect_off = tuple(i * k for i, k in zip(index, chunk_shape))
        expect_shape = tuple(min(k, s - o) for k, s, o in zip(chunk_shape, shape, expect_off))
        if offsets != expect_off or cshape != expect_shape:
            raise ManifestError(f"array {name!r}: chunk {index} has an inconsistent region", path=name)
        inline = c.get("inline")
        nbytes = _int(c.get("nbytes"), f"{name}.chunk.nbytes")
        if inline is None and nbytes != head.chunk_bytes:
            raise ManifestError(f"array {name!r}: chunk {index} nbytes {nbytes} != {head.chunk_bytes}", path=name)
        if inline is not None:
            _check_inline(name, inline, head.data_type, shape)
            if nbytes:
                raise ManifestError(f"array {name!r}: malformed inline value", path=name)
            digest, blocks = c.get("xxh3"), tuple[str, ...]()
            if not isinstance(digest, str) or not _HEX64.match(digest):
                raise ManifestError(f"array {name!r}: chunk {index} has a malformed xxh3", path=name)
            if c.get("blocks"):
                raise ManifestError(f"array {name!r}: chunk {index} has malformed block checksums", path=name)
        else:
            digest, blocks = check_chunk_digests(head, index, c.get("xxh3"), c.get("blocks", []))
        writer = _int(c.get("writer"), "writer", 0, world - 1)
        chunks.append(ChunkEntry(index, writer, offsets, cshape, nbytes, digest, inline, blocks))
    seen = {c.index for c in chunks}
    numel: int = math.prod(shape)
    if len(seen) != len(chunks) or (numel > 0 and len(seen) != math.prod(grid)):
        raise ManifestError(f"array {name!r}: chunks do not cover the grid {grid} exactly once", path=name)
    regions = doc.get("regions", [])
    if not isinstance(regions, list) or not all(
        isinstance(r, dict)
        and all(
            isinstance(v, list) and all(type(x) is int for x in v)
            for v in (r.get("offsets"), r.get("ranks"), r.get("shape", []))
        )
        for r in regions
    ):
        raise ManifestError(f"array {name!r}: regions must be a list of region objects", path=name)
    summary = Sharding.of((r["offsets"], r.get("shape", []), r["ranks"]) for r in regions).to_json()
    return dataclasses.replace(head, sharding={**summary, "regions": regions}, listed=tuple(chunks))


def rng_ok(rng: Any) -> bool:
    """Whether an RNG state has the shape ckpt.rng restores (validated before use)."""
    py, npst = (rng.get("python"), rng.get("numpy")) if isinstance(rng, dict) else (None, None)
    return (
        isinstance(py, dict)
        and isinstance(py.get("state"), list)
        and len(py["state"]) == 625
        and all(type(x) is int for x in py["state"])
        and isinstance(npst, dict)
        and isinstance(npst.get("keys"), str)
        and isinstance(npst.get("pos"), int)
        and isinstance(rng.get("torch"), str)
        and isinstance(rng.get("cuda", []), list)
    )


_CHECKSUM_TAIL = re.compile(rb',"manifest_xxh3":"([0-9a-f]{16})"\}')
_CHECKSUM_TAIL_BYTES = 36  # the member as with_checksum writes it, and the closing brace


def with_checksum(body: bytes) -> bytes:
    """A JSON object with its own checksum as the last member: `manifest_xxh3` is the
    xxh3_64 of the document as it reads without that member (`body`)."""
    if not body.endswith(b"}") or body == b"{}":
        raise ValueError("with_checksum needs a non-empty JSON object")
    return body[:-1] + b',"manifest_xxh3":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'"}'


def _check_checksum(raw: bytes, doc: dict[str, Any], schema: int) -> None:
    """Refuse a manifest whose bytes changed since it was written. Every schema-2 manifest
    is written with `manifest_xxh3`; only schema 1 (written before ckpt recorded it) may
    lack it, and is read as it is."""
    if "manifest_xxh3" not in doc:
        if schema >= 2:
            raise ManifestError("manifest lacks its manifest_xxh3 checksum (schema 2 always has one)")
        return
    m = _CHECKSUM_TAIL.fullmatch(raw[-_CHECKSUM_TAIL_BYTES:])
    if m is None:
        raise ManifestError("manifest's manifest_xxh3 is not its last member as written, or is malformed")
    hasher = xxhash.xxh3_64(memoryview(raw)[:-_CHECKSUM_TAIL_BYTES])  # the document without it,
    hasher.update(b"}")  # closed where the member began
    got = hasher.hexdigest()
    if got != m.group(1).decode():
        raise ManifestError(f"manifest fails its checksum (xxh3 {got}, recorded {m.group(1).decode()})")


def parse_manifest(raw: bytes) -> Manifest:
    """Parse and validate; raises ManifestError on anything a reader should not act on."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"manifest is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("format") != "ckpt":
        raise ManifestError("not a ckpt manifest")
    schema = doc.get("schema_version")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        raise UnsupportedSchemaError(
            f"manifest schema_version {schema!r} is not supported (this ckpt reads {READABLE_SCHEMAS})"
        )
    _check_checksum(raw, doc, schema)
    save_id = doc.get("save_id")
    if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
        raise ManifestError(f"manifest save_id {str(save_id)[:40]!r} is not 32 hex digits")
    world = _int(doc.get("world_size"), "world_size", 1, MAX_WORLD)
    arrays_doc = doc.get("arrays")
    ranks_doc = doc.get("ranks")
    roots_doc = doc.get("roots")
    trees = doc.get("trees") if schema < 3 else {}
    if not isinstance(arrays_doc, dict) or not isinstance(trees, dict) or not isinstance(ranks_doc, list):
        raise ManifestError("manifest lacks arrays, trees or ranks")
    arrays = {name: _parse_array(name, a, world, schema) for name, a in arrays_doc.items()}
    if trees:
        types = {name: a.data_type for name, a in arrays.items()}
        problem = next((p for p in (tree_problem(t, types) for t in trees.values()) if p is not None), None)
        if problem is not None:
            raise ManifestError(f"a state tree of the manifest holds {problem}")
    ranks = _parse_ranks(ranks_doc, trees, world) if schema < 3 else ()
    rank_files = _parse_rank_refs(ranks_doc, world) if schema >= 3 else ()
    if not isinstance(roots_doc, list) or not all(isinstance(r, list) for r in roots_doc):
        raise ManifestError("manifest roots must be a list of rank lists")
    roots = tuple(tuple(_int(x, "roots", 0, world - 1) for x in r) for r in roots_doc)
    created = doc.get("created", 0.0)
    if not (isinstance(created, float) or (type(created) is int and abs(created) < _INT_MAX)):
        created = 0.0  # (a crafted integer beyond a float's range raises in float())
    return Manifest(
        step=_int(doc.get("step"), "step"),
        save_id=save_id,
        created=float(created),
        world_size=world,
        arrays=arrays,
        trees=trees,
        ranks=ranks,
        roots=roots,
        meta=doc["meta"] if isinstance(doc.get("meta"), dict) else {},
        schema_version=schema,
        rank_files=rank_files,
    )


def _parse_ranks(ranks_doc: list[Any], trees: dict[str, Any], world: int) -> tuple[RankEntry, ...]:
    """Schemas 1-2: each rank's tree key, RNG, host and root."""
    ranks = []
    for r in ranks_doc:
        if not isinstance(r, dict) or not isinstance(r.get("tree"), str) or r.get("tree") not in trees:
            raise ManifestError("manifest rank entry is malformed")
        rng = r.get("rng")
        if rng is not None and not rng_ok(rng):
            raise ManifestError(f"manifest rank {r.get('rank')!r} has a malformed RNG state")
        ranks.append(
            RankEntry(
                _int(r.get("rank"), "rank", 0, world - 1),
                r["tree"],
                rng if isinstance(rng, dict) else None,
                str(r.get("host", "")),
                _int(r.get("root", 0), "root"),
            )
        )
    if len(ranks) != world or [r.rank for r in ranks] != list(range(world)):
        raise ManifestError("manifest must have one rank entry per rank, in order")
    return tuple(ranks)


def _parse_rank_refs(ranks_doc: list[Any], world: int) -> tuple[RankRef, ...]:
    """Schema 3: each rank file's size and xxh3, in rank order."""
    if len(ranks_doc) != world:
        raise ManifestError(f"manifest must reference one rank file per rank ({world}), not {len(ranks_doc)}")
    refs = []
    for r in ranks_doc:
        if not isinstance(r, list) or len(r) != 2 or not isinstance(r[1], str) or not _HEX64.match(r[1]):
            raise ManifestError("manifest rank file reference is not [size, xxh3]")
        refs.append(RankRef(_int(r[0], "rank file size", 2, MAX_RANK_FILE), r[1]))
    return tuple(refs)
