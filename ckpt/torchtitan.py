"""torchtitan on ckpt: its DCP checkpoint manager, with every checkpoint a committed ckpt version.

    trainer_config.checkpoint = ckpt.torchtitan.CheckpointManager.Config(enable=True, interval=500)

torchtitan builds the manager its `checkpoint` config names (`Config._owner`); this one is
torchtitan's own `CheckpointManager` (states, intervals, async modes, last-step
model-only saves) whose DCP saves and loads go through `ckpt.dcp` onto the root
`<dump folder>/<folder>`: a checkpoint of step N is version N, committed atomically,
checksummed, listed by `ckpt ls`, replicated and retained by ckpt. A resume without
`load_step` loads the newest intact version (a damaged one is passed over for the one
before); a folder holding none, but torchtitan's own `step-N` checkpoints, resumes from
those. `keep_latest_k` becomes ckpt's retention (`keep_last`), which never deletes the
newest intact version. A `load_only` manager opens no Checkpointer (it reads beside the
training job, which holds the root's lock). `async_with_pinned_mem` stages with DCP's pinned-memory stager and
writes on a thread (the writer holds the job's open Checkpointer, which cannot move to
another process). The last-step save in Hugging Face format is torchtitan's own, into
`<folder>-hf/step-N`. Needs `torchtitan` (0.3; `pip install torchtitan --no-deps tyro
spmd_types` is enough for the manager).
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchtitan.components.checkpointer.dcp import MODEL, AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as _DCPManager

from ckpt import dcp as ckpt_dcp
from ckpt._dist import destroy_comms, make_comm
from ckpt.checkpointer import Checkpointer
from ckpt.config import CheckpointerConfig
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps, version_dirname

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckpt")
_VERSION = re.compile(r"v(\d{12})")


class CheckpointManager(_DCPManager):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's DCP CheckpointManager onto a ckpt root (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_DCPManager.Config):  # type: ignore[misc]
        pass

    # Set by torchtitan's manager; typed here for the checks.
    enable: bool
    folder: str
    pg: Any
    states: dict[str, Any]
    stager: DefaultStager | None
    save_future: Future[Any] | None

    def __init__(self, config: Config, **kwargs: Any) -> None:
        keep = config.keep_latest_k
        config.keep_latest_k = 0  # torchtitan's purge deletes step-N directories: ckpt's retention instead
        try:
            super().__init__(config, **kwargs)
        finally:
            config.keep_latest_k = keep
        self._ckpt: Checkpointer | None = None
        self._auto_step = False
        self._native = False  # torchtitan's own step-N checkpoints are being looked for (see _load)
        if self.enable and not self.load_only:
            # DCP saves no RNG: neither does ckpt for it, and a load leaves the RNG alone.
            # (load_only, an evaluation beside the training job: no Checkpointer, which would
            # take the root's writer lock; the reader reads without one.)
            self._ckpt = Checkpointer(self.folder, keep_last=keep or None, config=CheckpointerConfig(capture_rng=False))

    def _close(self) -> None:
        try:
            if self.save_future is not None:  # an async save still writes through the Checkpointer
                self.save_future.result()
                self.save_future = None
            super()._close()
        finally:
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if self._native:
            return str(super()._create_checkpoint_id(step, folder))
        return os.path.join(folder or self.folder, version_dirname(step))

    def _find_load_step(self, folder: str = "") -> int:
        if self._native or (folder and folder != self.folder):
            found = int(super()._find_load_step(folder))
            if self._native and found != -1:
                log.warning("%s holds no ckpt version: resuming from torchtitan's own step-%d", self.folder, found)
            return found
        if self._ckpt is None:  # load_only: the newest step listed here, agreed over a gloo group
            steps = committed_steps(open_tier(self.folder)) if os.path.isdir(self.folder) else []
            comm = make_comm(CheckpointerConfig().timeout)  # (torchtitan's default group may be NCCL alone)
            try:
                return comm.reduce_max([steps[-1] if steps else -1])[0]
            finally:
                destroy_comms(comm)
        latest_step = self._ckpt.latest_step()
        # Agreed by the ranks: one whose node came back with empty disks lists nothing here,
        # and ckpt reads its part from the other tiers (peer copies, the remote).
        return self._ckpt._ctl.reduce_max([-1 if latest_step is None else latest_step])[0]

    def _load(self, step: int = -1) -> bool:
        """torchtitan's, except that a version of this root is loaded by every rank alike
        (torchtitan looks for the checkpoint's directory on each rank's own disk). A folder
        with no ckpt version is torchtitan's: its own step-N checkpoints (a job that moves
        to ckpt resumes from them), its initial load, or a fresh start."""
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1 or (step != -1 and self._native_step(step)):
            self._native = True
            try:
                return bool(super()._load(step))
            finally:
                self._native = False
        self._auto_step = step == -1  # the newest intact version, with ckpt's fallback
        states = self._states_to_load(load_step == 0)  # torchtitan's seed checkpoint (step 0) is the model only
        self.dcp_load(states, self._create_checkpoint_id(load_step), False, False)
        return True

    def _native_step(self, step: int) -> bool:
        """Whether `step` is one of torchtitan's own checkpoints here and no ckpt version."""
        if not os.path.isdir(os.path.join(self.folder, f"step-{step}")):
            return False
        return not os.path.isdir(os.path.join(self.folder, version_dirname(step)))

    def _ours(self, checkpoint_id: str) -> int | None:
        """The step of a checkpoint id of this root; None for another place (an initial load)."""
        m = _VERSION.fullmatch(os.path.basename(checkpoint_id))
        same = os.path.abspath(os.path.dirname(checkpoint_id)) == os.path.abspath(self.folder)
        return int(m.group(1)) if m and same else None

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        step = self._ours(checkpoint_id)
        if to_hf or step is None:
            if step is not None:
                checkpoint_id = os.path.join(f"{self.folder}-hf", f"step-{step}")
            done: Future[Any] | AsyncSaveResponse | None = super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
            return done
        # exclusive: torchtitan waits for a save before the next one and before closing, and
        # uses the Checkpointer for nothing else meanwhile, so an async save may run on DCP's thread.
        writer = ckpt_dcp.StorageWriter(self.folder, step, checkpointer=self._ckpt, overwrite=True, exclusive=True)
        if async_mode == AsyncMode.DISABLED:
            dcp_save(state_dict, storage_writer=writer)
            return None
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            if self.stager is None:
                self.stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=True,
                        use_shared_memory=True,
                        use_async_staging=True,
                        use_non_blocking_copy=True,
                    )
                )
            return async_save(state_dict, storage_writer=writer, process_group=self.pg, async_stager=self.stager)
        return async_save(state_dict, storage_writer=writer, process_group=self.pg)

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        step = self._ours(checkpoint_id)
        if from_hf or step is None:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = ckpt_dcp.StorageReader(self.folder, None if self._auto_step else step, checkpointer=self._ckpt)
        dcp_load(state_dict, storage_reader=reader)
        if MODEL in self.states:  # torchtitan flattens the model's state into the top level
            self.states[MODEL].load_state_dict(state_dict)
