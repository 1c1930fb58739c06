"""Importing checkpoints of other formats into ckpt versions: a DCP checkpoint directory, a
`torch.save` file, a safetensors file.

DCP and torch.save are pickles (DCP's `.metadata` file and its non-tensor items;
torch.save's whole file), and unpickling runs whatever code the file names. So importing
them requires the caller's explicit trust (`ckpt import --trust`): without it nothing is
read. A safetensors file holds no pickle and needs none. What is imported becomes an
ordinary ckpt version, which holds no pickle.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ckpt._roots import RootSpec
from ckpt.checkpointer import Checkpointer
from ckpt.config import CheckpointerConfig
from ckpt.store.errors import UnsupportedStateError, VersionExistsError, for_cli
from ckpt.store.new_root import first_missing, remove_unused

__all__ = ["UntrustedSourceError", "read_foreign", "import_checkpoint"]


class UntrustedSourceError(UnsupportedStateError):
    """Importing would unpickle a file the caller has not said it trusts."""


def _dcp_state(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = FileSystemReader(path)
    # .metadata read here first, its error as itself: DCP's loader would log the failure
    # with its traceback (to stderr, through the root logger) and try other files.
    _check_coverage(path, reader.read_metadata())
    try:
        planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # (a BaseException; its text is the ranks' tracebacks)
        why = "; ".join(f"{type(error).__name__}: {error}" for error, _ in e.failures.values())
        raise ValueError(" ".join(why.split())[:500]) from None
    _optimizer_ids(state)
    return state


def _check_coverage(path: str, metadata: Any) -> None:
    """UnsupportedStateError where a tensor's chunks do not cover it: DCP's loader would
    hand back the rest as the uninitialised memory of torch.empty (a save that left a
    rank's shard out, a damaged or edited .metadata). Chunks of a DCP save never overlap,
    so their volumes, each within the tensor, add up to its size exactly when they cover it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size, held = tuple(item.size), 0
        for chunk in item.chunks:
            if len(chunk.offsets) != len(size) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size, strict=True)
            ):
                raise UnsupportedStateError(
                    f"{path}: {key}: a chunk at {list(chunk.offsets)} lies outside {list(size)}"
                )
            held += math.prod(chunk.sizes)
        if held != math.prod(size):
            raise UnsupportedStateError(
                f"{path}: {key}: its chunks hold {held} of its {math.prod(size)} elements: the checkpoint lacks a part"
            )


def _refuse_sharded(path: str, node: Any) -> None:
    """UnsupportedStateError where a torch.save file holds DTensors sharded over several
    ranks (each rank's `torch.save(model.state_dict())` of FSDP2, say): a rank's file holds
    its shards alone."""
    from torch.distributed.tensor import DTensor

    if isinstance(node, DTensor):
        if node.device_mesh.size() > 1:
            raise UnsupportedStateError(
                f"{path}: holds DTensors over {node.device_mesh.size()} ranks (one rank's shards): import the "
                "job's DCP checkpoint directory, or a file of full tensors"
            )
    elif isinstance(node, dict):
        for v in node.values():
            _refuse_sharded(path, v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _refuse_sharded(path, v)


def _optimizer_ids(node: Any) -> None:
    """Give the optimizer state dicts in `node` their int parameter ids back, in place.

    DCP stores every dict key as a string, so `optimizer.state_dict()["state"]` comes back
    keyed "0", "1", ...; `Optimizer.load_state_dict` would keep those entries apart from
    the parameters (ids 0, 1, ... in `param_groups`, whose lists DCP keeps intact), and the
    resumed optimizer would start without its state. Other dict keys stay strings: only
    here do the ints in `param_groups` show which keys were ints."""
    if isinstance(node, list):
        for v in node:
            _optimizer_ids(v)
    if not isinstance(node, dict):
        return
    state, groups = node.get("state"), node.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list):
        ids = {str(i): i for g in groups if isinstance(g, dict) for i in g.get("params", ()) if type(i) is int}
        if state and all(k in ids for k in state):
            node["state"] = {ids[k]: v for k, v in state.items()}
    for v in node.values():
        _optimizer_ids(v)


def _is_safetensors(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".safetensors")


def _safetensors_state(path: str) -> dict[str, Any]:
    """A safetensors file's tensors under "model" (where `ckpt restore --to-safetensors`
    takes them from, and where restore({"model": module}) puts them back)."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise UnsupportedStateError(f"{path}: reading safetensors needs its package: pip install ckpt[hf]") from None
    try:
        return {"model": load_file(path, device="cpu")}
    except (SafetensorError, ValueError) as e:
        raise UnsupportedStateError(f"{path}: not a readable safetensors file: {e}") from None


def _check_source(path: str, *, trust: bool) -> bool:
    """What is refused before anything is read; whether `path` is a DCP directory."""
    is_dcp = os.path.isdir(path)
    if is_dcp and not os.path.isfile(os.path.join(path, ".metadata")):
        raise UnsupportedStateError(f"{path}: a directory without .metadata is not a DCP checkpoint")
    if not trust and not _is_safetensors(path):  # (safetensors holds no pickle)
        what = "a DCP checkpoint's .metadata and items" if is_dcp else "a torch.save file"
        unpickles = f"{path}: importing unpickles {what}, which can run any code"
        raise for_cli(
            UntrustedSourceError(f"{unpickles}; pass trust=True only for files from a source you trust"),
            f"{unpickles}; pass --trust only for files from a source you trust",
        )
    return is_dcp


def read_foreign(path: str, *, trust: bool) -> dict[str, Any]:
    """The state a DCP directory (it holds `.metadata`), a torch.save file or a
    `.safetensors` file holds."""
    is_dcp = _check_source(path, trust=trust)
    if _is_safetensors(path):
        return _safetensors_state(path)
    try:
        state = _dcp_state(path) if is_dcp else torch.load(path, map_location="cpu", weights_only=False)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a foreign reader raises on a file it cannot read
        what = "DCP checkpoint" if is_dcp else "torch.save file"
        raise UnsupportedStateError(f"{path}: not a readable {what}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"{path}: holds a {type(state).__name__}, not a dict of state")
    if not is_dcp:
        _refuse_sharded(path, state)
    return state


def import_checkpoint(path: str, root: RootSpec, step: int, *, trust: bool, overwrite: bool = False) -> int:
    """Save what `path` holds as version `step` under `root` (one process); its byte count."""
    _check_source(path, trust=trust)
    local = os.fspath(root) if isinstance(root, (str, os.PathLike)) else None
    made = None if local is None else first_missing(local)
    ck = None
    try:
        with Checkpointer(root, config=CheckpointerConfig(capture_rng=False)) as ck:
            # A root in use and a step already there fail before the source is read (hours, for
            # a large one): the save would refuse them only after.
            if not overwrite and step in ck.steps():
                there = f"step {step} is already committed under {ck.root}"
                raise for_cli(VersionExistsError(f"{there}; pass overwrite=True"), f"{there}; pass --overwrite")
            state = read_foreign(path, trust=trust)
            ck.save(step, state, overwrite=overwrite)
            ck.wait()
            return ck.stats()[-1].bytes_written
    except BaseException:
        # The directories this import made hold a root with no version: not left behind
        # for the next command to take as a checkpoint root. Only once it held the root's
        # lock: a root another writer made and locked meanwhile is that writer's.
        if made is not None and local is not None and ck is not None:
            remove_unused(made, local)
        raise
