"""Export a version's tensors under a prefix as Hugging Face safetensors files.

`ckpt restore ROOT --to-safetensors DIR --prefix model` writes the tensors of
`state["model"]` (a module or its state_dict) named as `module.state_dict()` names them
(nested keys joined with "."), in files of at most `max_shard_size` each:
`model.safetensors`, or `model-00001-of-0000N.safetensors` and the index
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) that
transformers' `from_pretrained` and `safetensors.torch.load_file` read.

Every tensor is read through the restore path (restore.execute): each chunk from the
first tier that holds a good copy, every byte checked against its xxh3, so a version
split over several node-local roots exports from wherever its parts are. Files are
written on a few threads, one file per thread at a time (memory: about one file per
thread), into a temporary directory inside DIR, fsynced, then renamed into place with
the index last: a reader never sees a partial export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckpt.restore.saved_ranks import saved_trees
from ckpt.restore.sources import Source
from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.errors import CkptError, VersionNotFoundError
from ckpt.store.fsio import DIR_MODE, fsync_dir
from ckpt.store.manifest import ArrayEntry, Manifest

__all__ = ["OutFile", "parse_size", "tensor_names", "plan_files", "write_safetensors", "export_safetensors", "DTYPES"]

Progress = Callable[[int], None]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: floating tensors only
_FLOATS = {"bfloat16", "float16", "float32", "float64"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20}
_UNITS.update({"GIB": 1 << 30, "TIB": 1 << 40})
_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


@dataclass(frozen=True)
class OutFile:
    """One safetensors file of the export and the tensors (by their exported names) it holds."""

    name: str
    tensors: tuple[str, ...]
    nbytes: int


def parse_size(text: str | int) -> int:
    """ "5GB" (10^9 bytes, as transformers counts), "500MiB", or a number of bytes."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size <= 0:
        raise ValueError(f"a shard size must be positive, not {text!r}")
    return size


def _unwrap(node: Any) -> Any:
    while isinstance(node, dict) and "__object__" in node:  # a module or optimizer: its state dict
        node = node["__object__"]
    return node


def tensor_names(manifest: Manifest, sources: Sequence[Source], prefix: str) -> dict[str, ArrayEntry]:
    """The arrays under `prefix` (dot-separated state keys), by the names
    `module.state_dict()` gives them, in saved order: of every rank's tree (pipeline
    stages hold different modules), rank 0's first."""
    out: dict[str, ArrayEntry] = {}
    trees: list[Any] = []
    for tree in saved_trees(manifest, sources):
        trees.append(tree)
        node = _unwrap(tree)
        for part in prefix.split(".") if prefix else []:
            node = _unwrap(node[part]) if isinstance(node, dict) and part in node else None
        if node is not None:
            _collect(manifest, node, out)
    if not out:
        have = sorted(_unwrap(trees[0])) if isinstance(_unwrap(trees[0]), dict) else []
        raise VersionNotFoundError(f"step {manifest.step} has no tensor under {prefix!r} to export (keys: {have})")
    return out


def _collect(manifest: Manifest, node: Any, out: dict[str, ArrayEntry]) -> None:
    """Every tensor of one tree's subtree into `out`; a name two trees give different arrays is an error."""

    def walk(n: Any, path: str) -> None:
        n = _unwrap(n)
        if isinstance(n, dict) and ("__tensor__" in n or "__ndarray__" in n):
            array = manifest.arrays[str(n.get("__tensor__", n.get("__ndarray__")))]
            if out.setdefault(path, array) is not array:
                raise CkptError(f"{path!r} names two different tensors in the ranks' states: not exporting")
        elif isinstance(n, dict) and "__tuple__" not in n and "__dict__" not in n and "__float__" not in n:
            for k, v in n.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(n, list):
            for i, v in enumerate(n):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(node, "")


def _out_bytes(array: ArrayEntry, dtype: str | None) -> int:
    kind = DTYPES[dtype] if dtype is not None and array.data_type in _FLOATS else array.data_type
    return array.nbytes // ITEMSIZE[array.data_type] * ITEMSIZE[kind]


