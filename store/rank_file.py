"""Rank files (schema 3): what one rank of a save contributes beyond its chunk files.

`ranks/<rank>.json` in the version directory holds the rank's JSON state tree, its RNG
state, its provenance and the digests of the chunks it wrote. It lies beside the rank's
chunks (on its root; replicas and the remote copy it with them), and the manifest covers
it by size and xxh3, so the manifest stays O(arrays + ranks) while a restoring rank reads
only the rank files of the chunks it reads. A rank file that is missing, short or fails
its checksum is a damaged copy like a damaged chunk: the reader takes another tier's copy.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import xxhash

from ckpt.store.chunk_read import open_checked, read_exact
from ckpt.store.errors import CorruptVersionError, ManifestError
from ckpt.store.manifest import ArrayEntry, ChunkEntry, Manifest, check_chunk_digests, rng_ok
from ckpt.store.tier import Tier, join_key
from ckpt.store.tree_format import tree_problem
from ckpt.store.versions import version_dirname

__all__ = [
    "RANKS_DIR",
    "RankFile",
    "RankFiles",
    "parse_rank_file",
    "rank_file_bytes",
    "rank_file_path",
    "read_rank_file",
    "read_rank_file_raw",
]

RANKS_DIR = "ranks"
RANK_FORMAT = "ckpt-rank"

Digests = tuple[str, tuple[str, ...]]  # a chunk file's xxh3 and its block digests


def rank_file_path(rank: int) -> str:
    """Relative to the version directory."""
    return f"{RANKS_DIR}/{rank}.json"


@dataclass(frozen=True)
class RankFile:
    rank: int
    host: str
    root: int  # index of the root group the rank wrote to
    tree: Any  # its JSON state tree
    rng: dict[str, Any] | None
    provenance: dict[str, Any]
    digests: dict[str, dict[int, Digests]]  # by array, by flat grid index: the chunks it wrote


def rank_file_bytes(
    *,
    step: int,
    save_id: str,
    rank: int,
    host: str,
    root: int,
    tree: Any,
    rng: dict[str, Any] | None,
    provenance: dict[str, Any],
    chunks: dict[str, list[tuple[int, str, tuple[str, ...]]]],
) -> bytes:
    """The file's bytes. `chunks`: per array, (flat grid index, xxh3, block digests) of each chunk file."""
    doc = {
        "format": RANK_FORMAT,
        "schema_version": 3,
        "step": step,
        "save_id": save_id,
        "rank": rank,
        "host": host,
        "root": root,
        "provenance": provenance,
        "rng": rng,
        "tree": tree,
        "chunks": {
            name: [[flat, digest, list(blocks)] if blocks else [flat, digest] for flat, digest, blocks in entries]
            for name, entries in chunks.items()
        },
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def parse_rank_file(raw: bytes, manifest: Manifest, rank: int) -> RankFile:
    """Parse and validate against the manifest (the caller checked size and xxh3 first):
    ManifestError on anything a reader should not act on."""
    where = rank_file_path(rank)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where} is not valid JSON: {str(e)[:200]}", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != RANK_FORMAT or doc.get("schema_version") != 3:
        raise ManifestError(f"{where} is not a ckpt rank file of schema 3", path=where)
    if (doc.get("step"), doc.get("save_id"), doc.get("rank")) != (manifest.step, manifest.save_id, rank):
        raise ManifestError(f"{where} belongs to another save or rank", path=where)
    rng = doc.get("rng")
    if rng is not None and not rng_ok(rng):
        raise ManifestError(f"{where} has a malformed RNG state", path=where)
    root = doc.get("root", 0)
    if type(root) is not int or root < 0:
        raise ManifestError(f"{where} has a malformed root index", path=where)
    chunks = doc.get("chunks")
    if not isinstance(chunks, dict):
        raise ManifestError(f"{where}: chunks must be an object", path=where)
    digests: dict[str, dict[int, Digests]] = {}
    for name, entries in chunks.items():
        array = manifest.arrays.get(name)
        if array is None or not isinstance(entries, list):
            raise ManifestError(f"{where} lists chunks of {name!r}, which the manifest lacks", path=where)
        mine: dict[int, Digests] = {}
        for entry in entries:
            if not isinstance(entry, list) or len(entry) not in (2, 3) or type(entry[0]) is not int:
                raise ManifestError(f"{where}: a chunk of {name!r} is not [index, xxh3, blocks?]", path=where)
            flat = entry[0]
            if not 0 <= flat < array.chunk_count or array.inline is not None or array.writer_of(flat) != rank:
                raise ManifestError(f"{where}: {name!r} chunk {flat} is not one rank {rank} wrote", path=where)
            mine[flat] = check_chunk_digests(array, flat, entry[1], entry[2] if len(entry) == 3 else [])
        digests[name] = mine
    tree = doc.get("tree")
    problem = tree_problem(tree, {name: a.data_type for name, a in manifest.arrays.items()})
    if problem is not None:
        raise ManifestError(f"{where}: its state tree holds {problem}", path=where)
    provenance = doc.get("provenance")
    return RankFile(
        rank,
        str(doc.get("host", "")),
        root,
        tree,
        rng if isinstance(rng, dict) else None,
        provenance if isinstance(provenance, dict) else {},
        digests,
    )


