"""DCP through ckpt, and the safetensors export, measured side by side.

    python bench/integrations.py [--params 100e6] [--reps 3] [--dir DIR] [--out FILE]

(bench/run.py runs it too, and puts its figures in latest.json and latest.md.)

One process, the bench state (model + Adam after one step, bench/_workload.py):

- durable save through DCP: `dcp.save(sd, storage_writer=ckpt.dcp.StorageWriter(...))`
  (returns once the version is committed), opening a Checkpointer per save (the one-line
  form) and reusing an open one (`checkpointer=ck`), against DCP's own `FileSystemWriter`
  (`sync_files=True`, its default) at thread_count 1 (its default) and 4;
- load through DCP, cold page cache: `ckpt.dcp.StorageReader` against `FileSystemReader`;
- export of the model's tensors to Hugging Face safetensors: `ckpt.export_safetensors`
  (every byte read verified, files written on threads, fsynced) against a plain
  `safetensors.torch.save_file` of the same tensors already in memory, fsynced (no read,
  no checks: the floor).

Every load is checked bitwise. Writes FILE (default bench/results/integrations.json) and
prints a table. Needs root (the page cache is dropped before each load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _report  # noqa: E402
import _sys  # noqa: E402
import _workload  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckpt.dcp  # noqa: E402
from ckpt import Checkpointer, export_safetensors  # noqa: E402


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            _sys.fsync_path(os.path.join(dirpath, f))
        _sys.fsync_path(dirpath)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_workload.local_tensors(a), _workload.local_tensors(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckpt-bench-integrations")
    ap.add_argument("--out", default=str(HERE / "results" / "integrations.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    state = _workload.build_state(args.params)
    size = _workload.nbytes(state)
    model_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    runs: dict[str, list[float]] = {}

    def record(op: str, seconds: float) -> None:
        runs.setdefault(op, []).append(seconds)
        print(f"[{time.strftime('%H:%M:%S')}] {op:48s} {seconds:7.3f} s", flush=True)

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    root = os.path.join(args.dir, "ckpt")
    reused = os.path.join(args.dir, "ckpt-reused")
    ck = Checkpointer(reused, keep_last=1, capture_rng=False)  # open across saves, as a training job keeps it
    dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(reused, 0, checkpointer=ck))  # plans the layout

    def one(rep: int) -> None:
        step = rep + 1
        native = os.path.join(args.dir, f"dcp-{rep}")
        ops = {
            "dcp.save via ckpt.dcp.StorageWriter": lambda: dcp.save(
                state, storage_writer=ckpt.dcp.StorageWriter(root, step, keep_last=1)
            ),
            "dcp.save via ckpt.dcp.StorageWriter(checkpointer=ck)": lambda: dcp.save(
                state, storage_writer=ckpt.dcp.StorageWriter(reused, step, checkpointer=ck)
            ),
            "dcp.save via FileSystemWriter, thread_count 1": lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(native + "-t1", thread_count=1)
            ),
            "dcp.save via FileSystemWriter, thread_count 4": lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(native + "-t4", thread_count=4)
            ),
        }
        names = list(ops)
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            record(name, timed(ops[name]))

        def load(reader: Any, op: str) -> None:
            target = _workload.empty_state(args.params)
            _sys.drop_caches()
            record(op, timed(lambda: dcp.load(target, storage_reader=reader)))
            if not _same(target, state):
                raise SystemExit(f"{op}: the loaded state differs from the saved one")

        load(ckpt.dcp.StorageReader(root), "dcp.load via ckpt.dcp.StorageReader")
        load(dcp.FileSystemReader(native + "-t4"), "dcp.load via FileSystemReader")
        shutil.rmtree(native + "-t1")
        shutil.rmtree(native + "-t4")

        out = os.path.join(args.dir, f"hf-{rep}")
        _sys.drop_caches()
        record(
            "export to safetensors (ckpt, cold, verified)",
            timed(lambda: export_safetensors(root, out, prefix="tensors.model", max_shard_size="1GB")),
        )
        loaded = {}
        from safetensors.torch import load_file

        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                loaded.update(load_file(os.path.join(out, f)))
        if set(loaded) != set(state["model"]) or not all(torch.equal(loaded[n], t) for n, t in state["model"].items()):
            raise SystemExit("the safetensors export differs from the model's tensors")
        shutil.rmtree(out)
        from safetensors.torch import save_file

        plain = os.path.join(args.dir, f"plain-{rep}")

        def save_plain() -> None:
            os.makedirs(plain)
            save_file(dict(state["model"]), os.path.join(plain, "model.safetensors"))
            _fsync_tree(plain)

        record("safetensors.torch.save_file from memory, fsynced", timed(save_plain))
        shutil.rmtree(plain)

    for rep in range(args.reps):
        one(rep)
    ck.close()

    medians = {op: statistics.median(v) for op, v in runs.items()}
    best_dcp = min(medians[k] for k in medians if "FileSystemWriter" in k)
    result = {
        "params": args.params,
        "reps": args.reps,
        "state_bytes": size,
        "model_bytes": model_bytes,
        "medians_s": medians,
        "runs_s": runs,
        "ratios": {
            "ckpt.dcp save (open Checkpointer) / best FileSystemWriter save": medians[
                "dcp.save via ckpt.dcp.StorageWriter(checkpointer=ck)"
            ]
            / best_dcp,
            "ckpt.dcp save (a Checkpointer per save) / best FileSystemWriter save": medians[
                "dcp.save via ckpt.dcp.StorageWriter"
            ]
            / best_dcp,
            "ckpt.dcp load / FileSystemReader load": medians["dcp.load via ckpt.dcp.StorageReader"]
            / medians["dcp.load via FileSystemReader"],
            "export / plain save_file": medians["export to safetensors (ckpt, cold, verified)"]
            / medians["safetensors.torch.save_file from memory, fsynced"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n".join(markdown(result)))
    shutil.rmtree(args.dir, ignore_errors=True)


def markdown(out: dict[str, Any]) -> list[str]:
    """The figures as markdown (bench/run.py appends it to latest.md)."""
    mib = 1 << 20
    title = (
        f"### DCP through ckpt, and the safetensors export ({out['params']:.3g} parameters, Adam; "
        f"{out['state_bytes'] / mib:,.0f} MiB state, {out['model_bytes'] / mib:,.0f} MiB model; "
        f"{out['reps']} repetitions)"
    )
    medians = [f"| {op} | {s:.3f} s |" for op, s in out["medians_s"].items()]
    return _report.extra_section(title, medians, out["ratios"])


if __name__ == "__main__":
    main()
