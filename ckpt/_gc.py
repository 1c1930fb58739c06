"""Pausing Python's cyclic garbage collector around short, allocation-heavy sections."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["no_cyclic_gc"]

# Set once the process is seen holding frozen objects of its own (a server that froze its
# heap before forking): from then on no section promotes (gc.unfreeze() would release
# them), and none pays gc.get_freeze_count(), which walks the frozen list.
_user_froze = False


@contextlib.contextmanager
def no_cyclic_gc(*, promote: bool = False) -> Iterator[None]:
    """Pause the cyclic GC for a short section that allocates thousands of small objects
    (describing ~1000 tensors at save(), building or parsing a manifest).

    Those allocations otherwise trigger full collections that walk the training process's
    whole heap: 0.1-0.4 s measured with a ~1200-tensor state, paid inside the save stall.
    What the section frees is freed by reference counting; nothing waits for the collector.

    `promote` (the sections of save() and of a restore): on exit, every object in the
    young generations moves to the oldest (gc.freeze() then gc.unfreeze(): list splices,
    and the young count restarts at 0). What save() leaves alive (a record or two per
    tensor, held until the commit) would otherwise be traversed by the young collection
    that the next allocation starts (~1 ms of a 2,336-tensor stall), then move up through
    the generations, where its number starts a full collection every few saves (~0.2 s
    each, with that state); a restore's manifest and plan (held until it returns) cost
    7-9 ms of collections a restore with a 1,168-array state. Both die by reference
    counting, so no collection needs to see them. The cost: a garbage cycle the training
    loop made shortly before is moved too, and is freed by the next full collection
    instead of a young one.

    Nested or concurrent use (the commit thread) is safe: only the section that found the
    collector enabled enables it again, so it is never left off unless the user turned it off.
    """
    global _user_froze
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if promote and not _user_froze:
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                else:
                    _user_froze = True
            gc.enable()
