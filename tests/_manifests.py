"""Crafted manifests for tests: a document edited by a test, written as ckpt writes one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from ckpt.store.digest import chunk_digest
from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.layout import LEGACY_BLOCK_BYTES, block_rows
from ckpt.store.manifest import parse_manifest, with_checksum


def crafted(doc: dict[str, Any]) -> bytes:
    """`doc` serialized with a valid `manifest_xxh3` (recomputed), as a hostile writer could:
    what a reader then refuses, it refuses for the edit, not for the checksum."""
    body = {k: v for k, v in doc.items() if k != "manifest_xxh3"}
    return with_checksum(json.dumps(body, separators=(",", ":")).encode())


def legacy(doc: dict[str, Any]) -> bytes:
    """`doc` as written before ckpt recorded `manifest_xxh3` (no checksum member)."""
    return json.dumps({k: v for k, v in doc.items() if k != "manifest_xxh3"}).encode()


def rank_docs(version: Path) -> list[dict[str, Any]]:
    """The rank files of a version directory (schema 3), in rank order."""
    doc = json.loads((version / "manifest.json").read_bytes())
    return [json.loads((version / "ranks" / f"{r}.json").read_bytes()) for r in range(len(doc["ranks"]))]


def chunk_digests(version: Path) -> dict[str, dict[int, list[Any]]]:
    """Per array, per flat grid index: [xxh3, blocks] of each chunk file, from the rank files."""
    out: dict[str, dict[int, list[Any]]] = {}
    for rank in rank_docs(version):
        for name, entries in rank["chunks"].items():
            for e in entries:
                out.setdefault(name, {})[e[0]] = [e[1], e[2] if len(e) == 3 else []]
    return out


def as_schema_3(version: Path) -> None:
    """Rewrite a version directory (schema 4) as ckpt wrote schema 3: the same files, their
    digests over ~4 MiB blocks (LEGACY_BLOCK_BYTES), recomputed here from the chunk files."""
    manifest = parse_manifest((version / "manifest.json").read_bytes())
    doc = json.loads((version / "manifest.json").read_bytes())
    rows: dict[str, int] = {}
    for name, a in doc["arrays"].items():
        rows[name] = block_rows(a["chunk_shape"], ITEMSIZE[a["data_type"]], LEGACY_BLOCK_BYTES)
        a["block_rows"] = rows[name]
    paths = {
        (name, array.flat(chunk.index)): version / array.chunk_path(chunk)
        for name, array in manifest.arrays.items()
        for chunk in array.iter_chunks()
    }
    ranks = rank_docs(version)
    raws = []
    for rank in ranks:
        for name, entries in rank["chunks"].items():
            a = doc["arrays"][name]
            block_bytes = rows[name] * ITEMSIZE[a["data_type"]] * _prod(a["chunk_shape"][1:])
            for i, e in enumerate(entries):
                data = paths[name, e[0]].read_bytes()
                xxh3 = chunk_digest(data, block_bytes)
                blocks = [] if not block_bytes or len(data) <= block_bytes else _blocks(data, block_bytes)
                entries[i] = [e[0], xxh3, blocks] if blocks else [e[0], xxh3]
        raws.append(json.dumps(rank, separators=(",", ":")).encode())
    for r, raw in enumerate(raws):
        (version / "ranks" / f"{r}.json").write_bytes(raw)
    doc["ranks"] = [[len(raw), xxhash.xxh3_64_hexdigest(raw)] for raw in raws]
    (version / "manifest.json").write_bytes(crafted({**doc, "schema_version": 3}))


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _blocks(data: bytes, block_bytes: int) -> list[str]:
    return [xxhash.xxh3_64_hexdigest(data[i : i + block_bytes]) for i in range(0, len(data), block_bytes)]


def as_schema_2(version: Path) -> None:
    """Rewrite a version directory as ckpt wrote schema 2: every chunk listed in the
    manifest with its digests (over ~4 MiB blocks, as schema 3), the trees and RNG there,
    no rank files."""
    as_schema_3(version)
    doc = json.loads((version / "manifest.json").read_bytes())
    ranks = rank_docs(version)
    digests = chunk_digests(version)
    trees: dict[str, Any] = {}
    rank_entries = []
    for r, rank in enumerate(ranks):
        key = f"t{r}"
        trees[key] = rank["tree"]
        rank_entries.append({"rank": r, "tree": key, "rng": rank["rng"], "host": rank["host"], "root": rank["root"]})
    arrays = {}
    for name, a in doc["arrays"].items():
        grid = [-(-s // c) for s, c in zip(a["shape"], a["chunk_shape"])]
        writers = [first + stride * k for count, first, stride in a["writers"] for k in range(count)]
        chunks = []
        for flat, writer in enumerate(writers):
            index, rest = [], flat
            for g in reversed(grid):
                rest, i = divmod(rest, g) if g else (rest, 0)
                index.append(i)
            index.reverse()
            offsets = [i * c for i, c in zip(index, a["chunk_shape"])]
            shape = [min(c, s - o) for c, s, o in zip(a["chunk_shape"], a["shape"], offsets)]
            entry: dict[str, Any] = {"index": index, "writer": writer, "offsets": offsets, "shape": shape}
            if "inline" in a:
                entry.update(nbytes=0, xxh3=a["xxh3"], inline=a["inline"])
            else:
                itemsize = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2}
                item = itemsize.get(a["data_type"], 8 if "64" in a["data_type"] else 4)
                nbytes = item
                for c in a["chunk_shape"]:
                    nbytes *= c
                xxh3, blocks = digests[name][flat]
                entry.update(nbytes=nbytes, xxh3=xxh3)
                if blocks:
                    entry["blocks"] = blocks
            chunks.append(entry)
        arrays[name] = {
            "data_type": a["data_type"],
            "shape": a["shape"],
            "chunk_shape": a["chunk_shape"],
            "replicated": a["replicated"],
            "regions": [],
            "block_rows": a["block_rows"],
            "chunks": chunks,
        }
    old = {**doc, "schema_version": 2, "ranks": rank_entries, "trees": trees, "arrays": arrays}
    (version / "manifest.json").write_bytes(crafted(old))
    for f in (version / "ranks").iterdir():
        f.unlink()
    (version / "ranks").rmdir()


def edit_rank_file(version: Path, rank: int, fn: Callable[[dict[str, Any]], None]) -> None:
    """Edit `ranks/<rank>.json` and make the manifest vouch for the result."""
    doc = json.loads((version / "ranks" / f"{rank}.json").read_bytes())
    fn(doc)
    vouch_rank_file(version, rank, json.dumps(doc, separators=(",", ":")).encode())


def vouch_rank_file(version: Path, rank: int, raw: bytes) -> None:
    """Write `raw` as `ranks/<rank>.json` with the manifest vouching for it (its size and
    xxh3, the manifest's checksum recomputed), as a hostile writer could."""
    (version / "ranks" / f"{rank}.json").write_bytes(raw)
    manifest = json.loads((version / "manifest.json").read_bytes())
    manifest["ranks"][rank] = [len(raw), xxhash.xxh3_64_hexdigest(raw)]
    (version / "manifest.json").write_bytes(crafted(manifest))
