"""The replicator: copies every committed version of a node's roots onto other disks and
to the shared remote, verifies the copies, records a status, and applies retention.

Runs as the `ckpt replicate` daemon or as a thread of the Checkpointer. One pass
(`run_once`) is idempotent and resumable; `run` repeats it until stopped; `drain` is the
Checkpointer's last pass at close(), bounded in time, and reports what it left undone.
A destination that fails is not tried again in the same pass (its other versions are
recorded `failed` too), so one pass meets an unreachable remote once.

Placement: each chunk must exist on `replicas` distinct disks, the source's included.
The part a source root holds is copied to `<replica root>/replicas/<source label>/`
on replica roots whose disk differs from the source's and from each other's, and whose
disk is still the one first recorded there (replicator.placement).

Over 450 lines on purpose: the pass, the drain and the retention order share one set of
bookkeeping (statuses, destinations failed in this pass, the remote's listing), which
would otherwise travel between modules as arguments.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

from ckpt._peer_status import with_peer_rule
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.gc import collect, judge
from ckpt.replicator.placement import (
    Destination,
    UnopenedTier,
    claim_disk,
    device_decides,
    device_id,
    disk_id,
    is_local_location,
    source_label,
)
from ckpt.replicator.policy import Policy, VersionInfo, expired
from ckpt.replicator.publish import clear_to_send, committed_info, publish, publish_waiting
from ckpt.replicator.ratelimit import RateLimiter
from ckpt.replicator.status import (
    REMOTE_DONE,
    STATE_DIR,
    CopyState,
    State,
    Status,
    VersionStatus,
    copies_done,
    read_status,
    redundant_saves,
    redundant_steps,
    remote_done,
    write_status,
)
from ckpt.replicator.transfer import SourceReadError, Transfer, copy_files, journal_for, missing_files, part_sizes
from ckpt.store import metrics
from ckpt.store.errors import (
    CkptError,
    CorruptVersionError,
    StoppedError,
    UnsupportedStateError,
    VersionExistsError,
    VersionNotFoundError,
)
from ckpt.store.manifest import MANIFEST_NAME, Manifest
from ckpt.store.pins import deleting, pin_version
from ckpt.store.retry import RetryPolicy
from ckpt.store.root import ROOT_ID_NAME
from ckpt.store.storage_options import redact
from ckpt.store.tier import Tier, join_key, local_location, open_tier
from ckpt.store.versions import (
    RootInfo,
    committed_steps,
    delete_version,
    is_committed,
    read_manifest,
    read_root_info,
    version_dirname,
)

__all__ = ["Replicator"]

log = logging.getLogger("ckpt.replicator")
WAITING: State = "waiting for other nodes"


def _refuse_a_source_as_remote(remote: str, sources: list[str]) -> None:
    """A source root is no remote: the remote's retention would delete the source's own
    versions, and its copies would be the originals, counted as a second copy."""
    if not is_local_location(remote):
        return
    path = os.path.realpath(local_location(remote) or remote)
    for source in sources:
        if path == os.path.realpath(source):
            raise CkptError(f"the remote {remote} is the root {source} itself: give another place")
    if os.path.exists(os.path.join(path, ROOT_ID_NAME)):  # (a remote the replicator makes has none)
        raise CkptError(
            f"the remote {remote} is another job's checkpoint root (it holds {ROOT_ID_NAME}): the remote's "
            "retention would delete its versions; give another place"
        )


class Replicator:
    def __init__(self, sources: list[str], config: ReplicatorConfig) -> None:
        self.sources = [os.path.abspath(s) for s in sources]
        self.config = config
        self.limiter = RateLimiter(config.bwlimit_mbps * 1e6 if config.bwlimit_mbps else None)
        self.stop = threading.Event()
        self._retry = RetryPolicy(stop=self.stop)
        self._status: dict[str, Status] = {s: _last_status(s) for s in self.sources}
        self._source_tiers: dict[str, Tier] = {s: open_tier(s) for s in self.sources}
        if config.remote is not None:
            _refuse_a_source_as_remote(config.remote, self.sources)
        self.remote = (
            Destination(config.remote, "shared", self._tier(config.remote)) if config.remote is not None else None
        )
        self.bytes_sent = 0
        self._remote_listing: list[VersionInfo] | None = None  # the remote's versions, listed once per pass
        self.errors: list[str] = []  # copies that failed in the last pass
        self._last_error: dict[str, str] = {}
        self._failed_dests: set[str] = set()  # destinations that failed in this pass: tried again in the next
        self._dests: dict[str, list[Destination]] = {}  # each source's replica destinations, last pass

    def _tier(self, location: str) -> Tier:
        return open_tier(location, self.config.storage_options, retry=self._retry)

    def _redact(self, text: str) -> str:
        return redact(text, self.config.storage_options)

    def _replica_dests(self, source: str) -> list[Destination]:
        """Distinct-disk destinations for copies of `source`. A replica root's disk identity is
        recorded the first time (in the source's status, so it outlives restarts); later the
        destination must still be on that disk (Destination.check_disk), or its copies fail.
        A root that fails to answer (an I/O error on its disk) stays required, its copies
        failed for the pass, and the other destinations go on."""
        status = self._status[source]
        used = {disk_id(source): source, device_id(source): source}  # disk or device -> the path of a copy on it
        out: list[Destination] = []
        for r in self.config.replica_roots:
            if len(out) == self.config.replicas - 1:
                break
            url = f"{r.rstrip('/')}/replicas/{source_label(source)}"
            try:
                dest = self._replica_dest(r, url, status, used)
            except (CkptError, OSError) as e:
                why = self._redact(f"{type(e).__name__}: {e}")
                log.error("replica root %s cannot be used in this pass (its copies fail): %s", self._redact(r), why)
                self.errors.append(f"{self._redact(r)}: {why}")
                self._last_error[url] = why
                self._failed_dests.add(url)
                dest = Destination(url, "replica", UnopenedTier(self._redact(url), why), disk=status.disks.get(r))
            if dest is not None:
                out.append(dest)
        if len(out) < self.config.replicas - 1:
            # The copies go on to the disks there are (retention counts those), and the pass
            # fails: `--once` exits 3 rather than report the copies asked for as made.
            short = f"only {len(out) + 1} distinct disks for {self.config.replicas} copies of {self._redact(source)}"
            log.error("%s (replica roots on a copy's disk or device are skipped)", short)
            self.errors.append(short)
        status.required_copies = len(out)
        status.replicas = [d.url for d in out]
        status.remote = self._redact(self.config.remote) if self.config.remote is not None else None
        return out

    def _replica_dest(self, r: str, url: str, status: Status, used: dict[str, str]) -> Destination | None:
        """Replica root `r`'s destination, None where it is on the disk or device of another
        copy (`used`: disk or device -> the path of a copy on it, updated)."""
        local = is_local_location(r)
        disk = status.disks.get(r)
        # a root its device tells (unmarked, or claimed by older code wherever it was) is on the
        # disk of a copy on that device; a recorded root found on another disk is check_disk's
        if local and disk in (None, disk_id(r)) and device_decides(r) and (there := used.get(device_id(r))):
            log.warning("replica root %s is on the device of %s, a copy's: no second disk, no copy there", r, there)
            status.disks.pop(r, None)
            for v in status.versions.values():
                v.copies.pop(url, None)  # a copy there is on that disk: it counts for no other
            return None
        if disk is None:
            disk = claim_disk(r)
            if local:
                status.disks[r] = disk
        if disk in used:
            return None
        used[disk] = r
        if local:
            used[device_id(r)] = r
        return Destination(url, "replica", self._tier(url), disk=disk if local else None)

    def run_once(self) -> dict[str, Status]:
        """One pass over every committed version of every source; returns the status."""
        started, sent = time.monotonic(), self.bytes_sent
        self.errors = []
        self._failed_dests = set()
        for source in self.sources:
            self._pass(source)
        if self.bytes_sent > sent:
            metrics.UPLOAD_THROUGHPUT.set((self.bytes_sent - sent) / max(time.monotonic() - started, 1e-6))
        metrics.REPLICATION_LAG.set(self.lag())
        metrics.NOT_REPLICATED.set(sum(len(self.not_replicated(s)) for s in self.sources))
        return self._status

    def not_replicated(self, source: str) -> list[int]:
        """Steps of `source`'s status that are not on every required copy and the remote yet."""
        status = self._status[source]
        return sorted(set(status.versions) - redundant_steps(status))

    def drain(self) -> dict[str, list[int]]:
        """The last pass (a Checkpointer's close()), then a report of what it left undone.

        The pass ends after `drain_timeout_s`: the stop ends the retry waits and the copy
        loops at once, and a request in flight within its own timeout. Then, per source, the
        committed versions that are not on every copy are recorded in the status (a copy
        never tried as `pending`; `ckpt ls` shows it), logged in one warning naming the steps,
        and counted in `ckpt_versions_not_replicated`. Returns those steps by source.
        """
        self.stop.clear()
        timer = threading.Timer(self.config.drain_timeout_s, self.stop.set)
        timer.daemon = True
        timer.start()
        try:
            self.run_once()
        except StoppedError:
            log.warning("the final replication pass stopped after drain_timeout_s=%gs", self.config.drain_timeout_s)
        except (CkptError, OSError) as e:
            metrics.REPLICATION_FAILURES.inc()
            log.warning("the final replication pass failed: %s", self._redact(f"{type(e).__name__}: {e}"))
        finally:
            timer.cancel()
            self.stop.set()
        left: dict[str, list[int]] = {}
        for source in self.sources:
            self._note_unreached(source)
            self._write_status(source)
            left[source] = self.not_replicated(source)
            self._report(source)
        metrics.NOT_REPLICATED.set(sum(len(steps) for steps in left.values()))
        return left

    def _note_unreached(self, source: str) -> None:
        """Give every committed version of `source` that a stopped pass did not reach an entry,
        with its missing copies `pending`, so the status names each copy still owed."""
        status = self._status[source]
        tier = self._source_tiers[source]
        now = time.time()
        for step in committed_steps(tier):
            if step in status.versions:
                continue
            try:
                manifest = read_manifest(tier, step)
            except CkptError:
                continue  # unreadable: the pass logs it
            status.versions[step] = VersionStatus(manifest.save_id, manifest.created)
        remote = self._redact(self.config.remote) if self.config.remote is not None else None
        for entry in status.versions.values():
            for dest in self._dests.get(source, []):
                entry.copies.setdefault(dest.url, CopyState("pending", now))
            if remote is not None and (entry.remote is None or entry.remote.url != remote):
                entry.remote = CopyState("pending", now, url=remote)

    def _report(self, source: str) -> None:
        """One warning per kind of copy that some versions of `source` lack."""
        status = self._status[source]
        if status.remote is not None:
            missing = [step for step, v in sorted(status.versions.items()) if not remote_done(status, v)]
            if missing:
                why = self._last_error.get(self.remote.url, "") if self.remote is not None else ""
                log.warning(
                    "%s not uploaded to %s: %s%s; the next replicator run on %s uploads them",
                    _count(len(missing), "version"),
                    status.remote,
                    _steps(missing),
                    f" (last error: {why})" if why else "",
                    source,
                )
        short = [step for step, v in sorted(status.versions.items()) if not copies_done(status, v)]
        if short:
            log.warning(
                "%s without their %s on other disks: %s; the next replicator run on %s makes them",
                _count(len(short), "version"),
                _count(status.required_copies, "replica copy", "replica copies"),
                _steps(short),
                source,
            )

    def lag(self) -> float:
        """Seconds since the oldest committed version that has not reached every copy yet (0: none)."""
        now, oldest = time.time(), None
        for source in self.sources:
            status = self._status[source]
            redundant = redundant_steps(status)
            for step, v in status.versions.items():
                if step not in redundant:
                    oldest = v.created if oldest is None else min(oldest, v.created)
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def redundant_steps(self, source: str) -> set[int]:
        return redundant_steps(self._status[source])

    def run(self) -> None:
        """Repeat passes until `stop` is set (SIGTERM in the daemon)."""
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except StoppedError:
                break
            except (CkptError, OSError) as e:
                metrics.REPLICATION_FAILURES.inc()
                log.warning("replication pass failed: %s", self._redact(f"{type(e).__name__}: {e}"))
            except Exception as e:
                metrics.REPLICATION_FAILURES.inc()
                log.exception("replication pass failed: %s", self._redact(f"{type(e).__name__}: {e}"))
            self.stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))

    def _pass(self, source: str) -> None:
        status = self._status[source]
        tier = self._source_tiers[source]
        state_dir = os.path.join(source, STATE_DIR)
        dests = self._dests[source] = self._replica_dests(source)
        steps = committed_steps(tier)
        self._remote_listing = None
        failed = self._failed_dests
        written = time.monotonic()
        for step in steps:
            if self.stop.is_set():
                raise StoppedError("replicator stopped")
            info = read_root_info(tier, step)
            entry = status.versions.get(step)
            if info is not None and entry is not None and entry.save_id == info.save_id and self._done(entry, dests):
                continue  # every copy is made: no manifest to read (a pass over many versions stays short)
            # Held against GC while it is read: the Checkpointer's retention would otherwise
            # delete it, or retire it as a spare tree the next save overwrites in place.
            with pin_version(tier, step) as held:
                if held:
                    self._copy(source, step, info, dests, state_dir, failed)
            if time.monotonic() - written > 1.0:  # progress for `ckpt ls`, without an fsync per version
                self._write_status(source)
                written = time.monotonic()
        for gone in set(status.versions) - set(steps):
            status.versions.pop(gone)
        try:
            self._gc(source, dests)
        finally:  # a GC that failed (the next pass tries again) loses none of this pass's record
            self._write_status(source)

    def _copy(
        self, source: str, step: int, info: RootInfo | None, dests: list[Destination], state_dir: str, failed: set[str]
    ) -> None:
        """Make the copies of `step` that its status lacks (the caller holds a pin on it)."""
        status = self._status[source]
        tier = self._source_tiers[source]
        entry = status.versions.get(step)
        try:
            manifest = read_manifest(tier, step)
        except VersionNotFoundError:
            return  # deleted (a GC) since the listing: nothing to copy
        except CkptError as e:  # tried again on the next pass; `--once` reports it
            log.warning("step %d on %s is unreadable, not replicated: %s", step, source, e)
            self.errors.append(f"step {step} on {source} is unreadable, not replicated: {self._redact(str(e))}")
            return
        writers = list(info.writers) if info is not None else []
        if entry is None or entry.save_id != manifest.save_id:
            entry = status.versions[step] = VersionStatus(manifest.save_id, manifest.created)
        for dest in dests:
            copy = entry.copies.get(dest.url)
            if copy is not None and copy.state == "verified":
                continue
            if dest.url in failed:
                if copy is None or copy.state == "pending":
                    entry.copies[dest.url] = CopyState("failed", time.time(), error=self._not_tried(dest))
                continue
            try:
                ok = self._push(source, step, manifest, writers, dest, state_dir, 0)
            except StoppedError:
                raise
            except Exception as e:  # noqa: BLE001 - a lost disk must not stop the other copies: recorded as failed
                if not _of_the_version(e):
                    failed.add(dest.url)
                entry.copies[dest.url] = CopyState("failed", time.time(), error=self._failed(step, dest, e))
                continue
            entry.copies[dest.url] = CopyState("verified" if ok else "pending", time.time())
        if self.remote is not None:
            self._push_remote(source, step, manifest, writers, entry, state_dir, failed)

    def _write_status(self, source: str) -> None:
        """Record the status beside the source, if its disk lets it: on a full disk the
        copies go on, and the GC they allow frees it (the next write records them). Until
        then `ckpt gc` reads the last status written, which requires more, never less."""
        try:
            write_status(source, self._status[source])
        except OSError as e:
            log.warning("cannot write the replicator's status of %s (kept in memory): %s", source, e)

    def _done(self, entry: VersionStatus, dests: list[Destination]) -> bool:
        """Whether every copy of the version exists, verified (or expired on the remote)."""
        if any((c := entry.copies.get(d.url)) is None or c.state != "verified" for d in dests):
            return False
        if self.remote is None:
            return True
        url = self._redact(self.remote.url)
        return entry.remote is not None and entry.remote.state in REMOTE_DONE and entry.remote.url == url

    def _push_remote(
        self,
        source: str,
        step: int,
        manifest: Manifest,
        writers: list[int],
        entry: VersionStatus,
        state_dir: str,
        failed: set[str],
    ) -> None:
        assert self.remote is not None
        url = self._redact(self.remote.url)
        done = entry.remote
        # verified for *this* remote: a status left by a run with another --to does not count
        if done is not None and done.state in REMOTE_DONE and done.url == url:
            return
        if self.remote.url in failed:
            if done is None or done.url != url or done.state == "pending":
                entry.remote = CopyState("failed", time.time(), url=url, error=self._not_tried(self.remote))
            return
        part = manifest.root_of(writers[0]) if writers else 0
        try:
            # (inside: the check lists the remote, whose failure is the remote's, as a push's is)
            if self._expired_on_remote(entry, manifest):
                entry.remote = CopyState("expired", time.time(), url=url)
                return
            waiting = done is not None and done.state == WAITING and done.url == url
            ok = self._push(source, step, manifest, writers, self.remote, state_dir, part, waiting=waiting)
        except StoppedError:
            raise
        except Exception as e:  # noqa: BLE001 - as for the replicas: recorded as failed
            if not _of_the_version(e):
                failed.add(self.remote.url)
            entry.remote = CopyState("failed", time.time(), url=url, error=self._failed(step, self.remote, e))
            return
        entry.remote = CopyState("verified" if ok else WAITING, time.time(), url=url)

    def _lacks_files(self, source: str, dest: Destination, step: int) -> bool:
        """Whether `dest` lacks a file of `source`'s version `step`, or holds one at another size."""
        return bool(missing_files(dest.tier, step, part_sizes(self._source_tiers[source], step)))

    def _expired_on_remote(self, entry: VersionStatus, manifest: Manifest) -> bool:
        """Whether a version whose part this node has uploaded, and which the remote does
        not hold now, was completed by the other nodes and then deleted by the remote's
        retention (which would delete it again at once). Uploading the part again would
        leave a directory that never gets a manifest, and the local version would never
        count as redundant, so local retention would keep it forever."""
        if entry.remote is None or entry.remote.state != WAITING:
            return False
        return self._remote_policy_expires(manifest)

    def _remote_policy_expires(self, manifest: Manifest) -> bool:
        """Whether the remote's retention deletes this version, given what the remote holds."""
        policy = self.config.remote_policy
        if policy is None or self.remote is None:
            return False
        keys = None if manifest.keys is None else frozenset(manifest.keys)
        candidate = VersionInfo(
            manifest.step,
            manifest.created,
            True,
            bool(manifest.meta.get("milestone")),
            keys=keys,
            partial=manifest.partial,
        )
        return expired(self._remote_now(), candidate, policy)

    def _remote_now(self) -> list[VersionInfo]:
        """The remote's versions, listed once per pass."""
        assert self.remote is not None
        if self._remote_listing is None:
            self._remote_listing = judge(self.remote.tier)[0]
        return self._remote_listing

    def _push(
        self,
        source: str,
        step: int,
        manifest: Manifest,
        writers: list[int],
        dest: Destination,
        state_dir: str,
        part: int,
        *,
        waiting: bool = False,
    ) -> bool:
        """Copy, verify and commit; True once the destination holds the version (or this part).
        Resumable: chunks the journal records as verified (and still there) are not sent again.
        `waiting`: this node's part was sent and recorded on the shared remote in an earlier
        pass (publish_waiting)."""
        dest.check_disk()
        there = committed_info(dest.tier, step)
        if there is not None and there.save_id == manifest.save_id:
            if dest.kind == "shared" or set(writers) <= set(there.writers):
                # The status did not vouch for it (it was lost, or a pass died before recording
                # it): a replica counts once it holds every file of the source's version at its
                # size (one listing each), else it is unpublished and copied again.
                if dest.kind == "shared" or not self._lacks_files(source, dest, step):
                    return True
                log.warning("%s: step %d is committed there with files missing; copying it again", dest.url, step)
                with deleting(dest.tier, step) as free:
                    if not free:
                        return False  # being read: next pass
                    delete_version(dest.tier, step)
        elif dest.tier.exists(join_key(version_dirname(step), MANIFEST_NAME)):
            # The destination holds step `step` committed from another save (the source was
            # saved again with overwrite=True). Copying into it would replace the chunks a
            # committed manifest names. A replica is a copy of this source alone: its stale
            # version is unpublished first (crash-safe, under readers' pins). The shared
            # remote's is not this node's to replace.
            if dest.kind == "shared":
                raise VersionExistsError(f"{self._redact(dest.url)} holds step {step} from another save; not replaced")
            with deleting(dest.tier, step) as free:
                if not free:
                    return False  # being read: next pass
                delete_version(dest.tier, step)

        def count(n: int) -> None:
            self.bytes_sent += n
            metrics.UPLOAD_BYTES.labels(tier=dest.kind).inc(n)

        transfer = Transfer(
            source=self._source_tiers[source],
            step=step,
            manifest=manifest,
            dest=dest,
            journal=journal_for(state_dir, dest, step, manifest.save_id),
            limiter=self.limiter,
            stop=self.stop,
            threads=self.config.threads,
            readback=self.config.readback,
        )
        if waiting:
            committed = publish_waiting(transfer, writers, part)
            if committed is not None:
                return committed
        if dest.kind == "shared" and not clear_to_send(transfer, part):
            return False  # another save of the step is being committed there: next pass
        sizes = copy_files(transfer, count)
        return publish(transfer, writers, part, sizes)

    def _not_tried(self, dest: Destination) -> str:
        """The error recorded for a copy skipped because its destination failed in this pass."""
        return f"not tried: {self._redact(dest.url)} failed in this pass ({self._last_error.get(dest.url, '')})"

    def _failed(self, step: int, dest: Destination, error: Exception) -> str:
        """Count and log a failed copy (once per destination until its error changes); the message."""
        metrics.REPLICATION_FAILURES.inc()
        msg = self._redact(f"{type(error).__name__}: {error}")
        self.errors.append(f"{self._redact(dest.url)}: {msg}")
        if self._last_error.get(dest.url) != msg:
            self._last_error[dest.url] = msg
            where = self._redact(dest.url)
            log.error("copy of step %d to %s failed (the other copies go on): %s", step, where, msg)
        return msg

    def _gc(self, source: str, dests: list[Destination]) -> None:
        policy = self.config.local_policy
        status = self._status[source]
        if policy is not None:
            redundant = with_peer_rule(source, redundant_saves(status))  # a job's peer copies may need more
            confirm = functools.partial(self._still_copied, source, dests)
            result = collect(self._source_tiers[source], policy, redundant=redundant, confirm=confirm)
            for step in result.deleted:
                status.versions.pop(step, None)
            self._gc_replicas(source, dests, policy)
        if (
            self.remote is not None
            and self.config.remote_policy is not None
            and self.remote.url not in self._failed_dests
        ):
            result = collect(self.remote.tier, self.config.remote_policy, abandon_after_s=self.config.abandon_after_s)
            for step in result.deleted:  # no status claims a copy the remote no longer holds
                for entry in (s.versions[step] for s in self._status.values() if step in s.versions):
                    if entry.remote is not None and entry.remote.state == "verified":
                        entry.remote = CopyState("expired", entry.remote.at, url=entry.remote.url)  # at: reached it
            for step, why in result.unjudged.items():
                log.warning("gc of the remote kept step %d, which it could not read: %s", step, self._redact(why))

    def _still_copied(self, source: str, dests: list[Destination], step: int) -> bool:
        """Whether `step`'s copies that the status counts as verified are still there, asked
        just before local retention deletes the source's version on their strength: a copy
        deleted since (by hand, a bucket's lifecycle rule, another job's GC) would leave the
        version nowhere. A copy found gone is marked failed, so a later pass makes it again;
        copies that cannot be checked now keep the version (no proof either way)."""
        status = self._status[source]
        entry = status.versions.get(step)
        if entry is None:
            return True  # no copies are required of it
        counted = [d for d in dests if (c := entry.copies.get(d.url)) is not None and c.state == "verified"]
        remote = self.remote
        if (
            remote is None
            or entry.remote is None
            or (entry.remote.state, entry.remote.url) != ("verified", status.remote)
        ):
            remote = None  # none required, not verified, or expired there by the remote's retention
        elif remote.url in self._failed_dests:
            return False  # it failed in this pass: not waited on again, and nothing is proven
        try:
            gone = [d for d in counted if not _holds(d, step, entry.save_id)]
            remote_gone = remote is not None and not _holds(remote, step, entry.save_id)
        except (CkptError, OSError) as e:
            log.warning("gc %s: step %d kept: its copies cannot be checked now: %s", source, step, self._redact(str(e)))
            return False
        now, why = time.time(), "gone since it was verified"
        for d in gone:
            entry.copies[d.url] = CopyState("failed", now, error=why)
        if remote_gone and entry.remote is not None:
            try:  # another node's GC of the remote, by the remote's policy: not to be sent again
                expired_there = self._remote_policy_expires(read_manifest(self._source_tiers[source], step))
            except (CkptError, OSError) as e:
                log.warning("gc %s: step %d kept: %s", source, step, self._redact(str(e)))
                return False
            if expired_there:
                entry.remote = CopyState("expired", now, url=entry.remote.url)
                remote_gone = False
            else:
                entry.remote = CopyState("failed", now, url=entry.remote.url, error=why)
        for where in [d.url for d in gone] + ([remote.url] if remote_gone and remote is not None else []):
            log.warning("gc %s: step %d's copy on %s is %s; it is made again", source, step, self._redact(where), why)
        return copies_done(status, entry) and remote_done(status, entry)

    def _gc_replicas(self, source: str, dests: list[Destination], policy: Policy) -> None:
        """Collect replica copies of versions the source no longer holds (deleted by this GC,
        by `ckpt gc`, or by hand), under the local policy and readers' pins.

        Kept: every version the source still holds (its required copies), and every version
        the remote is not done with (not there yet, nor expired there): the source would not
        have deleted those either. Nothing at all is collected from a source that lists no
        version: a lost or unmounted disk leaves its replicas as the only local copies.
        """
        on_source = set(committed_steps(self._source_tiers[source]))
        if not on_source:
            return
        for dest in dests:
            try:
                dest.check_disk()
                if not dest.tier.capabilities.local_files or not dest.tier.listdir(""):
                    continue
                judged = judge(dest.tier)
                pinned = on_source | self._remote_pending(judged[0])
                collect(dest.tier, policy, pinned=pinned, versions=judged)
            except (CkptError, OSError) as e:  # one failing replica disk must not stop the rest
                log.warning("gc of replica %s failed: %s", dest.url, e)

    def _remote_pending(self, versions: list[VersionInfo]) -> set[int]:
        """Of `versions`, the steps the remote is not done with: neither there nor expired."""
        if self.remote is None:
            return set()
        if self.remote.url in self._failed_dests:  # not listed again in this pass: all kept
            return {v.step for v in versions}
        listing = self._remote_now()
        there = {v.step for v in listing if v.intact}  # a damaged or unread copy there is none yet
        policy = self.config.remote_policy
        return {v.step for v in versions if v.step not in there and (policy is None or not expired(listing, v, policy))}


