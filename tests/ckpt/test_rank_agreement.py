"""What one rank does differently fails the call on every rank, with ckpt's errors: never a
version committed from different steps, ranks restoring different versions, one rank's
load_state_dict failing while the others return, a raw OSError on the rank whose disk
refused the commit, or ranks left waiting for a chunk that one rank cannot send. Real gloo
jobs of 2 ranks."""

from __future__ import annotations

import datetime
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=30)


def _outcome(fn: Any) -> dict[str, Any]:
    import ckpt

    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - what each rank saw
        return {"err": type(e).__name__, "ckpt": isinstance(e, ckpt.CkptError), "msg": str(e)[:300]}


def save_steps_job(ctx: Any, root: str) -> dict[str, Any]:
    import ckpt

    state = {"w": torch.arange(4096.0)}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        out = {"save": _outcome(lambda: ck.save(5 + ctx.rank, state))}  # rank 0: step 5, rank 1: step 6
        out["steps"] = ck.steps()
        out["again"] = _outcome(lambda: ck.save(7, state, milestone=ctx.rank == 1))
        out["same"] = _outcome(lambda: (ck.save(8, state), ck.wait(), ck.steps())[2])
    return out


def test_ranks_saving_different_steps_fail_alike(tmp_path: Path) -> None:
    results, failures = launch(THIS, "save_steps_job", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures
    for r in results:
        assert r["save"]["err"] == "ValueError" and "different steps (5..6)" in r["save"]["msg"], results
        assert r["again"]["err"] == "ValueError", results  # milestone differs
        assert r["steps"] == [] and r["same"] == {"ok": [8]}, results


def restore_steps_job(ctx: Any, root: str) -> dict[str, Any]:
    import ckpt

    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((8,), float(s))})
        ck.wait()
        target = {"w": torch.zeros(8)}
        out = {"restore": _outcome(lambda: ck.restore(target, step=1 + ctx.rank))}
        out["untouched"] = bool((target["w"] == 0).all())
        out["same"] = _outcome(lambda: ck.restore(target, step=1))
    return out