def plan_files(sizes: Sequence[tuple[str, int]], max_bytes: int, stem: str = "model") -> list[OutFile]:
    """Tensors in order into files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    groups: list[list[tuple[str, int]]] = [[]]
    for name, n in sizes:
        if groups[-1] and sum(s for _, s in groups[-1]) + n > max_bytes:
            groups.append([])
        groups[-1].append((name, n))
    if len(groups) == 1:
        return [OutFile(f"{stem}.safetensors", tuple(n for n, _ in groups[0]), sum(s for _, s in groups[0]))]
    total = len(groups)
    return [
        OutFile(f"{stem}-{i + 1:05d}-of-{total:05d}.safetensors", tuple(n for n, _ in g), sum(s for _, s in g))
        for i, g in enumerate(groups)
    ]


def _check_target(out_dir: str, force: bool) -> None:
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CkptError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise CkptError(f"{out_dir} is not empty: give --force to write the export into it")


def export_safetensors(
    root: str,
    out_dir: str,
    *,
    step: int | None = None,
    prefix: str = "model",
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    tiers: Sequence[str] = (),
    storage_options: dict[str, Any] | None = None,
    threads: int = 4,
    force: bool = False,
) -> list[str]:
    """Export the newest intact version of `root` (or `step`) that holds `prefix`'s top-level
    key, read from `root` and `tiers` (paths or fsspec URLs), as safetensors files in
    `out_dir`; returns the paths written (see the module docstring)."""
    from ckpt._dist import Comm
    from ckpt.restore.locate import first_manifest, restore_newest
    from ckpt.store.tier import open_tier

    opened = [open_tier(p, storage_options) for p in (root, *tiers)]
    parse_size(max_shard_size)  # a bad size fails before anything is read

    def load(located: Any) -> list[str]:
        manifest = first_manifest(located)
        if manifest is None:
            raise VersionNotFoundError(f"no readable manifest of step {located.step}")
        return write_safetensors(
            manifest,
            located.sources,
            out_dir,
            prefix=prefix,
            max_shard_size=max_shard_size,
            dtype=dtype,
            threads=threads,
            force=force,
        )

    needs = None if step is not None else frozenset({prefix.split(".")[0]})
    found = restore_newest(Comm.solo(), lambda: opened, load, step=step, missing_ok=False, needs=needs)
    assert found is not None  # missing_ok=False: VersionNotFoundError instead
    return found[1]


def write_safetensors(
    manifest: Manifest,
    sources: Sequence[Source],
    out_dir: str,
    *,
    prefix: str = "model",
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    threads: int = 4,
    force: bool = False,
    progress: Progress = lambda n: None,
) -> list[str]:
    """Write the export (see the module docstring); returns the paths written, index last."""
    import torch
    from safetensors.torch import save_file

    from ckpt._dist import Comm
    from ckpt.restore.execute import ReadRequest, full_tensor, load_arrays

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    names = tensor_names(manifest, sources, prefix)
    files = plan_files([(n, _out_bytes(a, dtype)) for n, a in names.items()], parse_size(max_shard_size))
    _check_target(out_dir, force)
    os.makedirs(out_dir, mode=DIR_MODE, exist_ok=True)
    tmp = os.path.join(out_dir, f".ckpt-export-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp, DIR_MODE)
    cast = None if dtype is None else getattr(torch, DTYPES[dtype])

    def write(f: OutFile) -> None:
        tensors = {}
        for name in f.tensors:
            array = names[name]
            dest = full_tensor(array)
            load_arrays(Comm.solo(), sources, manifest, [ReadRequest(array, dest, (0,) * len(array.shape))])
            tensors[name] = dest.to(cast) if cast is not None and array.data_type in _FLOATS else dest
            progress(array.nbytes)
        path = os.path.join(tmp, f.name)
        save_file(tensors, path, metadata={"format": "pt", "ckpt_step": str(manifest.step)})
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())

    try:
        with ThreadPoolExecutor(max(1, min(threads, len(files))), thread_name_prefix="ckpt-export") as pool:
            for _ in pool.map(write, files):
                pass
        written = [f.name for f in files]
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(f.nbytes for f in files)},
                "weight_map": {t: f.name for f in files for t in f.tensors},
            }
            name = "model.safetensors.index.json"
            with open(os.path.join(tmp, name), "w") as fh:
                json.dump(index, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            written.append(name)
        fsync_dir(tmp)
        # With force, an earlier export's files go first (its index before its shards):
        # transformers prefers a model.safetensors over an index, so none may be left over.
        stale = sorted((n for n in os.listdir(out_dir) if _EXPORT_FILE.fullmatch(n)), key=lambda n: "index" not in n)
        for name in stale:
            os.unlink(os.path.join(out_dir, name))
        for name in written:  # the index last: a reader that finds it finds every file
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        fsync_dir(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(out_dir, n) for n in written]
