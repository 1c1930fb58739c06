"""The shared state comparison (tests/_states.py) itself: what it calls equal and what not.

torch.equal calls -0.0 equal to 0.0 and a NaN unequal to itself; the comparison the
tests use must see bits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests._states import assert_bitwise, bitwise_diff, raw_bytes


def _nan(payload: int) -> torch.Tensor:
    return torch.tensor([payload], dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (torch.tensor([-0.0]), torch.tensor([0.0])),
        (_nan(0x7FC00001), _nan(0x7FC00002)),  # two NaNs, other payloads
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),
        (torch.tensor(1.0), torch.tensor([1.0])),  # 0-d vs 1-d
        (torch.zeros(2, 3), torch.zeros(3, 2)),
        (torch.tensor([0.0]).to(torch.bfloat16), torch.tensor([-0.0]).to(torch.bfloat16)),
        (torch.tensor([1.0]).to(torch.float8_e4m3fn), torch.tensor([2.0]).to(torch.float8_e4m3fn)),
        (torch.tensor([1 + 2j]), torch.tensor([1 - 2j])),
        (torch.tensor([True, False]), torch.tensor([True, True])),
        (np.array([-0.0]), np.array([0.0])),
        (np.float32(1), np.float64(1)),
        (-0.0, 0.0),
        (1, 1.0),
        (True, 1),
        ([1, 2], (1, 2)),
        ({"a": 1}, {"a": 1, "b": 2}),
        ({"a": torch.zeros(2)}, {"a": np.zeros(2, dtype=np.float32)}),
        (None, torch.zeros(1)),
    ],
)
def test_differences_are_found(got: Any, want: Any) -> None:
    assert bitwise_diff(got, want)
    with pytest.raises(AssertionError):
        assert_bitwise(got, want)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (_nan(0x7FC00123), _nan(0x7FC00123)),
        (torch.tensor([-0.0, float("inf")]), torch.tensor([-0.0, float("inf")])),
        (float("nan"), float("nan")),
        (torch.tensor(3.5), torch.tensor(3.5)),  # 0-d
        (torch.arange(12.0).reshape(3, 4).t(), torch.arange(12.0).reshape(3, 4).t().contiguous()),  # strides
        (torch.arange(12.0)[2:5], torch.tensor([2.0, 3.0, 4.0])),  # a view with an offset
        (torch.tensor([1 + 2j]).conj(), torch.tensor([1 - 2j])),  # a conjugate view
        (torch.nn.Parameter(torch.ones(3)), torch.ones(3)),
        (torch.empty(0, 3), torch.empty(0, 3)),
        (np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.arange(6.0).reshape(2, 3)),
        (np.array([1, "x", None], dtype=object), np.array([1, "x", None], dtype=object)),
        (
            {"m": {"w": torch.ones(2)}, "t": (1, None, "x"), "l": [np.int64(3)]},
            {"t": (1, None, "x"), "m": {"w": torch.ones(2)}, "l": [np.int64(3)]},
        ),
    ],
)
def test_equal_states_pass(got: Any, want: Any) -> None:
    assert bitwise_diff(got, want) == []
    assert_bitwise(got, want)


def test_the_message_names_the_place() -> None:
    got = {"model": {"w": torch.tensor([1.0, -0.0])}, "step": 3}
    want = {"model": {"w": torch.tensor([1.0, 0.0])}, "step": 4}
    assert bitwise_diff(got, want) == [
        "state['model']['w']: bytes differ, first at element 1 (-0.0 vs 0.0)",
        "state['step']: 3 vs 4",
    ]


def test_raw_bytes_are_the_row_major_element_bytes() -> None:
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).t()
    assert raw_bytes(t).tolist() == [1, 0, 3, 0, 2, 0, 4, 0]
