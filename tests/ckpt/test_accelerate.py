"""ckpt.accelerate: what `accelerator.save_state` saves, through a Checkpointer, resumed bit for bit.

Each run is a fresh process of tests/_accelerate_worker.py (real accelerate, no mocks): a
reference run records every loss; a second run saves mid-epoch with
`ckpt.accelerate.save_state` and stops; a third (new Accelerator, model, optimizer,
scheduler, loader, registered object, scaler; its torch RNG scrambled) resumes with
`ckpt.accelerate.load_state`. Every later loss must equal the reference's (== on the
floats, compared as float.hex) and the final parameters, optimizer, scheduler, scaler
and registered object too, byte for byte.

Mid-epoch resume is exact with `DataLoaderConfiguration(use_seedable_sampler=True)` (the
permutation of epoch e is drawn from seed + e, so a resumed run draws it again) and
either `use_stateful_dataloader=True` (the loader goes on at the next batch by itself) or
accelerate's `skip_first_batches` for the rest of the epoch. Accelerate's own loop counter
(`iteration`, the epoch the seedable sampler is seeded with) is part of the version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer
from tests._dist import REPO, launch

WORKER = str(REPO / "tests" / "_accelerate_worker.py")


def _run_one(workdir: Path, **spec: Any) -> list[dict[str, Any]]:
    """One phase in a fresh single process (no torch.distributed)."""
    out = workdir / f"{spec['phase']}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests._accelerate_worker", json.dumps(spec), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{spec['phase']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(out.read_text())]


def _run(world: int, workdir: Path, **spec: Any) -> list[dict[str, Any]]:
    if world == 1:
        return _run_one(workdir, **spec)
    results, failures = launch(WORKER, "run", world, workdir / spec["phase"], timeout=120, **spec)
    assert not failures, failures
    return results


def _resume_matches(tmp_path: Path, *, world: int, stateful: bool, stop_at: int, **loader: Any) -> list[dict[str, Any]]:
    """Reference, save at `stop_at` and stop, resume: the resumed run is the reference's tail.
    Returns the save phase's results (per rank)."""
    root = str(tmp_path / "ckpt")
    ref = _run(world, tmp_path, phase="reference", root=str(tmp_path / "ref"), stateful=stateful, **loader)
    saved = _run(world, tmp_path, phase="save", root=root, stateful=stateful, stop_at=stop_at, **loader)
    resumed = _run(world, tmp_path, phase="resume", root=root, stateful=stateful, scrambled=True, **loader)
    for rank in range(world):
        want, mid, got = ref[rank], saved[rank], resumed[rank]
        assert want["restored"] is None  # an empty root: load_state returns None
        assert len(want["losses"]) > stop_at
        assert mid["losses"] == want["losses"][:stop_at], f"rank {rank}: the saving run is not the reference"
        assert got["restored"] == stop_at
        assert got["progress"]["step"] == stop_at  # the registered object
        assert got["acc_step"] == mid["acc_step"]  # accelerator.step (gradient accumulation)
        assert got["losses"] == want["losses"][stop_at:], f"rank {rank}: resumed losses differ from the reference"
        for key in want["final"]:
            assert got["final"][key] == want["final"][key], f"rank {rank}: final {key} differs"
        ours = [w for w in mid["warnings"] + got["warnings"] if w.startswith("ckpt.accelerate")]
        assert not ours, ours
    return saved


def test_stateful_dataloader_resumes_mid_epoch(tmp_path: Path) -> None:
    """use_stateful_dataloader=True: saved at batch 4 of 9 of the second epoch."""
    _resume_matches(tmp_path, world=1, stateful=True, stop_at=13)


