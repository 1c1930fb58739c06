"""Turn the benchmark's raw records into targets, tables and a plot (bench/run.py)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def versions() -> dict[str, str]:
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release()}
    for name in ("moto", "s3fs"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            pass
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


MEDIA = ("disk", "tmpfs")
# The peers of each figure (operation keys without the world prefix; {w}: the world size).
PEER_DURABLE = ["durable/dcp_save_t{best}", "durable/dcp_async_save", "durable/torch_checkpointing"]
PEER_CPU_SAVE = [
    "durable/dcp_save_t1",
    "durable/dcp_save_t2",
    "durable/dcp_save_t4",
    "durable/dcp_async_save",
    "durable/torch_checkpointing",
    "durable/torch_save",
]
PEER_STALL = ["stall/dcp_async_save", "stall/torch_checkpointing"]
PEER_LOAD = ["restore/dcp_{w}to{w}", "restore/torch_checkpointing_{w}to{w}", "restore/torch_load"]


def build(records: list[dict[str, Any]], meta: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The report: per medium (the disk under --dir, tmpfs) its measurements and tables;
    the targets of both, each named with its medium."""
    media: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for medium in MEDIA:
        mine = [r for r in records if r.get("medium", "disk") == medium]
        if mine:
            media[medium] = _build_medium(mine, meta[medium], medium)
            targets += media[medium].pop("targets")
    return {"env": env, "targets": targets, "media": media}


