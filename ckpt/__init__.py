"""ckpt: fault-tolerant, asynchronous checkpoints for distributed PyTorch training.

from ckpt import Checkpointer
with Checkpointer("/nvme/ckpt/run1") as ck:
    start = ck.restore(state)
    ck.save(step, state)
"""

from ckpt.checkpointer import Checkpointer
from ckpt.config import CheckpointerConfig
from ckpt.sampler import DistributedSampler
from ckpt.shard import Shard
from ckpt.store.errors import (
    CkptError,
    CorruptVersionError,
    ManifestError,
    NonFiniteError,
    RankFailures,
    ReshardError,
    RootLockedError,
    StagingRaceError,
    StateMismatchError,
    StoppedError,
    TierUnavailableError,
    UnsupportedSchemaError,
    UnsupportedStateError,
    VersionExistsError,
    VersionNotFoundError,
)

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "DistributedSampler",
    "Shard",
    "CkptError",
    "CorruptVersionError",
    "ManifestError",
    "NonFiniteError",
    "StagingRaceError",
    "RankFailures",
    "ReshardError",
    "RootLockedError",
    "StateMismatchError",
    "StoppedError",
    "TierUnavailableError",
    "UnsupportedSchemaError",
    "UnsupportedStateError",
    "VersionExistsError",
    "VersionNotFoundError",
]

__version__ = "0.1.0"
