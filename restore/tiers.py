"""Storage tiers the restore layer reads from. Local roots are the first tier; replica
disks and remote stores (the replicator's) plug in through the same interface.

Call order: `committed()` to list, then `manifest(step)`, then `version_dir(step)` for
chunk reads. A tier that cannot be reached raises TierUnavailableError.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

from store import commit
from store.manifest import Manifest

__all__ = ["Tier", "LocalTier", "Candidate"]


@dataclass(frozen=True)
class Candidate:
    """A committed version as one tier sees it."""

    step: int
    save_id: str
    world_size: int  # ranks that saved it
    writers: tuple[int, ...]  # ranks whose chunks this tier holds


class Tier(ABC):
    name: str

    @abstractmethod
    def committed(self) -> list[Candidate]:
        """Committed versions on this tier, oldest first."""

    @abstractmethod
    def manifest(self, step: int) -> Manifest:
        """The parsed, validated manifest; raises VersionNotFoundError or ManifestError."""

    @abstractmethod
    def version_dir(self, step: int) -> str:
        """A local directory holding the version's files (tiers that are not local fetch first)."""


class LocalTier(Tier):
    """A root directory on a local filesystem."""

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        self.name = f"local:{self.root}"

    def committed(self) -> list[Candidate]:
        out = []
        for step in commit.committed_steps(self.root):
            info = commit.read_root_info(self.version_dir(step))
            writers = info.get("writers")
            save_id = info.get("save_id")
            world = info.get("world_size")
            if isinstance(writers, list) and isinstance(save_id, str) and isinstance(world, int):
                out.append(Candidate(step, save_id, world, tuple(int(w) for w in writers)))
        return out

    def manifest(self, step: int) -> Manifest:
        return commit.read_manifest(self.root, step)

    def version_dir(self, step: int) -> str:
        return os.path.join(self.root, commit.version_dirname(step))