def _build_medium(records: list[dict[str, Any]], meta: dict[str, Any], medium: str) -> dict[str, Any]:
    by_key: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        by_key[f"w{r['world']}/{r['op']}"][r["rep"]] = r
    state_bytes = meta["w1"]["state_bytes"]
    measurements = {}
    for key, reps in sorted(by_key.items()):
        secs = [r["seconds"] for r in reps.values()]
        rss = [r["extra_rss"] for r in reps.values()]
        nbytes = next(iter(reps.values())).get("bytes", state_bytes)
        m = {
            "seconds": _stats(secs),
            "reps": {str(k): round(v["seconds"], 4) for k, v in sorted(reps.items())},
            "rank_seconds": {str(k): v["rank_seconds"] for k, v in sorted(reps.items())},
            "bytes": nbytes,
            "gb_per_s": nbytes / statistics.median(secs) / 1e9,
            "extra_rss_bytes": _stats(rss),
            "extra_rss_x_state": max(rss) / nbytes,
        }
        cpu = [r["cpu_s"] for r in reps.values() if r.get("cpu_s") is not None]
        if cpu:
            m["cpu_s"] = _stats(cpu)
            m["cpu_s_per_gb"] = statistics.median(cpu) / (nbytes / 1e9)
        first = next(iter(reps.values()))
        extras = {
            k: [r[k] for r in reps.values()] for k in ("write_s", "fsync_s", "commit_s", "direct_bytes") if k in first
        }
        for k, v in extras.items():
            m[k] = _stats(v)
        measurements[key] = m

    def reps_of(key: str, field: str = "seconds") -> dict[int, float]:
        return {k: v[field] for k, v in by_key.get(key, {}).items() if k >= 0 and v.get(field) is not None}

    Rep = Callable[[int], float | None]

    def value(key: str, field: str = "seconds") -> Rep:
        return lambda r: reps_of(key, field).get(r)

    def per_rep(num: str | Rep, den: str | Rep) -> list[float]:
        """Ratio within each repetition (both measured in it)."""
        f = num if callable(num) else value(num)
        g = den if callable(den) else value(den)
        out = []
        for rep in sorted({r for key in by_key for r in by_key[key] if r >= 0}):
            a, b = f(rep), g(rep)
            if a is not None and b:
                out.append(a / b)
        return out

    def medians_ratio(num: Rep, den: Rep) -> list[float]:
        """The ratio of the medians over the repetitions, for figures of different phases."""
        reps = sorted({r for key in by_key for r in by_key[key] if r >= 0})
        a = [v for r in reps if (v := num(r)) is not None]
        b = [v for r in reps if (v := den(r)) is not None]
        return [statistics.median(a) / statistics.median(b)] if a and b else []

    def fastest(keys: list[str], field: str = "seconds") -> Rep:
        """Per repetition, the lowest of `keys` measured in it."""

        def f(rep: int) -> float | None:
            vals = [v for k in keys if (v := reps_of(k, field).get(rep)) is not None]
            return min(vals) if vals else None

        return f

    def prefixed(prefix: str) -> list[str]:
        return [k for k in by_key if k.startswith(prefix)]

    def best_by_median(prefix: str) -> str | None:
        keys = [k for k in prefixed(prefix) if reps_of(k)]
        return min(keys, key=lambda k: statistics.median(reps_of(k).values())) if keys else None

    def same_work_reads(p: str) -> tuple[list[str], list[str]]:
        """The same-work reads ckpt's restore is held to, and the others. Each is the first
        read of a file just written; on the VM here a file written with O_DIRECT reads back
        cold at the disk's speed while one written through the page cache mostly comes from
        the host's cache (bench/run.py). So where ckpt's saves wrote with O_DIRECT
        (SaveStats.direct_bytes), the floor is the read of the same-work file written so."""
        keys = prefixed(p + "restore/same_work_read_")
        of_direct = [k for k in keys if k.endswith("_of_o_direct_write")]
        buffered = [k for k in keys if k not in of_direct]
        if of_direct and any(reps_of(p + "durable/ckpt", "direct_bytes").values()):
            return of_direct, buffered
        return buffered, []

    targets: list[dict[str, Any]] = []
    info: list[dict[str, Any]] = []  # ratios shown for information, without a goal

    def target(
        name: str,
        ratios: list[float],
        limit: float | None,
        at_least: bool = False,
        how: str = "",
        floor: list[float] | None = None,
    ) -> None:
        """`floor`: the same ratio with the same-work floor in ckpt's place, where the goal
        compares ckpt with a peer: a goal the floor itself misses is beyond the medium."""
        if not ratios:
            return
        v = statistics.median(ratios)
        row: dict[str, Any] = {
            "name": f"{name}, {medium}",
            "medium": medium,
            "value": round(v, 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)],
            "per_rep": [round(x, 3) for x in ratios],
            "how": how,
        }
        if limit is None:
            info.append(row)
            return
        row.update(target=f"{'>=' if at_least else '<='} {limit}", **{"pass": v >= limit if at_least else v <= limit})
        if floor:
            row["floor"] = round(statistics.median(floor), 3)
        targets.append(row)

    for w in (1, 2):
        p = f"w{w}/"
        best_dcp = best_by_median(p + "durable/dcp_save_t")
        threads = best_dcp.rsplit("_t", 1)[1] if best_dcp else "1"
        peers_durable = [p + k.format(best=threads) for k in PEER_DURABLE]
        target(
            f"stall vs copy floor (world {w})",
            per_rep(p + "stall/ckpt", fastest(prefixed(p + "stall/floor_copy_"))),
            1.1,
            how="ckpt save() / two threads memcpy-ing the same bytes into a warm reused buffer",
        )
        target(
            f"stall with deferred staging vs best peer's blocking time (world {w})",
            per_rep(p + "stall/ckpt_deferred", fastest([p + k for k in PEER_STALL])),
            0.3,
            how="ckpt save() with deferred_staging=True / the lower of DCP async_save's return (reused stager) "
            "and torch-checkpointing's staging (until its lock() may be taken), same repetition",
        )
        target(
            f"durable vs best peer (world {w})",
            per_rep(p + "durable/ckpt", fastest(peers_durable)),
            0.8,
            how=f"ckpt save()+wait() / the fastest of DCP save (thread_count {threads}, its best median), "
            "DCP async_save and torch-checkpointing (plus the fsync it never makes), same repetition",
        )
        target(
            f"durable vs same-work floor (world {w})",
            per_rep(p + "durable/ckpt", fastest(prefixed(p + "durable/same_work_"))),
            1.15,
            how="ckpt save()+wait() / copy into a reused buffer, xxh3 every byte, one file per rank, fsync "
            "(fastest of 1 buffered thread, 4 buffered threads, 4 O_DIRECT threads)",
        )
        target(
            f"durable vs raw write floor (world {w})",
            per_rep(p + "durable/ckpt", fastest(prefixed(p + "durable/floor_"))),
            None,
            how="ckpt save()+wait() / the fastest raw durable write of the same bytes (no copy, no checksum)",
        )
        target(
            f"durable, every file created anew vs writing into a spare tree (world {w})",
            per_rep(p + "durable/ckpt_new_tree", p + "durable/ckpt"),
            None,
            how="ckpt save()+wait() with no retired tree to overwrite / the default (ckpt.store.spare)",
        )
        same = p + f"restore/ckpt_{w}to{w}"
        peer_load = fastest([p + k.format(w=w) for k in PEER_LOAD])
        held_to, other_reads = same_work_reads(p)
        same_work_read = fastest(held_to)
        target(
            f"same-layout restore vs best peer's load ({w}->{w})",
            per_rep(same, peer_load),
            0.6,
            how="cold ckpt restore / the fastest cold load of DCP, torch-checkpointing and torch.load, same repetition",
            floor=per_rep(same_work_read, peer_load),
        )
        target(
            f"same-layout restore vs same-work read floor ({w}->{w})",
            per_rep(same, same_work_read),
            1.2,
            how="cold ckpt restore / first cold read of one file per rank into the tensors, every byte "
            "xxh3-verified, the file written as ckpt writes (O_DIRECT where its saves used it); fastest of "
            "the reads measured of such a file (1 or 4 threads, through the page cache or with O_DIRECT)",
        )
        target(
            f"same-layout restore vs same-work read of a file written through the page cache ({w}->{w})",
            per_rep(same, fastest(other_reads)),
            None,
            how="cold ckpt restore / the same-work read of a file written with buffered writes, which the "
            "host below this VM keeps cached (bench/run.py)",
        )
        target(
            f"same-layout restore vs raw read floor ({w}->{w})",
            per_rep(same, fastest(prefixed(p + "restore/floor_read"))),
            None,
            how="cold ckpt restore / the fastest raw read of the same bytes, no verification",
        )
        target(
            f"CPU seconds per GB saved vs best peer (world {w})",
            per_rep(value(p + "durable/ckpt", "cpu_s"), fastest([p + k for k in PEER_CPU_SAVE], "cpu_s")),
            0.6,
            how="process CPU (user + system, all threads and children, all ranks) of ckpt save()+wait() / "
            "the lowest of DCP save (each thread_count), DCP async_save, torch-checkpointing and torch.save",
        )
        target(
            f"CPU seconds per GB restored vs best peer ({w}->{w})",
            per_rep(value(same, "cpu_s"), fastest([p + k.format(w=w) for k in PEER_LOAD], "cpu_s")),
            0.6,
            how="process CPU of the cold ckpt restore / the lowest of DCP load, torch-checkpointing and torch.load",
        )
    for w, base in ((1, "w1/restore/ckpt_1to1"), (3, None)):
        resharded = f"w{w}/restore/ckpt_2to{w}"
        if base is not None:
            target(
                f"resharded restore 2->{w} vs same-layout {w}->{w}",
                per_rep(resharded, base),
                1.25,
                how="cold, same process and repetition",
            )
        else:
            a, b = reps_of(resharded), reps_of("w2/restore/ckpt_2to2")
            if a and b:
                target(
                    f"resharded restore 2->{w} vs same-layout 2->2",
                    [statistics.median(a.values()) / statistics.median(b.values())],
                    1.25,
                    how="cold; ratio of medians (3 ranks vs 2 ranks reading the same checkpoint, separate phases)",
                )
        peer_reshard = fastest([f"w{w}/restore/dcp_2to{w}", f"w{w}/restore/torch_checkpointing_2to{w}"])
        target(
            f"resharded restore 2->{w} vs best peer's resharded load",
            per_rep(resharded, peer_reshard),
            0.5,
            how="cold ckpt restore / the faster cold resharding load of DCP and torch-checkpointing, same repetition",
            # the whole state, as the same-work read of world 1 (same repetition) or of the
            # world-2 phase (a ratio of medians: world 3 runs apart)
            floor=per_rep(fastest(same_work_reads("w1/")[0]), peer_reshard)
            if w == 1
            else medians_ratio(fastest(same_work_reads("w2/")[0]), peer_reshard),
        )
    target(
        "replication throughput vs plain s3fs put",
        per_rep("w1/replicate/s3fs_put", "w1/replicate/ckpt_replicator"),
        0.8,
        at_least=True,
        how="same files to the same moto server; throughput ratio = put time / replicator time",
    )
    for w in (1, 2):
        mw = meta.get(f"w{w}", {})
        first = by_key.get(f"w{w}/durable/ckpt_first", {}).get(-1, {}).get("extra_rss")
        steady = [r["extra_rss"] for k, r in by_key.get(f"w{w}/durable/ckpt", {}).items() if k >= 0]
        if first is not None and steady:
            held = mw.get("arena_bytes", 0)
            v = max(first, held + max(steady)) / mw["state_bytes"]
            target(
                f"peak extra RSS during save, x state size (world {w})",
                [v],
                1.15,
                how="max(first save incl. allocating the staging buffer, staging buffer + steady-state peak) / state bytes, summed over ranks",
            )
    steps = []
    for w in (1, 2):
        base_step = reps_of(f"w{w}/train_step/none")
        for mode in ("ckpt", "ckpt_deferred", "ckpt_overlap", "dcp_async_save"):
            with_save = reps_of(f"w{w}/train_step/{mode}")
            cost = [with_save[r] - base_step[r] for r in sorted(with_save) if r in base_step]
            if cost:
                steps.append(
                    {
                        "world": w,
                        "mode": mode,
                        "step_s": statistics.median(with_save.values()),
                        "without_save_s": statistics.median(base_step.values()),
                        "cost_s": _stats(cost),
                    }
                )
    return {
        "meta": meta,
        "targets": targets,
        "info": info,
        "measurements": measurements,
        "rss": rss_table(measurements),
        "train_step": steps,
    }


