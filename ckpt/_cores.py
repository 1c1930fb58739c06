"""The cores a rank can count on for its own threads."""

from __future__ import annotations

import os

from ckpt._roots import local_world

__all__ = ["rank_cores"]


def rank_cores() -> int:
    """This process's CPU affinity, or, where it is not pinned to cores of its own, its
    share of the machine's cores with this node's other ranks (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0))
    if cores == os.cpu_count():
        cores //= local_world()
    return max(1, cores)
