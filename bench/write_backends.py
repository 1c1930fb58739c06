"""Which writer should put chunk bytes on disk: direct files, tensorstore or zarr-python?

Writes the same arrays durably with each backend, interleaved over repetitions, and
reports medians and ratios against a raw one-file write. The library uses the fastest
(direct files; see the README). Usage:

    python bench/write_backends.py [--arrays 300] [--mib 600] [--reps 3] [--dir /tmp/wb]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt.store.fsio import fsync_dir, fsync_dirs, write_chunk


def arrays(n: int, total_mib: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    rows = max(1, (total_mib << 20) // (n * 1024 * 4))
    return [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(n)]


def raw(dir_: str, data: list[np.ndarray]) -> None:
    path = os.path.join(dir_, "all.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for a in data:
        view = memoryview(a).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + (64 << 20)])
    os.fsync(fd)
    os.close(fd)
    fsync_dir(dir_)


def direct(dir_: str, data: list[np.ndarray]) -> None:
    def one(i: int) -> str:
        d = os.path.join(dir_, f"a{i}", "c", "0")
        os.makedirs(d)
        write_chunk(os.path.join(d, "0"), memoryview(data[i]))
        return d

    with ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(one, range(len(data))))
    fsync_dirs(dirs + [os.path.dirname(os.path.dirname(d)) for d in dirs] + [dir_])


def tensorstore_zarr3(dir_: str, data: list[np.ndarray]) -> None:
    import tensorstore as ts

    futures = []
    for i, a in enumerate(data):
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(dir_, f"a{i}")},
            "metadata": {
                "shape": list(a.shape),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(a.shape)}},
                "data_type": "float32",
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            },
            "create": True,
        }
        store = ts.open(spec).result()
        futures.append(store.write(a))
    for f in futures:
        f.result()


def zarr_python(dir_: str, data: list[np.ndarray]) -> None:
    import zarr

    root = zarr.open_group(dir_, mode="w", zarr_format=3)
    for i, a in enumerate(data):
        arr = root.create_array(f"a{i}", shape=a.shape, chunks=a.shape, dtype="float32", compressors=None)
        arr[:] = a
    # zarr-python's LocalStore never fsyncs: make it durable afterwards, as a user would have to.
    paths = [os.path.join(r, f) for r, _, fs in os.walk(dir_) for f in fs]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(_fsync_file, paths))
    fsync_dirs([r for r, _, _ in os.walk(dir_)])


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


BACKENDS = {"raw_one_file": raw, "direct": direct, "tensorstore_zarr3": tensorstore_zarr3, "zarr_python": zarr_python}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=300)
    ap.add_argument("--mib", type=int, default=600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckpt-write-backends")
    args = ap.parse_args()
    data = arrays(args.arrays, args.mib)
    times: dict[str, list[float]] = {k: [] for k in BACKENDS}
    for _ in range(args.reps):
        for name, fn in BACKENDS.items():
            d = os.path.join(args.dir, name)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            t = time.perf_counter()
            fn(d, data)
            times[name].append(time.perf_counter() - t)
            shutil.rmtree(d, ignore_errors=True)
    nbytes = sum(a.nbytes for a in data)
    base = statistics.median(times["raw_one_file"])
    result = {
        "bytes": nbytes,
        "arrays": len(data),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "range_s": {k: [min(v), max(v)] for k, v in times.items()},
        "ratio_vs_raw": {k: statistics.median(v) / base for k, v in times.items()},
    }
    print(f"{len(data)} arrays, {nbytes / 2**20:.0f} MiB, {args.reps} reps, durable writes")
    for k in BACKENDS:
        print(f"  {k:18s} median {result['median_s'][k]:6.2f} s  x{result['ratio_vs_raw'][k]:.2f} raw")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "write_backends.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