def test_skip_first_batches_resumes_mid_epoch(tmp_path: Path) -> None:
    """A plain prepared DataLoader: the resumed run skips the consumed batches with
    accelerator.skip_first_batches (set_epoch at the start of each epoch)."""
    _resume_matches(tmp_path, world=1, stateful=False, stop_at=13)


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "skip_first_batches"])
def test_a_loader_with_workers_drawing_noise_resumes_exactly_from_an_epoch_s_end(
    tmp_path: Path, stateful: bool
) -> None:
    """num_workers=2 and a dataset that draws from torch's RNG in the workers, whose seeds
    come from the loader's own generator at each iter(): the generator is in the version.
    Before, the resumed epochs drew other seeds (and, stateful, accelerate's first iterator,
    made when the loader was prepared, kept a base seed of the generator before the restore)."""
    _resume_matches(tmp_path, world=1, stateful=stateful, stop_at=9, workers=2, noisy=True)


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "skip_first_batches"])
def test_a_loader_with_workers_drawing_noise_resumed_mid_epoch_draws_the_next_epochs_alike(
    tmp_path: Path, stateful: bool
) -> None:
    """Saved at batch 4 of 9 of the second epoch: the rest of that epoch draws other noise
    (no state holds how far each worker's RNG drew), and every later epoch the same batches
    as the reference (the seedable sampler reseeds the generator each epoch)."""
    spec: dict[str, Any] = {"stateful": stateful, "workers": 2, "noisy": True}
    [ref] = _run_one(tmp_path, phase="reference", root=str(tmp_path / "ref"), **spec)
    _run_one(tmp_path, phase="save", root=str(tmp_path / "ckpt"), stop_at=13, **spec)
    [got] = _run_one(tmp_path, phase="resume", root=str(tmp_path / "ckpt"), scrambled=True, **spec)
    assert got["restored"] == 13 and len(ref["inputs"]) == 27
    assert got["inputs"][18 - 13 :] == ref["inputs"][18:], "the epochs after the resumed one draw other batches"


