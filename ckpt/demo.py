"""The main job (for now): a 2-rank training loop that checkpoints, dies, and resumes.

    python -m ckpt.demo [--dir DIR] [--steps 30] [--every 5] [--crash-at 17]

Run 1 trains an uninterrupted reference. Run 2 trains with async saves every few steps
and exits abruptly at --crash-at; run 3 restores the newest committed version and
finishes. The losses and final weights of runs 2+3 must equal the reference bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from ckpt import Checkpointer, DistributedSampler

WORLD = 2


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))


def _worker(rank: int, port: int, out_dir: str, ckpt_dir: str | None, steps: int, every: int, crash_at: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, seed=1)
    # The loader draws a base seed from its generator on every iter(); a private generator
    # keeps that draw out of the global RNG, which would otherwise shift after a resume.
    loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    torch.manual_seed(100 + rank)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "sampler": sampler,
        "step": 0,
        "epoch": 0,
        "losses": [],
    }
    ck = Checkpointer(ckpt_dir) if ckpt_dir else None
    if ck is not None and ck.restore(state) is not None and rank == 0:
        print(f"  rank 0 resumed from step {state['step']} (epoch {state['epoch']}, sample {sampler.position})")
    step: int = state["step"]
    epoch: int = state["epoch"]
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad.div_(WORLD)
            opt.step()
            sched.step()
            step += 1
            state["losses"].append(loss.item())
            state["step"], state["epoch"] = step, epoch
            if ck is not None and step % every == 0:
                t0 = time.perf_counter()
                ck.save(step, state)
                if rank == 0:
                    print(
                        f"  step {step}: saved asynchronously, training stalled {1e3 * (time.perf_counter() - t0):.1f} ms"
                    )
            if step == crash_at:
                if rank == 0:
                    print(f"  step {step}: both ranks exit abruptly (os._exit), no clean shutdown")
                os._exit(0)
            if step >= steps:
                break
        else:
            epoch += 1
            continue
        break
    if ck is not None:
        ck.close()
    result = {"losses": state["losses"], "weights": [p.detach().flatten().tolist() for p in model.parameters()]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _run(out_dir: str, ckpt_dir: str | None, steps: int, every: int, crash_at: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(out_dir, exist_ok=True)
    args = (port, out_dir, ckpt_dir, steps, every, crash_at)
    mp.start_processes(_worker, args, nprocs=WORLD, start_method="spawn")  # type: ignore[attr-defined,no-untyped-call]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--crash-at", type=int, default=17)
    args = ap.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-demo-")
    ckpt_dir = os.path.join(work, "ckpt")
    print(f"ckpt demo in {work}")
    print("1) reference run, no checkpoints")
    _run(os.path.join(work, "ref"), None, args.steps, args.every, -1)
    print(f"2) run with checkpoints every {args.every} steps, killed at step {args.crash_at}")
    _run(os.path.join(work, "crashed"), ckpt_dir, args.steps, args.every, args.crash_at)
    print("3) restart: restore the newest committed version and finish")
    _run(os.path.join(work, "resumed"), ckpt_dir, args.steps, args.every, -1)
    ok = True
    for rank in range(WORLD):
        with open(os.path.join(work, "ref", f"rank{rank}.json")) as f:
            ref = json.load(f)
        with open(os.path.join(work, "resumed", f"rank{rank}.json")) as f:
            got = json.load(f)
        same_loss = ref["losses"] == got["losses"]
        same_w = ref["weights"] == got["weights"]
        ok &= same_loss and same_w
        print(
            f"rank {rank}: {len(got['losses'])} losses identical to reference: {same_loss}; final weights identical: {same_w}"
        )
    print(f"final loss {got['losses'][-1]:.6f}; checkpoints: `ckpt ls {ckpt_dir}`")
    print("RESULT:", "resumed run is bit-exact" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
