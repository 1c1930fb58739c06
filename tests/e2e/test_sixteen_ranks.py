"""A real 16-process job (bench/scale.py's): 16 gloo ranks on 4 simulated nodes, a root
each, save a state of every layout kind (ZeRO-style shards cut at arbitrary points,
DTensors on a 1-D and a 2 x 8 mesh, rows, experts, replicated tensors) three times;
12 ranks resume it, check every tensor bitwise and save; 16 ranks resume that. Each rank
counts its collective calls per steady-state save."""

from __future__ import annotations

from pathlib import Path


def test_sixteen_ranks_save_then_resume_on_twelve_and_sixteen(tmp_path: Path) -> None:
    from bench.scale import real_job

    got = real_job(str(tmp_path))
    assert got["resume_16_12_16_bitwise"] is True, got
    assert got["max_collectives_per_steady_save"] <= 3, got
    assert got["all_gathers_in_steady_saves"] == 0, got
