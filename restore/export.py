"""Whole-version exports: copy a version into a local root, or assemble it into one plain
state dict (and write it as one torch.save file, TorchFile). The version is chosen by
restore.locate like any restore.

Single-process: every chunk is read (and verified) from the first tier that holds a good
copy, so a version split over several node-local roots, or damaged on one of them, can
still be exported from the rest.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt.restore.saved_ranks import saved_trees
from ckpt.restore.sources import Source, from_first_good, rank_file_bytes_from
from ckpt.store import commit
from ckpt.store.chunk_read import read_chunk
from ckpt.store.errors import CkptError, CorruptVersionError, VersionExistsError
from ckpt.store.faults import fault_point
from ckpt.store.fsio import DIR_MODE, FILE_MODE, fsync_dir, fsync_dirs, makedirs, write_chunk, write_new
from ckpt.store.manifest import ArrayEntry, ChunkEntry, Manifest
from ckpt.store.new_root import first_missing, remove_unused
from ckpt.store.rank_file import RANKS_DIR, rank_file_path
from ckpt.store.root import RootLock, version_above
from ckpt.store.tree_format import DICT, MARKERS, OBJECT, TUPLE
from ckpt.store.versions import committed_steps, version_dirname
from ckpt.store.zarr_meta import ArrayNode, write_hierarchy

if TYPE_CHECKING:
    import torch

    from ckpt.restore.execute import Comm

__all__ = ["copy_version", "assemble", "selected", "decode_tree", "TorchFile"]

log = logging.getLogger("ckpt")
Progress = Callable[[int], None]


def copy_version(
    manifest: Manifest, sources: Sequence[Source], dest_root: str, progress: Progress = lambda n: None
) -> str:
    """Copy every chunk, verified, into dest_root/v<step>/ with the commit protocol; returns
    its path. A root this call made is removed again if the copy fails."""
    made = first_missing(dest_root)
    makedirs(dest_root)
    lock = RootLock(dest_root)
    lock.acquire()
    try:
        if manifest.step in committed_steps(dest_root):
            raise VersionExistsError(f"step {manifest.step} is already committed in {dest_root}")
        tmp_name = commit.tmp_dirname(manifest.step, manifest.save_id)
        tmp = os.path.join(dest_root, tmp_name)
        # A copy of this save that was killed left its directory (the name is the save's):
        # under the lock no one else writes it.
        commit.remove_tmp(dest_root, tmp_name)
        os.makedirs(tmp, mode=DIR_MODE)
        dirs: set[str] = {tmp}
        try:
            if manifest.rank_files:  # the digests, trees and RNG of every rank, verified
                os.mkdir(os.path.join(tmp, RANKS_DIR), DIR_MODE)
                dirs.add(os.path.join(tmp, RANKS_DIR))
                for rank in range(manifest.world_size):
                    raw = rank_file_bytes_from(sources, manifest, rank)
                    write_new(os.path.join(tmp, rank_file_path(rank)), raw, fsync=True)
            for array in manifest.arrays.values():
                for chunk in array.iter_chunks():
                    if chunk.inline is not None:
                        continue
                    buf = np.empty(chunk.nbytes, dtype=np.uint8)
                    chunk = from_first_good(
                        sources,
                        manifest,
                        array,
                        chunk,
                        lambda s, c, a=array, b=buf: _read_into(s, a, c, b),  # type: ignore[misc]
                    )
                    path = os.path.join(tmp, array.chunk_path(chunk))
                    makedirs(os.path.dirname(path))
                    dirs.add(os.path.dirname(path))
                    written = write_chunk(path, memoryview(buf), block_bytes=array.digest_block_bytes(chunk))  # type: ignore[arg-type]
                    if written.xxh3 != chunk.xxh3:  # the copy must be what the manifest promises
                        raise CorruptVersionError(f"copy of {path} changed in memory", path=path)
                    fault_point("copy-chunk")  # tests: a copy killed part-way
                    progress(chunk.nbytes)
            fsync_dirs(sorted(d for d in _with_parents(dirs, tmp)))
            hier = write_hierarchy(
                tmp, [ArrayNode.of(a) for a in manifest.arrays.values()], {"ckpt": {"step": manifest.step}}
            )
            commit.prepare(tmp, manifest, list(range(manifest.world_size)), hier)
            commit.publish(dest_root, tmp_name, manifest.step, overwrite=False)
        except BaseException:
            commit.remove_tmp(dest_root, tmp_name)
            raise
        return os.path.join(dest_root, version_dirname(manifest.step))
    except BaseException:
        lock.release()
        if made is not None:
            remove_unused(made, dest_root)
        raise
    finally:
        lock.release()


def _read_into(src: Source, array: ArrayEntry, chunk: ChunkEntry, buf: np.ndarray) -> ChunkEntry:
    """The whole chunk into `buf`, verified; the chunk with its digests."""
    read_chunk(src.tier, src.step, array, chunk, memoryview(buf))  # type: ignore[arg-type]
    return chunk


def _with_parents(dirs: set[str], top: str) -> set[str]:
    out = set()
    for d in dirs:
        while d.startswith(top):
            out.add(d)
            if d == top:
                break
            d = os.path.dirname(d)
    return out


def assemble(
    comm: Comm,
    manifest: Manifest,
    sources: Sequence[Source],
    progress: Progress = lambda n: None,
    keys: frozenset[str] | None = None,
) -> dict[str, Any]:
    """Every array as one full CPU tensor, placed in rank 0's state tree (objects become their
    state dicts); with `keys`, only those top-level keys (and only their arrays are read).
    `comm`: a single process's (ckpt._dist.Comm.solo())."""
    from ckpt.restore.execute import ReadRequest, full_tensor, load_arrays  # torch: only where tensors are built

    tree, wanted = selected(manifest, sources, keys)
    tensors: dict[str, torch.Tensor] = {}
    for array in manifest.arrays.values():
        if array.name not in wanted:
            continue
        dest = full_tensor(array)
        load_arrays(comm, sources, manifest, [ReadRequest(array, dest, (0,) * len(array.shape))])
        tensors[array.name] = dest
        progress(math.prod(array.shape) * dest.element_size())
    return decode_tree(tree, tensors)  # type: ignore[no-any-return]


