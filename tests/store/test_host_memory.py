"""store.host_arrays.host_memory: a tensor's bytes as a writable memoryview over its own memory."""

from __future__ import annotations

import struct

import pytest
import torch

from ckpt.store.host_arrays import host_memory


def test_bytes_written_through_the_view_land_in_the_tensor_and_it_can_still_grow() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = host_memory(t)
    assert (len(view), view.format, view.readonly) == (48, "B", False)
    assert bytes(view) == struct.pack("<12f", *range(12))
    view[16:32] = struct.pack("<4f", 7.5, 7.5, 7.5, 7.5)
    assert torch.equal(t[1], torch.full((4,), 7.5))
    t.resize_(6, 4)  # no mark on the storage (Tensor.numpy() leaves one that refuses this)
    assert t.shape == (6, 4)


def test_a_view_of_a_slice_starts_at_the_slice() -> None:
    base = torch.arange(10, dtype=torch.int64)
    view = host_memory(base[4:8])
    view[:8] = (99).to_bytes(8, "little")
    assert base.tolist() == [0, 1, 2, 3, 99, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "t",
    [torch.empty(0), torch.arange(16.0).reshape(4, 4).t(), torch.arange(8.0)[::2]],
    ids=["empty", "transposed", "strided"],
)
def test_what_it_cannot_view_as_flat_bytes_is_refused(t: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous, non-empty CPU tensor"):
        host_memory(t)
