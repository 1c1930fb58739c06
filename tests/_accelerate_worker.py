"""Training runs with Hugging Face Accelerate for tests/ckpt/test_accelerate.py, each in a
fresh process: a reference run, a run that saves with ckpt.accelerate.save_state and stops,
and a run that resumes with ckpt.accelerate.load_state.

The same function `run(ctx, **spec)` serves both launches: single-process (`python -m
tests._accelerate_worker SPEC OUT`: no torch.distributed, accelerate's DistributedType.NO)
and the 2-rank gloo scenarios of tests/_dist.py (`launch(__file__, "run", 2, ...)`: the
process group is already up; accelerate picks it up as MULTI_CPU from RANK/WORLD_SIZE).

The model has dropout (the torch RNG matters), the optimizer is AdamW, the scheduler a
LambdaLR, the loader a shuffled DataLoader with its own generator prepared by the
Accelerator with a seedable sampler, a registered object counts the progress, and a
gradient scaler (torch.amp's, on the CPU: accelerate makes none there) scales the loss
and grows its scale every 3 steps. Every loss is recorded as float.hex (exact), and the
final parameters, optimizer, scheduler, scaler and registered state as base64/JSON.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

EPOCHS = 3
SAMPLES = 36  # 9 batches of 4 per epoch on one process; 5 per rank on two (the last one padded)
BATCH = 4


class Progress:
    """The registered object: the global step and the sum of the losses so far."""

    def __init__(self) -> None:
        self.step = 0
        self.loss_sum = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss_sum": self.loss_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.loss_sum = state["step"], state["loss_sum"]


class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset that draws from torch's RNG per sample (augmentation): in a loader's
    worker that is the worker's RNG, seeded from the loader's generator at each iter()."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1:]), self.y[i]


class _Collect(logging.Handler):
    """The warnings ckpt logs, for the result."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


class _Ctx:
    """tests._dist.Ctx's fields, for a single process (tests/_dist.py loads this file without
    registering it as a module, so no dataclass here)."""

    def __init__(self, rank: int, world: int, workdir: Path) -> None:
        self.rank, self.world, self.workdir = rank, world, workdir


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).decode()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"dtype": str(v.dtype), "shape": list(v.shape), "bytes": _b64(v)}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float):
        return v.hex()
    return v


def run(
    ctx: Any,
    *,
    phase: str,
    root: str,
    stateful: bool,
    stop_at: int = 0,
    scrambled: bool = False,
    seedable: bool = True,
    loader_generator: bool = True,
    accumulate: int = 1,
    workers: int = 0,
    noisy: bool = False,
) -> dict[str, Any]:
    """phase: "reference" (train to the end), "save" (train to step `stop_at`, save, stop) or
    "resume" (load_state, train to the end). Returns the losses of the steps it trained
    (hex), the warnings ckpt logged and, at the end, the final state. `seedable=False` and
    `loader_generator=False` make a loader whose mid-epoch resume cannot be exact;
    `accumulate`: accelerate's gradient_accumulation_steps; `workers`: the loader's
    num_workers; `noisy`: each sample drawn with noise from torch's RNG."""
    if ctx.world > 1:  # accelerate reads the layout from the environment; the group is already up
        os.environ.update(
            RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), LOCAL_RANK=str(ctx.rank), LOCAL_WORLD_SIZE=str(ctx.world)
        )
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader, TensorDataset

    import ckpt.accelerate
    from ckpt import Checkpointer

    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    data = (Noisy if noisy else TensorDataset)(
        torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)
    )
    own = torch.Generator().manual_seed(7) if loader_generator else None
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=own, num_workers=workers)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1.0 + 0.1 * s))
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=accumulate,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable, use_stateful_dataloader=stateful),
    )
    # accelerate creates a GradScaler for fp16 on GPUs only; give it one, as it would there.
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    assert accelerator.num_processes == ctx.world, (accelerator.num_processes, ctx.world)

    out: dict[str, Any] = {"losses": [], "warnings": [], "batches": [], "inputs": []}
    warnings = _Collect(out["warnings"])
    logging.getLogger("ckpt").addHandler(warnings)
    with Checkpointer(root) as ck:
        if phase == "reference":  # nothing committed yet: None, and nothing changes
            before = accelerator.unwrap_model(model).state_dict()
            out["restored"] = ckpt.accelerate.load_state(accelerator, ck)
            assert all(torch.equal(v, before[k]) for k, v in accelerator.unwrap_model(model).state_dict().items())
        if phase == "resume":
            if scrambled:  # the RNG of the fresh process must not matter: restore sets it
                torch.manual_seed(999)
            out["restored"] = ckpt.accelerate.load_state(accelerator, ck)
            out["acc_step"] = accelerator.step
            out["progress"] = progress.state_dict()
        # The epoch and the batch to go on from follow from the step, as in accelerate's examples:
        # a version saved at the last batch of an epoch goes on at the start of the next one.
        start_epoch, skip = divmod(progress.step, len(loader))
        for epoch in range(start_epoch, EPOCHS):
            if stateful:
                active = loader  # a restored StatefulDataLoader goes on at the next batch by itself
            else:
                loader.set_epoch(epoch)
                active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
            out["batches"].append(0)  # per epoch of this run
            for x, y in active:
                out["batches"][-1] += 1
                out["inputs"].append(x.double().sum().item().hex())  # the batch this step saw
                with accelerator.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optim.step()
                    sched.step()
                    optim.zero_grad()
                progress.step += 1
                progress.loss_sum += loss.item()
                out["losses"].append(loss.item().hex())
                if phase == "save" and progress.step == stop_at:
                    assert ckpt.accelerate.save_state(accelerator, ck, progress.step)
                    ck.wait()
                    out["acc_step"] = accelerator.step
                    out["params"] = _jsonable(accelerator.unwrap_model(model).state_dict())
                    return out
    unwrapped = accelerator.unwrap_model(model)
    out["final"] = _jsonable(
        {
            "params": unwrapped.state_dict(),
            "optim": optim.optimizer.state_dict(),
            "sched": {k: v for k, v in sched.scheduler.state_dict().items() if k != "lr_lambdas"},
            "scaler": accelerator.scaler.state_dict(),
            "progress": progress.state_dict(),
            "acc_step": accelerator.step,
        }
    )
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    result = run(_Ctx(0, 1, Path(spec["root"]).parent), **spec)
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
