"""One rank of the crash harness's training job (tests/crash_harness.py starts two).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests._harness_worker SPEC_JSON

A small MLP with Adam, data-parallel over gloo, plus a hand-sharded tensor (`ckpt.Shard`)
whose rows differ per rank. Every step is deterministic (the data of step s comes from
a generator seeded with s and the rank; gradients are summed by all_reduce), so a step
re-done after a restore produces the same bits. The rank saves every step to its own
root (every other incarnation with deferred staging); the harness's replicator daemons
copy the versions elsewhere.

Journals (append-only JSON lines, fsynced), under SPEC["journal"]:
- `expected.rank<r>.jsonl`: before save(s): {"step": s, "sums": {key: digest}, "milestone": b};
  after save(s+1) returned (so s is committed) or after close(): {"committed": s}.
- `restored.rank<r>.jsonl`: after restore(): {"inc": n, "step": s or null, "sums": ...}.

`sums` maps each tensor's key path ("model.0.weight", "optim.state.0.exp_avg",
"shard" = this rank's rows only) to "<dtype><shape>:<xxh3 of its bytes>".
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

STACKS_SIGNAL = signal.SIGUSR2  # dumps a harness process's threads into its log
ROWS, COLS = 64, 256  # this rank's piece of the sharded tensor: (2 * ROWS, COLS) in all


def digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).numpy().tobytes()
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{xxhash.xxh3_64_hexdigest(data)}"


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key path, tensor) for every tensor of a nested dict/list, keys joined with '.'."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))


def sums_of(
    model: torch.nn.Module, opt: torch.optim.Optimizer, shard: torch.Tensor, counter: torch.Tensor
) -> dict[str, str]:
    tree = {"model": model.state_dict(), "optim": opt.state_dict(), "counter": counter}
    out = {k: digest(v) for k, v in flatten(tree)}
    out["shard"] = digest(shard)
    return out


def _age() -> float:
    """Seconds since this process was started (Linux)."""
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


class Journal:
    """Append-only JSON lines, each fsynced before append() returns."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def append(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(self.fd)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def main(spec: dict[str, Any]) -> int:
    from ckpt import Checkpointer, Shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} inc{spec['inc']} %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    marks = [("imports", time.monotonic())]
    started = marks[0][1] - _age()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=spec["timeout_s"]))
    model, opt = build()
    params = list(model.parameters())
    shard = torch.zeros(ROWS, COLS)
    counter = torch.zeros((), dtype=torch.int64)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "shard": Shard(shard, (ROWS * world, COLS), (ROWS * rank, 0)),
        "counter": counter,
        "meta": {"step": 0},
    }
    expected = Journal(os.path.join(spec["journal"], f"expected.rank{rank}.jsonl"))
    restored = Journal(os.path.join(spec["journal"], f"restored.rank{rank}.jsonl"))
    stop_file, ready_file = spec["stop_file"], f"{spec['ready_prefix']}.rank{rank}"
    root = spec["roots"][rank]
    marks.append(("process group", time.monotonic()))
    # Every other incarnation saves with deferred staging: the optimizer is in the state, so
    # its parameters and moments are copied after save() returns, while the next step runs.
    with Checkpointer(
        root,
        tiers=spec["tiers"][rank],
        capture_rng=False,
        timeout=timedelta(seconds=spec["timeout_s"]),
        deferred_staging=spec["inc"] % 2 == 1,
        peer_copies=1,  # each root's part also on the other node: a node's loss (kind "node") needs no remote
        keep_last=spec["keep_last"],  # prunes the peer copies (and the root, beside its daemon)
        peer_drain_timeout_s=spec["timeout_s"],
    ) as ck:
        marks.append(("open", time.monotonic()))
        start = ck.restore(state)
        marks.append(("restore", time.monotonic()))
        starts = [started] + [t for _, t in marks]
        logging.getLogger("harness").info(
            "start-up: %s", ", ".join(f"{n} {t - p:.2f}s" for (n, t), p in zip(marks, starts))
        )
        restored.append(
            {"inc": spec["inc"], "step": start, "sums": sums_of(model, opt, shard, counter) if start else {}}
        )
        if start is not None and (state["meta"]["step"] != start or int(counter) != start):
            print(f"restored step {start} but the state says {state['meta']} / counter {int(counter)}", flush=True)
            return 3
        with open(ready_file + ".tmp", "w") as f:
            f.write(str(start or 0))
        os.replace(ready_file + ".tmp", ready_file)
        step = start or 0
        last_saved: int | None = None
        while True:
            step += 1
            gen = torch.Generator().manual_seed(step * world + rank)
            x = torch.randn(16, 64, generator=gen)
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()  # type: ignore[no-untyped-call]
            stop = 1.0 if rank == 0 and os.path.exists(stop_file) else 0.0
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None] + [torch.tensor([stop])])
            dist.all_reduce(flat)  # a sum of two: the same bits on both ranks
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p) / world
                offset += p.numel()
            opt.step()
            shard.add_(torch.randn(ROWS, COLS, generator=gen), alpha=0.01)
            counter.fill_(step)
            state["meta"] = {"step": step}
            tagged = spec["tag_every"] > 0 and step % spec["tag_every"] == 0
            expected.append({"step": step, "sums": sums_of(model, opt, shard, counter), "milestone": tagged})
            ck.save(step, state, milestone=tagged)
            if last_saved is not None:
                expected.append({"committed": last_saved})  # save() waited for it
            last_saved = step
            if flat[-1].item() > 0:
                break
            if spec["step_sleep_s"]:
                time.sleep(spec["step_sleep_s"])
    expected.append({"committed": last_saved})  # close() waited for it
    dist.destroy_process_group()
    return 0


def child(kind: str, payload: Any, env: dict[str, str], log_path: str) -> None:
    """Entry point of every process the harness starts, forked by a multiprocessing
    forkserver that has imported torch and ckpt already (an interpreter that imports them
    takes 3 to 15 s on a small, busy machine). `kind` "trainer": one rank, `payload` its
    spec; "cli": the `ckpt` command line, `payload` its arguments."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The harness sends STACKS_SIGNAL to a process that hangs before it kills it: every
    # thread's stack lands in the log.
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    for k in ("CKPT_FAULT", "CKPT_FAULT_RANK", "CKPT_DELAY"):
        os.environ.pop(k, None)
    os.environ.update(env)
    if kind == "trainer":
        sys.exit(main(payload))
    from ckpt.cli import main as ckpt_cli

    ckpt_cli.main(args=payload, prog_name="ckpt")


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
