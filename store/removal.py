"""Deleting a local directory tree without holding the interpreter.

Retention, overwrites and peer-copy rounds delete whole version trees on background
threads while the training loop runs. A version of a few thousand arrays is a few
thousand directories and files, and `shutil.rmtree` walks them in Python: for each entry
a handful of calls that take the GIL back between the system calls (69 ms of this
process's CPU for a tree of 2,336 arrays here; beside a main thread that runs Python
without pause, 61.6 s, as each return to the interpreter waits for the switch interval).
The system's `rm -rf` does the same walk in a child process; the calling thread only
waits for it.

The child is started with posix_spawn, which reports a failed exec without a pipe: a pipe
(subprocess's) could be inherited by a process another thread forks meanwhile (a
DataLoader worker), and the wait for its end would last as long as that process. `rm` is
looked up in the system's directories, not on PATH, where a wrapper could keep the files.
Where it is missing, cannot start, or leaves something behind, `shutil.rmtree` runs
after it: it finishes the work or raises the OSError of what could not go, with its errno.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

__all__ = ["remove_tree"]


@functools.cache
def _rm() -> str | None:
    return next((p for p in ("/bin/rm", "/usr/bin/rm") if os.access(p, os.X_OK)), None)


def _rm_rf(rm: str, path: str) -> None:
    """`rm -rf -- path` in a child, waited for; its outcome is judged by what is left."""
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    try:
        pid = os.posix_spawn(rm, [rm, "-rf", "--", path], {"LC_ALL": "C"}, file_actions=devnull)
    except OSError:  # it could not be started (no memory, no processes left): Python's walk does it
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, a reaper thread)
        pass


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
        _rm_rf(rm, path)
        if not os.path.lexists(path):
            return
    shutil.rmtree(path, ignore_errors=ignore_errors, onerror=None if ignore_errors else _gone_already)
