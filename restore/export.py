"""Whole-version operations for the CLI: choose a version across tiers, copy it into a
local directory, or assemble it into one plain state dict.

Single-process: every chunk is read (and verified) from the first tier that holds a good
copy, so a version split over several node-local roots, or damaged on one of them, can
still be exported from the rest.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ckpt.restore.discover import choose_step, reachable_steps
from ckpt.restore.execute import ReadRequest, Source, full_tensor, load_arrays
from ckpt.restore.tiers import Tier
from ckpt.store import commit
from ckpt.store.chunk_read import read_chunk
from ckpt.store.errors import CorruptVersionError, TierUnavailableError, VersionNotFoundError
from ckpt.store.fsio import DIR_MODE, fsync_dirs, makedirs, write_chunk
from ckpt.store.manifest import Manifest
from ckpt.store.zarr_meta import ArrayNode, write_hierarchy

__all__ = ["open_version", "copy_version", "assemble", "decode_tree"]

log = logging.getLogger("ckpt")
Progress = Callable[[int], None]


class _Solo:
    """The collectives of a single process."""

    rank, world = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        return None


def open_version(
    tiers: Sequence[Tier], step: int | None = None, exclude: frozenset[int] = frozenset()
) -> tuple[int, Manifest, list[Source]]:
    """The newest (or the given) step whose chunks the tiers together hold; its manifest and sources."""
    cands = []
    by_tier = []
    failed: list[TierUnavailableError] = []
    for tier in tiers:
        try:
            mine = tier.committed()
        except TierUnavailableError as e:  # a failed disk: the other tiers may hold copies
            log.warning("%s is unavailable, reading the other tiers: %s", tier.name, e)
            failed.append(e)
            mine = []
        cands += mine
        by_tier.append(mine)
    if failed and len(failed) == len(tiers):
        raise failed[0]
    chosen = choose_step([cands], step, exclude)
    if chosen is None:
        where = ", ".join(t.name for t in tiers)
        partial = sorted({c.step for c in cands} - set(reachable_steps([cands])))
        hint = (
            f" (steps {partial} are there only in part: other ranks' chunks are on other roots; add them with --tier)"
        )
        what = f"step {step} is not committed" if step is not None else "no complete committed version"
        raise VersionNotFoundError(f"{what} in {where}" + (hint if partial else ""))
    save_id = reachable_steps([cands])[chosen]
    sources: list[Source] = []
    manifest: Manifest | None = None
    errors = []
    for tier, mine in zip(tiers, by_tier):
        for c in mine:
            if c.step == chosen and c.save_id == save_id:
                sources.append(Source(tier.version_dir(chosen), frozenset(c.writers), tier.name, tier.fetcher(chosen)))
                if manifest is None:
                    try:
                        manifest = tier.manifest(chosen)
                    except CorruptVersionError as e:
                        errors.append(str(e))
    if manifest is None:
        raise CorruptVersionError(f"no readable manifest of step {chosen}: {'; '.join(errors)}")
    return chosen, manifest, sources


def copy_version(
    manifest: Manifest, sources: Sequence[Source], dest_root: str, progress: Progress = lambda n: None
) -> str:
    """Copy every chunk, verified, into dest_root/v<step>/ with the commit protocol; returns its path."""
    makedirs(dest_root)
    lock = commit.RootLock(dest_root)
    lock.acquire()
    try:
        if manifest.step in commit.committed_steps(dest_root):
            raise FileExistsError(os.path.join(dest_root, commit.version_dirname(manifest.step)))
        save_id = manifest.save_id if len(manifest.save_id) == 32 else uuid.uuid4().hex
        tmp_name = commit.tmp_dirname(manifest.step, save_id)
        tmp = os.path.join(dest_root, tmp_name)
        os.makedirs(tmp, mode=DIR_MODE)
        dirs: set[str] = {tmp}
        try:
            for array in manifest.arrays.values():
                for chunk in array.chunks:
                    if chunk.inline is not None:
                        continue
                    buf = np.empty(chunk.nbytes, dtype=np.uint8)
                    _read_whole(sources, array, chunk, buf)
                    path = os.path.join(tmp, array.chunk_path(chunk))
                    makedirs(os.path.dirname(path))
                    dirs.add(os.path.dirname(path))
                    written = write_chunk(path, memoryview(buf), block_bytes=array.digest_block_bytes(chunk))  # type: ignore[arg-type]
                    if written.xxh3 != chunk.xxh3:  # the copy must be what the manifest promises
                        raise CorruptVersionError(f"copy of {path} changed in memory", path=path)
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
        return os.path.join(dest_root, commit.version_dirname(manifest.step))
    finally:
        lock.release()


def _with_parents(dirs: set[str], top: str) -> set[str]:
    out = set()
    for d in dirs:
        while d.startswith(top):
            out.add(d)
            if d == top:
                break
            d = os.path.dirname(d)
    return out


def _read_whole(sources: Sequence[Source], array: Any, chunk: Any, buf: np.ndarray) -> None:
    errors = []
    for src in sources:
        if chunk.writer not in src.writers:
            continue
        try:
            src.prepare(array, chunk)
            read_chunk(src.version_dir, array, chunk, memoryview(buf))  # type: ignore[arg-type]
            return
        except (CorruptVersionError, OSError) as e:  # an I/O error (failing disk): try the next copy
            src.discard(array, chunk)
            errors.append(str(e))
    raise CorruptVersionError("; ".join(errors) or f"{array.name} chunk {list(chunk.index)} is on no tier")


def assemble(manifest: Manifest, sources: Sequence[Source], progress: Progress = lambda n: None) -> dict[str, Any]:
    """Every array as one full CPU tensor, placed in rank 0's state tree (objects become their state dicts)."""
    tensors: dict[str, torch.Tensor] = {}
    for array in manifest.arrays.values():
        dest = full_tensor(array)
        load_arrays(_Solo(), sources, manifest, [ReadRequest(array, dest, (0,) * len(array.shape))])
        tensors[array.name] = dest
        progress(math.prod(array.shape) * dest.element_size())
    return decode_tree(manifest.trees[manifest.ranks[0].tree], tensors)  # type: ignore[no-any-return]


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