def test_saved_at_the_last_batch_of_an_epoch_resumes_at_the_next(tmp_path: Path) -> None:
    """At the last batch the loader's state is "finished" and its epoch count not yet bumped:
    the resumed run must start the next epoch (not repeat the permutation of this one)."""
    _resume_matches(tmp_path, world=1, stateful=True, stop_at=9)


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "skip_first_batches"])
def test_two_gloo_ranks(tmp_path: Path, stateful: bool) -> None:
    """accelerate's MULTI_CPU (DDP over gloo, the loader sharded per rank), 5 batches per rank
    and epoch, saved in the second epoch. The models are saved unwrapped, so the 2-rank
    version loads into a plain model in this process."""
    saved = _resume_matches(tmp_path, world=2, stateful=stateful, stop_at=7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.restore({"models": {"0": model}}) == 7
    from tests._accelerate_worker import _jsonable

    assert _jsonable(model.state_dict()) == saved[0]["params"] == saved[1]["params"]


def test_loaders_that_cannot_resume_exactly_are_named_at_save(tmp_path: Path) -> None:
    """A loader shuffling with a plain RandomSampler (its permutation is drawn from the
    generator's state at the start of the epoch), or with no generator of its own (each
    iter() draws from the global torch RNG): save_state says what to change."""
    [saved] = _run_one(
        tmp_path,
        phase="save",
        root=str(tmp_path / "ckpt"),
        stateful=True,
        stop_at=4,
        seedable=False,
        loader_generator=False,
    )
    warnings = saved["warnings"]
    assert any("use_seedable_sampler=True" in w for w in warnings), warnings
    assert any("generator=torch.Generator()" in w for w in warnings), warnings


def test_importing_ckpt_does_not_import_accelerate() -> None:
    code = (
        "import sys, ckpt, ckpt.checkpointer, ckpt.accelerate\n"
        "assert 'accelerate' not in sys.modules, 'accelerate was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_stateful_loader_s_state_into_a_plain_loader_is_a_state_mismatch(tmp_path: Path) -> None:
    """Before, load_state raised AttributeError ('DataLoader' object has no attribute
    'load_state_dict') after loading the model, with accelerator.step left as it was."""
    code = f"""
import json, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from ckpt import Checkpointer, StateMismatchError
import ckpt.accelerate as ca

def build(stateful):
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, use_stateful_dataloader=stateful))
    data = torch.arange(20.0).reshape(10, 2)
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    return (acc, *acc.prepare(torch.nn.Linear(3, 2), dl))

acc, m, dl = build(True)
next(iter(dl))
acc.step = 3
with Checkpointer({str(tmp_path / "r")!r}) as ck:
    ca.save_state(acc, ck, 1)
acc2, m2, dl2 = build(False)
try:
    with Checkpointer({str(tmp_path / "r")!r}) as ck:
        ca.load_state(acc2, ck)
    print(json.dumps({{"raised": None}}))
except StateMismatchError as e:
    print(json.dumps({{"raised": "StateMismatchError", "message": str(e), "step": acc2.step}}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["raised"] == "StateMismatchError", got
    assert "use_stateful_dataloader=True" in got["message"] and got["step"] == 0


@pytest.mark.parametrize("case", ["params_only", "loader_added"])
def test_load_state_with_strict_false_leaves_what_the_version_lacks(tmp_path: Path, case: str) -> None:
    """strict=False with a version that lacks slots the accelerator now has (a params-only
    version's loaders and step; a loader added since): those stay as they are. Before,
    load_state raised AttributeError on the empty slot after the model was loaded."""
    code = f"""
import json, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from ckpt import Checkpointer
import ckpt.accelerate as ca

def build(loaders):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    data = torch.arange(20.0).reshape(10, 2)
    dls = [torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(i))
           for i in range(loaders)]
    return (acc, *acc.prepare(torch.nn.Linear(3, 2), *dls))

acc, m, dl = build(1)
with torch.no_grad():
    m.weight.fill_(7.0)
acc.step = 5
with Checkpointer({str(tmp_path / "r")!r}) as ck:
    ca.save_state(acc, ck, 1, **({{"only": ("models",)}} if {case!r} == "params_only" else {{}}))
acc2, m2, *dls = build(1 if {case!r} == "params_only" else 2)
with Checkpointer({str(tmp_path / "r")!r}) as ck:
    got = ca.load_state(acc2, ck, strict=False)
print(json.dumps({{"got": got, "weight": bool((m2.weight == 7.0).all()), "step": acc2.step}}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"got": 1, "weight": True, "step": 0 if case == "params_only" else 5}, out


# -- found by review (2026-12-07): accumulation windows and another world size -------------


def test_a_save_inside_a_gradient_accumulation_window_is_named_at_save_and_at_load(tmp_path: Path) -> None:
    """The gradients accumulated since the last optimizer step are in no version (as in
    accelerate's own save_state), so a resume from inside a window applies the rest of the
    window's alone: it diverged from the run that went on, with no word. Now both the save
    and the load say so; a save at a window's end says nothing."""
    words = "inside a gradient accumulation window"
    for stop_at, inside in ((6, False), (7, True)):
        root = str(tmp_path / f"at{stop_at}")
        [saved] = _run_one(tmp_path, phase="save", root=root, stateful=True, stop_at=stop_at, accumulate=3)
        [resumed] = _run_one(tmp_path, phase="resume", root=root, stateful=True, accumulate=3)
        assert resumed["restored"] == stop_at
        for run in (saved, resumed):
            said = [w for w in run["warnings"] if words in w]
            assert len(said) == int(inside), (stop_at, run["warnings"])
        if inside:
            assert f"step {stop_at} is saved inside" in saved["warnings"][-1], saved["warnings"]


def test_a_stateful_loader_resumed_on_another_world_size_starts_its_epoch_again(tmp_path: Path) -> None:
    """A StatefulDataLoader's state is its rank's position in its shard; on another world
    size the shards differ, and loading rank r % saved_world's position repeated or skipped
    samples, silently. Now the epoch starts again from its first batch, with a warning."""
    root = str(tmp_path / "ckpt")
    _run(2, tmp_path, phase="save", root=root, stateful=True, stop_at=7)  # 5 batches a rank and epoch
    [resumed] = _run_one(tmp_path, phase="resume", root=root, stateful=True)
    assert resumed["restored"] == 7
    said = [w for w in resumed["warnings"] if "saved on 2 ranks and is loaded on 1" in w]
    assert len(said) == 1 and "dataloader 0" in said[0], resumed["warnings"]
    assert resumed["batches"][0] == 9, resumed["batches"]  # the whole epoch, on one process


def test_a_plain_loader_saved_mid_epoch_and_resumed_stateful_says_its_epoch_starts_again(tmp_path: Path) -> None:
    """A plain loader keeps no position in the epoch. Resumed into a StatefulDataLoader (which
    goes on by itself, so no skip_first_batches), its epoch started again from its first
    batch in silence. Now a warning says so; saved at an epoch's last batch, nothing is lost
    and nothing is said."""
    for stop_at, mid_epoch in ((7, True), (9, False)):  # 9 batches an epoch
        where = tmp_path / str(stop_at)
        where.mkdir()
        root = str(where / "ckpt")
        _run_one(where, phase="save", root=root, stateful=False, stop_at=stop_at)
        [resumed] = _run_one(where, phase="resume", root=root, stateful=True)
        assert resumed["restored"] == stop_at
        said = [w for w in resumed["warnings"] if "was saved as a plain loader" in w]
        assert resumed["batches"][0] == 9, resumed["batches"]  # the whole epoch
        if mid_epoch:
            assert len(said) == 1 and "inside an epoch" in said[0] and "dataloader 0" in said[0], resumed["warnings"]
        else:
            assert said == [], resumed["warnings"]


def test_a_plain_loader_saved_inside_a_resumed_epoch_is_named_too(tmp_path: Path) -> None:
    """A resumed epoch iterates the loader accelerator.skip_first_batches made, not the
    prepared one: a save there was recorded as outside an epoch, and its load into a
    stateful loader started the epoch again in silence."""
    code = f"""
import json, logging, torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from ckpt import Checkpointer
import ckpt.accelerate as ca

said = []
class Keep(logging.Handler):
    def emit(self, record): said.append(record.getMessage())
logging.getLogger("ckpt").addHandler(Keep())

def build(stateful):
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, use_stateful_dataloader=stateful))
    data = torch.arange(20.0).reshape(10, 2)
    return (acc, *acc.prepare(torch.nn.Linear(2, 2), torch.utils.data.DataLoader(data, batch_size=2)))

acc, m, dl = build(False)
for i, batch in enumerate(acc.skip_first_batches(dl, 2)):  # a resumed epoch: batches 3, 4, ...
    if i == 1:
        with Checkpointer({str(tmp_path / "r")!r}) as ck:
            ca.save_state(acc, ck, 4)
        break
acc2, m2, dl2 = build(True)
with Checkpointer({str(tmp_path / "r")!r}) as ck:
    print(json.dumps({{"step": ca.load_state(acc2, ck), "said": said}}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["step"] == 4
    assert any("saved as a plain loader inside an epoch" in w for w in got["said"]), got["said"]


RELOAD_SCRIPT = """
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from ckpt import Checkpointer
import ckpt.accelerate as ca

phase, root = sys.argv[1], sys.argv[2]
set_seed(0)
config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=True)
acc = Accelerator(cpu=True, dataloader_config=config)
data = TensorDataset(torch.arange(36.0).reshape(36, 1))
dl = acc.prepare(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)))
seen, step = [], 0
with Checkpointer(root) as ck:
    if phase == "resave":  # load step 13 (inside an epoch) and save it again before any batch
        ca.save_state(acc, ck, ca.load_state(acc, ck, step=13) + 100)
        ck.wait()
        sys.exit(0)
    if phase == "resume-resaved":
        step = ca.load_state(acc, ck, step=113) - 100
    if phase == "twice":  # inside an epoch, then at an epoch's end, before any batch
        ca.load_state(acc, ck, step=13)
        step = ca.load_state(acc, ck, step=18)
    for epoch in range(step // len(dl), 3):
        dl.set_epoch(epoch)
        for (x,) in dl:
            step += 1
            seen.append(int(x.sum().item()))
            if phase == "save" and step in (13, 18):
                ca.save_state(acc, ck, step)
                ck.wait()
print(json.dumps(seen))
"""


def test_a_stateful_loader_s_position_survives_a_resave_and_a_second_load(tmp_path: Path) -> None:
    """A save right after a mid-epoch load_state kept the position (the loader is not being
    iterated, so its record says not mid-epoch); two loads before any batch take the
    second's position (found by review: the epoch started again, and batches were skipped)."""
    script = tmp_path / "reload.py"
    script.write_text(RELOAD_SCRIPT)
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def run(phase: str) -> list[int]:
        proc = subprocess.run(
            [sys.executable, str(script), phase, root], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"{phase}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1]) if phase != "resave" else []

    ref = run("save")
    assert len(ref) == 27
    run("resave")
    assert run("resume-resaved") == ref[13:]
    assert run("twice") == ref[18:]
