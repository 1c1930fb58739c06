"""A save on preemption: a real SIGTERM reaches one rank of a 2-rank gloo job; every rank
sees `reached_preemption()` at the same step, saves it, commits and exits 0; a restart
restores that step bitwise. Also with the signal landing while a save is in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from tests._dist import launch
from tests._states import bitwise_diff

THIS = os.path.abspath(__file__)


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """`script` (dedented) run by a fresh interpreter in the repository: its own signal handlers."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(THIS).parents[2]),
    )


STEPS = 400  # the signal comes at step 5; a job that missed it would train on to the end


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_until_preempted(
    ctx: Any, root: str, save_every: int, slow_save: bool, full_every: int | None = None
) -> dict[str, Any]:
    import torch.distributed as dist

    from ckpt import Checkpointer

    pids = [None] * ctx.world
    dist.all_gather_object(pids, os.getpid())
    model, opt = _model(0)  # data-parallel replicas: the same on every rank
    state = {"model": model, "optim": opt, "step": 0}
    if slow_save:
        os.environ["CKPT_DELAY"] = f"write:{ctx.rank}:1.5"  # the signal lands while step 4 is written
    handled: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: handled.append(s))  # chained by the Checkpointer
    stopped_at, signalled_at, committed_s = None, None, None
    schedule: dict[str, Any] = {} if full_every is None else {"full_every": full_every, "partial_keys": ("model",)}
    with Checkpointer(root, preemption_signals=(signal.SIGTERM,), **schedule) as ck:
        for step in range(1, STEPS + 1):
            torch.manual_seed(1000 * step)
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state["step"] = step
            if step % save_every == 0:
                ck.save(step, state)
            if step == 5 and ctx.rank == 0:
                signalled_at = time.monotonic()
                os.kill(pids[1], signal.SIGTERM)  # rank 1 only
            if ck.reached_preemption():
                if full_every is not None:
                    ck.save(step, state)  # the whole state; nothing if this step was just saved whole
                elif step % save_every:  # (the loop of earlier READMEs: still right without full_every)
                    ck.save(step, state)
                ck.wait()
                committed_s = None if signalled_at is None else time.monotonic() - signalled_at
                stopped_at = step
                break
            time.sleep(0.02)  # a training step takes time: the signal arrives within a few
        steps = ck.steps()
    signal.signal(signal.SIGTERM, previous)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{root}.ref.{ctx.rank}")
    return {"stopped_at": stopped_at, "steps": steps, "handled": handled, "committed_s": committed_s}


def resume(ctx: Any, root: str) -> dict[str, Any]:
    from ckpt import Checkpointer

    model, opt = _model(99)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(root) as ck:
        got = ck.restore(state)
    ref = torch.load(f"{root}.ref.{ctx.rank}", weights_only=True)
    diff = bitwise_diff({"model": model.state_dict(), "optim": opt.state_dict()}, ref)
    ctx.check(not diff, f"restored state differs: {diff[:3]}")
    return {"restored": got, "step": state["step"]}


def _run(tmp_path: Path, save_every: int, slow_save: bool, full_every: int | None = None) -> list[dict[str, Any]]:
    root = str(tmp_path / "root")
    results, failures = launch(
        THIS,
        "train_until_preempted",
        2,
        tmp_path,
        root=root,
        save_every=save_every,
        slow_save=slow_save,
        full_every=full_every,
    )
    assert not failures, failures
    stops = [r["stopped_at"] for r in results]
    assert stops[0] is not None and stops[0] == stops[1], stops  # the same step on every rank
    assert 5 <= stops[0] < STEPS
    assert results[1]["handled"] == [signal.SIGTERM] and results[0]["handled"] == []  # the old handler ran too
    assert results[0]["steps"][-1] == stops[0]
    assert not [n for n in os.listdir(root) if ".tmp-" in n]  # nothing half-written
    resumed, failures = launch(THIS, "resume", 2, tmp_path, root=root)
    assert not failures, failures
    assert [r["restored"] for r in resumed] == [stops[0]] * 2
    assert [r["step"] for r in resumed] == [stops[0]] * 2
    return results


