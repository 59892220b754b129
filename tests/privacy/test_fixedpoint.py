"""Fixed-point encoding and the flat vector of a delta."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.privacy.fixedpoint import FixedPoint, flatten, unflatten


@pytest.mark.parametrize(("n", "bits"), [(1, 32), (2, 31), (100, 25), (1000, 22)])
def test_bit_width_follows_the_number_of_clients(n: int, bits: int) -> None:
    fp = FixedPoint(1.0, n)
    assert fp.bits == bits
    assert fp.levels * n <= 2**32 - 1


def test_round_trip_is_within_half_a_step() -> None:
    fp = FixedPoint(2.0, 10)
    x = np.linspace(-2, 2, 1001)
    assert np.max(np.abs(fp.decode_sum(fp.encode(x), 1) - x)) <= fp.step / 2 + 1e-12
    assert np.array_equal(fp.decode_sum(fp.encode([-9.0, 9.0]), 1), [-2.0, 2.0])


def test_bad_ranges_are_refused() -> None:
    with pytest.raises(BadRequest, match="positive number"):
        FixedPoint(0.0, 3)
    with pytest.raises(BadRequest, match="at most 3"):
        FixedPoint(1.0, 3).decode_sum(np.zeros(2, dtype=np.uint32), 4)


def test_flatten_and_unflatten_a_delta() -> None:
    delta = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.float16), "s": torch.tensor(2.5)}
    vector, layout = flatten(delta)
    assert vector.shape == (18,) and layout.names == ("b", "s", "w")
    back = unflatten(vector, layout)
    for k, v in delta.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    with pytest.raises(BadRequest, match="does not fit"):
        unflatten(vector[:-1], layout)