def test_ranks_restoring_different_steps_fail_alike(tmp_path: Path) -> None:
    results, failures = launch(THIS, "restore_steps_job", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures
    for r in results:
        assert r["restore"]["err"] == "ValueError" and "different steps (1, 2)" in r["restore"]["msg"], results
        assert r["untouched"] and r["same"] == {"ok": 1}, results


def load_state_dict_job(ctx: Any, root: str) -> dict[str, Any]:
    import ckpt

    torch.manual_seed(0)
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(3, {"model": torch.nn.Linear(4, 4)})
        ck.wait()
    model = torch.nn.Linear(4, 4, bias=ctx.rank == 0)  # rank 1's model built without its bias
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        return _outcome(lambda: ck.restore({"model": model}))


def test_a_load_state_dict_that_fails_on_one_rank_fails_the_restore_on_all(tmp_path: Path) -> None:
    results, failures = launch(THIS, "load_state_dict_job", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures
    assert [r.get("err") for r in results] == ["RankFailures", "StateMismatchError"], results
    assert all(r["ckpt"] for r in results), results
    assert 'Unexpected key(s) in state_dict: "bias"' in results[1]["msg"], results


def _chattr(flag: str, path: str) -> bool:
    return subprocess.run(["chattr", flag, path], capture_output=True).returncode == 0


def publish_refused_job(ctx: Any, base: str) -> dict[str, Any]:
    """Rank 1's root refuses the rename that publishes step 2 (made immutable while rank 1
    waits after preparing it): every rank's save fails with a ckpt error, step 2 is
    committed on neither root... or, published on root 0 before the refusal, restored
    nowhere; once the root takes writes again, step 2 is saved."""
    import glob

    import ckpt

    mine = f"{base}/r1"
    state = {"w": torch.arange(2000.0)}  # replicated: the same on every rank
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(f"{base}/r{{rank}}", timeout=TIMEOUT) as ck:
        ck.save(1, state)
        ck.wait()
        if ctx.rank == 0:  # while rank 1 sleeps after preparing, freeze its root

            def freeze() -> None:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    if glob.glob(f"{mine}/v000000000002.tmp-*/manifest.json"):
                        out["frozen"] = _chattr("+i", mine)
                        return
                    time.sleep(0.01)

            watcher = threading.Thread(target=freeze)
            watcher.start()
        if ctx.rank == 1:
            os.environ["CKPT_DELAY"] = "after-prepare:1:2"
        out["save"] = _outcome(lambda: (ck.save(2, state), ck.wait()))
        os.environ.pop("CKPT_DELAY", None)
        if ctx.rank == 0:
            watcher.join()
        torch.distributed.barrier()
        if ctx.rank == 0:
            out["thawed"] = _chattr("-i", mine)
        torch.distributed.barrier()
        target = {"w": torch.zeros(2000)}
        out["restore"] = _outcome(lambda: ck.restore(target))
        out["retry"] = _outcome(lambda: (ck.save(2, state, overwrite=True), ck.wait(), ck.restore(target))[2])
        out["bitwise"] = bool(torch.equal(target["w"], state["w"]))
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_a_root_that_refuses_the_publish_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    if not _chattr("+i", str(tmp_path)) or not _chattr("-i", str(tmp_path)):
        pytest.skip("the filesystem under tmp_path takes no immutable flag")
    try:
        results, failures = launch(THIS, "publish_refused_job", 2, tmp_path, timeout=150, base=str(tmp_path))
    finally:
        _chattr("-i", str(tmp_path / "r1"))
    assert not failures, failures
    assert results[0]["frozen"] and results[0]["thawed"], results
    assert results[0]["save"]["err"] == "RankFailures", results
    assert results[1]["save"]["err"] == "TierUnavailableError", results  # its errno kept, not a bare OSError
    assert "cannot publish step 2" in results[1]["save"]["msg"], results
    for r in results:
        assert r["save"]["ckpt"] and r["restore"] == {"ok": 1} and r["retry"] == {"ok": 2} and r["bitwise"], results


def long_key_job(ctx: Any, root: str) -> dict[str, Any]:
    """A key path too long for a file path (ckpt.store.manifest.MAX_NAME_BYTES): on every
    rank, then on rank 1 only. Each fails the save on both ranks, before anything is written."""
    import ckpt

    deep: Any = torch.ones(2)
    for _ in range(17):  # 17 levels of 127 characters: an array name of 2175 bytes
        deep = {"k" * 127: deep}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, {"w": torch.arange(8.0)})
        out = {"both": _outcome(lambda: ck.save(2, {"w": torch.ones(8), "d": deep}))}
        one = {"w": torch.ones(8), "d": deep if ctx.rank == 1 else {}}
        out["one"] = _outcome(lambda: ck.save(2, one))
        ck.wait()
        out["steps"] = ck.steps()
        target = {"w": torch.zeros(8)}
        out["restore"] = _outcome(lambda: ck.restore(target))
        out["bitwise"] = bool(torch.equal(target["w"], torch.arange(8.0)))
    return out


def test_a_key_path_too_long_on_any_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    results, failures = launch(THIS, "long_key_job", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures
    for r in results:
        assert r["both"]["err"] == "UnsupportedStateError" and r["both"]["msg"].startswith("state['d']"), results
        assert r["steps"] == [1] and r["restore"] == {"ok": 1} and r["bitwise"], results
    assert [r["one"]["err"] for r in results] == ["RankFailures", "UnsupportedStateError"], results
    assert "UnsupportedStateError: state['d']" in results[0]["one"]["msg"], results  # rank 1's, named


# float64: each saving rank's half is one 40 MiB chunk, above the size from which malloc
# always maps new memory (32 MiB at most), so an allocation of it must grow the address space.
SEND_ROWS, SEND_COLS = 10240, 1024


def _rows(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo * SEND_COLS, hi * SEND_COLS, dtype=torch.float64).reshape(hi - lo, SEND_COLS)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def send_save_job(ctx: Any, base: str) -> None:
    """A root per rank, each holding its half of `w`, one chunk."""
    import ckpt

    half = SEND_ROWS // 2
    piece = ckpt.Shard(_rows(half * ctx.rank, half * (ctx.rank + 1)), (SEND_ROWS, SEND_COLS), (half * ctx.rank, 0))
    with ckpt.Checkpointer(f"{base}/r{{rank}}", timeout=TIMEOUT) as ck:
        ck.save(1, {"w": piece})
        ck.wait()


def send_buffer_job(ctx: Any, base: str) -> dict[str, Any]:
    """Rank 0 restores all of `w`, so rank 1 reads its chunk and sends it (restore.execute's
    rounds); rank 1's address space is capped below that chunk (in a fresh process: one
    that saved it keeps room), so it cannot allocate the send buffer. Then, uncapped, the
    same restore succeeds."""
    import resource

    import ckpt
    from tests._states import bitwise_diff

    lo, hi = (0, SEND_ROWS) if ctx.rank == 0 else (SEND_ROWS, SEND_ROWS)  # rank 1 restores nothing of w
    target = {"w": ckpt.Shard(torch.zeros(hi - lo, SEND_COLS, dtype=torch.float64), (SEND_ROWS, SEND_COLS), (lo, 0))}
    threading.stack_size(1 << 20)  # the restore's threads fit under the cap: only the chunk's buffer does not
    out: dict[str, Any] = {}
    # A short group timeout: a rank left waiting for rank 1's sends fails in seconds, not 30 minutes.
    with ckpt.Checkpointer(f"{base}/r{{rank}}", timeout=datetime.timedelta(seconds=10)) as ck:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if ctx.rank == 1:
            chunk = SEND_ROWS // 2 * SEND_COLS * 8
            resource.setrlimit(resource.RLIMIT_AS, (_address_space() + chunk // 2, hard))
        try:
            out["capped"] = _outcome(lambda: ck.restore(target))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        out["again"] = _outcome(lambda: ck.restore(target))
    out["diff"] = bitwise_diff(target["w"].local_tensor, _rows(lo, hi), "w")
    return out


def test_a_rank_that_cannot_allocate_a_chunk_it_sends_fails_the_restore_on_every_rank(tmp_path: Path) -> None:
    """Before, rank 1 left the rounds while rank 0 waited in the exchange for its chunk:
    both ranks raised gloo's RuntimeError once the group's timeout had passed."""
    _, failures = launch(THIS, "send_save_job", 2, tmp_path, timeout=120, base=str(tmp_path))
    assert not failures, failures
    results, failures = launch(THIS, "send_buffer_job", 2, tmp_path, timeout=120, base=str(tmp_path))
    assert not failures, failures
    capped = [r["capped"] for r in results]
    assert [c.get("err") for c in capped] == ["RankFailures", "RuntimeError"], capped
    assert "can't allocate memory" in capped[1]["msg"], capped  # the fault is the one meant
    assert "rank 1: RuntimeError" in capped[0]["msg"] and "can't allocate memory" in capped[0]["msg"], capped
    for r in results:
        assert r["again"] == {"ok": 1} and r["diff"] == [], results
