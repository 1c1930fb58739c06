"""What the command line shows while it works: a progress bar on a terminal, and ckpt's
warnings as one line each on stderr (above the bar while it is shown)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

__all__ = ["WARNINGS", "progress"]


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal's stderr, gone once it stops (so no stale bar is left
    above the next message); nothing when stderr is no terminal."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True))
    more = (TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, *more, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        WARNINGS.console = bar.console
        try:
            yield lambda n: bar.advance(task, n)
        finally:
            WARNINGS.console = None


class _ToStderr(logging.Handler):
    """ckpt's warnings as `ckpt: warning: ...` lines on the command's stderr (above the
    progress bar while one is shown)."""

    console: Any = None  # the progress bar's rich Console, while it is shown

    def emit(self, record: logging.LogRecord) -> None:
        line = f"ckpt: {record.levelname.lower()}: {record.getMessage()}"
        if self.console is not None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(line, err=True)


WARNINGS = _ToStderr(logging.WARNING)
