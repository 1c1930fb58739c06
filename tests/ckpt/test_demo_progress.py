"""The demo's launcher polls a rank's progress while the rank rewrites it: it must never read a torn value."""

import threading
from pathlib import Path

from ckpt.demo import read_progress, write_progress


def test_progress_is_never_read_torn(tmp_path: Path) -> None:
    assert read_progress(str(tmp_path), 0) is None
    done = threading.Event()

    def writer() -> None:
        for step in range(1, 5001):
            write_progress(str(tmp_path), 0, step)
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    while not done.is_set():
        value = read_progress(str(tmp_path), 0)  # a torn read raised ValueError in the CI run of 12cb5cc
        if value is not None:
            seen.append(value)
    thread.join()
    assert seen == sorted(seen), "progress went backwards"
    assert read_progress(str(tmp_path), 0) == 5000
