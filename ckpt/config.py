"""`CheckpointerConfig`: every tunable of the Checkpointer, validated, never rewritten."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from ckpt.replicator.policy import KeepLast, KeepMilestones, Policy, Union

__all__ = ["CheckpointerConfig"]


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    capture_rng: bool = True
    """Save and restore Python, NumPy, torch CPU and CUDA RNG states, per rank."""

    if_busy: Literal["wait", "skip"] = "wait"
    """When a save is still in flight: wait for it, or skip this save (save() returns False)."""

    max_staging_bytes: int | None = None
    """Bound on the host staging buffer. None: one copy of everything the rank writes.
    Under a smaller bound, save() writes all but the last batch before returning."""

    writer_threads: int = 4
    """Threads writing chunk files in parallel."""

    direct_io: bool = True
    """Write chunks of 1 MiB and more with O_DIRECT, straight from the staging buffer: no
    copy into the page cache, and no gigabytes of dirty pages competing with training for
    memory. Filesystems that refuse O_DIRECT get buffered writes (SaveStats.direct_bytes
    says which were direct)."""

    deferred_staging: bool = False
    """save() returns before copying the tensors an optimizer owns (parameters, moments);
    the commit thread copies them while forward and backward go on. The optimizer (in the
    state, or passed to Checkpointer.guard) waits for the copy in step(). Everything else is
    copied before save() returns. A deferred tensor changed in place during the copy fails
    the save (StagingRaceError) instead of committing a torn version."""

    overlap_writes: bool | None = None
    """Let the writers start on each chunk as soon as save() has copied it, so the commit
    runs alongside the stall instead of after it. It shortens the time to a durable commit
    by up to the copy's time, but the writers' hashing and I/O take CPU and memory bandwidth
    from the copy, so save() blocks longer where cores are few (2 cores: +30-55%).
    None: on with CUDA sources (the copy is DMA), or when this rank has at least
    copy_threads + writer_threads cores (its affinity, or the machine's cores over
    LOCAL_WORLD_SIZE if it is not pinned); off otherwise."""

    copy_threads: int = 2
    """Threads copying tensors into the staging buffer (the training stall), save()'s own
    included: 1 copies on save()'s thread alone. Large chunks are spread over them by size,
    and a state of hundreds of small tensors copies half of them on each of two threads."""

    split_bytes: int = 64 << 20
    """Replicated arrays larger than this are split along dim 0 so several ranks write them."""

    verify_on_restore: bool = True
    """Check xxh3 while restoring. Resharded reads then read whole ~1 MiB checksummed blocks;
    without it, exactly the byte ranges each rank needs."""

    reader_threads: int = 4
    """Threads reading chunks in parallel during restore; from a tier in memory (tmpfs), at
    most this rank's cores (as overlap_writes counts them): there each read is a copy. From
    a disk, each reads chunks of 1 MiB and more with O_DIRECT, 16 MiB at a time, into a
    buffer of its own (the page cache is left to the job)."""

    timeout: timedelta = timedelta(minutes=30)
    """Timeout of the checkpointer's own gloo collectives."""

    check_finite: bool = False
    """Refuse to commit a version with NaN or Inf in any floating tensor (checked on the
    staged copy by the writer threads, so training does not wait for it)."""

    straggler_threshold: float = 0.3
    """Warn (and count in a metric) when a rank's write time exceeds the ranks' median by this fraction."""

    keep_last: int | None = None
    """Retention of the root: after each commit, delete all but the newest `keep_last`
    versions, and the milestones (save(milestone=True), and every `keep_every`-th step);
    never the newest intact version nor one a restore reads (the rules of `ckpt gc`).
    None keeps every version."""

    keep_every: int | None = None
    """With keep_last: also keep every step that is a multiple of this (milestones)."""

    full_every: int | None = None
    """A schedule of params-only versions: the first save of this Checkpointer and every
    `full_every`-th after it hold the whole state (as does every milestone); the others hold
    only `partial_keys`. A save that fails restarts the schedule (the next one is full).
    Restore picks the newest version holding every key it needs, and retention always
    keeps the newest full one."""

    partial_keys: tuple[str, ...] | None = None
    """The top-level keys of the state a params-only version holds, e.g. ("model",)."""

    preemption_signals: tuple[int, ...] = ()
    """Signals (e.g. signal.SIGTERM) that announce a preemption: see
    Checkpointer.reached_preemption. The handlers chain to the ones installed before."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port plus the local rank."""

    peer_copies: int = 0
    """Copies of each root's part of every version on other nodes' disks, sent over the
    job's own process group (ckpt._peers): a node that comes back with empty disks, or a
    replacement, restores from them without the remote. Root i's copies go to roots
    i + k * peer_stride (k = 1..peer_copies); a root's node is its leader's rank //
    LOCAL_WORLD_SIZE, and no copy may land on its own node."""

    peer_stride: int = 1
    """See peer_copies: e.g. the number of nodes per rack, to copy across racks."""

    peer_bwlimit_mbps: float | None = None
    """Cap on the MB/s each root's leader sends for peer copies (training's own traffic
    comes first). None: uncapped."""

    peer_drain_timeout_s: float = 120.0
    """close() lets the peer copies of committed versions finish for at most this long."""

    def retention(self) -> Policy | None:
        """The policy keep_last and keep_every describe; None keeps everything."""
        if self.keep_last is None:
            return None
        return Union((KeepLast(self.keep_last), KeepMilestones(every=self.keep_every)))

    def __post_init__(self) -> None:
        if self.if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', not {self.if_busy!r}")
        if self.max_staging_bytes is not None and self.max_staging_bytes <= 0:
            raise ValueError("max_staging_bytes must be positive or None")
        if self.writer_threads < 1 or self.copy_threads < 1 or self.reader_threads < 1:
            raise ValueError("writer_threads, copy_threads and reader_threads must be at least 1")
        if self.deferred_staging and self.max_staging_bytes is not None:
            raise ValueError("deferred_staging needs the whole state staged at once (max_staging_bytes=None)")
        if self.split_bytes < 1:
            raise ValueError("split_bytes must be positive")
        port = self.metrics_port
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise ValueError(f"metrics_port must be a port number (1-65535) or None, not {port!r}")
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, not {self.keep_last!r}")
        if self.keep_every is not None and (
            self.keep_last is None or type(self.keep_every) is not int or self.keep_every < 1
        ):
            raise ValueError(f"keep_every needs keep_last, and must be a positive int, not {self.keep_every!r}")
        if self.full_every is not None and (
            type(self.full_every) is not int or self.full_every < 1 or not self.partial_keys
        ):
            raise ValueError(
                f"full_every needs partial_keys (the keys a params-only version holds), and must be an int >= 1, "
                f"not {self.full_every!r}"
            )
        keys: object = self.partial_keys  # a str would pass as a tuple of one-letter keys
        if isinstance(keys, str) or (keys is not None and not keys):
            raise ValueError("partial_keys is a non-empty tuple of keys, e.g. ('model',)")
        if self.straggler_threshold <= 0:
            raise ValueError("straggler_threshold must be positive")
        if isinstance(self.peer_copies, bool) or self.peer_copies < 0 or self.peer_stride < 1:
            raise ValueError("peer_copies must be >= 0 and peer_stride >= 1")
        if self.peer_bwlimit_mbps is not None and not self.peer_bwlimit_mbps > 0:
            raise ValueError("peer_bwlimit_mbps must be positive or None")
        if not self.peer_drain_timeout_s > 0:
            raise ValueError("peer_drain_timeout_s must be positive")