# figure -> {column: operation key without the world prefix}; worlds are tried 1..3.
_RSS_ROWS: list[tuple[str, dict[str, str]]] = [
    (
        "save, first call (allocates any reused buffer)",
        {"ckpt": "durable/ckpt_first", "DCP async_save": "durable/dcp_async_save_first"},
    ),
    (
        "save, steady state",
        {
            "ckpt": "durable/ckpt",
            "DCP async_save": "durable/dcp_async_save",
            "DCP save": "durable/dcp_save_t1",
            "torch-ckpting": "durable/torch_checkpointing",
            "torch.save": "durable/torch_save",
        },
    ),
    (
        "restore {w}->{w}",
        {
            "ckpt": "restore/ckpt_{w}to{w}",
            "DCP load": "restore/dcp_{w}to{w}",
            "torch-ckpting": "restore/torch_checkpointing_{w}to{w}",
            "torch.load": "restore/torch_load",
        },
    ),
    (
        "restore 2->{w} (resharded)",
        {
            "ckpt": "restore/ckpt_2to{w}",
            "DCP load": "restore/dcp_2to{w}",
            "torch-ckpting": "restore/torch_checkpointing_2to{w}",
        },
    ),
    (
        "replication to loopback S3 (x bytes replicated)",
        {"ckpt": "replicate/ckpt_replicator", "s3fs put": "replicate/s3fs_put"},
    ),
]
RSS_COLUMNS = [
    "ckpt",
    "DCP async_save",
    "DCP save",
    "DCP load",
    "torch-ckpting",
    "torch.save",
    "torch.load",
    "s3fs put",
]


