"""GPU check: training stall and time to commit with CUDA tensors (pinned staging).

    bash bench/gpu_check.sh [--gb 2] [--reps 3] [--out FILE]

Measures, on one GPU, with the state on the device:
- ckpt save() stall (the device-to-pinned-host copy on a side stream) and time to a durable commit,
  with the writers after the copy and with overlap_writes (each chunk written as it lands);
- the same with deferred staging: save() blocking, and the time until the copy has ended while
  the GPU runs other work (checked bitwise against the values of the save() call);
- DCP async_save blocking time with a reused stager, and DCP save;
- the floor: a non-blocking copy of the same bytes into preallocated pinned host memory.
Prints a table and writes FILE (default bench/results/gpu_check.json). Runs in well under
5 minutes. ckpt must be importable (installed, as bench/gpu_check.sh does): the checkout's
store/, restore/ and replicator/ are subpackages of ckpt only once installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_check.json")


def _state(gb: float) -> dict[str, torch.Tensor]:
    n = int(gb * 2**30 / 4)
    per = 8 << 20  # ~32 MiB float32 tensors, ~300 of them for 10 GB
    out, i = {}, 0
    while n > 0:
        k = min(per, n)
        out[f"t{i:04d}"] = torch.randn(k, device="cuda")
        n -= k
        i += 1
    return out


def _floor(state: dict[str, torch.Tensor]) -> float:
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        took = time.perf_counter() - t
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=RESULTS, help="where the JSON results go")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        sys.exit(2)
    from ckpt import Checkpointer

    work = args.dir or tempfile.mkdtemp(prefix="ckpt-gpu-")
    state = _state(args.gb)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    results: dict[str, list[float]] = {"floor_copy": []}
    results.update({"dcp_async_blocking": [], "dcp_save": []})
    direct = 0
    for overlap in (False, True):  # the writers after the copy, or taking each chunk as it lands
        tag = "ckpt_overlap" if overlap else "ckpt"
        results.update({f"{tag}_stall": [], f"{tag}_commit": []})
        with Checkpointer(os.path.join(work, tag), overlap_writes=overlap) as ck:
            ck.save(0, state)  # warm-up: allocates the pinned staging buffer once
            ck.wait()
            name, first = next(iter(state.items()))
            for rep in range(1, args.reps + 1):
                if not overlap:
                    results["floor_copy"].append(_floor(state))
                expected = first[: 1 << 20].cpu()
                torch.cuda.synchronize()
                t = time.perf_counter()
                ck.save(rep, state)
                results[f"{tag}_stall"].append(time.perf_counter() - t)
                for v in state.values():  # the optimizer may change parameters at once
                    v.add_(1.0)
                ck.wait()
                results[f"{tag}_commit"].append(time.perf_counter() - t)
                assert ck._arena.buffer is not None and ck._arena.buffer.is_pinned()
                direct = ck.stats()[-1].direct_bytes  # O_DIRECT straight from the pinned buffer
            out = {k: torch.empty_like(v) for k, v in state.items()}
            ck.restore(out, step=args.reps)
            if not torch.equal(out[name][: 1 << 20].cpu(), expected):
                raise SystemExit(f"{tag}: the restored tensor differs from its value at save()")
    results.update({"ckpt_deferred_stall": [], "ckpt_deferred_staged": [], "ckpt_deferred_commit": []})
    x = torch.randn(4096, 4096, device="cuda")
    owner = torch.optim.SGD(list(state.values()), lr=0.0)  # the optimizer owning the state: its step() waits
    with Checkpointer(os.path.join(work, "ckpt-deferred"), deferred_staging=True) as ck:
        ck.guard(owner)
        ck.save(0, state)
        ck.wait()
        name, first = next(iter(state.items()))
        for rep in range(1, args.reps + 1):
            expected = first[: 1 << 20].cpu()
            torch.cuda.synchronize()
            t = time.perf_counter()
            ck.save(rep, state)
            results["ckpt_deferred_stall"].append(time.perf_counter() - t)
            for _ in range(20):  # the forward and backward the copy overlaps
                torch.mm(x, x)
            owner.step()  # waits for the copy (changes nothing: lr 0, no gradients)
            for v in state.values():
                v.add_(1.0)
            ck.wait()
            results["ckpt_deferred_commit"].append(time.perf_counter() - t)
            results["ckpt_deferred_staged"].append(ck.stats()[-1].staged_s)
        out = {k: torch.empty_like(v) for k, v in state.items()}
        ck.restore(out, step=args.reps)
        if not torch.equal(out[name][: 1 << 20].cpu(), expected):
            raise SystemExit("deferred staging: the restored tensor differs from its value at save()")
    try:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(os.path.join(work, "dcp-async-0"), cache_staged_state_dict=True)
        for rep in range(args.reps + 1):
            t = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=os.path.join(work, f"dcp-async-{rep}"), storage_writer=writer)
            blocking = time.perf_counter() - t
            fut.result()
            if rep:  # rep 0 warms the reused stager
                results["dcp_async_blocking"].append(blocking)
        for rep in range(args.reps):
            t = time.perf_counter()
            dcp.save(state, checkpoint_id=os.path.join(work, f"dcp-{rep}"), no_dist=True)
            results["dcp_save"].append(time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - DCP is a peer; report and go on
        print(f"DCP measurement failed: {type(e).__name__}: {e}")
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(f"{torch.cuda.get_device_name(0)}, {nbytes / 2**30:.2f} GiB on the device, {args.reps} reps")
    print(f"  written with O_DIRECT from the pinned buffer: {direct / 2**30:.2f} GiB of {nbytes / 2**30:.2f}")
    for k, v in med.items():
        print(f"  {k:22s} {v:8.3f} s   {nbytes / v / 1e9:7.2f} GB/s")
    if "floor_copy" in med:
        print(f"  stall / floor copy: {med['ckpt_stall'] / med['floor_copy']:.2f}x")
        print(
            f"  overlap_writes: stall {med['ckpt_overlap_stall'] / med['ckpt_stall']:.2f}x, "
            f"commit {med['ckpt_overlap_commit'] / med['ckpt_commit']:.2f}x the sequential save's"
        )
    if "dcp_async_blocking" in med:
        print(f"  stall / DCP async_save blocking: {med['ckpt_stall'] / med['dcp_async_blocking']:.2f}x")
        print(
            f"  deferred stall / DCP async_save blocking: {med['ckpt_deferred_stall'] / med['dcp_async_blocking']:.2f}x"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        doc = {"device": torch.cuda.get_device_name(0), "bytes": nbytes, "direct_bytes": direct, "seconds": results}
        json.dump(doc | {"median": med}, f)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
