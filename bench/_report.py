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


def build(records: list[dict[str, Any]], meta: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
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
        first = next(iter(reps.values()))
        extras = {k: [r[k] for r in reps.values()] for k in ("write_s", "fsync_s", "commit_s") if k in first}
        for k, v in extras.items():
            m[k] = _stats(v)
        measurements[key] = m

    def reps_of(key: str) -> dict[int, float]:
        return {k: v["seconds"] for k, v in by_key.get(key, {}).items() if k >= 0}

    def per_rep(num: str | Callable[[int], float | None], den: str | Callable[[int], float | None]) -> list[float]:
        """Ratio within each repetition (both measured in it)."""
        f = num if callable(num) else (lambda r, k=num: reps_of(k).get(r))
        g = den if callable(den) else (lambda r, k=den: reps_of(k).get(r))
        out = []
        for rep in sorted({r for key in by_key for r in by_key[key] if r >= 0}):
            a, b = f(rep), g(rep)
            if a is not None and b:
                out.append(a / b)
        return out

    def fastest(prefix: str) -> Callable[[int], float | None]:
        keys = [k for k in by_key if k.startswith(prefix)]

        def f(rep: int) -> float | None:
            vals = [by_key[k][rep]["seconds"] for k in keys if rep in by_key[k]]
            return min(vals) if vals else None

        return f

    def best_by_median(prefix: str) -> str | None:
        keys = [k for k in by_key if k.startswith(prefix) and reps_of(k)]
        return min(keys, key=lambda k: statistics.median(reps_of(k).values())) if keys else None

    targets: list[dict[str, Any]] = []

    def target(name: str, ratios: list[float], limit: float, at_least: bool = False, how: str = "") -> None:
        if not ratios:
            return
        value = statistics.median(ratios)
        ok = value >= limit if at_least else value <= limit
        targets.append(
            {
                "name": name,
                "value": round(value, 3),
                "target": f"{'>=' if at_least else '<='} {limit}",
                "pass": ok,
                "range": [round(min(ratios), 3), round(max(ratios), 3)],
                "per_rep": [round(x, 3) for x in ratios],
                "how": how,
            }
        )

    for w in (1, 2):
        p = f"w{w}/"
        target(
            f"stall vs copy floor (world {w})",
            per_rep(p + "stall/ckpt", fastest(p + "stall/floor_copy_")),
            1.2,
            how="ckpt save() / two threads copying into a warm buffer (fastest of torch copy_ and memcpy), same repetition",
        )
        target(
            f"stall vs DCP async_save blocking, reused stager (world {w})",
            per_rep(p + "stall/ckpt", p + "stall/dcp_async_save"),
            0.8,
            how="ckpt save() / async_save() return, FileSystemWriter(cache_staged_state_dict=True) reused",
        )
        target(
            f"stall with deferred staging vs DCP async_save blocking, reused stager (world {w})",
            per_rep(p + "stall/ckpt_deferred", p + "stall/dcp_async_save"),
            0.8,
            how="ckpt save() with deferred_staging=True / async_save() return; what this moves into the "
            "training step is in the training-step table",
        )
        best = best_by_median(p + "durable/dcp_save_t")
        for op, label, how in (
            ("ckpt", "", "ckpt save()+wait()"),
            ("ckpt_overlap", " with overlap_writes", "ckpt save()+wait() with overlap_writes=True"),
        ):
            target(
                f"durable commit{label} vs write floor (world {w})",
                per_rep(p + f"durable/{op}", fastest(p + "durable/floor_")),
                1.1,
                how=f"{how} / fastest raw durable write of the same bytes in that repetition",
            )
            if best:
                threads = "" if label else f": {best.rsplit('_', 1)[1]}"
                target(
                    f"durable commit{label} vs DCP save at best thread_count (world {w}{threads})",
                    per_rep(p + f"durable/{op}", best),
                    0.9,
                    how=f"{how} / DCP save with the thread_count of lowest median",
                )
        target(
            f"stall with overlap_writes vs copy floor (world {w})",
            per_rep(p + "stall/ckpt_overlap", fastest(p + "stall/floor_copy_")),
            1.2,
            how="save() with the writers taking CPU and memory bandwidth from the copy (off by default on 2 cores)",
        )
        same = f"restore/ckpt_{w}to{w}"
        target(
            f"same-layout restore vs read floor ({w}->{w})",
            per_rep(p + same, fastest(p + "restore/floor_read")),
            1.2,
            how="cold ckpt restore / fastest raw read of the same bytes into the existing tensors",
        )
        target(
            f"same-layout restore vs DCP load ({w}->{w})",
            per_rep(p + same, p + f"restore/dcp_{w}to{w}"),
            0.6,
            how="cold ckpt restore / cold DCP load, same repetition",
        )
    target(
        "resharded restore 2->1 vs same-layout 1->1",
        per_rep("w1/restore/ckpt_2to1", "w1/restore/ckpt_1to1"),
        1.25,
        how="cold, same process and repetition",
    )
    a, b = reps_of("w3/restore/ckpt_2to3"), reps_of("w2/restore/ckpt_2to2")
    if a and b:
        target(
            "resharded restore 2->3 vs same-layout 2->2",
            [statistics.median(a.values()) / statistics.median(b.values())],
            1.25,
            how="cold; ratio of medians (3 ranks vs 2 ranks reading the same checkpoint, separate phases)",
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
            value = max(first, held + max(steady)) / mw["state_bytes"]
            target(
                f"peak extra RSS during save, x state size (world {w})",
                [value],
                1.15,
                how="max(first save incl. allocating the staging buffer, staging buffer + steady-state peak) / state bytes, summed over ranks",
            )
    steps = []
    for w in (1, 2):
        base = reps_of(f"w{w}/train_step/none")
        for mode in ("ckpt", "ckpt_deferred", "ckpt_overlap", "dcp_async_save"):
            with_save = reps_of(f"w{w}/train_step/{mode}")
            cost = [with_save[r] - base[r] for r in sorted(with_save) if r in base]
            if cost:
                steps.append(
                    {
                        "world": w,
                        "mode": mode,
                        "step_s": statistics.median(with_save.values()),
                        "without_save_s": statistics.median(base.values()),
                        "cost_s": _stats(cost),
                    }
                )
    return {
        "env": env,
        "meta": meta,
        "targets": targets,
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
            "torch.save": "durable/torch_save",
        },
    ),
    (
        "restore {w}->{w}",
        {"ckpt": "restore/ckpt_{w}to{w}", "DCP load": "restore/dcp_{w}to{w}", "torch.load": "restore/torch_load"},
    ),
    ("restore 2->{w} (resharded)", {"ckpt": "restore/ckpt_2to{w}", "DCP load": "restore/dcp_2to{w}"}),
    (
        "replication to loopback S3 (x bytes replicated)",
        {"ckpt": "replicate/ckpt_replicator", "s3fs put": "replicate/s3fs_put"},
    ),
]
RSS_COLUMNS = ["ckpt", "DCP async_save", "DCP save", "DCP load", "torch.save", "torch.load", "s3fs put"]


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
    env, meta = report["env"], report["meta"]
    gb = meta["w1"]["state_bytes"] / 1e9
    lines = [
        "# ckpt benchmark",
        "",
        f"{env['started']}; {gb:.2f} GB state ({meta['w1']['tensors']} tensors, width {meta['w1']['width']}, "
        f"{env['params']:.3g} params + Adam), {env['reps']} repetitions, {env['cpus']} CPUs, "
        f"torch {env['torch']}, load average {', '.join(f'{x:.1f}' for x in env['load_average'])}; "
        f"wall time {env['wall_seconds']:.0f} s.",
        "",
        "## Targets",
        "",
        "| target | value (median) | range | goal | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in report["targets"]:
        lines.append(
            f"| {t['name']} | {t['value']:.2f}x | {t['range'][0]:.2f}-{t['range'][1]:.2f} | {t['target']} | "
            f"{'PASS' if t['pass'] else '**FAIL**'} |"
        )
    lines += [
        "",
        "## Measurements",
        "",
        "Seconds: median and range over repetitions (at world > 1, the slowest rank). GB/s over the "
        "state's bytes (replication: the version's files). Extra RSS: highest peak over the RSS before "
        "the operation, summed over ranks, as a multiple of the bytes moved (memory freed by an earlier "
        "operation of the same process may be reused without raising the peak: only `_first` rows show the "
        "allocation of a reused buffer).",
        "",
        "| world | operation | median s | range s | GB/s | extra RSS |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ms = report["measurements"]

    def sort_key(k: str) -> tuple[int, str, str]:
        world, kind = k.split("/", 2)[:2]
        return (_ORDER.index(kind) if kind in _ORDER else 9, world, k)

    for key in sorted(ms, key=sort_key):
        m = ms[key]
        world, op = key.split("/", 1)
        s = m["seconds"]
        lines.append(
            f"| {world[1:]} | {op} | {s['median']:.3f} | {s['min']:.3f}-{s['max']:.3f} | {m['gb_per_s']:.2f} | "
            f"{m['extra_rss_x_state']:.2f}x |"
        )
    lines += ["", "`_first`: the first call (allocates the reused buffer), excluded from the targets.", ""]
    if report.get("train_step"):
        lines += [
            "## Training step with a save",
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
        "## Peak extra RSS",
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
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]); no plot")
        return
    ms = report["measurements"]
    fig, axes = plt.subplots(2, 3, figsize=(21, 11))
    panels = [
        ("stall", "training stall per save (s, log scale)", True),
        ("durable", "save until durable and committed (s)", False),
        ("restore", "cold restore (s)", False),
        ("replicate", "replication to loopback S3 (MB/s)", False),
    ]
    for ax, (kind, title, log) in zip(axes.flat, panels):
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
            "tab:green" if "ckpt" in k else "tab:gray" if "floor" in k else "tab:blue" if "dcp" in k else "tab:orange"
            for k in keys
        ]
        y = list(range(len(keys)))
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(y)
        ax.set_yticklabels([k.replace(f"/{kind}/", " ") for k in keys], fontsize=8)
        ax.invert_yaxis()
        if log:
            from matplotlib.ticker import FormatStrFormatter, NullFormatter

            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    ax = axes.flat[4]
    ts = report["targets"]
    vals = [t["value"] for t in ts]
    limits = [float(t["target"].split()[1]) for t in ts]
    y = list(range(len(ts)))
    ax.barh(y, vals, color=["tab:green" if t["pass"] else "tab:red" for t in ts])
    ax.scatter(limits, y, marker="|", s=300, color="black", zorder=3, label="goal")
    ax.set_yticks(y)
    ax.set_yticklabels([t["name"] for t in ts], fontsize=7)
    ax.invert_yaxis()
    ax.set_title("targets: ratio (median of repetitions) and goal; green pass, red fail")
    ax.grid(axis="x", alpha=0.3)
    axes.flat[5].axis("off")
    gb = report["meta"]["w1"]["state_bytes"] / 1e9
    fig.suptitle(
        f"ckpt vs DCP, torch.save and the machine's floors: {gb:.2f} GB state, median of {report['env']['reps']} "
        "(bars: range). green ckpt, blue DCP, orange torch.save/load and s3fs put, gray floors"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