def read_rank_file_raw(tier: Tier, step: int, manifest: Manifest, rank: int) -> bytes:
    """Rank `rank`'s file from `tier`, checked against the manifest's size and xxh3.
    CorruptVersionError (with both digests, so a re-read may cure it) if it is damaged,
    TierUnavailableError if it cannot be read."""
    if not 0 <= rank < len(manifest.rank_files):
        raise CorruptVersionError(f"step {step} has no rank {rank}")
    ref = manifest.rank_files[rank]
    key = join_key(version_dirname(step), rank_file_path(rank))
    where = f"{tier.location}/{key}"
    handle = open_checked(tier, key, ref.size, ref.xxh3, "rank file")
    try:
        raw = bytearray(ref.size)
        read_exact(handle, memoryview(raw), 0, where)
    finally:
        handle.close()
    got = xxhash.xxh3_64_hexdigest(raw)
    if got != ref.xxh3:
        raise CorruptVersionError(
            f"rank file {where} fails its checksum (xxh3 {got}, manifest {ref.xxh3})",
            path=where,
            expected=ref.xxh3,
            actual=got,
        )
    return bytes(raw)


def read_rank_file(tier: Tier, step: int, manifest: Manifest, rank: int) -> RankFile:
    """Rank `rank`'s file from `tier`, verified and parsed (see read_rank_file_raw)."""
    return parse_rank_file(read_rank_file_raw(tier, step, manifest, rank), manifest, rank)


class RankFiles:
    """The rank files of one tier's copies, each read once (thread-safe): what resolves a
    schema-3 chunk's digests. Failures are not kept: a read that failed is tried again."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._files: dict[tuple[str, int], RankFile] = {}

    def get(self, step: int, manifest: Manifest, rank: int) -> RankFile:
        key = (manifest.save_id, rank)
        found = self._files.get(key)  # (a dict read is atomic: no lock, once per chunk read)
        if found is None:
            found = read_rank_file(self.tier, step, manifest, rank)
            with self._lock:
                self._files[key] = found
        return found

    def resolve(self, step: int, manifest: Manifest, array: ArrayEntry, chunk: ChunkEntry) -> ChunkEntry:
        """`chunk` with its digests: as it is where the manifest lists them (schemas 1-2,
        inline values), else from its writer's rank file on this tier."""
        if chunk.resolved:
            return chunk
        got = self.get(step, manifest, chunk.writer).digests.get(array.name, {}).get(array.flat(chunk.index))
        if got is None:
            raise CorruptVersionError(
                f"{self.tier.location}/{version_dirname(step)}/{rank_file_path(chunk.writer)} lacks the digests "
                f"of {array.name} chunk {list(chunk.index)}",
                path=array.path,
            )
        c = chunk  # built whole: dataclasses.replace costs more, once per chunk read
        return ChunkEntry(c.index, c.writer, c.offsets, c.shape, c.nbytes, got[0], c.inline, got[1])
