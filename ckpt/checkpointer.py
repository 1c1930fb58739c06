"""`Checkpointer`: the training loop's entry point (save, wait, restore, list).

It wires one job's pieces together and sequences them: the roots (ckpt._roots), the save
pipeline (ckpt._save, with the commit thread of ckpt._commit), the restore loop
(ckpt.restore.locate, loading through ckpt._load), and the replicator thread. The format
and the commit protocol live in ckpt.store, reading in ckpt.restore.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal, NamedTuple

import xxhash

from ckpt import _roots
from ckpt._dist import Comm, destroy_comms, make_comms, subgroup
from ckpt._job import SaveStats
from ckpt._load import load_version, locate
from ckpt._peer_status import forget_peer_copies, resume_peer_copies
from ckpt._peers import PeerCopier, plan_peers
from ckpt._preemption import PreemptionWatch
from ckpt._retention import Retention
from ckpt._roots import PathSpec, RootSpec
from ckpt._save import Saver
from ckpt.config import CheckpointerConfig
from ckpt.provenance import job_provenance
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import Policy
from ckpt.replicator.service import Replicator
from ckpt.restore.locate import Located, restore_newest
from ckpt.store import metrics
from ckpt.store.errors import CkptError, CorruptVersionError, UnsupportedStateError
from ckpt.store.faults import fault_delay
from ckpt.store.manifest import Manifest
from ckpt.store.tier import Tier, is_url, open_tier
from ckpt.store.versions import check_step, committed_steps

__all__ = ["Checkpointer", "RootSpec", "close_on_exit"]

log = logging.getLogger("ckpt")


def close_on_exit(close: Callable[[], None], exc: BaseException | None, who: str) -> None:
    """A context manager's exit: close(); when the body raised, its exception wins and a
    failure of close() (a pending save's) is logged instead."""
    if exc is None:
        close()
        return
    try:
        close()
    except Exception:
        log.exception("%s: a pending save failed while handling another error", who)


class _Keys(NamedTuple):
    """What a save holds: the top-level keys `only=` or the full_every schedule name (None:
    none named), and whether it saves the whole state all the same (a milestone)."""

    named: tuple[str, ...] | None
    whole: bool


class Checkpointer:
    """Asynchronous, atomic checkpoints of a training job's full state.

    Collective under torch.distributed: every rank constructs it, saves and restores
    together. `root` may differ per rank (node-local disks): pass a callable of the
    rank or a string with {rank}, {local_rank}, {node} or {hostname}. `tiers` are
    further places restore() reads from, in order: local paths (replica disks), fsspec
    URLs (s3://bucket/prefix, configured by AWS_* variables or `storage_options`), or
    ckpt.store.tier.Tier objects.
    """

    def __init__(
        self,
        root: RootSpec,
        *,
        tiers: Sequence[PathSpec | Tier] = (),
        storage_options: Mapping[str, Any] | None = None,
        replicate_to: str | None = None,
        replication: ReplicatorConfig | None = None,
        config: CheckpointerConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or CheckpointerConfig(), **overrides)
        # Installed first: a signal that cannot be handled fails before any root is locked.
        self._preemption = PreemptionWatch(self.config.preemption_signals) if self.config.preemption_signals else None
        self.unsent_signal: int | None = None  # see _close
        try:
            self._open(root, tiers, storage_options, replicate_to, replication)
        except BaseException:
            if self._preemption is not None:
                self._preemption.close()
            raise

    def _open(
        self,
        root: RootSpec,
        tiers: Sequence[PathSpec | Tier],
        storage_options: Mapping[str, Any] | None,
        replicate_to: str | None,
        replication: ReplicatorConfig | None,
    ) -> None:
        self._ctl, self._data = make_comms(self.config.timeout)
        self.rank, self.world = self._ctl.rank, self._ctl.world
        if self.rank == 0:
            # Rank 0 puts it in every manifest. It runs git, whose pipes a process forked by
            # another thread meanwhile (a DataLoader worker) would inherit and hold open: the
            # commit thread would wait for that process to end, and the loop for the commit.
            job_provenance()
        self._closed = True
        self.root, disks = _roots.choose_root(self._ctl, root)
        replication = _roots.replication_config(replication, replicate_to, storage_options, self.root, disks)
        policy = self.config.retention()
        if policy is not None and replication is not None:
            if replication.local_policy is not None:
                raise ValueError("give keep_last or the replicator's local_policy, not both")
            replication, policy = replace(replication, local_policy=policy), None  # it also waits for the copies
        opened = _roots.open_root(self._ctl, self.root)
        self._ctx, self._lock = opened.ctx, opened.lock
        self._tier = open_tier(self.root)
        extra = list(tiers) + ([replication.remote] if replication and replication.remote else [])
        self._tiers = [self._tier, *_roots.open_tiers(extra, self.rank, storage_options)]
        self._disks = [r for r in (disks or [self.root]) if not is_url(r)]
        self._replicator: Replicator | None = None
        self._replicator_thread: threading.Thread | None = None
        self._replicator_lock: int | None = None
        self._retention: Retention | None = None
        self._peer_comm: Comm | None = None
        self._peers: PeerCopier | None = None
        try:
            self._open_rest(policy, replication)
        except BaseException:
            self._abandon_open()
            raise
        self._closed = False

    def _abandon_open(self) -> None:
        """An _open that failed once the root was locked: what it started stops, and the
        root is free again (a retry in the process would be RootLockedError)."""
        if self._replicator is not None and self._replicator_thread is not None:
            self._replicator.stop.set()
            self._replicator_thread.join()
        if self._replicator_lock is not None:
            os.close(self._replicator_lock)
        if self._retention is not None:
            self._retention.close()
        if self._peers is not None:
            self._peers.abandon()  # no round has begun: nothing committed yet
        if self._lock is not None:
            self._lock.release()

    def _open_rest(self, policy: Policy | None, replication: ReplicatorConfig | None) -> None:
        """_open, once the root is locked."""
        _roots.recover(self._ctl, self._ctx, self._tier)
        self._replicator_lock = _roots.lock_replicator(self._ctl, self._ctx, replication)
        if replication is not None and self._ctx.is_leader:
            self._replicator = Replicator([self.root], replication)
            self._replicator_thread = threading.Thread(target=self._replicator.run, name="ckpt-replicator", daemon=True)
            self._replicator_thread.start()
        if self.config.metrics_port is not None:
            metrics.serve(self.config.metrics_port + _roots.local_rank(self._ctl))
        self._saves = 0  # save() calls that staged a version since the schedule (re)started: full_every counts them
        # (step, whole state) of the last save staged, unless it failed: see _final_save
        self._last_saved: tuple[int, bool] | None = None
        if self._ctx.is_leader and not self.config.peer_copies:
            forget_peer_copies(self.root)  # an earlier job's peer copies hold nothing back on this root now
        elif self._ctx.is_leader:
            resume_peer_copies(self.root)
        self._retention = Retention(self._tier, self.root, policy) if self._ctx.is_leader else None
        self._peer_comm, self._peers = self._open_peers()
        fault_delay("open-saver", self.rank)  # tests: an open interrupted once its threads run
        self._saver = Saver(
            self.config,
            self._ctl,
            self._data,
            self._ctx,
            self._tier,
            on_commit=self._committed if self._retention is not None or self._peers is not None else None,
        )

    def _committed(self, step: int, milestone: bool) -> None:
        if self._retention is not None:
            self._retention.committed(step)
        if self._peers is not None:
            self._peers.committed(step, milestone)

    def _open_peers(self) -> tuple[Comm | None, PeerCopier | None]:
        """The roots' leaders' group and this leader's peer-copy thread (ckpt._peers)."""
        if not self.config.peer_copies:
            return None, None
        error: BaseException | None = None
        # Without LOCAL_WORLD_SIZE (srun, mpirun) ranks are told apart by host name: taking
        # each rank for a node of its own would let a copy land on its own node unseen.
        hosts = None if os.environ.get("LOCAL_WORLD_SIZE") else _roots.host_names(self._ctl)
        try:
            plan = plan_peers(
                self._ctx.root_groups, self._ctx.root_index, self.config.peer_copies, self.config.peer_stride, hosts
            )
        except ValueError as e:  # (ranks that disagree on their nodes: not every rank refuses)
            error = e
        self._ctl.agree(error)  # every rank raises, before any waits in the subgroup's creation
        comm = subgroup(plan.leaders, self.config.timeout)
        if comm is None or not self._ctx.is_leader:
            return comm, None
        retention = self._retention
        copier = PeerCopier(
            comm,
            plan,
            self.root,
            policy=self.config.retention(),
            bwlimit_mbps=self.config.peer_bwlimit_mbps,
            on_verified=(lambda step: None) if retention is None else retention.committed,
            keep_every=self.config.keep_every,
        )
        return comm, copier

    # -- saving ----------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        overwrite: bool = False,
        milestone: bool = False,
        only: Sequence[str] | None = None,
    ) -> bool:
        """Stage `state` and return; the commit goes on in the background.

        Returns False when the save was skipped (if_busy="skip" and a save in flight).
        `milestone=True` tags the version: milestone retention policies always keep it.
        `only`: save just these top-level keys (a params-only version, say ("model",));
        with `full_every`, the schedule chooses. A milestone is always full.
        Raises a previous save's error, VersionExistsError, UnsupportedStateError.

        After reached_preemption() returned True, a save is the job's last one: see
        `_final_save` (the whole state; a step just saved whole is not saved again).
        """
        self._check_open()
        check_step(step)
        if type(overwrite) is not bool or type(milestone) is not bool:  # ("no" would be a milestone)
            raise TypeError(f"overwrite and milestone must be bools, not {overwrite!r} and {milestone!r}")
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
        if self._preemption is not None and self._preemption.agreed:
            return self._final_save(step, state, only=only, overwrite=overwrite, milestone=milestone)
        return self._save_keys(step, state, self._keys_to_save(state, only, milestone, step), overwrite, milestone)

    def _final_save(
        self, step: int, state: Mapping[str, Any], *, only: Sequence[str] | None, overwrite: bool, milestone: bool
    ) -> bool:
        """The save of a job that stops (preemption; MultiTier's force): the whole state,
        whatever full_every's schedule says (`only=` still chooses), after the save in
        flight even if that one failed (its error is logged: this save supersedes it). A
        step this Checkpointer's last save holds whole is not saved again (False), unless
        as a milestone; a params-only version of the step that it made is replaced. Every
        rank decides alike: the saves and their outcomes are the job's."""
        self._check_open()
        try:
            self._saver.wait()
        except Exception:  # logged: the state now is what must be committed
            log.exception("rank %d: the save in flight failed; the final save of step %d goes on", self.rank, step)
            self._restart_schedule()
        keys = self._keys_to_save(state, only, milestone, step, final=True)
        if self._last_saved == (step, True) and keys.whole and not overwrite and not milestone:
            return False
        if self._last_saved is not None and self._last_saved[0] == step:
            overwrite = True  # (its own version of this step: params-only, or now a milestone)
        return self._save_keys(step, state, keys, overwrite, milestone)

    def _save_keys(
        self, step: int, state: Mapping[str, Any], keys: _Keys | None, overwrite: bool, milestone: bool
    ) -> bool:
        """Save `keys` of `state` (None: the whole state, no keys named)."""
        keys = keys or _Keys(None, True)
        partial = False
        if not keys.whole and keys.named is not None:  # (a pipeline stage's rank may lack some: trees differ)
            mine = {k: state[k] for k in keys.named if k in state}
            partial, state = len(mine) < len(state), mine
        try:
            saved = self._saver.save(
                step, state, overwrite=overwrite, milestone=milestone, named=keys.named, partial=partial
            )
        except BaseException:
            self._restart_schedule()
            raise
        self._saves += saved
        if saved:
            self._last_saved = (step, not self._saver.last_partial)
        return saved

    def _restart_schedule(self) -> None:
        """A save failed (this one, or an earlier one reported now): it may be the full one
        the full_every schedule counts on, so the next save is full. Params-only versions
        with no full one behind them leave nothing to resume from."""
        self._saves = 0
        self._last_saved = None

    def _keys_to_save(
        self, state: Mapping[str, Any], only: Sequence[str] | None, milestone: bool, step: int, *, final: bool = False
    ) -> _Keys:
        """The top-level keys this save names (this rank's state may lack some; each must be
        some rank's), and whether it saves the whole state. The schedule saves a milestone
        (tagged, or a step keep_every keeps), and a `final` save, in full; `only=` at a step
        keep_every keeps is saved in full too (a warning says so)."""
        every = self.config.keep_every
        if only is not None:
            if milestone:
                raise ValueError("a milestone is always a full version: give milestone=True without only=")
            keys = (only,) if isinstance(only, str) else tuple(only)
        elif (
            self.config.full_every is not None
            and not final
            and not milestone
            and not (every and step % every == 0)
            and self._saves % self.config.full_every
        ):
            assert self.config.partial_keys is not None
            keys = self.config.partial_keys
        else:
            return _Keys(None, True)
        missing = [k for k in keys if k not in state]
        if not keys or (missing and self.world == 1):
            raise ValueError(f"only= / partial_keys name keys the state does not have: {missing or '(none given)'}")
        if only is not None and every and step % every == 0:  # retention keeps it for good: a resume must take it
            if self.rank == 0:
                log.warning(
                    "step %d is a milestone (keep_every=%d): saved in full, not only %s", step, every, list(keys)
                )
            return _Keys(keys, True)
        if missing:  # ranks may hold different trees (pipeline stages): this one saves what it has
            log.info("rank %d: no %s in this rank's state; the other ranks' hold them", self.rank, missing)
        return _Keys(keys, False)

    def reached_preemption(self) -> bool:
        """Collective, once per training step on every rank: True on every rank, at the same
        step, from the first call after any rank received one of `preemption_signals`. Then
        save(), wait() and exit. One all-reduce of an int per call; False (and no
        collective) without preemption_signals."""
        self._check_open()
        return self._preemption is not None and self._preemption.reached(self._ctl)

    def take_over_signal(self, sig: int) -> None:
        """Put this Checkpointer's handler for `sig` (one of `preemption_signals`) back over
        any installed since, which then no longer receive that signal: only the ranks'
        agreement in reached_preemption() acts on it. For a framework whose own handler acts
        on the rank that got the signal (Lightning's SIGTERM handler broadcasts from inside
        the handler under DDP: a notice on some ranks only leaves the ranks' collectives
        mismatched). close() puts back the handler from before this Checkpointer's. From the
        main thread; a no-op for another signal."""
        self._check_open()
        if self._preemption is not None:
            self._preemption.take_over(sig)

    def wait_staged(self) -> float:
        """Block until the last save's tensors are copied (deferred staging), after which
        the state may change; returns the seconds waited. Optimizers in the state do this
        themselves at the start of step()."""
        return self._saver.gate.wait()

    def guard(self, *optimizers: Any) -> None:
        """Make these optimizers' step() wait for a deferred copy, as the ones found in the
        state do (for an optimizer the state reaches only through a wrapper's state_dict())."""
        self._saver.gate.guard(optimizers)

    def wait(self) -> None:
        """Block until every pending save is committed; raise its error if it failed."""
        try:
            self._saver.wait()
        except BaseException:
            self._restart_schedule()
            raise

    # -- reading ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps on this rank's root, oldest first."""
        return committed_steps(self._tier)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def stats(self) -> list[SaveStats]:
        """Timings of this rank's completed saves, oldest first."""
        return list(self._saver.stats)

    def restore(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        if_incomplete: Literal["raise", "fresh"] = "raise",
    ) -> int | None:
        """Load the newest intact committed step (or `step`) into `state` in place; None if
        nothing is committed on any tier searched.

        A version some ranks' part of which is on no tier searched (a node replaced with
        empty disks, a root left out) is never silently skipped for a fresh start: an older
        complete version is restored instead (with a warning naming the newer ones; the job's
        next saves of those steps replace their surviving parts, after committing), and if
        there is none, IncompleteVersionError names the versions, the missing ranks' parts
        and where the ranks looked. `if_incomplete="fresh"` returns None then instead.

        With `strict` (and no `step`), only versions that hold every top-level key of
        `state` are candidates: newer params-only versions are passed over (one log line
        each); if versions exist but none holds every key, VersionNotFoundError says so.

        `state` is a dict shaped like the saved one: every slot takes only a saved value of
        its kind (a tensor, a dict, a list), and with `strict` every dict has exactly the
        saved keys (StateMismatchError names the difference). `strict=False` loads the keys
        both sides have and leaves the rest alone.

        Every configured tier is searched (this rank's root first, then the replicator's
        copies on this node's disks, then `tiers` and the remote). A version that turns out
        corrupt is skipped with a warning for the next older one, unless `step` was given;
        a bad chunk is first read from another tier that holds it. The state may use
        another world size or sharding than the one that saved it.
        """
        return self._restore(state, step, strict=strict, if_incomplete=if_incomplete, written=set())

    def _restore(
        self,
        state: Mapping[str, Any],
        step: int | None,
        *,
        strict: bool,
        if_incomplete: Literal["raise", "fresh"],
        written: set[str],
    ) -> int | None:
        """restore(); `written`: the state's top-level keys that failed attempts may have
        filled, this one's and those of earlier ones (MultiTier's other tiers): added to
        here, and no version lacking one is loaded (ckpt._load.load_version)."""
        self._check_open()
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"state must be a dict to restore into, got {type(state).__name__}")
        if step is not None:
            check_step(step)
        if if_incomplete not in ("raise", "fresh"):
            raise ValueError(f"if_incomplete must be 'raise' or 'fresh', not {if_incomplete!r}")
        self.wait()
        # The state is another from here: a save of the same step is not "done", and the
        # full_every schedule starts again (its params-only versions would rest on the last full one).
        self._restart_schedule()

        passed_over: set[int] = set()
        try:
            found = restore_newest(
                self._ctl,
                self._search_tiers,
                lambda located: load_version(self._ctl, self.config, located, state, strict=strict, written=written),
                step=step,
                needs=frozenset(str(k) for k in state) if strict and step is None else None,
                if_incomplete=if_incomplete,
                passed_over=passed_over,
            )
        except CorruptVersionError:
            metrics.VERIFY_ERRORS.inc()
            raise
        finally:  # raised too: a caller that goes on (MultiTier, from another tier) saves over them
            self._saver.passed_over = frozenset(passed_over)
        return None if found is None else found[0]

    def export_safetensors(
        self,
        out_dir: str,
        step: int | None = None,
        *,
        prefix: str = "model",
        max_shard_size: str | int = "5GB",
        dtype: str | None = None,
        force: bool = False,
    ) -> list[str]:
        """Collective: export the newest intact version holding `prefix`'s top-level key (or
        `step`) as Hugging Face safetensors files in `out_dir`, written by all the ranks in
        parallel (a share of the files each, read through every tier the job reaches and
        the group, verified). `out_dir` must be a directory every rank reaches. The same
        files as `ckpt restore --to-safetensors` (restore.to_safetensors); returns their
        paths, the index last, on every rank."""
        from ckpt._export import export_version
        from ckpt.restore.to_safetensors import export_needs

        self._check_open()
        error: BaseException | None = None
        try:
            if step is not None:
                check_step(step)
        except (TypeError, ValueError) as e:
            error = e
        self._ctl.agree(error)  # (a rank that raised alone would leave the others in the next collective)
        # Every rank plans the files from its arguments: ranks that differ would read in
        # rounds that do not pair up (a hang), or export mixed trees.
        args = repr((step, prefix, max_shard_size, dtype, force))  # (never raises, whatever their types)
        mine = xxhash.xxh3_64_intdigest(args.encode()) >> 1
        high, low = self._ctl.reduce_max([mine, -mine])
        if high != -low:
            raise ValueError(
                "export_safetensors(): the ranks pass different step, prefix, max_shard_size, dtype or force"
            )
        self.wait()
        found = restore_newest(
            self._ctl,
            self._search_tiers,
            lambda located: export_version(
                self._ctl,
                self.config,
                located,
                out_dir,
                prefix=prefix,
                max_shard_size=max_shard_size,
                dtype=dtype,
                force=force,
            ),
            step=step,
            missing_ok=False,
            needs=export_needs(step, prefix),
        )
        assert found is not None  # missing_ok=False: VersionNotFoundError instead
        return found[1]

    def _search_tiers(self) -> list[Tier]:
        """Where restore looks, in order: this rank's root, the replicator's copies on this
        node's disks, then `tiers` and the remote."""
        return [self._tier, *_roots.replica_tiers(self._disks), *self._tiers[1:]]

    def _locate(
        self, step: int | None, read: Callable[[Manifest, Located], None] | None = None
    ) -> tuple[Manifest, Located] | None:
        """ckpt._load.locate, once this Checkpointer's pending saves are done. With `read`
        (a load into the state, as DCP's), the full_every schedule starts again, as at
        restore()."""
        self._check_open()
        self.wait()
        if read is not None:
            self._restart_schedule()
        return locate(self._ctl, self._search_tiers, step, read)

    # -- lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CkptError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for pending saves (raising their error), let the replicator make its last
        pass (at most `drain_timeout_s`; versions left unreplicated are reported, not
        raised), then release the root."""
        self._close(resend=True)

    def _close(self, *, resend: bool) -> None:
        """close(); `resend=False`: a late preemption notice is kept in `unsent_signal`
        instead of being sent again (MultiTier sends it after closing every tier)."""
        if self._closed:
            return
        try:
            self._saver.wait()
            if self._peers is not None and self._saver.stats:  # its done-callback may not have run yet
                last = self._saver.stats[-1]  # (a step already copied is not copied again)
                self._peers.committed(last.step, last.milestone)
        finally:
            self._closed = True
            if self._peers is not None:
                self._peers.close(self.config.peer_drain_timeout_s)
            if self._replicator is not None and self._replicator_thread is not None:
                self._replicator.stop.set()
                self._replicator_thread.join()
                self._drain_replicator(self._replicator)
            if self._replicator_lock is not None:
                os.close(self._replicator_lock)
                self._replicator_lock = None
            self._saver.close()
            if self._retention is not None:
                self._retention.close()
            try:
                if self._lock is not None:
                    self._lock.release()
                destroy_comms(self._ctl, self._data, *([self._peer_comm] if self._peer_comm is not None else []))
            finally:
                # Last: it sends a notice that came too late again, and the handler it reaches
                # may raise (KeyboardInterrupt, SystemExit) with the root released.
                if self._preemption is not None:
                    self.unsent_signal = self._preemption.close(resend=resend)

    def _drain_replicator(self, replicator: Replicator) -> None:
        """One last pass so the final versions reach their copies and the remote before exit,
        for at most `ReplicatorConfig.drain_timeout_s`; the versions it leaves behind are
        reported (Replicator.drain: a warning naming the steps, a metric, the status)."""
        try:
            replicator.drain()
        except Exception as e:  # noqa: BLE001 - close() must still release the root; the pass is logged
            log.warning("rank %d: final replication pass failed: %s: %s", self.rank, type(e).__name__, e)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        close_on_exit(self.close, exc, f"rank {self.rank}")
