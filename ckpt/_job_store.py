"""The rendezvous of a job whose ranks this process starts on this machine (the demo, the
crash harness, the benchmarks), hosted here as torchrun's agent hosts it."""

from __future__ import annotations

from typing import Any


def job_store(world: int) -> tuple[Any, dict[str, str]]:
    """A TCPStore for a `world`-rank job, served by this process, and the environment each
    rank's env:// init needs to reach it as a client (rank 0 too). Keep the store
    referenced until the ranks have ended.

    Port 0: the OS picks a port free on every address, and the store holds it from then on.
    A port found free on 127.0.0.1 and bound later by rank 0 may be in use on another
    address meanwhile (rank 0's store binds them all): rank 0 fails, and the other ranks
    retry their connection for the whole init timeout (30 min).
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env
