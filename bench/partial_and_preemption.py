"""Params-only intermediate versions and the save on preemption, measured.

    python bench/partial_and_preemption.py [--params 50e6] [--reps 3] [--dir DIR] [--out FILE]

(bench/run.py runs it too, and puts its figures in latest.json and latest.md.)

- storage: the bytes of a full version (model + Adam state after one step) and of a
  params-only version (`save(..., only=("model",))`) of the same model, from their
  manifests, and their ratio;
- preemption: a real SIGTERM sent to this process during training; the time from the
  signal to a committed version (the next `reached_preemption()` at a step boundary,
  then save() and wait()), against the time of a plain save()+wait() of the same state
  measured side by side (the floor: the save itself).

Writes FILE (default bench/results/partial_and_preemption.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt import Checkpointer
from ckpt.store.versions import read_manifest


def build_model(params: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, int(params // (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "partial_and_preemption.json"))
    args = ap.parse_args()
    model, opt = build_model(args.params)
    state = {"model": model, "optim": opt, "step": 0}
    out: dict[str, object] = {"params": sum(p.numel() for p in model.parameters())}
    plain, preempt = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        root = os.path.join(work, "root")
        with Checkpointer(root, preemption_signals=(signal.SIGTERM,)) as ck:
            ck.save(1, state)
            ck.save(2, state, only=("model",))
            ck.wait()
            full, params_only = read_manifest(root, 1).total_bytes, read_manifest(root, 2).total_bytes
            out.update(full_bytes=full, params_only_bytes=params_only, ratio=params_only / full)
            step = 10
            for _ in range(args.reps):
                step += 1
                t = time.perf_counter()
                ck.save(step, state)
                ck.wait()
                plain.append(time.perf_counter() - t)
            # The last measurement: after it the Checkpointer has seen the notice for good.
            step += 1
            sent = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)
            while not ck.reached_preemption():
                time.sleep(0.001)  # a training step
            ck.save(step, state)
            ck.wait()
            preempt.append(time.perf_counter() - sent)
    out.update(save_wait_s=statistics.median(plain), signal_to_committed_s=preempt[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("\n".join(markdown(out)))


def markdown(out: dict[str, Any]) -> list[str]:
    """The figures as a markdown table (bench/run.py appends it to latest.md)."""
    mib = 1 << 20
    full, part = out["full_bytes"], out["params_only_bytes"]
    return [
        f"### Params-only versions and the save on preemption ({out['params']:,} parameters, Adam)",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| full version (model + Adam state) | {full / mib:,.1f} MiB |",
        f"| params-only version | {part / mib:,.1f} MiB ({100 * part / full:.1f}% of full) |",
        f"| save() + wait() of the full state (median) | {out['save_wait_s']:.3f} s |",
        f"| SIGTERM to a committed version | {out['signal_to_committed_s']:.3f} s |",
    ]


if __name__ == "__main__":
    main()
