"""ckpt: fault-tolerant, asynchronous checkpoints for distributed PyTorch training.

from ckpt import Checkpointer
with Checkpointer("/nvme/ckpt/run1") as ck:
    start = ck.restore(state)
    ck.save(step, state)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckpt.store.errors import (
    CkptError,
    CollectiveError,
    CorruptVersionError,
    IncompleteVersionError,
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

if TYPE_CHECKING:
    from ckpt.checkpointer import Checkpointer
    from ckpt.config import CheckpointerConfig
    from ckpt.multitier import MultiTier
    from ckpt.restore.to_safetensors import export_safetensors
    from ckpt.sampler import DistributedSampler
    from ckpt.shard import Shard

# Imported on first use: they import torch (about 2 s), which `ckpt --help`, `ckpt ls`
# and `ckpt verify` never need.
_LAZY = {
    "Checkpointer": "ckpt.checkpointer",
    "CheckpointerConfig": "ckpt.config",
    "MultiTier": "ckpt.multitier",
    "DistributedSampler": "ckpt.sampler",
    "Shard": "ckpt.shard",
    "export_safetensors": "ckpt.restore.to_safetensors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "MultiTier",
    "DistributedSampler",
    "Shard",
    "export_safetensors",
    "CkptError",
    "CorruptVersionError",
    "ManifestError",
    "NonFiniteError",
    "StagingRaceError",
    "RankFailures",
    "CollectiveError",
    "ReshardError",
    "RootLockedError",
    "StateMismatchError",
    "StoppedError",
    "TierUnavailableError",
    "UnsupportedSchemaError",
    "UnsupportedStateError",
    "VersionExistsError",
    "VersionNotFoundError",
    "IncompleteVersionError",
]

__version__ = "0.1.0"
