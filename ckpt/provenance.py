"""Where a checkpoint's state came from: hardware, software versions, host, and the git
commit of the training code. Collected once per process; recorded in every manifest."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from typing import Any

import torch

__all__ = ["rank_provenance", "job_provenance"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _git(path: str) -> dict[str, Any] | None:
    def run(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", path, *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()

    try:
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
        top = run("rev-parse", "--show-toplevel")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "path": top}


@functools.cache
def rank_provenance() -> dict[str, Any]:
    """What differs per rank: host, CPU model, GPU names."""
    return {"host": platform.node(), "cpu": _cpu_model(), "gpus": _gpus()}


@functools.cache
def job_provenance() -> dict[str, Any]:
    """Software versions and the git commit of the training code (the script's checkout, else the cwd's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ckpt_version = version("ckpt")
    except PackageNotFoundError:
        ckpt_version = "0+unknown"
    script = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else os.getcwd()
    return {
        "ckpt_version": ckpt_version,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "git": _git(script) or _git(os.getcwd()),
    }
