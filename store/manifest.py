"""The manifest: a versioned JSON document that is the contract of a committed version.

It lists every array (dtype, global shape, chunk grid, which rank wrote each chunk and
its xxh3), each rank's non-tensor state as a JSON tree, and provenance. Parsing
validates everything a reader will act on, before any file is opened or any buffer
is allocated: schema version, array names (so no path can leave the version),
dtypes, shapes and byte counts.
"""

from __future__ import annotations

import functools
import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckpt.store.digest import combine_blocks
from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.errors import CorruptVersionError, ManifestError, UnsupportedSchemaError
from ckpt.store.layout import CHUNK_SEPARATOR, chunk_file
from ckpt.store.layout import block_rows as expected_block_rows

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "ROOT_INFO_NAME",
    "SAVE_ID",
    "ChunkEntry",
    "ArrayEntry",
    "RankEntry",
    "Manifest",
    "escape_component",
    "keys_of",
    "parse_manifest",
    "with_checksum",
]

# 2: "." chunk keys; a blocked chunk's xxh3 is the digest of its block digests (store/digest.py)
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MANIFEST_NAME = "manifest.json"
ROOT_INFO_NAME = "root.json"
STATE_PREFIX = "state"
MAX_ARRAY_BYTES = 1 << 48  # 256 TiB: anything larger is a crafted manifest
MAX_NDIM = 32
MAX_ROW_BYTES = 1 << 30  # one row of a chunk is the smallest unit a reader buffers
MAX_COMPONENT = 128  # characters of one array path component (file names stop at 255 bytes)
_RESERVED = frozenset({"zarr.json"})  # names a group directory holds besides its children
_COMPONENT = re.compile(r"^[A-Za-z0-9_.~%+-]+$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
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
    parts = name.split("/")
    for p in parts:
        if not _COMPONENT.match(p) or p in (".", "..") or p.startswith("__"):
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
    xxh3: str  # xxh3_64 hex of the file's bytes (or of the inline value)
    inline: str | None = None  # little-endian value bytes as hex, for single-element arrays
    blocks: tuple[str, ...] = ()  # xxh3_64 of each block of `block_rows` rows, when more than one


@dataclass(frozen=True, slots=True)
class ArrayEntry:
    name: str  # escaped components joined by '/'; the zarr path is state/<name>
    data_type: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    replicated: bool
    regions: tuple[dict[str, Any], ...]  # {"offsets", "shape", "ranks"}: how ranks held it at save
    chunks: tuple[ChunkEntry, ...]
    block_rows: int = 0  # rows of dim 0 per checksummed block (0: the chunk is one block)
    schema: int = SCHEMA_VERSION  # of the manifest it came from: chunk keys and digests changed in 2

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
        if not chunk.blocks or self.schema < 2:
            return 0
        return self.block_rows * math.prod(self.chunk_shape[1:]) * ITEMSIZE[self.data_type]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.data_type]

    def chunk_at(self, index: tuple[int, ...]) -> ChunkEntry:
        """The chunk at a grid index (chunks are validated to cover the grid once, in grid order)."""
        flat = 0
        for i, s, c in zip(index, self.shape, self.chunk_shape):
            flat = flat * -(-s // c) + i
        if flat < len(self.chunks) and self.chunks[flat].index == index:
            return self.chunks[flat]
        for entry in self.chunks:  # a manifest listing them in another order
            if entry.index == index:
                return entry
        raise CorruptVersionError(f"{self.name} has no chunk {list(index)}", path=self.path)


@dataclass(frozen=True, slots=True)
class RankEntry:
    rank: int
    tree: str  # key into Manifest.trees
    rng: dict[str, Any] | None
    host: str
    root: int  # index of the root group (filesystem) the rank wrote to


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    save_id: str
    created: float
    world_size: int
    arrays: dict[str, ArrayEntry]
    trees: dict[str, Any]
    ranks: tuple[RankEntry, ...]
    roots: tuple[tuple[int, ...], ...]  # per root group: the ranks whose chunks it holds
    meta: dict[str, Any] = field(default_factory=dict)  # provenance, timings
    schema_version: int = SCHEMA_VERSION  # kept when an older version is copied

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for a in self.arrays.values() for c in a.chunks)

    @property
    def keys(self) -> tuple[str, ...] | None:
        """The top-level keys of the saved state (meta "keys"); None where not recorded
        (versions of older ckpts, which always held the whole state)."""
        return keys_of(self.meta.get("keys"))

    def to_json(self) -> bytes:
        doc = {
            "format": "ckpt",
            "schema_version": self.schema_version,
            "step": self.step,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "roots": [list(r) for r in self.roots],
            "meta": self.meta,
            "ranks": [
                {"rank": r.rank, "tree": r.tree, "rng": r.rng, "host": r.host, "root": r.root} for r in self.ranks
            ],
            "trees": self.trees,
            "arrays": {
                name: {
                    "data_type": a.data_type,
                    "shape": list(a.shape),
                    "chunk_shape": list(a.chunk_shape),
                    "replicated": a.replicated,
                    "regions": list(a.regions),
                    "block_rows": a.block_rows,
                    "chunks": [_chunk_doc(c) for c in a.chunks],
                }
                for name, a in self.arrays.items()
            },
        }
        return with_checksum(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())


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


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"manifest field {what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _ints(v: Any, what: str, lo: int = 0) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise ManifestError(f"manifest field {what} must be a list of at most {MAX_NDIM} integers")
    return tuple(_int(x, what, lo) for x in v)


