"""torch-checkpointing (Meta, import name torch_checkpointing) as a peer under test.

Measures one CheckpointManager, built once and reused by every save as a user would:

  stall    save() until `with manager.lock(): ...` may be entered, i.e. until the
           async staging copy is done and the state may change again (save()
           itself returns before that; lock() is the library's documented guard
           for the optimizer step).
  durable  save() until the future it returns is done: the background process has
           written every file, passed the store barrier and renamed the temporary
           directory onto `path`. The library never calls fsync (neither the files
           nor the directory; storage/filesystem.py only closes them), so durable
           here means "in the page cache and renamed", not on disk; none is added.

Configuration, library defaults except:
  - LocalFileSystemStorageConfig(use_direct_io=False): the default O_DIRECT write
    path fails on ext4 with EINVAL on unaligned writes; buffered writes are what a
    user on ext4 must choose. (Reads fall back to buffered I/O by themselves.)
  - Every item (model, optim, step) gets ItemSpec(resharder=DefaultResharder()), so
    sharding metadata is written at save and a load into a different world size /
    DTensor Shard(0) layout is resharded (DefaultResharder handles Shard/Replicate
    placements on any mesh; plain tensors count as replicated).
  - CPU only: the default AsyncCheckpointSaverConfig works as is (staging on a
    background thread into shared-memory buffers, written by a spawned subprocess;
    CheckpointStagerConfig turns pinned memory and non-blocking copies off without
    CUDA), but at world > 1 the first save's metadata all-gather
    (DefaultMetadataManager._all_gather_pickled_data) puts its tensors on
    device="cuda". The manager is therefore built with a subclass doing the same
    gather of the same pickled metadata with all_gather_object over the (gloo)
    default group. It runs once: the metadata is cached for later saves.

The integer `step` is saved as a 0-d int64 tensor: as a plain int it would be read
from `step_<rank>.pt`, which a checkpoint written by fewer ranks lacks. Non-tensor
leaves (param_groups) are only restored from the file on a same-layout load; a
resharding load keeps the target's (identical here).

The subprocess spawn (~3 s, importing torch) is waited for in __init__, as it would
overlap with a job's start-up; the first save still allocates the staging buffers.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing import checkpoint_manager as _checkpoint_manager
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.metadata_manager import DefaultMetadataManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


class _CpuMetadataManager(DefaultMetadataManager):
    """DefaultMetadataManager whose all-gather of pickled metadata works without CUDA."""

    def _all_gather_pickled_data(self, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))


class TorchCheckpointing:
    def __init__(self) -> None:
        config = CheckpointManager.Config(
            default=ItemSpec(resharder=DefaultResharder()),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
        if torch.cuda.is_available():
            self._manager = CheckpointManager(config)
        else:
            with mock.patch.object(_checkpoint_manager, "DefaultMetadataManager", _CpuMetadataManager):
                self._manager = CheckpointManager(config)
        # Wait for the writer subprocess to start (otherwise the first save() waits for it).
        process = getattr(getattr(self._manager, "_saver", None), "_checkpoint_process", None)
        if process is not None:
            process.wait_for_init()

    @staticmethod
    def _payload(state: dict[str, Any]) -> dict[str, Any]:
        out = dict(state)
        if "step" in out:
            out["step"] = torch.tensor(int(out["step"]), dtype=torch.int64)
        return out

    def save(self, path: str, state: dict[str, Any]) -> tuple[float, float]:
        """Save `state` to `path` (absent or empty: the final rename refuses an occupied one).

        Returns (stall seconds, durable seconds), both from the start of save().
        """
        payload = self._payload(state)
        t0 = time.perf_counter()
        future = self._manager.save(path, payload)
        with self._manager.lock():  # blocks until staging is done
            stall = time.perf_counter() - t0
        if future is not None:
            future.result()
        return stall, time.perf_counter() - t0

    def load(self, path: str, state: dict[str, Any]) -> None:
        """Load `path` into the tensors of `state` in place (resharding if the layout differs)."""
        payload = self._payload(state)
        loaded = self._manager.load(path, into=payload)
        if "step" in state:
            state["step"] = int(loaded["step"])

    def close(self) -> None:
        self._manager.close()
