"""Zarr v3 metadata documents (`zarr.json`) for the arrays and groups of a version.

Chunk bytes are written directly (store.fsio) as the uncompressed `bytes` codec,
little-endian, C order, default chunk keys with the "." separator: exactly what zarr-python and
tensorstore read. Single-element arrays carry their value as `fill_value` and have
no chunk file.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.fsio import DIR_MODE, fsync_files, write_new
from ckpt.store.layout import CHUNK_SEPARATOR
from ckpt.store.manifest import ArrayEntry

__all__ = [
    "ArrayNode",
    "DOCUMENT_FORMAT",
    "array_document",
    "documents",
    "group_paths",
    "write_documents",
    "write_hierarchy",
]

_INT_TYPES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def _fill_value(data_type: str, inline: str | None) -> Any:
    dt = data_type
    if dt == "bool":
        return bool(inline and bytes.fromhex(inline)[0])
    if dt in _INT_TYPES:
        if inline is None:
            return 0
        return int.from_bytes(bytes.fromhex(inline), "little", signed=dt.startswith("int"))
    if dt.startswith("complex"):
        return [0.0, 0.0]
    if inline is None:
        return 0.0
    # zarr v3: a float fill_value may be the hex of its IEEE bits, which keeps NaN payloads exact.
    return "0x" + bytes.fromhex(inline)[::-1].hex()


@dataclass(frozen=True)
class ArrayNode:
    """What an array's zarr.json says: known at save time, except an inline value."""

    path: str  # relative to the version directory, e.g. "state/model/wte.weight"
    data_type: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inline: str | None = None  # hex of a single-element array's value (its fill_value)
    separator: str = CHUNK_SEPARATOR  # of the chunk keys

    @staticmethod
    def of(entry: ArrayEntry) -> ArrayNode:
        inline = entry.single_inline
        return ArrayNode(
            entry.path, entry.data_type, tuple(entry.shape), tuple(entry.chunk_shape), inline, entry.separator
        )


def array_document(node: ArrayNode, attributes: dict[str, Any]) -> dict[str, Any]:
    codec: dict[str, Any] = {"name": "bytes"}
    if ITEMSIZE[node.data_type] > 1:
        codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(node.shape),
        "data_type": node.data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(node.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": node.separator}},
        "fill_value": _fill_value(node.data_type, node.inline),
        "codecs": [codec],
        "attributes": attributes,
        "storage_transformers": [],
    }


DOCUMENT_FORMAT = json.dumps(array_document(ArrayNode("a/b", "float32", (3, 2), (2, 2)), {})).encode()
"""What this code writes as an array's zarr.json, by example: part of a save layout's key
(ckpt._plan.layout_key), so a spare tree's documents are this code's when the key matches."""


def group_paths(array_paths: Iterable[str]) -> list[str]:
    """The groups above these arrays, relative to the version directory ("" the root), in order."""
    groups: set[str] = {""}
    for path in array_paths:
        parts = path.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(groups)


def documents(
    version_dir: str, arrays: Iterable[ArrayNode], root_attributes: dict[str, Any] | None
) -> tuple[list[tuple[str, bytes]], set[str]]:
    """The zarr.json files (path, bytes) for `arrays`, and for the root and intermediate
    groups unless `root_attributes` is None; plus every directory they need."""
    dirs: set[str] = {version_dir}
    docs: list[tuple[str, bytes]] = []
    nodes = list(arrays)
    if root_attributes is not None:
        for g in group_paths(a.path for a in nodes):
            d = os.path.join(version_dir, g) if g else version_dir
            dirs.add(d)
            doc = {"zarr_format": 3, "node_type": "group", "attributes": root_attributes if not g else {}}
            docs.append((os.path.join(d, "zarr.json"), json.dumps(doc).encode()))
    for a in nodes:
        d = os.path.join(version_dir, a.path)
        dirs.add(d)
        dirs.add(posixpath.dirname(d))
        docs.append((os.path.join(d, "zarr.json"), json.dumps(array_document(a, {})).encode()))
    return docs, dirs


def write_documents(docs: list[tuple[str, bytes]], dirs: set[str], replace: bool = False) -> list[str]:
    """Create `dirs` and the files of `docs` (which must not exist, unless `replace`: a
    reused tree, store.spare), without fsync; returns the file paths, for the caller to
    fsync together with the rest of the version."""
    for d in sorted(dirs):
        os.makedirs(d, mode=DIR_MODE, exist_ok=True)
    for path, data in docs:
        write_new(path, data, replace=replace)
    return [path for path, _ in docs]


def write_hierarchy(
    version_dir: str, arrays: Iterable[ArrayNode], root_attributes: dict[str, Any] | None, replace: bool = False
) -> list[str]:
    """Write and fsync zarr.json files (see `documents`; `replace` as in write_documents);
    returns the directories touched, for the caller to fsync."""
    docs, dirs = documents(version_dir, arrays, root_attributes)
    # Written first, then fsynced together: concurrent fsyncs share journal commits (ext4).
    fsync_files(write_documents(docs, dirs, replace))
    return sorted(dirs)
