"""The replicator: copies every committed version of a node's roots onto other disks and
to the shared remote, verifies the copies, records a status, and applies retention.

Runs as the `ckpt replicate` daemon or as a thread of the Checkpointer. One pass
(`run_once`) is idempotent and resumable; `run` repeats it until stopped.

Placement: each chunk must exist on `replicas` distinct disks, the source's included.
The part a source root holds is copied to `<replica root>/replicas/<source label>/`
on replica roots whose disk differs from the source's and from each other's.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.replicator.gc import gc_local, gc_remote, local_versions, remote_versions
from ckpt.replicator.policy import Policy, VersionInfo, expired
from ckpt.replicator.push import Destination, Stopped, disk_id, push_version
from ckpt.replicator.ratelimit import RateLimiter
from ckpt.store import commit, metrics, objstore
from ckpt.store.errors import CkptError
from ckpt.store.fsio import FILE_MODE, makedirs
from ckpt.store.manifest import Manifest

__all__ = ["ReplicatorConfig", "Replicator", "STATE_DIR", "REMOTE_DONE", "read_status", "source_label"]

log = logging.getLogger("ckpt.replicator")
STATE_DIR = ".replicator"
WAITING = "waiting for other nodes"
REMOTE_DONE = frozenset({"verified", "expired"})
"""Remote states of a version that need nothing more: its remote copy is verified, or the
remote's retention deleted it (or would delete it on arrival) while this node's part waited."""


@dataclass(frozen=True, kw_only=True)
class ReplicatorConfig:
    replicas: int = 1
    """Copies of every chunk on distinct disks, the original included (1: no extra copy)."""
    replica_roots: tuple[str, ...] = ()
    """Where copies may go: other local disks, or a peer's disk through any fsspec URL."""
    remote: str | None = None
    """The shared tier: s3://bucket/prefix, file:///path, any fsspec URL."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options for URLs (endpoint_url, key, ...). Default: AWS_* variables and files."""
    bwlimit_mbps: float | None = None
    """Cap on the bytes/s all copies and uploads of this replicator send, in MB/s."""
    threads: int = 8
    readback: bool = True
    """Verify each copy by reading it back and comparing its xxh3 with the manifest."""
    interval_s: float = 0.5
    local_policy: Policy | None = None
    """Retention of the source roots (and their replicas); None keeps everything."""
    remote_policy: Policy | None = None
    """Retention of the remote; None keeps everything."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.replicas - 1 > len(self.replica_roots):
            raise ValueError(f"replicas={self.replicas} needs at least {self.replicas - 1} replica roots")
        if self.bwlimit_mbps is not None and self.bwlimit_mbps <= 0:
            raise ValueError("bwlimit_mbps must be positive")
        if self.threads < 1 or self.interval_s <= 0:
            raise ValueError("threads and interval_s must be positive")


def source_label(root: str) -> str:
    """A stable name for a source root in replica directories: host and path."""
    path = os.path.abspath(root).strip("/").replace("/", "_")
    return f"{platform.node()}_{path}"[:200]


def read_status(root: str) -> dict[str, Any]:
    try:
        with open(os.path.join(root, STATE_DIR, "status.json")) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


class Replicator:
    def __init__(self, sources: list[str], config: ReplicatorConfig) -> None:
        self.sources = [os.path.abspath(s) for s in sources]
        self.config = config
        self.limiter = RateLimiter(config.bwlimit_mbps * 1e6 if config.bwlimit_mbps else None)
        self.stop = threading.Event()
        self._status: dict[str, dict[str, Any]] = {s: read_status(s) for s in self.sources}
        self.remote = Destination(config.remote, "shared", config.storage_options) if config.remote else None
        self.bytes_sent = 0
        self._remote_listing: list[VersionInfo] | None = None  # the remote's versions, listed once per pass
        self.errors: list[str] = []  # copies that failed in the last pass
        self._last_error: dict[str, str] = {}
        self._disks: dict[str, str] = {}  # replica root -> the disk it was on when first seen

    def _replica_dests(self, source: str) -> list[Destination]:
        used = {disk_id(source)}
        out: list[Destination] = []
        for r in self.config.replica_roots:
            if len(out) == self.config.replicas - 1:
                break
            # The disk first seen there: if it is unmounted, the path falls through to the disk
            # below the mount point, and copies must not land there and count as replicas.
            d = self._disks.setdefault(r, disk_id(r))
            if d in used:
                continue
            used.add(d)
            url = (
                objstore.join(r, "replicas", source_label(source))
                if objstore.is_url(r)
                else os.path.join(r, "replicas", source_label(source))
            )
            out.append(Destination(url, "replica", self.config.storage_options, disk=d))
        if len(out) < self.config.replicas - 1:
            log.warning("only %d distinct disks for %d copies of %s", len(out) + 1, self.config.replicas, source)
        return out

    def run_once(self) -> dict[str, Any]:
        """One pass over every committed version of every source; returns the status."""
        started, sent = time.monotonic(), self.bytes_sent
        self.errors = []
        for source in self.sources:
            self._pass(source)
        if self.bytes_sent > sent:
            metrics.UPLOAD_THROUGHPUT.set((self.bytes_sent - sent) / max(time.monotonic() - started, 1e-6))
        metrics.REPLICATION_LAG.set(self.lag())
        return self._status

    def lag(self) -> float:
        """Seconds since the oldest committed version that has not reached every copy yet (0: none)."""
        now, oldest = time.time(), None
        for source in self.sources:
            redundant = self.redundant_steps(source)
            for step, entry in self._status.get(source, {}).get("versions", {}).items():
                if int(step) not in redundant:
                    created = float(entry.get("created", now))
                    oldest = created if oldest is None else min(oldest, created)
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def run(self) -> None:
        """Repeat passes until `stop` is set (SIGTERM in the daemon)."""
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except Stopped:
                break
            except CkptError as e:
                metrics.REPLICATION_FAILURES.inc()
                log.warning("replication pass failed: %s", objstore.redact(str(e), self.config.storage_options))
            except Exception as e:  # noqa: BLE001 - a backend error must not end the daemon or the thread
                metrics.REPLICATION_FAILURES.inc()
                msg = objstore.redact(f"{type(e).__name__}: {e}", self.config.storage_options)
                log.error("replication pass failed: %s", msg)
            self.stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))

    def _pass(self, source: str) -> None:
        status = self._status.setdefault(source, {})
        versions: dict[str, Any] = status.setdefault("versions", {})
        state_dir = os.path.join(source, STATE_DIR)
        dests = self._replica_dests(source)
        steps = commit.committed_steps(source)
        self._remote_listing = None
        failed: set[str] = set()  # destinations that failed in this pass: tried again in the next
        for step in steps:
            if self.stop.is_set():
                raise Stopped()
            vdir = os.path.join(source, commit.version_dirname(step))
            info = commit.read_root_info(vdir)
            try:
                manifest = commit.read_manifest(source, step)
            except CkptError as e:
                log.warning("step %d on %s is unreadable, not replicated: %s", step, source, e)
                continue
            raw_writers = info.get("writers", [])
            writers = [int(w) for w in raw_writers] if isinstance(raw_writers, list) else []
            entry = versions.get(str(step))
            if not entry or entry.get("save_id") != manifest.save_id:
                entry = {"save_id": manifest.save_id, "created": manifest.created, "copies": {}, "remote": None}
                versions[str(step)] = entry
            for dest in dests:
                copy = entry["copies"].get(dest.url)
                if (copy and copy["state"] == "verified") or dest.url in failed:
                    continue
                try:
                    ok = self._push(source, step, manifest, writers, dest, state_dir, 0)
                except Exception as e:
                    if isinstance(e, Stopped):
                        raise
                    failed.add(dest.url)
                    entry["copies"][dest.url] = {"state": "failed", "error": self._failed(step, dest, e)}
                    continue
                entry["copies"][dest.url] = {"state": "verified" if ok else "pending", "at": time.time()}
            remote_url = objstore.redact(self.remote.url, self.config.storage_options) if self.remote else ""
            done = entry["remote"] or {}
            # verified for *this* remote: a status left by a run with another --to does not count
            if self.remote is not None and not (done.get("state") in REMOTE_DONE and done.get("url") == remote_url):
                if self.remote.url in failed:
                    continue
                if self._expired_on_remote(entry, manifest):
                    entry["remote"] = {"url": remote_url, "state": "expired", "at": time.time()}
                    self._write_status(source)
                    continue
                part = manifest.ranks[writers[0]].root if writers else 0
                try:
                    ok = self._push(source, step, manifest, writers, self.remote, state_dir, part)
                except Exception as e:
                    if isinstance(e, Stopped):
                        raise
                    failed.add(self.remote.url)
                    entry["remote"] = {
                        "url": remote_url,
                        "state": "failed",
                        "error": self._failed(step, self.remote, e),
                    }
                    continue
                entry["remote"] = {
                    "url": remote_url,
                    "state": "verified" if ok else "waiting for other nodes",
                    "at": time.time(),
                }
            self._write_status(source)
        for gone in set(versions) - {str(s) for s in steps}:
            versions.pop(gone)
        self._gc(source, dests, versions)
        self._write_status(source)

    def _expired_on_remote(self, entry: dict[str, Any], manifest: Manifest) -> bool:
        """Whether a version whose part this node has uploaded, and which the remote does
        not hold now, was completed by the other nodes and then deleted by the remote's
        retention (which would delete it again at once). Uploading the part again would
        leave a directory that never gets a manifest, and the local version would never
        count as redundant, so local retention would keep it forever."""
        policy = self.config.remote_policy
        if policy is None or self.remote is None or (entry["remote"] or {}).get("state") != WAITING:
            return False
        candidate = VersionInfo(manifest.step, manifest.created, True, bool(manifest.meta.get("milestone")))
        return expired(self._remote_now(), candidate, policy)

    def _remote_now(self) -> list[VersionInfo]:
        """The remote's versions, listed once per pass."""
        assert self.remote is not None
        if self._remote_listing is None:
            self._remote_listing = remote_versions(self.remote.url, dict(self.config.storage_options))
        return self._remote_listing

    def _push(
        self, source: str, step: int, manifest: Any, writers: list[int], dest: Destination, state_dir: str, part: int
    ) -> bool:
        def count(n: int) -> None:
            self.bytes_sent += n
            metrics.UPLOAD_BYTES.labels(tier=dest.kind).inc(n)

        return push_version(
            source,
            step,
            manifest,
            writers,
            dest,
            state_dir,
            part_index=part,
            limiter=self.limiter,
            threads=self.config.threads,
            readback=self.config.readback,
            stop=self.stop,
            progress=count,
        )

    def _failed(self, step: int, dest: Destination, error: Exception) -> str:
        """Count and log a failed copy (once per destination until its error changes); the message."""
        metrics.REPLICATION_FAILURES.inc()
        msg = objstore.redact(f"{type(error).__name__}: {error}", self.config.storage_options)
        self.errors.append(f"{dest.url}: {msg}")
        if self._last_error.get(dest.url) != msg:
            self._last_error[dest.url] = msg
            where = objstore.redact(dest.url, self.config.storage_options)
            log.error("copy of step %d to %s failed (the other copies go on): %s", step, where, msg)
        return msg

    def redundant_steps(self, source: str) -> set[int]:
        """Steps of `source` whose required copies (replicas and remote) are all verified (or
        expired on the remote)."""
        need_copies = len(self._replica_dests(source))
        out = set()
        for step, entry in self._status.get(source, {}).get("versions", {}).items():
            copies = sum(1 for c in entry.get("copies", {}).values() if c.get("state") == "verified")
            remote_ok = self.remote is None or (entry.get("remote") or {}).get("state") in REMOTE_DONE
            if copies >= need_copies and remote_ok:
                out.add(int(step))
        return out

    def _gc(self, source: str, dests: list[Destination], versions: dict[str, Any]) -> None:
        policy = self.config.local_policy
        if policy is not None:
            result = gc_local(source, policy, redundant=self.redundant_steps(source))
            for step in result.deleted:
                versions.pop(str(step), None)
            self._gc_replicas(source, dests, policy)
        if self.remote is not None and self.config.remote_policy is not None:
            gc_remote(self.remote.url, self.config.remote_policy, storage_options=dict(self.config.storage_options))

    def _gc_replicas(self, source: str, dests: list[Destination], policy: Policy) -> None:
        """Collect replica copies of versions the source no longer holds (deleted by this GC,
        by `ckpt gc`, or by hand), under the local policy and readers' pins.

        Kept: every version the source still holds (its required copies), and every version
        the remote is not done with (not there yet, nor expired there): the source would not
        have deleted those either. Nothing at all is collected from a source that lists no
        version: a lost or unmounted disk leaves its replicas as the only local copies.
        """
        on_source = set(commit.committed_steps(source))
        if not on_source:
            return
        for dest in dests:
            if not dest.local or not os.path.isdir(dest.prefix):
                continue
            try:
                versions = local_versions(dest.prefix)
                gc_local(dest.prefix, policy, pinned=on_source | self._remote_pending(versions), versions=versions)
            except Exception as e:  # noqa: BLE001 - one failing replica disk must not stop the rest
                log.warning("gc of replica %s failed: %s", dest.url, e)

    def _remote_pending(self, versions: list[VersionInfo]) -> set[int]:
        """Of `versions`, the steps the remote is not done with: neither there nor expired."""
        if self.remote is None:
            return set()
        listing = self._remote_now()
        there = {v.step for v in listing}
        policy = self.config.remote_policy
        return {v.step for v in versions if v.step not in there and (policy is None or not expired(listing, v, policy))}

    def _write_status(self, source: str) -> None:
        status = self._status[source]
        status["updated"] = time.time()
        path = os.path.join(source, STATE_DIR, "status.json")
        makedirs(os.path.dirname(path))
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        # os.open with an explicit mode: open() would create it 0o666 & ~umask
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE), "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)