def test_sigterm_to_one_rank_stops_every_rank_at_one_committed_step(tmp_path: Path) -> None:
    results = _run(tmp_path, save_every=1000, slow_save=False)
    assert results[0]["steps"] == [results[0]["stopped_at"]]
    print(f"signal to committed version: {results[0]['committed_s']:.3f} s")


def test_sigterm_during_a_save_in_flight_still_ends_with_a_committed_version(tmp_path: Path) -> None:
    results = _run(tmp_path, save_every=4, slow_save=True)
    steps, stop = results[0]["steps"], results[0]["stopped_at"]
    assert 4 in steps and steps[-1] == stop, steps  # the save in flight committed, then the preemption's


def test_the_save_on_preemption_holds_the_whole_state_under_a_params_only_schedule(tmp_path: Path) -> None:
    """full_every=3: a save every 2 steps, params-only but every third; the signal at step
    5. The save on preemption holds the whole state (or the step was saved whole just
    before), and a restart restores that step, optimizer too, not an older full version."""
    results = _run(tmp_path, save_every=2, slow_save=False, full_every=3)
    steps, stop = results[0]["steps"], results[0]["stopped_at"]
    assert steps[-1] == stop and 2 in steps, steps


def test_a_handler_left_installed_after_close_passes_the_signal_on(tmp_path: Path) -> None:
    """Two Checkpointers closed out of order: the first one's handler cannot be taken off
    (the second's is on top) and is put back by the second's close(). It must not swallow
    the signal: the process dies of it, as it would without ckpt."""
    out = _python(
        f"""
        import os, signal
        from ckpt import Checkpointer
        a = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGUSR1,))
        b = Checkpointer({str(tmp_path / "b")!r}, preemption_signals=(signal.SIGUSR1,))
        a.close()
        b.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)
        print("survived")
        """
    )
    assert out.returncode == -signal.SIGUSR1, (out.returncode, out.stdout, out.stderr[-2000:])


def test_a_closed_watch_under_an_open_one_does_not_kill_the_process(tmp_path: Path) -> None:
    """Two Checkpointers with preemption_signals, the first closed while the second trains
    on: the second's handler chains to the first's, still installed beneath it. The signal
    is the second's notice (the job saves and exits); the first, closed, must not turn it
    into the default action and kill the process before reached_preemption() sees it."""
    out = _python(
        f"""
        import os, signal
        from ckpt import Checkpointer
        a = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGUSR1,))
        b = Checkpointer({str(tmp_path / "b")!r}, preemption_signals=(signal.SIGUSR1,))
        a.close()
        os.kill(os.getpid(), signal.SIGUSR1)  # (its handlers run before the next line)
        print("reached", b.reached_preemption())
        b.close()
        """
    )
    assert out.returncode == 0 and "reached True" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])


def test_take_over_keeps_the_signal_from_a_handler_installed_later_and_close_puts_it_back(tmp_path: Path) -> None:
    """A framework's handler installed over ckpt's (as Lightning's SIGTERM handler is):
    after Checkpointer.take_over_signal, the signal is ckpt's notice only; close() puts back the handler from
    before ckpt's (the framework's is the framework's to put back)."""
    out = _python(
        f"""
        import os, signal
        from ckpt import Checkpointer
        calls = []
        ck = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGUSR1, signal.SIGUSR2))
        under = signal.getsignal(signal.SIGUSR1)
        def framework(signum, frame):
            calls.append(signum)
            under(signum, frame)
        signal.signal(signal.SIGUSR1, framework)
        ck.take_over_signal(signal.SIGUSR1)
        ck.take_over_signal(signal.SIGINT)  # not one it handles: nothing changes
        os.kill(os.getpid(), signal.SIGUSR1)
        print("calls", calls, "reached", ck.reached_preemption())
        ck.close()
        print("back", signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        """
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "calls [] reached True" in out.stdout and "back True True" in out.stdout, out.stdout


def test_two_fits_that_raise_leave_a_sigterm_deadly(tmp_path: Path) -> None:
    """Lightning's order, twice in one process (each fit raising): ckpt's watch installed,
    Lightning's handler over it, take_over, close() on the exception, Lightning's teardown
    putting back ckpt's closed handler. Before, the second fit's closed handler passed the
    signal to the first's, which took the call for an open watch's chain and only passed it
    on: every later SIGTERM was swallowed."""
    out = _python(
        """
        import os, signal, time
        from ckpt._preemption import PreemptionWatch

        def fit_that_raises():
            watch = PreemptionWatch([signal.SIGTERM])  # on_fit_start
            found = signal.getsignal(signal.SIGTERM)  # Lightning registers its handler over it
            signal.signal(signal.SIGTERM, lambda s, f: found(s, f) if callable(found) else None)
            watch.take_over(signal.SIGTERM)  # on_train_start
            watch.close()  # on_exception
            signal.signal(signal.SIGTERM, found)  # Lightning's teardown

        fit_that_raises()
        fit_that_raises()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        print("survived")
        """
    )
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])


