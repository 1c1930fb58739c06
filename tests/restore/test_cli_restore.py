"""`ckpt restore` and `ckpt inspect`: exports across tiers, bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import zarr
from click.testing import CliRunner

from ckpt import Checkpointer, Shard
from ckpt.cli import main as cli
from ckpt.store import versions
from tests._dist import Ctx, launch
from tests._states import assert_bitwise


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "meta": {"epoch": 2, "pair": (1, 2.5)}}


def test_restore_to_torch_and_to_dir_are_bitwise(tmp_path: Path) -> None:
    root = tmp_path / "root"
    src = _state(0)
    with Checkpointer(root) as ck:
        ck.save(3, src)
        src["meta"]["epoch"] = 9
        ck.save(4, src)
    runner = CliRunner()
    out = runner.invoke(cli, ["restore", str(root), "--step", "3", "--to-torch", str(tmp_path / "s3.pt")])
    assert out.exit_code == 0, out.output
    got = torch.load(tmp_path / "s3.pt", weights_only=True)
    want = {
        "model": src["model"].state_dict(),
        "optim": src["optim"].state_dict(),
        "meta": {"epoch": 2, "pair": (1, 2.5)},
    }
    assert_bitwise(got, want, "step 3 through --to-torch")

    out = runner.invoke(cli, ["restore", str(root), "--to", str(tmp_path / "copy")])
    assert out.exit_code == 0, out.output
    assert "restored step 4" in out.output
    assert versions.committed_steps(str(tmp_path / "copy")) == [4]
    assert runner.invoke(cli, ["verify", str(tmp_path / "copy")]).exit_code == 0
    fresh = _state(1)
    with Checkpointer(tmp_path / "copy") as ck:
        assert ck.restore(fresh) == 4
    assert_bitwise(fresh["model"].state_dict(), src["model"].state_dict(), "model")
    assert_bitwise(fresh["meta"], {"epoch": 9, "pair": (1, 2.5)}, "meta")

    usage = runner.invoke(cli, ["restore", str(root)])
    assert usage.exit_code == 2  # neither --to nor --to-torch
    missing = runner.invoke(cli, ["restore", str(root), "--step", "7", "--to", str(tmp_path / "x")])
    assert missing.exit_code == 3 and "step 7" in missing.output


def test_restore_skips_a_corrupt_version_and_uses_a_tier(tmp_path: Path) -> None:
    root, tier = tmp_path / "root", tmp_path / "tier"
    src = _state(0)
    with Checkpointer(root) as ck:
        ck.save(1, src)
        src["meta"]["epoch"] = 5
        ck.save(2, src)
    shutil.copytree(root / "v000000000002", tier / "v000000000002")
    chunk = next((root / "v000000000002" / "state" / "model").rglob("c.0.0"))
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 1
    chunk.write_bytes(bytes(raw))
    runner = CliRunner()
    alone = runner.invoke(cli, ["restore", str(root), "--to-torch", str(tmp_path / "a.pt")])
    assert alone.exit_code == 0, alone.output
    assert "step 2 is not intact" in alone.output and "restored step 1" in alone.output
    assert torch.load(tmp_path / "a.pt", weights_only=True)["meta"]["epoch"] == 2
    both = runner.invoke(cli, ["restore", str(root), "--tier", str(tier), "--to-torch", str(tmp_path / "b.pt")])
    assert both.exit_code == 0 and "restored step 2" in both.output, both.output
    got = torch.load(tmp_path / "b.pt", weights_only=True)
    assert_bitwise(got["model"], src["model"].state_dict(), "model")


def save_two_nodes(ctx: Ctx, root: str) -> dict:
    import torch.distributed as dist  # noqa: F401

    torch.manual_seed(0)
    full = torch.randn(12, 5)
    rows = [(0, 2), (2, 5), (5, 9), (9, 12)][ctx.rank]  # uneven, 4 ranks
    state = {
        "w": Shard(full[rows[0] : rows[1]].clone(), (12, 5), (rows[0], 0)),
        "rep": torch.arange(40, dtype=torch.int64).reshape(8, 5),
    }
    with Checkpointer(lambda r: f"{root}/node{r // 2}", split_bytes=64) as ck:
        ck.save(1, state)
    return {"full": full.tolist()}


def test_multi_root_version_is_assembled_and_copied(tmp_path: Path) -> None:
    results, failures = launch(__file__, "save_two_nodes", 4, tmp_path / "job", root=str(tmp_path))
    assert not failures, failures
    full = torch.tensor(results[0]["full"])
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    runner = CliRunner()
    alone = runner.invoke(cli, ["restore", str(node0), "--to-torch", str(tmp_path / "x.pt")])
    assert alone.exit_code == 3  # node0 alone does not hold every rank's chunks
    out = runner.invoke(cli, ["restore", str(node0), "--tier", str(node1), "--to", str(tmp_path / "all")])
    assert out.exit_code == 0, out.output
    version = tmp_path / "all" / "v000000000001"
    w = torch.from_numpy(zarr.open_array(str(version / "state" / "w"))[:])
    rep = torch.from_numpy(zarr.open_array(str(version / "state" / "rep"))[:])
    assert_bitwise({"w": w, "rep": rep}, {"w": full, "rep": torch.arange(40, dtype=torch.int64).reshape(8, 5)})
    info = json.loads(runner.invoke(cli, ["inspect", str(version.parent), "--json"]).output)
    arrays = {a["name"]: a for a in info["arrays"]}
    assert info["world_size"] == 4 and arrays["w"]["shape"] == [12, 5]
    assert arrays["w"]["sharding"].startswith("uneven sharded on dim 0 in 4 pieces")
    assert arrays["rep"]["sharding"] == "replicated"
    table = runner.invoke(cli, ["inspect", str(node0), "--tier", str(node1)])
    assert table.exit_code == 0 and "sharded" in table.output and "float32" in table.output


def _exported_step(root: Path, out: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["restore", str(root), "--to-torch", str(out), "--force", *args])
    if r.exit_code != 0:
        return -r.exit_code, r.output
    return int(torch.load(out, weights_only=True)["step"]), r.output


def test_an_export_takes_the_newest_full_version_when_the_state_s_keys_changed(tmp_path: Path) -> None:
    """`ckpt restore ROOT --to-torch F` exports the newest version that is not a params-only
    one. Before, it asked for every key any version held: where the state dropped a key
    ("ema" after step 2) it exported step 2, not step 4, and where the keys of older and
    newer versions differed both ways it exited 3 saying no version held every key."""
    out = tmp_path / "out.pt"
    dropped = tmp_path / "dropped"
    with Checkpointer(dropped, capture_rng=False) as ck:
        for s in (1, 2):
            ck.save(s, {"model": {"w": torch.full((2,), float(s))}, "ema": {"w": torch.zeros(2)}, "step": s})
        for s in (3, 4):
            ck.save(s, {"model": {"w": torch.full((2,), float(s))}, "step": s})
    assert _exported_step(dropped, out)[0] == 4
    ls = CliRunner().invoke(cli, ["ls", str(dropped), "--json"])  # none is shown as params-only
    assert [(r["step"], r["keys"], r["partial"]) for r in json.loads(ls.output)] == [
        (s, None, False) for s in (1, 2, 3, 4)
    ]
    swapped = tmp_path / "swapped"
    with Checkpointer(swapped, capture_rng=False) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "ema": {"w": torch.zeros(2)}, "step": 1})
        ck.save(2, {"model": {"w": torch.ones(2)}, "optim": {"m": torch.zeros(2)}, "step": 2})
    assert _exported_step(swapped, out)[0] == 2
    # Params-only versions are passed over for the full one before them, each said in a line.
    schedule = tmp_path / "schedule"
    with Checkpointer(schedule, capture_rng=False, full_every=3, partial_keys=("model", "step")) as ck:
        for s in range(1, 6):
            ck.save(s, {"model": {"w": torch.full((2,), float(s))}, "optim": {"m": torch.zeros(2)}, "step": s})
    got, output = _exported_step(schedule, out)
    assert got == 4, output
    assert "step 5 is a params-only version: passed over for step 4" in output
    ls = CliRunner().invoke(cli, ["ls", str(schedule), "--json"])
    assert [r["keys"] for r in json.loads(ls.output)] == [
        None,
        ["model", "step"],
        ["model", "step"],
        None,
        ["model", "step"],
    ]
    with Checkpointer(tmp_path / "only-partial", capture_rng=False) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "step": 1, "optim": {"m": torch.zeros(2)}}, only=("model", "step"))
    code, output = _exported_step(tmp_path / "only-partial", out)
    assert code == -3 and "params-only" in output and "--keys" in output, output
    assert _exported_step(tmp_path / "only-partial", out, "--keys", "model,step")[0] == 1


def save_stages(ctx: Ctx, root: str) -> dict:
    """Two ranks as two pipeline stages (each its own module and state), and a DDP-style
    model saved through DCP, whose dedup gives each tensor and item to one rank only."""
    from datetime import timedelta

    import torch.distributed.checkpoint as dcp

    import ckpt.dcp

    stage = {"w": torch.full((3,), float(ctx.rank)), "lr": 0.1 * (ctx.rank + 1), "ids": {ctx.rank: ctx.rank}}
    with Checkpointer(f"{root}/pp", capture_rng=False) as ck:
        ck.save(1, {"model": {f"stage{ctx.rank}": stage}, "step": 1, "where": {"rank": ctx.rank}})
    # torchtitan's model_parts: a list of each rank's stages; a per-rank tensor at one place
    part = {f"layers.{2 * ctx.rank + i}.w": torch.full((2,), 10.0 * (2 * ctx.rank + i)) for i in (0, 1)}
    # and a frozen stage: its optimizer holds no state, the other's state under int keys
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    if ctx.rank == 1:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    with Checkpointer(f"{root}/parts", capture_rng=False) as ck:
        sampler = {"indices": list(range(ctx.rank, 8, 2))[: 3 + ctx.rank]}  # per-rank lists: [0, 2, 4], [1, 3, 5, 7]
        ck.save(1, {"model": [part], "pos": torch.tensor([ctx.rank]), "optim": opt.state_dict(), "sampler": sampler})
    torch.save(opt.state_dict(), f"{root}/optim{ctx.rank}.pt")
    # trees that cannot be one: a tuple of one tensor on rank 0, of two on rank 1
    with Checkpointer(f"{root}/odd", capture_rng=False) as ck:
        ck.save(1, {"t": tuple(torch.full((2,), float(i)) for i in range(ctx.rank + 1))})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    writer = ckpt.dcp.StorageWriter(f"{root}/dcp", 1, timeout=timedelta(seconds=60))
    dcp.save({"model": model.state_dict(), "epoch": 3}, storage_writer=writer)
    return {}


def test_an_export_to_torch_holds_what_every_saved_rank_held(tmp_path: Path) -> None:
    """Before, `--to-torch` assembled rank 0's state tree alone and exited 0: a pipeline
    stage on another rank, and the tensors DCP's dedup gave rank 1, were left out."""
    results, failures = launch(__file__, "save_stages", 2, tmp_path / "job", root=str(tmp_path))
    assert not failures, failures
    runner = CliRunner()
    out = tmp_path / "pp.pt"
    r = runner.invoke(cli, ["restore", str(tmp_path / "pp"), "--to-torch", str(out)])
    assert r.exit_code == 0, r.output
    got = torch.load(out, weights_only=True)
    assert_bitwise(got["model"]["stage0"]["w"], torch.zeros(3))
    assert_bitwise(got["model"]["stage1"]["w"], torch.ones(3))
    assert (got["model"]["stage0"]["lr"], got["model"]["stage1"]["lr"]) == (0.1, 0.2)
    assert got["model"]["stage1"]["ids"] == {1: 1} and got["step"] == 1
    assert got["where"] == {"rank": 0}  # a value both ranks hold, differently: the lower rank's
    # stages in a list merge item by item (before: rank 0's list stood alone, exit 0)
    out = tmp_path / "parts.pt"
    r = runner.invoke(cli, ["restore", str(tmp_path / "parts"), "--to-torch", str(out)])
    assert r.exit_code == 0, r.output
    got = torch.load(out, weights_only=True)
    assert sorted(got["model"][0]) == [f"layers.{i}.w" for i in range(4)], got
    for i in range(4):
        assert_bitwise(got["model"][0][f"layers.{i}.w"], torch.full((2,), 10.0 * i))
    assert_bitwise(got["pos"], torch.tensor([0]))  # a tensor both ranks hold, differently: the lower rank's
    assert got["sampler"] == {"indices": [0, 2, 4]}  # and a list: the lower rank's, never a mix
    stepped = torch.load(tmp_path / "optim1.pt", weights_only=True)["state"]
    assert sorted(got["optim"]["state"]) == [0, 1]  # rank 0's held none: rank 1's stands
    for k in (0, 1):
        for name, t in stepped[k].items():
            assert_bitwise(got["optim"]["state"][k][name], t)
    # where the trees cannot merge, an error that says so, never a file that lacks a tensor
    r = runner.invoke(cli, ["restore", str(tmp_path / "odd"), "--to-torch", str(tmp_path / "odd.pt")])
    assert r.exit_code == 3 and "do not merge" in r.output, r.output
    assert not (tmp_path / "odd.pt").exists()
    r = runner.invoke(
        cli, ["restore", str(tmp_path / "odd"), "--to", str(tmp_path / "odd-copy")]
    )  # a copy merges nothing
    assert r.exit_code == 0 and (tmp_path / "odd-copy" / "v000000000001").is_dir(), r.output
    out = tmp_path / "dcp.pt"
    r = runner.invoke(cli, ["restore", str(tmp_path / "dcp"), "--to-torch", str(out)])
    assert r.exit_code == 0, r.output
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    got = torch.load(out, weights_only=True)
    exported = {k: v for k, v in _leaves(got) if isinstance(v, torch.Tensor) and v.dtype == torch.float32}
    want = model.state_dict()
    assert sorted(n.split("model.", 1)[-1] for n in exported) == sorted(want)
    for name, t in exported.items():
        assert_bitwise(t, want[name.split("model.", 1)[-1]])


def _leaves(node: object, path: str = "") -> list[tuple[str, object]]:
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _leaves(v, f"{path}.{k}" if path else str(k))]
    return [(path, node)]


def test_keys_a_chosen_step_lacks_are_an_error(tmp_path: Path) -> None:
    """`--step 1 --keys model,nope`: step 1 holds no "nope". Before, the file held "model"
    alone (with `--keys nope`, nothing at all) and the command exited 0; without --step
    such a request was already refused."""
    with Checkpointer(tmp_path / "root", capture_rng=False) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "other": {"w": torch.zeros(2)}, "step": 1})
    out = tmp_path / "out.pt"
    for keys in ("model,nope", "nope"):
        r = CliRunner().invoke(
            cli, ["restore", str(tmp_path / "root"), "--step", "1", "--to-torch", str(out), "--keys", keys]
        )
        assert r.exit_code == 3 and "step 1 holds no nope" in r.output, r.output
        assert not out.exists()
    r = CliRunner().invoke(
        cli, ["restore", str(tmp_path / "root"), "--step", "1", "--to-torch", str(out), "--keys", "model"]
    )
    assert r.exit_code == 0, r.output
    assert sorted(torch.load(out, weights_only=True)) == ["model"]
