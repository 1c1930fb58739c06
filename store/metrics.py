"""Prometheus metrics shared by the Checkpointer and the replicator (prometheus-client).

The objects live in the default registry; `serve(port)` exposes them over HTTP on
127.0.0.1 (or a given address). Each process exposes its own: the daemon with
`--metrics-port`, a trainer with `Checkpointer(metrics_port=...)` (port + local rank).
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

__all__ = [
    "SAVE_STALL",
    "COMMIT_LATENCY",
    "BYTES_WRITTEN",
    "SAVE_FAILURES",
    "STRAGGLERS",
    "VERIFY_ERRORS",
    "REPLICATION_LAG",
    "UPLOAD_BYTES",
    "UPLOAD_THROUGHPUT",
    "REPLICATION_FAILURES",
    "NOT_REPLICATED",
    "RETENTION_DELETED",
    "ROOT_FREE_BYTES",
    "LOW_SPACE_WARNINGS",
    "serve",
]

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

SAVE_STALL = Histogram("ckpt_save_stall_seconds", "Time save() blocked the training loop", buckets=_BUCKETS)
COMMIT_LATENCY = Histogram(
    "ckpt_commit_latency_seconds", "From save() to the version being committed", buckets=_BUCKETS
)
BYTES_WRITTEN = Counter("ckpt_bytes_written_total", "Chunk bytes this process wrote to local disk")
SAVE_FAILURES = Counter("ckpt_save_failures_total", "Saves that failed and were not committed", ["reason"])
STRAGGLERS = Counter(
    "ckpt_stragglers_total", "Saves where a rank's write time exceeded the median by the threshold", ["rank"]
)
VERIFY_ERRORS = Counter("ckpt_verification_errors_total", "Chunks or copies that failed their checksum")
REPLICATION_LAG = Gauge("ckpt_replication_lag_seconds", "Age of the newest committed version not yet on the remote")
UPLOAD_BYTES = Counter("ckpt_upload_bytes_total", "Bytes the replicator copied or uploaded", ["tier"])
UPLOAD_THROUGHPUT = Gauge("ckpt_upload_throughput_bytes_per_second", "Throughput of the last replication pass")
REPLICATION_FAILURES = Counter("ckpt_replication_failures_total", "Replication attempts that failed")
NOT_REPLICATED = Gauge(
    "ckpt_versions_not_replicated",
    "Committed versions not yet on every required copy and the remote, after the last replication pass",
)
RETENTION_DELETED = Counter("ckpt_retention_deleted_total", "Versions the Checkpointer's own retention deleted")
ROOT_FREE_BYTES = Gauge(
    "ckpt_root_free_bytes", "Free bytes on the filesystem of this process's root, after its last commit"
)
LOW_SPACE_WARNINGS = Counter(
    "ckpt_low_space_warnings_total",
    "Commits after which the root's filesystem had room for fewer than two more versions",
)

_served: dict[int, object] = {}
_lock = threading.Lock()


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Expose the metrics over HTTP (once per port); returns the port."""
    with _lock:
        if port not in _served:
            _served[port] = start_http_server(port, addr=addr)
    return port
