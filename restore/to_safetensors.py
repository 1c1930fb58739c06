"""Export a version's tensors under a prefix as Hugging Face safetensors files.

`ckpt restore ROOT --to-safetensors DIR --prefix model` writes the tensors of
`state["model"]` (a module or its state_dict) named as `module.state_dict()` names them
(nested keys joined with "."), in files of at most `max_shard_size` each:
`model.safetensors`, or `model-00001-of-0000N.safetensors` and the index
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) that
transformers' `from_pretrained` and `safetensors.torch.load_file` read.

Every tensor is read through the restore path (restore.execute), a file's tensors a batch
at a time: each chunk from the first tier that holds a good copy, every byte checked
against its xxh3, so a version split over several node-local roots exports from wherever
its parts are. Files are written on a few threads, one file per thread at a time (memory:
about one file per thread), into a temporary directory inside DIR, fsynced, then renamed
into place with the index last: a reader never sees a partial export.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ckpt.restore.locate import ExportPrefix
from ckpt.restore.saved_ranks import saved_trees
from ckpt.restore.sources import Source
from ckpt.store.dtypes import ITEMSIZE
from ckpt.store.errors import CkptError, VersionNotFoundError, for_cli
from ckpt.store.faults import fault_point
from ckpt.store.fsio import DIR_MODE, fsync_dir, makedirs, open_new, write_new
from ckpt.store.manifest import ArrayEntry, Manifest
from ckpt.store.removal import remove_tree
from ckpt.store.root import version_above

__all__ = [
    "ExportTarget",
    "close_export",
    "open_export",
    "OutFile",
    "parse_size",
    "tensor_names",
    "tree_tensors",
    "plan_files",
    "write_safetensors",
    "export_safetensors",
    "export_needs",
    "export_sizes",
    "finish_export",
    "write_file",
    "DTYPES",
]

Progress = Callable[[int], None]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype: floating tensors only
_FLOATS = {"bfloat16", "float16", "float32", "float64"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20}
_UNITS.update({"GIB": 1 << 30, "TIB": 1 << 40})
_HEADER_KEY = "__metadata__"  # the header's own entry: a tensor of this name makes the file unreadable
_EXPORT_PREFIX = ".ckpt-export-"  # an export's temporary directory in its target (export_dirname)
log = logging.getLogger("ckpt")
READ_BATCH_BYTES = 256 << 20  # tensors a single-process export reads at once (one read, one progress step)
_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


@dataclass(frozen=True)
class OutFile:
    """One safetensors file of the export and the tensors (by their exported names) it holds."""

    name: str
    tensors: tuple[str, ...]
    nbytes: int


def parse_size(text: str | int) -> int:
    """ "5GB" (10^9 bytes, as transformers counts), "500MiB", or a number of bytes."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
        size = int(Fraction(m.group(1)) * _UNITS[m.group(2)])  # (exact: a float overflows, or rounds)
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
        for name, array in tree_tensors(manifest, tree, prefix):
            if out.setdefault(name, array) is not array:
                raise CkptError(f"{name!r} names two different tensors in the ranks' states: not exporting")
    if not out:
        raise VersionNotFoundError(
            f"step {manifest.step} has no tensor under {prefix!r} to export (keys: {_keys(trees)})"
        )
    return out


def _keys(trees: Sequence[Any]) -> list[str]:
    top = _unwrap(trees[0]) if trees else None
    return sorted(top) if isinstance(top, dict) else []


def tree_tensors(manifest: Manifest, tree: Any, prefix: str) -> list[tuple[str, ArrayEntry]]:
    """The tensors of one rank's tree under `prefix`, in its order, by their exported names.
    The prefix goes by those names too; a key may hold dots ("ema.model"), and a prefix
    that names two entries is refused (CkptError)."""
    node, last = _unwrap(tree), ""
    if prefix:
        found = _under(tree, prefix.split("."))
        if len(found) > 1:
            raise CkptError(f"{prefix!r} names {len(found)} entries of the state (keys holding dots): not exporting")
        node, last = found[0] if found else (None, "")
    out: list[tuple[str, ArrayEntry]] = []

    def walk(n: Any, path: str) -> None:
        n = _unwrap(n)
        if isinstance(n, dict) and ("__tensor__" in n or "__ndarray__" in n):
            out.append((path, manifest.arrays[str(n.get("__tensor__", n.get("__ndarray__")))]))
            return
        for name, child in _children(n):
            walk(child, f"{path}.{name}" if path else name)

    if node is not None:
        walk(node, "")
    return [(name or last, array) for name, array in out]  # (a prefix naming a tensor: by its own key)