def _holds(dest: Destination, step: int, save_id: str) -> bool:
    """Whether `dest` holds `step` committed, and from the save `save_id`."""
    info = read_root_info(dest.tier, step)
    return info is not None and info.save_id == save_id and is_committed(dest.tier, step)


def _of_the_version(e: Exception) -> bool:
    """Whether a failed copy is this version's own (its source damaged or failing to read, the
    remote holding another save of its step, or keys longer than the remote takes), not its
    destination's: the other versions are still copied there in the same pass."""
    return isinstance(e, (CorruptVersionError, VersionExistsError, UnsupportedStateError, SourceReadError))


def _last_status(source: str) -> Status:
    """What an earlier replicator recorded for `source`; a record that cannot be read is
    started anew, with a warning: copies not in it are made again, and a copy a
    destination holds committed (verified before it was committed) counts as it is."""
    try:
        return read_status(source) or Status()
    except (CkptError, OSError) as e:
        log.warning("%s: the replicator's status cannot be read, so it starts anew: %s", source, e)
        return Status()


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _steps(steps: list[int], most: int = 12) -> str:
    """`step 3` / `steps 2, 4, 6` (the first `most` of a long list, then how many in all)."""
    shown = ", ".join(map(str, steps[:most])) + (f", ... ({len(steps)} in all)" if len(steps) > most else "")
    return ("step " if len(steps) == 1 else "steps ") + shown
