"""Fixed-point encoding and the flat vector of a delta."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.privacy.fixedpoint import FixedPoint, SharedGrid, flatten, unflatten


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


SHARES = {"a": 0.1, "b": 0.3, "c": 0.2, "d": 0.4}


@pytest.mark.parametrize(
    ("levels", "owners", "bits"), [(127, 4, 9), (127, 128, 9), (127, 129, 10), (7, 4, 5)]
)
def test_the_shared_ring_holds_the_sum_of_every_owners_codes(levels: int, owners: int, bits: int) -> None:
    assert SharedGrid.bits_for(levels, owners) == bits


def test_owners_at_their_extremes_sum_on_the_shared_grid_without_wrapping() -> None:
    ranges, sizes = [0.5, 2.0], [3, 2]
    grids = {o: SharedGrid.agree(sizes, ranges, SHARES, o, 127) for o in SHARES}
    reader = SharedGrid.agree(sizes, ranges, SHARES, None, 127)
    assert np.array_equal(reader.step, np.repeat([0.5 / 127, 2.0 / 127], sizes))  # the shares sum to 1
    for sign in (1.0, -1.0):  # each owner's weighted share at (and past) its range: the widest sum
        values = {o: sign * s * np.repeat([0.6, 2.5], sizes) for o, s in SHARES.items()}
        codes = [grids[o].encode(values[o]) for o in SHARES]
        assert all(c.max() < 2 ** grids["a"].ring_bits for c in codes)
        total = np.sum(codes, axis=0, dtype=np.uint64) % 2**reader.ring_bits
        decoded = reader.decode_sum(total)
        assert np.all(np.sign(decoded) == sign) and np.all(np.abs(decoded) <= np.repeat(ranges, sizes) * 1.05)
        assert np.allclose(decoded, sum(grids[o].decode_sum(c) for o, c in zip(SHARES, codes, strict=True)))


def test_one_owner_round_trips_within_half_a_step_inside_its_span() -> None:
    grid = SharedGrid.agree([1000], [1.0], SHARES, "b", 127)
    x = np.linspace(-0.3, 0.3, 1000)  # owner b's span: its share 0.3 of the range 1.0
    assert np.max(np.abs(grid.decode_sum(grid.encode(x)) - x)) <= grid.step[0] / 2 + 1e-12
    with_noise = SharedGrid.agree([4], [1.0], SHARES, "b", 127, noise_span=0.5)
    assert with_noise.step[0] == pytest.approx((1.0 + 4 * 0.5) / 127)  # the noise shares widen the grid


def test_a_shared_grid_refuses_ranges_that_do_not_fit() -> None:
    with pytest.raises(BadRequest, match="1 ranges posted for a model of 2 tensors"):
        SharedGrid.agree([3, 2], [1.0], SHARES, "a", 127)
    with pytest.raises(BadRequest, match="positive numbers"):
        SharedGrid.agree([3], [0.0], SHARES, "a", 127)
    with pytest.raises(BadRequest, match="only decodes"):
        SharedGrid.agree([3], [1.0], SHARES, None, 127).encode(np.zeros(3))
