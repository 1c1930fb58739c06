"""Deleting a local directory tree without holding the interpreter.

Retention, overwrites and peer-copy rounds delete whole version trees on background
threads while the training loop runs. A version of a few thousand arrays is a few
thousand directories and files, and `shutil.rmtree` walks them in Python: for each entry
a handful of calls that take the GIL back between the system calls (~0.2 s of the GIL for
a tree of 2,336 arrays here, competing with the training thread and its next save()). An
`rm -rf` child does the same walk outside the process; the calling thread only waits.

Where `rm` is missing or cannot be started, or leaves something behind, `shutil.rmtree`
runs after it: it finishes the work or raises the OSError of what could not go, with its
errno.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Any

__all__ = ["remove_tree"]


@functools.cache
def _rm() -> str | None:
    return shutil.which("rm")


def _gone_already(fn: object, path: str, exc_info: tuple[type[BaseException], BaseException, Any]) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def remove_tree(path: str, *, ignore_errors: bool = False) -> None:
    """Delete `path` and everything beneath it; links are removed, never followed. A path
    that does not exist (or is deleted meanwhile) is no error; any other failure raises
    its OSError unless `ignore_errors`."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):  # a link or a file goes as itself, without a child
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    except OSError:
        if ignore_errors:
            return
        raise
    rm = _rm()
    if rm is not None:
        try:
            subprocess.run(
                [rm, "-rf", "--", path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        except OSError:  # it could not be started (no memory, no processes left): Python's walk does it
            pass
        if not os.path.lexists(path):
            return
    shutil.rmtree(path, ignore_errors=ignore_errors, onerror=None if ignore_errors else _gone_already)
