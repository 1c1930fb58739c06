"""The one exception hierarchy of the project; `ckpt` re-exports it.

Errors subclass the builtin they refine, so callers that catch `FileNotFoundError`
or `ValueError` keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = [
    "CkptError",
    "VersionNotFoundError",
    "IncompleteVersionError",
    "VersionExistsError",
    "CorruptVersionError",
    "TierUnavailableError",
    "ReshardError",
    "RankFailures",
    "CollectiveError",
    "RootLockedError",
    "UnsupportedStateError",
    "StateMismatchError",
    "ManifestError",
    "UnsupportedSchemaError",
    "NonFiniteError",
    "StagingRaceError",
    "StoppedError",
]


class CkptError(Exception):
    """Base of every error raised by ckpt.

    `cli`: the message in the CLI's words where the API's names an argument of a call
    (`if_incomplete=`, `strict=`, `trust=`); the `ckpt` command prints it instead."""

    cli: str | None = None


E = TypeVar("E", bound=CkptError)


def for_cli(error: E, message: str) -> E:
    """`error`, with the message the CLI prints in its place (CkptError.cli)."""
    error.cli = message
    return error


class VersionNotFoundError(CkptError, FileNotFoundError):
    """The requested step is not committed on any reachable root."""


class IncompleteVersionError(VersionNotFoundError):
    """Versions are committed, but some ranks' part of each is on no tier searched (a node
    replaced with empty disks, a root left out): restore names the versions and the
    missing ranks instead of starting fresh. `restore(state, if_incomplete="fresh")`
    starts fresh instead, by choice."""


class VersionExistsError(CkptError, FileExistsError):
    """A save targeted a step that is already committed and overwrite was not asked for."""


class CorruptVersionError(CkptError):
    """A chunk or manifest does not match what the manifest promises.

    `causes`: when the damage was found by other ranks of a collective restore, each such
    rank's finding (rank -> "TypeName: message"); empty when this rank found it.
    `io_error`: the bytes could not be read (an I/O error of a local file): a bad sector,
    or a read that fails once, so a reader tries again before it calls it damage."""

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        expected: str = "",
        actual: str = "",
        causes: Mapping[int, str] | None = None,
        io_error: bool = False,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual
        self.causes = dict(causes or {})
        self.io_error = io_error


class ManifestError(CorruptVersionError, ValueError):
    """A manifest does not parse or fails validation (schema, paths, shapes, dtypes)."""


class UnsupportedSchemaError(ManifestError):
    """A manifest of a schema this ckpt does not read (written by a newer ckpt): no proof of
    damage, so GC keeps such a version rather than judging it."""


class TierUnavailableError(CkptError, OSError):
    """A storage tier (a root, a disk, a remote) cannot be reached or written."""


class ReshardError(CkptError, ValueError):
    """The saved layout cannot be mapped onto the current one."""


class RootLockedError(CkptError, BlockingIOError):
    """Another process already writes to this root."""


class UnsupportedStateError(CkptError, TypeError):
    """The state holds an object ckpt will not serialise; the message names its key."""


class StateMismatchError(CkptError, ValueError):
    """The target state does not match the saved one (missing key, other shape or dtype)."""


class RankFailures(CkptError):
    """A collective save or restore failed on one or more ranks; `causes` maps each failed
    rank to its error ("TypeName: message")."""

    def __init__(self, causes: Mapping[int, str]) -> None:
        self.causes = dict(causes)
        detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(self.causes.items()))
        super().__init__(f"failed on {len(self.causes)} rank(s): {detail}")


class CollectiveError(CkptError, RuntimeError):
    """A collective of the checkpointer's own gloo group failed: another rank died or hung
    past the timeout, or the network broke. The last committed version is intact; a version
    whose commit was under way is rolled forward or discarded when the roots are next
    opened. The Checkpointer cannot save again in this job (its group is broken)."""


class NonFiniteError(CkptError, ValueError):
    """check_finite found NaN or Inf in a tensor; the version was not committed."""


class StagingRaceError(CkptError, RuntimeError):
    """With deferred staging, a saved tensor changed in place before its copy ended; the
    version was not committed (see Checkpointer.wait_staged)."""


class StoppedError(CkptError):
    """A replicator was asked to stop; the copy in flight was abandoned before its commit."""
