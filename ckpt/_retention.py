"""The Checkpointer's own retention: after each commit, its root's leader deletes what the
policy does not keep (with the safety rules of `ckpt gc`: replicator.gc.collect), and warns
when the root's filesystem has room for fewer than two more versions.

The oldest version a pass deletes is kept instead as the spare tree the next save of its
layout overwrites (store.spare), unless the root is low on space.

It runs on its own thread, one pass at a time (commits that land during a pass are
covered by the next one), so neither save() nor the commit waits for a deletion. Where a
replicator runs in the Checkpointer, the policy is the replicator's local policy instead
(it also waits for the required copies); this then only watches the free space. A
replicator daemon's status on the root is honoured the same way: a version whose copies
it has not verified is kept; and the peer-copy rule (ckpt._peer_status) holds back what
the root's peer copies still need.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ckpt._peer_status import with_peer_rule
from ckpt.replicator.gc import collect, spare_candidate
from ckpt.replicator.policy import Policy
from ckpt.replicator.status import read_status, redundant_saves
from ckpt.store import metrics
from ckpt.store.errors import CkptError
from ckpt.store.spare import drop, retire, spare_key, spares
from ckpt.store.tier import Tier
from ckpt.store.versions import read_manifest_facts, read_root_info, version_dirname

__all__ = ["Retention"]

log = logging.getLogger("ckpt")


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


class Retention:
    def __init__(self, tier: Tier, root: str, policy: Policy | None) -> None:
        self._tier, self._root, self._policy = tier, root, policy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retention")
        self._lock = threading.Lock()
        self._queued: Future[None] | None = None
        self._newest = -1
        self._spares = policy is not None
        self._sizes: dict[str, int] = {}  # bytes of a version on this root, per save layout

    def committed(self, step: int) -> None:
        """Called after each commit of this root; queues a pass unless one is still queued."""
        with self._lock:
            self._newest = max(self._newest, step)
            if self._queued is None or self._queued.running() or self._queued.done():
                self._queued = self._pool.submit(self._run)

    def _run(self) -> None:
        with self._lock:
            step = self._newest
        try:
            if self._policy is not None:
                # A replicator daemon on this root: keep what it has not copied yet, as `ckpt gc` does.
                status = read_status(self._root)
                redundant = with_peer_rule(self._root, None if status is None else redundant_saves(status))
                if self._spares:
                    spare = spare_candidate(self._tier, self._policy, redundant)
                    if spare is not None:
                        self._retire(spare)
                result = collect(self._tier, self._policy, redundant=redundant)
                metrics.RETENTION_DELETED.inc(len(result.deleted))
                if result.deleted:
                    log.info("%s: retention deleted steps %s", self._root, result.deleted)
                for kept, why in result.unjudged.items():
                    log.warning("%s: retention kept step %d, which it could not read: %s", self._root, kept, why)
            self._check_space(step)
        except (CkptError, OSError) as e:  # a disk or a listing that failed: the next pass retries
            log.warning("%s: retention pass failed: %s: %s", self._root, type(e).__name__, e)
        except Exception:  # a bug: with its traceback, but never failing a save (it runs on its own thread)
            log.exception("%s: retention pass failed", self._root)

    def _retire(self, step: int) -> None:
        """Keep the tree of `step`, which retention deletes, for the next save of its layout
        (store.spare); on any doubt it is deleted as usual."""
        try:
            layout = read_manifest_facts(self._tier, step).layout
            info = read_root_info(self._tier, step)
            if layout and info is not None:
                retire(self._tier, self._root, step, spare_key(layout, info.writers))
        except (CkptError, OSError) as e:
            log.info("%s: step %d is deleted, not kept as a spare tree: %s", self._root, step, e)

    def _version_bytes(self, step: int) -> int:
        """Bytes of `step` on this root. Measured once per save layout: its chunk files
        are of fixed sizes, and a walk of a large version's tree (a directory per array)
        takes ~0.1 s of Python, on the GIL the training loop wants."""
        try:
            layout = read_manifest_facts(self._tier, step).layout
        except (CkptError, OSError):
            layout = None
        size = self._sizes.get(layout) if layout else None
        if size is None:
            size = _tree_bytes(os.path.join(self._root, version_dirname(step)))
            if layout:
                self._sizes[layout] = size
        return size

    def _check_space(self, step: int) -> None:
        free = shutil.disk_usage(self._root).free
        size = self._version_bytes(step)
        kept = spares(self._root) if free < 2 * size else []
        if kept:  # the space is worth more than the files: a save of another layout needs it
            log.info("%s: low on space, deleting the spare trees %s", self._root, kept)
            for tree in kept:
                drop(self._root, tree)
            free = shutil.disk_usage(self._root).free
        metrics.ROOT_FREE_BYTES.set(free)
        if free < 2 * size:
            metrics.LOW_SPACE_WARNINGS.inc()
            log.warning(
                "%s: %d MiB free, room for fewer than two more versions of %d MiB; "
                "set keep_last= (or a replicator's local_policy) or free space",
                self._root,
                free >> 20,
                size >> 20,
            )

    def close(self) -> None:
        """Let a queued pass finish (the last versions' retention), then stop."""
        self._pool.shutdown(wait=True)