def selected(manifest: Manifest, sources: Sequence[Source], keys: frozenset[str] | None) -> tuple[Any, set[str]]:
    """Every saved rank's state tree as one (merged_tree; only its `keys`, if given) and the
    arrays it refers to."""
    tree: Any = None
    held: set[tuple[str, ...]] = set()
    for i, mine in enumerate(saved_trees(manifest, sources)):
        if keys is not None and isinstance(mine, dict):
            mine = {k: v for k, v in mine.items() if k in keys}
        held |= _tensor_paths(mine)
        tree = mine if i == 0 else merged_tree(tree, mine)
    # A place in the tree where a rank saved a tensor and the merged tree has none: never a
    # file that silently lacks it (a tensor that differs across ranks has its place).
    lost = sorted(held - _tensor_paths(tree))
    if lost:
        raise CkptError(
            f"step {manifest.step}: the saved ranks' state trees do not merge into one: the tensors at "
            f"{', '.join('/'.join(p) for p in lost[:3])}{' ...' if len(lost) > 3 else ''} would be left out; "
            "restore() it on the saved layout, or export it with --to-safetensors"
        )
    return tree, referenced_arrays(tree)


def _tensor_paths(node: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Where a saved JSON tree holds tensors (keys, list indices, a DICT pair's key's JSON)."""
    if isinstance(node, list):
        return {p for i, v in enumerate(node) for p in _tensor_paths(v, (*path, str(i)))}
    if not isinstance(node, dict):
        return set()
    if "__tensor__" in node or "__ndarray__" in node:
        return {path}
    if len(node) == 1 and isinstance(node.get(DICT), list):
        return {p for pair in node[DICT] if _is_pair(pair) for p in _tensor_paths(pair[1], (*path, _pair_key(pair)))}
    return {p for k, v in node.items() for p in _tensor_paths(v, (*path, str(k)))}


def merged_tree(first: Any, other: Any) -> Any:
    """Two saved ranks' trees as one: `first`, with what only `other` holds added. A rank's
    tree may hold a share of the state: DCP gives each replicated tensor and item to one
    rank, pipeline stages hold different modules (a dict, or a list of parts, each). Where
    both hold a key, the two values' dicts (lists and tuples: item by item) are merged the
    same way, and otherwise `first`'s value stands (values that differ across ranks, such
    as a per-rank position, are those of the lower rank), unless only `other`'s holds
    tensors."""
    if _is_plain(first) and _is_plain(other):
        out = dict(first)
        for k, v in other.items():
            out[k] = merged_tree(out[k], v) if k in out else v
        return out
    if isinstance(first, list) and isinstance(other, list):  # item by item: pipeline stages in a list
        more = other[len(first) :]  # (taken where it holds tensors: else `first` is the value, as it stands)
        return [
            *(merged_tree(a, b) for a, b in zip(first, other)),
            *first[len(other) :],
            *(more if referenced_arrays(more) else []),
        ]
    if isinstance(first, dict) and isinstance(other, dict) and len(first) == len(other) == 1:
        if OBJECT in first and OBJECT in other:
            return {OBJECT: merged_tree(first[OBJECT], other[OBJECT])}
        if TUPLE in first and TUPLE in other and isinstance(first[TUPLE], list) and isinstance(other[TUPLE], list):
            if len(first[TUPLE]) == len(other[TUPLE]):  # (a tuple's length is part of its value)
                return {TUPLE: merged_tree(first[TUPLE], other[TUPLE])}
        if DICT in first and DICT in other and isinstance(first[DICT], list) and isinstance(other[DICT], list):
            pairs = {_pair_key(p): p for p in first[DICT] if _is_pair(p)}
            for p in other[DICT]:
                if _is_pair(p):
                    k = _pair_key(p)
                    pairs[k] = [p[0], merged_tree(pairs[k][1], p[1])] if k in pairs else p
            return {DICT: list(pairs.values())}
    if not referenced_arrays(first) and referenced_arrays(other):
        return other  # (an empty dict, None: a frozen stage's optimizer state) tensors are never dropped for it
    return first


def _is_plain(node: Any) -> bool:
    """A dict of string keys (no marked object)."""
    return isinstance(node, dict) and not (len(node) == 1 and next(iter(node)) in MARKERS)


def _is_pair(p: Any) -> bool:
    return isinstance(p, list) and len(p) == 2


def _pair_key(p: list[Any]) -> str:
    return json.dumps(p[0])  # the key's JSON: 1, true and "1" are three keys


def referenced_arrays(node: Any) -> set[str]:
    """The array names a saved JSON tree refers to."""
    if isinstance(node, list):
        return {n for v in node for n in referenced_arrays(v)}
    if not isinstance(node, dict):
        return set()
    for marker in ("__tensor__", "__ndarray__"):
        if marker in node:
            return {str(node[marker])}
    return {n for v in node.values() for n in referenced_arrays(v)}


def decode_tree(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild plain Python values from a saved JSON tree (no live objects needed)."""
    if isinstance(node, list):
        return [decode_tree(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__ndarray__" in node:
        return tensors[node["__ndarray__"]].numpy()
    if "__object__" in node:
        return decode_tree(node["__object__"], tensors)
    if "__tuple__" in node:
        return tuple(decode_tree(v, tensors) for v in node["__tuple__"])
    if "__dict__" in node:
        return {k: decode_tree(v, tensors) for k, v in node["__dict__"]}
    if "__float__" in node:
        return float(node["__float__"])
    return {k: decode_tree(v, tensors) for k, v in node.items()}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a device")):
        if test(mode):
            return name
    return "a device" if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"


class TorchFile:
    """The file `ckpt restore --to-torch` writes, made whole or not at all.

    Checked and started before anything is read: the directory must exist, and a
    temporary file is created in it at once (so a directory that takes no files, such as
    /proc, fails in a second, not after the whole read), to be renamed onto the path once
    written and fsynced. What is at the path is replaced only if it is a regular file and
    `force` was given; a device, a directory, a link or a FIFO never is. A file that
    appears at the path meanwhile is not replaced either (a hard link, create-only).

    Use: `with TorchFile(path, force=...) as out: out.write(state)`; leaving the block
    without write() (an error) removes the temporary file."""

    def __init__(self, path: str, *, force: bool) -> None:
        self.path = path
        self.force = force
        # The directory as the kernel resolves it (symbolic links, then ".."), and the file
        # checked and written in it: os.path.abspath collapses ".." by the text alone, so
        # "link/../f" would be checked at one place and written at another.
        name = os.path.basename(path)
        if name in ("", ".", ".."):
            raise CkptError(f"cannot write {path}: it names a directory, not a file")
        self._dir = os.path.realpath(os.path.dirname(path) or ".")
        full = os.path.join(self._dir, name)
        self._target = full
        if not os.path.isdir(self._dir):
            raise CkptError(f"cannot write {path}: {self._dir} is not a directory")
        above = version_above(self._dir)
        if above is not None:  # a deletion of the version would take the file with it
            raise CkptError(f"cannot write {path}: it is inside the version {above}")
        self._check()
        self._tmp = os.path.join(self._dir, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise CkptError(f"cannot write {path}: {e.strerror} (creating a file in {self._dir})") from None

    def _check(self) -> None:
        try:
            mode = os.lstat(self._target).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise CkptError(f"{self.path} is {_kind(mode)}, not a regular file: not replacing it")
        if not self.force:
            raise CkptError(f"{self.path} exists: give --force to replace it")

    def write(self, state: Any) -> None:
        import torch

        assert self._fd is not None
        fd, self._fd = self._fd, None
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        self._check()  # again: something may have appeared there during the read
        if self.force:
            os.replace(self._tmp, self._target)
        else:
            try:
                os.link(self._tmp, self._target)  # create-only
            except FileExistsError:
                raise CkptError(f"{self.path} exists: give --force to replace it") from None
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                os.replace(self._tmp, self._target)  # a filesystem without hard links
            else:
                os.unlink(self._tmp)
        fsync_dir(self._dir)

    def __enter__(self) -> TorchFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
