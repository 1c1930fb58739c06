"""The safetensors export by the ranks of a job (`Checkpointer.export_safetensors`): every
rank writes its share of the files, each read through the job's tiers and the group.

What no single process handles: the saved ranks' trees are read a slice per rank
(ceil(saved world / world) each, sent over the group by a rank that holds them when the
reader's node does not), and their tensor names are merged pairwise up a binary tree of
ranks (O(tensors x log world) bytes a rank), then broadcast. The files are planned alike
on every rank (restore.to_safetensors.plan_files); in round k rank r writes file
k * world + r, its tensors read by one collective read (restore.execute: chunks on
another node's root come over the group, every byte verified), so a rank holds one file
at a time. Rank 0 then writes the index and renames the files into place, as the
single-process export does.

The target directory must be one every rank reaches (a shared filesystem's): rank 0
checks that it sees every rank's files before anything is renamed into place.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckpt._dist import Comm, describe_error
from ckpt._load import agreed_manifest, read_agreed, saved_rank_of
from ckpt.config import CheckpointerConfig
from ckpt.restore.execute import ReadRequest, full_tensor
from ckpt.restore.locate import Located
from ckpt.restore.to_safetensors import (
    ExportTarget,
    as_exported,
    check_dtype,
    close_export,
    export_sizes,
    finish_export,
    open_export,
    parse_size,
    plan_files,
    tree_tensors,
    write_file,
)
from ckpt.store.errors import CkptError, RankFailures, VersionNotFoundError
from ckpt.store.manifest import ArrayEntry, Manifest

__all__ = ["export_version"]

_NAMES_TAG = 7 << 24  # the tag base of the name merge's messages
Names = dict[str, tuple[int, int, str]]  # exported name -> (saved rank, position in its tree, array)


def export_version(
    ctl: Comm,
    config: CheckpointerConfig,
    located: Located,
    out_dir: str,
    *,
    prefix: str,
    max_shard_size: str | int,
    dtype: str | None,
    force: bool,
) -> list[str]:
    """Collective: the chosen version's tensors under `prefix` as safetensors files in
    `out_dir` (see the module docstring); the paths written, index last, on every rank."""
    cast = check_dtype(dtype)
    limit = parse_size(max_shard_size)
    manifest = agreed_manifest(ctl, located)
    names = _names(ctl, manifest, located, prefix)
    files = plan_files(export_sizes(names, dtype), limit)
    target = _agreed_target(ctl, manifest, out_dir, force)
    tmp = target.tmp
    ok = False
    try:
        for first in range(0, len(files), ctl.world):
            mine = files[first + ctl.rank] if first + ctl.rank < len(files) else None
            requests = []
            if mine is not None:
                for name in mine.tensors:
                    array = names[name]
                    requests.append(ReadRequest(array, full_tensor(array), (0,) * len(array.shape)))
            read_agreed(ctl, config, located, manifest, requests)
            error: BaseException | None = None
            if mine is not None:
                try:
                    tensors = {n: as_exported(r.dest, names[n], cast) for n, r in zip(mine.tensors, requests)}
                    write_file(os.path.join(tmp, mine.name), tensors, manifest.step)
                except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
                    error = e
            ctl.agree(error)
        result: tuple[bool, list[str] | str] | None = None
        if ctl.rank == 0:
            try:
                result = (True, finish_export(tmp, out_dir, files))
            except Exception as e:  # noqa: BLE001 - every rank raises it
                result = (False, describe_error(e))
        ok, paths = ctl.broadcast(result, src=0)
    finally:
        if ctl.rank == 0:  # after the broadcast or an agreed failure: no rank still writes into it
            close_export(target, ok)
    if not ok:
        raise RankFailures({0: str(paths)})
    assert isinstance(paths, list)
    return paths


def _names(ctl: Comm, manifest: Manifest, located: Located, prefix: str) -> dict[str, ArrayEntry]:
    """Every saved rank's tensors under `prefix`, by exported name, in saved order (rank 0's
    first), as restore.to_safetensors.tensor_names gives them, without any rank reading
    more than its slice of the trees."""
    mine: Names = {}
    error: str | None = None
    for first in range(0, manifest.world_size, ctl.world):
        want = first + ctl.rank if first + ctl.rank < manifest.world_size else None
        found = saved_rank_of(ctl, manifest, located, want)
        if found is not None and want is not None and error is None:
            try:
                tensors = tree_tensors(manifest, found.tree, prefix)
            except Exception as e:  # noqa: BLE001 - every rank still joins the merge, then raises it
                error = f"saved rank {want}'s tree: {describe_error(e)}"
                continue
            for i, (n, a) in enumerate(tensors):  # one at a time: two of one name within a tree clash too
                error = error or _merge(mine, {n: (want, i, a.name)})
    # Up a binary tree: at distance d, rank r (a multiple of 2d) takes in rank r + d's names.
    d = 1
    while d < ctl.world:
        if ctl.rank % (2 * d) == d:
            ctl.send_bytes(json.dumps({"names": mine, "error": error}).encode(), [ctl.rank - d], _NAMES_TAG + d)
            break
        if ctl.rank % (2 * d) == 0 and ctl.rank + d < ctl.world:
            got = json.loads(ctl.recv_bytes(ctl.rank + d, _NAMES_TAG + d))
            error = error or got["error"] or _merge(mine, {n: tuple(v) for n, v in got["names"].items()})
        d *= 2
    ordered = sorted(mine.items(), key=lambda kv: kv[1][:2]) if ctl.rank == 0 else None
    error, ordered = ctl.broadcast((error, ordered) if ctl.rank == 0 else None, src=0)
    if error is not None:
        raise CkptError(error)
    assert ordered is not None
    if not ordered:
        raise VersionNotFoundError(f"step {manifest.step} has no tensor under {prefix!r} to export")
    return {name: manifest.arrays[array] for name, (_, _, array) in ordered}


def _merge(into: Names, other: dict[str, Any]) -> str | None:
    """Add `other`'s names, keeping each one's first place; the error when a name is two arrays."""
    for name, (rank, pos, array) in other.items():
        have = into.get(name)
        if have is not None and have[2] != array:
            return f"{name!r} names two different tensors in the ranks' states: not exporting"
        if have is None or (rank, pos) < have[:2]:
            into[name] = (int(rank), int(pos), str(array))
    return None


def _agreed_target(ctl: Comm, manifest: Manifest, out_dir: str, force: bool) -> ExportTarget:
    """Rank 0 checks the target and makes the temporary directory; every rank must see it.
    Rank 0's record names the directories made for the target; the others' name none."""
    made: tuple[str | None, str] | None = None
    target: ExportTarget | None = None
    if ctl.rank == 0:
        try:
            target = open_export(manifest, out_dir, force)
            made = (target.tmp, "")
        except Exception as e:  # noqa: BLE001 - every rank raises it
            made = (None, describe_error(e))
    try:
        tmp_or_none, why = ctl.broadcast(made, src=0)
        if tmp_or_none is None:
            raise CkptError(why)
        error = None
        if not os.path.isdir(tmp_or_none):
            error = CkptError(
                f"rank {ctl.rank} cannot see {tmp_or_none}: the export's target must be a directory every rank reaches"
            )
        ctl.agree(error)
    except BaseException:
        if target is not None:
            close_export(target, done=False)
        raise
    return target if target is not None else ExportTarget(str(tmp_or_none), ())