def test_a_notice_after_the_last_check_is_passed_on_at_close(tmp_path: Path) -> None:
    """A SIGTERM noted after the last reached_preemption() (as while close() waits for the
    last save): close() sends it on to the handler before ckpt's, here the default, so the
    process ends as it would have without ckpt. Before, the notice was dropped and the
    process went on."""
    out = _python(
        f"""
        import os, signal, time
        import torch
        from ckpt import Checkpointer
        ck = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGTERM,))
        ck.save(1, {{"w": torch.ones(3)}})
        os.kill(os.getpid(), signal.SIGTERM)  # noted; no reached_preemption() follows
        ck.close()
        time.sleep(1)
        print("survived")
        """
    )
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])
    assert (tmp_path / "a" / "v000000000001" / "manifest.json").exists()  # the save before it committed


def test_a_signal_named_twice_is_handled_once_and_close_puts_the_default_back(tmp_path: Path) -> None:
    """preemption_signals=(SIGUSR1, SIGUSR1): the second install took ckpt's own handler for
    the one before it, so a notice recursed (RecursionError in the training loop) and
    close() left ckpt's handler installed (the process then outlived the signal)."""
    out = _python(
        f"""
        import os, signal, time
        from ckpt import Checkpointer
        ck = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGUSR1, signal.SIGUSR1))
        os.kill(os.getpid(), signal.SIGUSR1)
        print("reached", ck.reached_preemption())
        ck.close()
        print("default", signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)
        print("survived")
        """
    )
    assert out.returncode == -signal.SIGUSR1, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "reached True" in out.stdout and "default True" in out.stdout, out.stdout


def test_a_late_notice_the_handler_before_had_is_not_sent_to_it_again(tmp_path: Path) -> None:
    """A Python handler installed before ckpt's (a requeue hook) gets each notice once: a
    notice after the last check reached it as it came, so close() does not send it again
    (it ran twice)."""
    out = _python(
        f"""
        import os, signal
        from ckpt import Checkpointer
        calls = []
        signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
        ck = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGUSR1,))
        os.kill(os.getpid(), signal.SIGUSR1)  # noted; no reached_preemption() follows
        ck.close()
        print("calls", len(calls))
        """
    )
    assert out.returncode == 0 and "calls 1" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])


def test_a_late_notice_to_two_open_watches_still_ends_the_process(tmp_path: Path) -> None:
    """Two Checkpointers open, the first closed, then a SIGTERM, then the second closed: the
    second's handler passed the notice to the first's (a watch: it only forwards), and was
    taken to have given it to a handler from before, so no one sent it on: the process
    outlived the SIGTERM (found by review)."""
    out = _python(
        f"""
        import os, signal, time
        from ckpt import Checkpointer
        c1 = Checkpointer({str(tmp_path / "a")!r}, preemption_signals=(signal.SIGTERM,))
        c2 = Checkpointer({str(tmp_path / "b")!r}, preemption_signals=(signal.SIGTERM,))
        c1.close()
        os.kill(os.getpid(), signal.SIGTERM)
        c2.close()
        time.sleep(1)
        print("survived")
        """
    )
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])