def _children(node: Any) -> list[tuple[str, Any]]:
    """The entries inside a saved tree's node, by the names an export gives them: a dict's
    keys (`str(key)` for keys of other types than str), a list's or tuple's indices."""
    n = _unwrap(node)
    if isinstance(n, dict) and ("__tensor__" in n or "__ndarray__" in n or "__float__" in n):
        return []
    if isinstance(n, dict) and "__tuple__" in n and isinstance(n["__tuple__"], list):
        return _children(n["__tuple__"])
    if isinstance(n, dict) and "__dict__" in n and isinstance(n["__dict__"], list):
        return [(str(i[0]), i[1]) for i in n["__dict__"] if isinstance(i, list) and len(i) == 2]
    if isinstance(n, dict):
        return [(str(k), v) for k, v in n.items()]
    if isinstance(n, list):
        return [(str(i), v) for i, v in enumerate(n)]
    return []


def _under(node: Any, parts: Sequence[str]) -> list[tuple[Any, str]]:
    """Every entry the path `parts` reaches from `node`, and its own name: each step one
    name, which may be several parts joined by dots."""
    by_name: dict[str, list[Any]] = {}
    for name, child in _children(node):
        by_name.setdefault(name, []).append(child)
    out: list[tuple[Any, str]] = []
    for i in range(1, len(parts) + 1):
        key = ".".join(parts[:i])
        for child in by_name.get(key, []):
            out += _under(child, parts[i:]) if i < len(parts) else [(_unwrap(child), key)]
    return out


def export_needs(step: int | None, prefix: str) -> ExportPrefix | None:
    """What a version must hold to be the export's choice: the top-level key `prefix`
    starts with (None: any version, when the step is given or the export takes the whole
    state)."""
    return None if step is not None or not prefix else ExportPrefix(prefix)


def check_dtype(dtype: str | None) -> Any:
    """The torch dtype floating tensors are cast to (None: as saved); ValueError for another name."""
    import torch

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    return None if dtype is None else getattr(torch, DTYPES[dtype])


def as_exported(tensor: Any, array: ArrayEntry, cast: Any) -> Any:
    return tensor.to(cast) if cast is not None and array.data_type in _FLOATS else tensor


def export_sizes(names: dict[str, ArrayEntry], dtype: str | None) -> list[tuple[str, int]]:
    """Each tensor's exported name and bytes, in order; CkptError, before anything is read or
    written, for one that safetensors cannot hold (its type, or the header's own name)."""
    out = []
    for name, array in names.items():
        kind = DTYPES[dtype] if dtype is not None and array.data_type in _FLOATS else array.data_type
        if name == _HEADER_KEY:
            raise CkptError(f"{name!r} is the safetensors header's own name: not exporting a tensor under it")
        if not _storable(kind):
            raise CkptError(f"{name!r} is {kind}, which safetensors cannot store: not exporting")
        out.append((name, array.nbytes // ITEMSIZE[array.data_type] * ITEMSIZE[kind]))
    return out


@functools.cache
def _storable(data_type: str) -> bool:
    """Whether the installed safetensors writes tensors of this type (it has no complex128;
    older versions lack more): an empty one, serialized in memory, tells."""
    import torch
    from safetensors.torch import save

    from ckpt.restore.torch_dtypes import ZARR_TO_TORCH

    try:
        save({"t": torch.empty(0, dtype=ZARR_TO_TORCH[data_type])})
    except Exception:  # noqa: BLE001 - whatever safetensors raises for a type it lacks (a KeyError today)
        return False
    return True


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


def check_target(out_dir: str, force: bool) -> None:
    above = version_above(out_dir)
    if above is not None:  # a deletion of the version would take the export with it
        raise CkptError(f"{out_dir} is inside the version {above}: give a directory of its own")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CkptError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        full = f"{out_dir} is not empty"
        raise for_cli(
            CkptError(f"{full}: pass force=True to write the export into it"),
            f"{full}: give --force to write the export into it",
        )


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

    needs = export_needs(step, prefix)
    found = restore_newest(Comm.solo(), lambda: opened, load, step=step, missing_ok=False, needs=needs)
    assert found is not None  # missing_ok=False: VersionNotFoundError instead
    return found[1]


@dataclass(frozen=True)
class ExportTarget:
    """An export's temporary directory inside its target, and the directories made for the
    target (deepest first), which a failed export removes again."""

    tmp: str
    made: tuple[str, ...]
    lock: int = -1  # a descriptor of `tmp` holding its flock while the export runs (-1: none here)


def open_export(manifest: Manifest, out_dir: str, force: bool) -> ExportTarget:
    """Check the target, make it (and its missing parents) and the temporary directory in it,
    locked; first remove what exports killed there left (temporary directories no one locks)."""
    _remove_stale(out_dir)
    check_target(out_dir, force)
    made: list[str] = []  # those this call creates (not another's, nor ones found there)
    lock = -1
    try:
        makedirs(out_dir, made)
        tmp = os.path.join(out_dir, export_dirname(manifest))
        os.mkdir(tmp, DIR_MODE)
        lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        if lock >= 0:
            os.close(lock)
        _remove_empty(made[::-1])
        raise
    return ExportTarget(tmp, tuple(made[::-1]), lock)


def _remove_stale(out_dir: str) -> None:
    """Remove the temporary directories of exports killed part-way: those whose lock a live
    export does not hold (a process's flock ends with it)."""
    try:
        names = [n for n in os.listdir(out_dir) if n.startswith(_EXPORT_PREFIX)]
    except OSError:  # none yet, or not a directory (check_target says which)
        return
    for name in names:
        path = os.path.join(out_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # not a directory of ours (a link, a file): left as found
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live export's
            continue
        finally:
            os.close(fd)
        log.info("removing %s, left by an export that did not finish", path)
        remove_tree(path, ignore_errors=True)


def close_export(target: ExportTarget, done: bool) -> None:
    """Remove the temporary directory; after a failure (not `done`) also the directories made
    for the target, while they are empty: a failed export leaves nothing it made behind."""
    remove_tree(target.tmp, ignore_errors=True)
    if target.lock >= 0:
        os.close(target.lock)
    if not done:
        _remove_empty(target.made)


def _remove_empty(dirs: Sequence[str]) -> None:
    """Remove `dirs` (deepest first) while they are empty directories (one already gone: on
    to its parent)."""
    for d in dirs:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            continue
        except OSError:
            return


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
    from ckpt._dist import Comm
    from ckpt.restore.execute import ReadRequest, full_tensor, load_arrays

    cast = check_dtype(dtype)
    names = tensor_names(manifest, sources, prefix)
    files = plan_files(export_sizes(names, dtype), parse_size(max_shard_size))
    target = open_export(manifest, out_dir, force)
    tmp = target.tmp

    def write(f: OutFile) -> None:
        # The file's tensors read in batches of READ_BATCH_BYTES, each one read whose reader
        # lanes share its chunks: a read per tensor waited for each small one in turn
        # (0.60-0.75 s against ~0.3 s for a 389 MiB model from a cold disk); progress
        # moves a batch at a time.
        tensors = {}
        for batch in _batches([(name, names[name]) for name in f.tensors], READ_BATCH_BYTES):
            requests = [ReadRequest(a, full_tensor(a), (0,) * len(a.shape)) for _, a in batch]
            load_arrays(Comm.solo(), sources, manifest, requests)
            for (name, a), r in zip(batch, requests):
                tensors[name] = as_exported(r.dest, a, cast)
            progress(sum(a.nbytes for _, a in batch))
        write_file(os.path.join(tmp, f.name), tensors, manifest.step)
        fault_point("export-file")  # tests: an export killed part-way

    done = False
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(files))), thread_name_prefix="ckpt-export") as pool:
            for _ in pool.map(write, files):
                pass
        written = finish_export(tmp, out_dir, files)
        done = True
        return written
    finally:
        close_export(target, done)


