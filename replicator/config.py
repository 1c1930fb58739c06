"""`ReplicatorConfig`: every tunable of the replicator, validated, never rewritten."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt.replicator.policy import Policy
from ckpt.store.tier import local_location

_MIN_BWLIMIT_MBPS = 0.001  # below, the limiter's waits overflow a timestamp

__all__ = ["ReplicatorConfig"]


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
    """Verify each copy against the manifest's xxh3: by the store's own checksum of the bytes
    sent where it gives one (S3's ETag), else by reading the copy back. False: by size only."""
    interval_s: float = 0.5
    local_policy: Policy | None = None
    """Retention of the source roots (and their replicas); None keeps everything."""
    remote_policy: Policy | None = None
    """Retention of the remote; None keeps everything."""
    drain_timeout_s: float = 120.0
    """The last pass a Checkpointer's close() makes ends after this long (and a request in
    flight within its timeout); what it did not copy or upload is reported (a warning naming
    the steps, `ckpt_versions_not_replicated`, `ckpt ls`) and left to the next replicator
    run. An unreachable remote ends it sooner: a dead endpoint fails within a few seconds."""
    abandon_after_s: float = 6 * 3600.0
    """A remote version directory without a manifest in which nothing was written for this
    long is an upload no replicator is working on (a live one rewrites its part record every
    pass): the remote's GC collects it (with remote_policy set)."""

    def __post_init__(self) -> None:
        roots: object = self.replica_roots
        if isinstance(roots, (str, bytes)) or not isinstance(roots, (tuple, list)):
            raise ValueError(f"replica_roots is a sequence of paths, not {roots!r}")
        if self.remote == "" or "" in self.replica_roots:
            # an unset variable (`--to "$REMOTE"`): "" would open the working directory
            raise ValueError("the remote and the replica roots must not be empty (no remote: None)")
        for where in (*([] if self.remote is None else [self.remote]), *self.replica_roots):
            local_location(where)  # a file: URL of no path of this machine: ValueError
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.replicas - 1 > len(self.replica_roots):
            raise ValueError(f"replicas={self.replicas} needs at least {self.replicas - 1} replica roots")
        if self.bwlimit_mbps is not None and not _MIN_BWLIMIT_MBPS <= self.bwlimit_mbps:  # (nan: no cap at all)
            raise ValueError(f"bwlimit_mbps must be a number of MB/s, at least {_MIN_BWLIMIT_MBPS} (1 kB/s)")
        if self.threads < 1 or not 0 < self.interval_s <= threading.TIMEOUT_MAX:  # (inf, nan: the wait fails)
            raise ValueError(
                f"threads and interval_s must be positive (interval_s at most {threading.TIMEOUT_MAX:.0f})"
            )
        if not self.abandon_after_s > 0:  # (nan too)
            raise ValueError("abandon_after_s must be positive")
        if not self.drain_timeout_s > 0:
            raise ValueError("drain_timeout_s must be positive")
