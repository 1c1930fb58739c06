"""What has been copied and verified, per destination and version, kept beside the source
root so a restarted replicator resumes without re-sending verified chunks."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading

from ckpt.store.fsio import FILE_MODE, makedirs_within

__all__ = ["Journal"]

log = logging.getLogger("ckpt.replicator")


class Journal:
    """A set of verified relative paths, saved atomically (write temp, fsync, rename)."""

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = root  # the source root it lies in: never made again by a save (makedirs_within)
        self._lock = threading.Lock()
        try:
            with open(path) as f:
                doc = json.load(f)
            self.done: set[str] = set(doc.get("verified", []))
        except (OSError, ValueError):
            self.done = set()

    def add(self, rel: str) -> None:
        with self._lock:
            self.done.add(rel)

    def discard(self, rel: str) -> None:
        with self._lock:
            self.done.discard(rel)

    def save(self) -> None:
        """Write it, if the disk lets it: one that cannot be written (a full disk, the very
        case retention is for) costs a restarted replicator some re-sent files, and must not
        fail the copy, or no version would ever count as copied and none be freed."""
        with self._lock:
            data = json.dumps({"verified": sorted(self.done)}).encode()
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            makedirs_within(self.root, os.path.dirname(self.path))
            # an explicit mode: open() would create it 0o666 & ~umask
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot write the journal %s (kept in memory): %s", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