def rss_table(measurements: dict[str, Any]) -> list[dict[str, Any]]:
    """Peak extra RSS of each operation (highest repetition, summed over ranks) as a multiple
    of the bytes it moves: the state for saves and restores, the version's files for
    replication; and ckpt's over each peer's, within the same figure."""
    rows = []
    for label, cols in _RSS_ROWS:
        for w in (1, 2, 3):
            if label.startswith("restore 2->") and w == 2:
                continue
            vals = {}
            for col, op in cols.items():
                m = measurements.get(f"w{w}/" + op.format(w=w))
                if m is not None:
                    vals[col] = m["extra_rss_x_state"]
            if "ckpt" not in vals or len(vals) < 2 and "replication" not in label:
                continue
            rows.append(
                {
                    "figure": label.format(w=w),
                    "world": w,
                    "x_bytes": vals,
                    "ckpt_over_peer": {c: vals["ckpt"] / v for c, v in vals.items() if c != "ckpt" and v > 0},
                }
            )
    return rows


_ORDER = ["stall", "staged", "train_step", "durable", "restore", "replicate"]


def markdown(report: dict[str, Any]) -> str:
    env, media = report["env"], report["media"]
    sizes = "; ".join(
        f"{name}: {m['meta']['w1']['state_bytes'] / 1e9:.2f} GB state ({m['meta']['w1']['tensors']} tensors, "
        f"{m['meta']['w1']['params']:.3g} params + Adam) under {m['meta']['w1'].get('dir', '?')}"
        for name, m in media.items()
    )
    lines = [
        "# ckpt benchmark",
        "",
        f"{env['started']}; {sizes}; {env['reps']} repetitions, {env['cpus']} CPUs, torch {env['torch']}, "
        f"load average {', '.join(f'{x:.1f}' for x in env['load_average'])}; wall time {env['wall_seconds']:.0f} s.",
        "",
        "## Targets",
        "",
        "| target | value (median) | range | goal | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in report["targets"]:
        result = "PASS" if t["pass"] else "**FAIL**"
        if not t["pass"] and t.get("floor") is not None and t["floor"] > float(t["target"].split()[-1]):
            result += f" (beyond the floor: the same-work read scores {t['floor']:.2f}x)"
        lines.append(
            f"| {t['name']} | {t['value']:.2f}x | {t['range'][0]:.2f}-{t['range'][1]:.2f} | {t['target']} | {result} |"
        )
    info = [row for m in media.values() for row in m.get("info", [])]
    if info:
        lines += [
            "",
            "Ratios shown for information (no goal):",
            "",
            "| ratio | value (median) | range |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {t['name']} | {t['value']:.2f}x | {t['range'][0]:.2f}-{t['range'][1]:.2f} |" for t in info]
    for name, m in media.items():
        lines += ["", *_medium_markdown(name, m)]
    return "\n".join(lines)


def _medium_markdown(medium: str, report: dict[str, Any]) -> list[str]:
    lines = [
        f"## Measurements ({medium})",
        "",
        "Seconds: median and range over repetitions (at world > 1, the slowest rank). GB/s over the "
        "state's bytes (replication: the version's files). CPU s/GB: process CPU seconds (user + system, "
        "every thread and child process, summed over ranks) per GB of state. Extra RSS: highest peak over "
        "the RSS before the operation, summed over ranks, as a multiple of the bytes moved (memory freed by "
        "an earlier operation of the same process may be reused without raising the peak: only `_first` "
        "rows show the allocation of a reused buffer).",
        "",
        "| world | operation | median s | range s | GB/s | CPU s/GB | extra RSS |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ms = report["measurements"]

    def sort_key(k: str) -> tuple[int, str, str]:
        world, kind = k.split("/", 2)[:2]
        return (_ORDER.index(kind) if kind in _ORDER else 9, world, k)

    for key in sorted(ms, key=sort_key):
        m = ms[key]
        world, op = key.split("/", 1)
        s = m["seconds"]
        cpu = f"{m['cpu_s_per_gb']:.2f}" if "cpu_s_per_gb" in m else ""
        lines.append(
            f"| {world[1:]} | {op} | {s['median']:.3f} | {s['min']:.3f}-{s['max']:.3f} | {m['gb_per_s']:.2f} | "
            f"{cpu} | {m['extra_rss_x_state']:.2f}x |"
        )
    lines += [
        "",
        "`_first`: the first call (allocates the reused buffer), excluded from the targets. "
        "`written/torch_checkpointing`: its save future (files written, never fsynced); "
        "`durable/torch_checkpointing` adds the fsync of its files that a durable save needs. "
        "`durable/ckpt_new_tree`: a ckpt save with no spare tree to overwrite (every file created).",
        "",
    ]
    if report.get("train_step"):
        lines += [
            f"## Training step with a save ({medium})",
            "",
            "A step of fixed compute (matmuls standing in for forward and backward) after save() returns, "
            "then what the next optimizer step must wait for. Cost: the step's time minus the same step "
            "without a save, in the same repetition. It holds save()'s blocking time and the slowdown "
            "of the compute by the save's background work (on this CPU-only machine, a deferred copy "
            "runs on the cores the compute needs).",
            "",
            "| world | save | step s | step without save s | cost s (median) | range s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in report["train_step"]:
            c = row["cost_s"]
            lines.append(
                f"| {row['world']} | {row['mode']} | {row['step_s']:.3f} | {row['without_save_s']:.3f} | "
                f"{c['median']:.3f} | {c['min']:.3f}-{c['max']:.3f} |"
            )
        lines.append("")
    lines += [
        f"## Peak extra RSS ({medium})",
        "",
        "Highest peak over the RSS before the operation (summed over ranks), as a multiple of the "
        "bytes the operation moves: the state for saves and restores, the version's files for "
        "replication. In brackets: ckpt's figure over that peer's.",
        "",
        "| figure | world | " + " | ".join(RSS_COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in RSS_COLUMNS) + " |",
    ]
    for row in report.get("rss", []):
        cells = []
        for col in RSS_COLUMNS:
            v = row["x_bytes"].get(col)
            ratio = row["ckpt_over_peer"].get(col)
            shown = ratio is not None and row["x_bytes"][col] >= 0.05 and row["x_bytes"]["ckpt"] >= 0.05
            cells.append("" if v is None else f"{v:.2f}x" + (f" ({ratio:.2f})" if shown else ""))
        lines.append(f"| {row['figure']} | {row['world']} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]); no plot")
        return
    media = report["media"]
    fig = plt.figure(figsize=(24, 17))
    grid = fig.add_gridspec(3, 3)
    panels = [
        (medium, kind, title, log, grid[row, col])
        for row, medium in enumerate(media)
        for col, (kind, title, log) in enumerate(
            [
                ("stall", "training stall per save (s, log scale)", True),
                ("durable", "save until durable and committed (s)", False),
                ("restore", "cold restore (s)", False),
            ]
        )
    ]
    if "disk" in media:
        panels.append(("disk", "replicate", "replication to loopback S3 (MB/s)", False, grid[2, 0]))
    for medium, kind, title, log, cell in panels:
        ax = fig.add_subplot(cell)
        ms = media[medium]["measurements"]
        keys = sorted(k for k in ms if k.split("/")[1] == kind and not k.endswith("_first"))
        if kind == "replicate":
            med = [ms[k]["bytes"] / ms[k]["seconds"]["median"] / 1e6 for k in keys]
            lo = [m - ms[k]["bytes"] / ms[k]["seconds"]["max"] / 1e6 for k, m in zip(keys, med)]
            hi = [ms[k]["bytes"] / ms[k]["seconds"]["min"] / 1e6 - m for k, m in zip(keys, med)]
        else:
            med = [ms[k]["seconds"]["median"] for k in keys]
            lo = [m - ms[k]["seconds"]["min"] for k, m in zip(keys, med)]
            hi = [ms[k]["seconds"]["max"] - m for k, m in zip(keys, med)]
        colors = [
            "tab:green"
            if "ckpt" in k
            else "tab:gray"
            if "floor" in k or "same_work" in k
            else "tab:blue"
            if "dcp" in k
            else "tab:purple"
            if "torch_checkpointing" in k
            else "tab:orange"
            for k in keys
        ]
        y = list(range(len(keys)))
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(y)
        ax.set_yticklabels([k.replace(f"/{kind}/", " ") for k in keys], fontsize=7)
        ax.invert_yaxis()
        if log:
            from matplotlib.ticker import FormatStrFormatter, NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{title}, {medium}")
        ax.grid(axis="x", alpha=0.3)
    ax = fig.add_subplot(grid[2, 1:])
    ts = report["targets"]
    vals = [t["value"] for t in ts]
    limits = [float(t["target"].split()[1]) for t in ts]
    y = list(range(len(ts)))
    ax.barh(y, vals, color=["tab:green" if t["pass"] else "tab:red" for t in ts])
    ax.scatter(limits, y, marker="|", s=200, color="black", zorder=3, label="goal")
    ax.set_yticks(y)
    ax.set_yticklabels([t["name"] for t in ts], fontsize=6)
    ax.invert_yaxis()
    ax.set_title("targets: ratio (median of repetitions) and goal; green pass, red fail")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(
        f"ckpt vs DCP, torch-checkpointing, torch.save and the machine's floors, median of {report['env']['reps']} "
        "(bars: range). green ckpt, blue DCP, purple torch-checkpointing, orange torch.save/load and s3fs put, "
        "gray floors"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def extra_section(title: str, medians: list[str], ratios: dict[str, float]) -> list[str]:
    """An extra script's section of latest.md: its title, its medians' rows, its ratios."""
    rows = [f"| {name} | {v:.2f}x |" for name, v in ratios.items()]
    return [
        title,
        "",
        "| operation | median |",
        "| --- | --- |",
        *medians,
        "",
        "| ratio | value |",
        "| --- | --- |",
        *rows,
    ]
