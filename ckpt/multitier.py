"""`MultiTier`: one job saving to several roots at their own cadences.

    ram = Checkpointer("/dev/shm/run1", keep_last=2, peer_copies=1)   # fast, survives a node loss
    disk = Checkpointer("/nvme/run1/{node}", keep_last=3, replicate_to="s3://bucket/run1")
    with MultiTier((ram, 10), (disk, 100)) as ck:
        start = ck.restore(state)          # the newest intact version on any of them
        for step in range(...):
            ...
            ck.save(step, state)           # RAM every 10 steps, NVMe (and S3) every 100
            if ck.reached_preemption():
                ck.save(step, state, force=True)  # every tier, now
                break

Each root has its own Checkpointer, so nothing is shared but the training state: each
locks its root, stages into its own buffer (a save to two tiers at one step stages twice),
commits and applies its retention on its own, and two Checkpointers can never open one
root (RootLockedError). Restore tries the tiers from the one holding the newest version
(anywhere its restore looks: its root, copies, `tiers` and remote) down, and keeps the
newest version any of them restores intact.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from ckpt._preemption import pass_on
from ckpt.checkpointer import Checkpointer, close_on_exit
from ckpt.store.errors import CkptError, CorruptVersionError, IncompleteVersionError, VersionNotFoundError
from ckpt.store.versions import check_step, newest_committed

__all__ = ["MultiTier"]

log = logging.getLogger("ckpt")


class MultiTier:
    """Several Checkpointers, each saved every `every` steps; the first is the fastest."""

    def __init__(self, *tiers: tuple[Checkpointer, int]) -> None:
        if not tiers:
            raise ValueError("MultiTier needs at least one (Checkpointer, every) pair")
        for ck, every in tiers:
            if not isinstance(ck, Checkpointer) or isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"each tier is (Checkpointer, every >= 1), not ({ck!r}, {every!r})")
        roots = [ck.root for ck, _ in tiers]
        if len(set(roots)) != len(roots):
            raise ValueError(f"two tiers share a root: {roots}")
        self.tiers = tuple(tiers)

    def save(
        self, step: int, state: Mapping[str, Any], *, force: bool = False, milestone: bool = False, **kwargs: Any
    ) -> list[str]:
        """Save to every tier whose cadence divides `step` (all of them with `force`); the
        roots saved to. Each returns as its own save() does: the commits go on behind.

        A forced save is each tier's final one (as a save after reached_preemption()): the
        whole state, after a failed save in flight too, and nothing on a tier whose last
        save holds this step whole (its cadence saved it just before), so that no
        VersionExistsError stops the tiers after it (the disk, where RAM goes with the
        node); a params-only version of the step that the cadence made is replaced."""
        unknown = set(kwargs) - {"only", "overwrite"}
        if unknown:
            raise TypeError(f"MultiTier.save() got unexpected keyword arguments {sorted(unknown)}")
        overwrite = kwargs.get("overwrite", False)
        if type(overwrite) is not bool or type(milestone) is not bool:
            raise TypeError(f"overwrite and milestone must be bools, not {overwrite!r} and {milestone!r}")
        if force:
            check_step(step)
        saved = []
        for ck, every in self.tiers:
            if force:
                done = ck._final_save(step, state, only=kwargs.get("only"), overwrite=overwrite, milestone=milestone)
            else:
                done = step % every == 0 and ck.save(step, state, milestone=milestone, **kwargs)
            if done:
                saved.append(ck.root)
        return saved

    def restore(self, state: Mapping[str, Any], **kwargs: Any) -> int | None:
        """Collective: load the newest version intact on any tier into `state`; None when no
        tier holds one. A tier whose versions are incomplete or damaged is passed over for
        the next (with a warning); if every tier fails, the first failure is raised."""
        ranked = sorted(((self._newest(ck), i) for i, (ck, _) in enumerate(self.tiers)), reverse=True)
        best: tuple[int, Checkpointer] | None = None
        dirty = False  # a restore after `best` was loaded may have overwritten part of the state
        # Keys a failed attempt on any tier may have filled: a later tier's version must hold
        # them all, else the state would mix two versions (a single Checkpointer's rule).
        written: set[str] = set()
        first_error: Exception | None = None
        for newest, i in ranked:
            ck = self.tiers[i][0]
            if newest < 0 or (best is not None and newest <= best[0]):
                break
            try:
                got = ck._restore(state, **_restore_args(kwargs), written=written)
            except (IncompleteVersionError, VersionNotFoundError, CorruptVersionError) as e:
                log.warning("rank %d: tier %s has no version to restore: %s", ck.rank, ck.root, e)
                first_error = first_error or e
                dirty = best is not None
                continue
            if got is not None and (best is None or got > best[0]):
                best, dirty = (got, ck), False
            elif best is not None:
                dirty = True
        if best is not None and dirty:  # load the newest one found again, whole
            ck = best[1]
            passed = ck._saver.passed_over  # by its first restore: a restore by step passes over fewer
            try:
                ck._restore(state, **_restore_args({**kwargs, "step": best[0]}), written=written)
            finally:
                ck._saver.passed_over |= passed
        if best is None and first_error is not None:
            raise first_error
        return None if best is None else best[0]

    @staticmethod
    def _newest(ck: Checkpointer) -> int:
        """Collective: the newest step committed anywhere this tier's restore looks (its
        root, the replicator's and peers' copies, its `tiers` and remote; a shared store
        listed by rank 0 alone), on any rank (-1: none). A place that cannot be listed
        counts for nothing here, as in the restore, which lists it again; a bug raises on
        every rank."""
        mine = -1
        bug: Exception | None = None
        try:
            for tier in ck._search_tiers():
                if tier.capabilities.shared and ck.rank != 0:
                    continue
                try:
                    newest = newest_committed(tier)
                except (CkptError, OSError) as e:  # unreachable or unreadable: its restore says what it finds
                    log.warning("rank %d: cannot list %s to rank the tiers: %s", ck.rank, tier.location, e)
                    continue
                mine = max(mine, -1 if newest is None else newest)
        except Exception as e:  # noqa: BLE001 - a bug: raised on every rank below, none left waiting
            bug = e
        agreed, failed = ck._ctl.reduce_max([mine, int(bug is not None)])
        if failed:
            ck._ctl.agree(bug)  # every rank raises (the one that failed, its own error)
        return agreed

    def reached_preemption(self) -> bool:
        """Collective: True once any tier's preemption_signals arrived (see
        Checkpointer.reached_preemption). Every tier is asked: a tier's handler only notes
        the signal, so a tier not asked would swallow it."""
        return any([ck.reached_preemption() for ck, _ in self.tiers])

    def wait(self) -> None:
        for ck, _ in self.tiers:
            ck.wait()

    def close(self) -> None:
        """Close every tier, then pass on a preemption notice that came after the last
        reached_preemption(): sent by the first tier's close, SIGTERM's default would end
        the process before the next tier's last save had committed."""
        errors = []
        unsent: int | None = None
        try:
            for ck, _ in self.tiers:
                try:
                    ck._close(resend=False)
                except Exception as e:  # noqa: BLE001 - every tier is closed; the first error is raised
                    errors.append(e)
                unsent, ck.unsent_signal = unsent or ck.unsent_signal, None
        finally:
            if unsent is not None:
                pass_on(unsent)
        if errors:
            raise errors[0]

    def __enter__(self) -> MultiTier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        close_on_exit(self.close, exc, "MultiTier")


def _restore_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Checkpointer.restore's keyword arguments, defaults filled, for Checkpointer._restore."""
    unknown = set(kwargs) - {"step", "strict", "if_incomplete"}
    if unknown:
        raise TypeError(f"restore() got unexpected keyword arguments {sorted(unknown)}")
    return {"step": None, "strict": True, "if_incomplete": "raise", **kwargs}