def _parse_array(name: str, doc: Any, world: int, schema: int) -> ArrayEntry:
    if not isinstance(doc, dict):
        raise ManifestError(f"array {name!r} is not an object")
    _check_name(name)
    dtype = doc.get("data_type")
    if dtype not in ITEMSIZE:
        raise ManifestError(f"array {name!r} has unsupported data_type {dtype!r}", path=name)
    shape = _ints(doc.get("shape"), f"{name}.shape")
    chunk_shape = _ints(doc.get("chunk_shape"), f"{name}.chunk_shape", lo=1)
    if len(chunk_shape) != len(shape):
        raise ManifestError(f"array {name!r}: chunk_shape and shape differ in rank", path=name)
    if any(c > max(s, 1) for c, s in zip(chunk_shape, shape)):  # writers never chunk beyond the extent
        raise ManifestError(f"array {name!r}: chunk_shape {chunk_shape} exceeds the shape {shape}", path=name)
    if (
        math.prod(shape) * ITEMSIZE[dtype] > MAX_ARRAY_BYTES
        or math.prod(chunk_shape) * ITEMSIZE[dtype] > MAX_ARRAY_BYTES
    ):
        raise ManifestError(f"array {name!r}: shape {shape} is absurdly large", path=name)
    chunk_bytes = math.prod(chunk_shape) * ITEMSIZE[dtype]
    block_rows = _int(doc.get("block_rows", 0), f"{name}.block_rows", 0, chunk_shape[0] if chunk_shape else 0)
    if block_rows != expected_block_rows(chunk_shape, ITEMSIZE[dtype]):
        raise ManifestError(f"array {name!r}: block_rows {block_rows} does not follow from its chunk shape", path=name)
    if chunk_shape and math.prod(chunk_shape[1:]) * ITEMSIZE[dtype] > MAX_ROW_BYTES:
        raise ManifestError(f"array {name!r}: rows of {chunk_shape[1:]} are absurdly large", path=name)
    grid = [math.ceil(s / c) for s, c in zip(shape, chunk_shape)]
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
        if inline is None and nbytes != chunk_bytes:
            raise ManifestError(f"array {name!r}: chunk {index} nbytes {nbytes} != {chunk_bytes}", path=name)
        if inline is not None:
            if not isinstance(inline, str) or len(inline) != 2 * ITEMSIZE[dtype] or math.prod(shape) != 1 or nbytes:
                raise ManifestError(f"array {name!r}: malformed inline value", path=name)
            try:
                bytes.fromhex(inline)
            except ValueError:
                raise ManifestError(f"array {name!r}: malformed inline value", path=name) from None
        digest = c.get("xxh3")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise ManifestError(f"array {name!r}: chunk {index} has a malformed xxh3", path=name)
        blocks = c.get("blocks", [])
        if block_rows and not blocks and inline is None:
            raise ManifestError(f"array {name!r}: chunk {index} lacks its block checksums", path=name)
        if blocks:
            want = -(-chunk_shape[0] // block_rows) if block_rows and shape else 0
            if (
                not isinstance(blocks, list)
                or len(blocks) != want
                or not all(isinstance(b, str) and _HEX64.match(b) for b in blocks)
            ):
                raise ManifestError(f"array {name!r}: chunk {index} has malformed block checksums", path=name)
            if schema >= 2 and combine_blocks(blocks) != digest:
                raise ManifestError(f"array {name!r}: chunk {index}'s xxh3 does not match its blocks", path=name)
        writer = _int(c.get("writer"), "writer", 0, world - 1)
        chunks.append(ChunkEntry(index, writer, offsets, cshape, nbytes, digest, inline, tuple(blocks)))
    seen = {c.index for c in chunks}
    numel: int = math.prod(shape)
    if len(seen) != len(chunks) or (numel > 0 and len(seen) != math.prod(grid)):
        raise ManifestError(f"array {name!r}: chunks do not cover the grid {grid} exactly once", path=name)
    regions = doc.get("regions", [])
    if not isinstance(regions, list) or not all(
        isinstance(r, dict) and isinstance(r.get("offsets"), list) and isinstance(r.get("ranks"), list) for r in regions
    ):
        raise ManifestError(f"array {name!r}: regions must be a list of region objects", path=name)
    replicated = bool(doc.get("replicated"))
    return ArrayEntry(name, dtype, shape, chunk_shape, replicated, tuple(regions), tuple(chunks), block_rows, schema)


def _rng_ok(rng: Any) -> bool:
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
    world = _int(doc.get("world_size"), "world_size", 1, 1 << 24)
    arrays_doc = doc.get("arrays")
    trees = doc.get("trees")
    ranks_doc = doc.get("ranks")
    roots_doc = doc.get("roots")
    if not isinstance(arrays_doc, dict) or not isinstance(trees, dict) or not isinstance(ranks_doc, list):
        raise ManifestError("manifest lacks arrays, trees or ranks")
    arrays = {name: _parse_array(name, a, world, schema) for name, a in arrays_doc.items()}
    ranks = []
    for r in ranks_doc:
        if not isinstance(r, dict) or r.get("tree") not in trees:
            raise ManifestError("manifest rank entry is malformed")
        rng = r.get("rng")
        if rng is not None and not _rng_ok(rng):
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
    if not isinstance(roots_doc, list) or not all(isinstance(r, list) for r in roots_doc):
        raise ManifestError("manifest roots must be a list of rank lists")
    roots = tuple(tuple(_int(x, "roots", 0, world - 1) for x in r) for r in roots_doc)
    created = doc.get("created", 0.0)
    return Manifest(
        step=_int(doc.get("step"), "step"),
        save_id=save_id,
        created=float(created) if isinstance(created, (int, float)) else 0.0,
        world_size=world,
        arrays=arrays,
        trees=trees,
        ranks=tuple(ranks),
        roots=roots,
        meta=doc["meta"] if isinstance(doc.get("meta"), dict) else {},
        schema_version=schema,
    )
