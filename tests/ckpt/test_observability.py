"""Metrics over loopback, stragglers, provenance, check_finite."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import ckpt
from ckpt import Checkpointer
from ckpt.cli import main as cli
from tests._dist import Ctx, launch

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_endpoint_is_scraped_and_parsed(tmp_path: Path) -> None:
    port = _free_port()
    with Checkpointer(tmp_path, metrics_port=port) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.randn(256, 256)})
            ck.wait()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["ckpt_save_stall_seconds_count"] >= 2
    assert samples["ckpt_commit_latency_seconds_count"] >= 2
    assert samples["ckpt_bytes_written_total"] >= 2 * 256 * 256 * 4


def test_check_finite_refuses_and_keeps_the_previous_version(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, check_finite=True) as ck:
        ck.save(1, {"w": torch.ones(8), "h": torch.ones(4, dtype=torch.bfloat16)})
        ck.wait()
        bad = torch.ones(1000)
        bad[567] = float("inf")
        ck.save(2, {"w": bad, "h": torch.ones(4, dtype=torch.bfloat16)})
        with pytest.raises(ckpt.NonFiniteError, match=r"'w'.*rank 0"):
            ck.wait()
        assert ck.steps() == [1] and ck.latest_step() == 1
        nan_bf16 = torch.ones(4, dtype=torch.bfloat16)
        nan_bf16[0] = float("nan")
        ck.save(3, {"w": torch.ones(8), "h": nan_bf16})
        with pytest.raises(ckpt.NonFiniteError, match="'h'"):
            ck.wait()
        ck.save(4, {"w": torch.ones(8), "h": torch.ones(4, dtype=torch.bfloat16)})
        ck.wait()
        assert ck.steps() == [1, 4]
    with Checkpointer(tmp_path) as ck:  # off by default: NaN is saved as is
        ck.save(5, {"w": torch.tensor([float("nan")])})
        ck.wait()
        assert ck.latest_step() == 5


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=str
)
def test_check_finite_refuses_float8_nan_and_inf(tmp_path: Path, dtype: torch.dtype) -> None:
    """Before, float8 tensors were not checked: a NaN in one was committed as the newest version."""
    good = (torch.arange(64, dtype=torch.float32) / 8 - 4).to(dtype)  # finite, signs and zeros
    with Checkpointer(tmp_path, check_finite=True) as ck:
        ck.save(1, {"w": good})
        ck.wait()
        step = 1
        specials = [float("nan")] + ([float("inf"), float("-inf")] if dtype == torch.float8_e5m2 else [])
        for v in specials:
            bad = good.clone()
            bad[37] = torch.tensor(v).to(dtype)
            step += 1
            ck.save(step, {"w": bad})
            with pytest.raises(ckpt.NonFiniteError, match="'w'"):
                ck.wait()
        assert ck.steps() == [1]
        got = {"w": torch.zeros(64).to(dtype)}
        ck.restore(got)
        assert torch.equal(got["w"].view(torch.uint8), good.view(torch.uint8))


def nan_on_one_rank(ctx: Ctx, root: str) -> dict:
    with Checkpointer(root, check_finite=True) as ck:
        ck.save(1, {"w": torch.ones(64)})
        ck.wait()
        w = torch.ones(64)
        if ctx.rank == 1:
            w[3] = float("nan")
        from ckpt import Shard

        ck.save(2, {"w": Shard(w, (128,), (64 * ctx.rank,))})
        try:
            ck.wait()
            ctx.check(False, "a NaN on rank 1 must fail the save everywhere")
        except ckpt.CkptError as e:
            ctx.check("rank 1" in str(e), f"the error names rank 1: {e}")
        ctx.check(ck.steps() == [1], f"previous version stays the newest: {ck.steps()}")
    return {}


def straggler(ctx: Ctx, root: str) -> dict:
    from ckpt.store import metrics

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ckpt").addHandler(Grab())
    with Checkpointer(root) as ck:
        for step in (1, 2):
            piece = torch.randn(64, 64)  # each rank writes its own piece
            ck.save(step, {"w": ckpt.Shard(piece, (128, 64), (64 * ctx.rank, 0))})
            ck.wait()
    if ctx.rank == 0:
        hits = [m for m in records if "straggler rank 1" in m]
        ctx.check(len(hits) == 2, f"a straggler warning per save: {records}")
        ctx.check(all(root in m for m in hits), f"the warning names the disk: {hits}")
        ctx.check(metrics.STRAGGLERS.labels(rank="1")._value.get() == 2, "counted in the metric")
        ctx.check(metrics.STRAGGLERS.labels(rank="0")._value.get() == 0, "rank 0 is not a straggler")
        from ckpt.store.versions import read_manifest

        timings = read_manifest(root, 2).meta["timings"]  # O(1) in the ranks: the straggler is named
        ctx.check(timings["ranks"] == 2 and timings["write_s"]["max_rank"] == 1, f"manifest timings: {timings}")
        ctx.check(timings["write_s"]["max"] >= 0.4, f"the slow rank's write time: {timings}")
    return {}


def test_nan_on_one_rank_fails_the_save_on_all(tmp_path: Path) -> None:
    _, failures = launch(__file__, "nan_on_one_rank", 2, tmp_path / "job", root=str(tmp_path / "root"))
    assert not failures, failures


def test_a_slow_rank_is_reported_as_straggler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELAY", "write:1:0.4")  # rank 1's writer sleeps 0.4 s per chunk
    _, failures = launch(__file__, "straggler", 2, tmp_path / "job", root=str(tmp_path / "root"))
    assert not failures, failures


def test_inspect_shows_provenance(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(3)})
    out = CliRunner().invoke(cli, ["inspect", str(tmp_path), "--json"])
    meta = json.loads(out.output)["meta"]
    assert meta["torch_version"] == torch.__version__ and meta["ckpt_version"]
    assert meta["ranks"][0]["host"] and meta["ranks"][0]["cpu"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # the tests run inside the project's checkout
        assert meta["git"]["commit"] == head.stdout.strip()
    table = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert "torch_version" in table.output and "ranks [0]" in table.output


def test_daemon_metrics_endpoint(tmp_path: Path) -> None:
    import os
    import signal
    import sys
    import time

    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.randn(512, 512)})
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "ckpt.cli", "replicate", str(root), "--to", f"file://{tmp_path / 'remote'}"]
    proc = subprocess.Popen([*cmd, "--metrics-port", str(port)], env=env, cwd=REPO)
    try:
        samples: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                samples = {
                    s.name + str(sorted(s.labels.items())): s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                }
                if samples.get("ckpt_upload_bytes_total[('tier', 'shared')]", 0) >= 512 * 512 * 4:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert samples.get("ckpt_upload_bytes_total[('tier', 'shared')]", 0) >= 512 * 512 * 4, samples
        assert "ckpt_replication_lag_seconds[]" in samples
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