def _batches(arrays: Sequence[tuple[str, ArrayEntry]], limit: int) -> list[list[tuple[str, ArrayEntry]]]:
    """Consecutive runs of arrays of at most `limit` bytes (an array larger than it alone)."""
    out: list[list[tuple[str, ArrayEntry]]] = []
    size = 0
    for name, array in arrays:
        if not out or size + array.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, array))
        size += array.nbytes
    return out


def export_dirname(manifest: Manifest) -> str:
    """The temporary directory, inside the export's target, that its files are written into."""
    return f"{_EXPORT_PREFIX}{manifest.step}-{manifest.save_id[:16]}-{uuid.uuid4().hex[:8]}"


def write_file(path: str, tensors: dict[str, Any], step: int) -> None:
    """One safetensors file, durable, with the mode ckpt's own files get: safetensors (0.8
    on) writes a temporary file of mode 0600 and renames it onto the path, which would make
    the export readable by its writer alone (a serving job of another user could not)."""
    from safetensors.torch import save_file

    os.close(open_new(path, replace=False))  # created as ckpt creates its files: the mode the umask gives
    mode = stat.S_IMODE(os.stat(path).st_mode)
    save_file(tensors, path, metadata={"format": "pt", "ckpt_step": str(step)})
    os.chmod(path, mode)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def finish_export(tmp: str, out_dir: str, files: Sequence[OutFile]) -> list[str]:
    """With every file written into `tmp`: the index, then each file renamed into `out_dir`
    (the index last: a reader that finds it finds every file); the paths, index last."""
    missing = [f.name for f in files if not os.path.isfile(os.path.join(tmp, f.name))]
    if missing:
        raise CkptError(f"{len(missing)} export files are not in {tmp}, first {missing[0]}")
    written = [f.name for f in files]
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(f.nbytes for f in files)},
            "weight_map": {t: f.name for f in files for t in f.tensors},
        }
        name = "model.safetensors.index.json"
        write_new(os.path.join(tmp, name), json.dumps(index, indent=2).encode(), fsync=True)
        written.append(name)
    fsync_dir(tmp)
    # With force, an earlier export's files go first (its index before its shards):
    # transformers prefers a model.safetensors over an index, so none may be left over.
    stale = sorted((n for n in os.listdir(out_dir) if _EXPORT_FILE.fullmatch(n)), key=lambda n: "index" not in n)
    for name in stale:
        os.unlink(os.path.join(out_dir, name))
    for name in written:
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    fsync_dir(out_dir)
    return [os.path.join(out_dir, n) for n in written]
