"""Secure aggregation: exact unmasking, masked vectors that look uniform, dropouts, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from gpuflex.errors import BadRequest, Conflict, Forbidden, SpecError
from gpuflex.privacy.fixedpoint import SharedGrid
from gpuflex.privacy.secagg import Client, SecAggConfig, aggregate, unmask

from .helpers import Round, play, request, setup


def config(n: int, t: int | None = None, clip: float = 1.0) -> SecAggConfig:
    return SecAggConfig("job-1", 7, n, t or SecAggConfig.default_threshold(n), clip)


def ring_sum(vectors: list[np.ndarray]) -> np.ndarray:
    return (np.sum([v.astype(np.uint64) for v in vectors], axis=0) % 2**32).astype(np.uint32)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(3, 6),
    size=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
    drop=st.integers(0, 2),
)
def test_unmasking_is_exact(n: int, size: int, seed: int, drop: int) -> None:
    cfg = config(n)
    rng = np.random.default_rng(seed)
    inputs = [rng.uniform(-1.5, 1.5, size) for _ in range(n)]
    dropped = set(range(min(drop, n - cfg.threshold)))
    total = play(setup(cfg), inputs, dropped)
    alive = [i for i in range(n) if i not in dropped]
    assert np.array_equal(total, ring_sum([cfg.encoding.encode(inputs[i]) for i in alive]))
    decoded = cfg.encoding.decode_sum(total, len(alive))
    expected = np.sum([np.clip(inputs[i], -1, 1) for i in alive], axis=0) if size else np.zeros(0)
    assert np.allclose(decoded, expected, atol=len(alive) * cfg.encoding.step)


def test_extremes_do_not_wrap() -> None:
    cfg = config(5)
    ones = [np.full(8, 3.0)] * 5  # clipped to +clip: every client at the top level
    total = play(setup(cfg), ones)
    assert np.allclose(cfg.encoding.decode_sum(total, 5), 5.0)
    total = play(setup(cfg), [np.full(8, -3.0)] * 5)
    assert np.allclose(cfg.encoding.decode_sum(total, 5), -5.0)


def test_aggregate_decodes_the_float_sum() -> None:
    cfg = config(4)
    r = setup(cfg)
    inputs = [np.linspace(-0.5, 0.5, 16) * (i + 1) / 4 for i in range(4)]
    masked = {i: c.mask(inputs[i]) for i, c in enumerate(r.clients)}
    reveals = [c.reveal(request(r, set(range(4)))) for c in r.clients]
    assert np.allclose(aggregate(cfg, r.public_keys, masked, reveals), np.sum(inputs, axis=0), atol=1e-8)


def fixed_clients(cfg: SecAggConfig) -> list[Client]:
    return [
        Client(cfg, i, key=X25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32), seed=bytes([i + 9]) * 16)
        for i in range(cfg.n)
    ]


def test_one_masked_vector_is_indistinguishable_from_uniform() -> None:
    # the most structured input there is (all zeros encode to one level), with fixed keys and seeds so
    # the test is deterministic; chi-square over 256 bins of the high and of the low byte, and KS, at 0.001
    cfg = config(3)
    r = setup(cfg, fixed_clients(cfg))
    plain = cfg.encoding.encode(np.zeros(100_000))
    masked = r.clients[0].mask(np.zeros(100_000))
    for values in (masked >> 24, masked & 0xFF):
        counts = np.bincount(values, minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-3
    assert stats.kstest(masked / 2**32, "uniform").pvalue > 1e-3
    # the same tests see the unmasked encoding for what it is
    assert stats.chisquare(np.bincount(plain >> 24, minlength=256)).pvalue < 1e-3


@pytest.mark.parametrize("dropped", [{0}, {5}, {1, 4}, {0, 5}])
def test_dropped_clients_are_recovered(dropped: set[int]) -> None:
    cfg = config(6, t=4)
    inputs = [np.full(10, 0.1 * i) for i in range(6)]
    total = play(setup(cfg), inputs, dropped=dropped)
    expected = sum(0.1 * i for i in range(6) if i not in dropped)
    assert np.allclose(cfg.encoding.decode_sum(total, 6 - len(dropped)), expected, atol=1e-6)


def test_one_drop_too_many_fails_with_a_clear_error() -> None:
    cfg = config(6, t=4)
    with pytest.raises(BadRequest, match="refused: 3 survivors, fewer than the threshold 4"):
        play(setup(cfg), [np.zeros(3)] * 6, dropped={0, 1, 2})  # the survivors refuse to reveal
    r = setup(cfg)
    masked = {i: r.clients[i].mask(np.zeros(3)) for i in (3, 4, 5)}
    with pytest.raises(BadRequest, match="3 masked vectors, fewer than the threshold 4: the round fails"):
        unmask(cfg, r.public_keys, masked, [])


def test_a_client_masks_once_and_only_finite_values() -> None:
    cfg = config(3)
    r = setup(cfg)
    with pytest.raises(BadRequest, match="NaN or infinite"):
        r.clients[0].mask(np.array([0.0, np.nan]))
    r.clients[1].mask(np.zeros(2))
    with pytest.raises(Conflict, match="already masked"):
        r.clients[1].mask(np.ones(2))
    with pytest.raises(Conflict, match="already shared"):
        r.clients[1].shares(r.public_keys)


def test_too_few_reveals_fail_with_a_clear_error() -> None:
    cfg = config(5)
    r = setup(cfg)
    masked = {i: c.mask(np.zeros(4)) for i, c in enumerate(r.clients)}
    reveals = [r.clients[i].reveal(request(r, set(range(5)))) for i in (0, 1)]
    with pytest.raises(BadRequest, match="shares from 2 survivors, fewer than the threshold 3"):
        unmask(cfg, r.public_keys, masked, reveals)


def test_a_client_refuses_to_reveal_both_secrets_of_one_client() -> None:
    cfg = config(5)
    r = setup(cfg)
    r.clients[0].reveal(request(r, {0, 1, 2, 3}))  # client 4 dropped: its key share revealed
    with pytest.raises(Forbidden, match=r"clients \[4\]"):
        r.clients[0].reveal(request(r, {0, 1, 2, 3, 4}))  # now its seed share too: refused
    both = request(r, {0, 1, 2})
    overlapping = type(both)(both.survivors | {3}, both.dropped)
    with pytest.raises(Forbidden, match="both survivor and dropped"):
        r.clients[1].reveal(overlapping)


def test_the_aggregator_refuses_a_reveal_that_mixes_kinds() -> None:
    cfg = config(4)
    r = setup(cfg)
    masked = {i: c.mask(np.zeros(3)) for i, c in enumerate(r.clients) if i != 3}
    reveals = [r.clients[i].reveal(request(r, {0, 1, 2})) for i in range(3)]
    reveals[0].keys[0] = reveals[0].seeds[0]
    with pytest.raises(Forbidden, match="client 0's reveal"):
        unmask(cfg, r.public_keys, masked, reveals)


def test_a_client_refuses_a_request_below_the_threshold() -> None:
    cfg = config(5)
    r = setup(cfg)
    with pytest.raises(BadRequest, match="2 survivors, fewer than the threshold 3"):
        r.clients[0].reveal(request(r, {0, 1}))


@pytest.mark.parametrize(
    ("n", "t", "message"),
    [
        (2, 2, "at least 3 workers, not 2"),
        (5, 6, "threshold for 5 workers must lie in 3..5, not 6"),
        (6, 3, "threshold for 6 workers must lie in 4..6, not 3"),
    ],
)
def test_bad_configurations_are_refused(n: int, t: int, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        SecAggConfig("j", 0, n, t, 1.0)


def test_seeds_are_bound_to_the_round() -> None:
    cfg = config(3)
    clients = fixed_clients(cfg)
    setup(cfg, clients)
    other = SecAggConfig("job-1", 8, 3, 2, 1.0)
    later = [Client(other, i, key=c.key, seed=c.seed) for i, c in enumerate(clients)]
    setup(other, later)
    assert not np.array_equal(clients[0].mask(np.zeros(8)), later[0].mask(np.zeros(8)))


def test_share_bundles_travel_sealed_to_their_holder() -> None:
    cfg = config(4)
    clients = [Client(cfg, i) for i in range(4)]
    keys = [c.public_key for c in clients]
    transport = [c.transport_public_key for c in clients]
    wire = {c.index: c.sealed_shares(keys, transport) for c in clients}  # owner -> holder -> bytes
    for owner, bundles in wire.items():
        for holder, sealed in bundles.items():
            clients[holder].hold_sealed(owner, sealed)
    r = Round(cfg, clients, keys)
    inputs = [np.full(5, 0.25)] * 4
    total = play(r, inputs, dropped={2})
    assert np.allclose(cfg.encoding.decode_sum(total, 3), 0.75)


def test_a_sealed_bundle_opens_only_for_its_holder_and_round() -> None:
    cfg = config(3)
    clients = [Client(cfg, i) for i in range(3)]
    sealed = clients[0].sealed_shares(
        [c.public_key for c in clients], [c.transport_public_key for c in clients]
    )
    with pytest.raises(BadRequest, match="this share bundle from client 0 was sealed to another key"):
        clients[2].hold_sealed(0, sealed[1])
    with pytest.raises(
        BadRequest,
        match="from client 2 fails its check: tampered, or sealed for another round or holder than client 1",
    ):
        clients[1].hold_sealed(2, sealed[1])  # claimed to come from client 2
    later = Client(SecAggConfig("job-1", 8, 3, 2, 1.0), 1, transport_key=clients[1].transport_key)
    with pytest.raises(BadRequest, match="tampered"):
        later.hold_sealed(0, sealed[1])


def test_a_narrow_ring_unmasks_the_exact_sum_of_shared_grid_codes_and_looks_uniform() -> None:
    owners = {str(i): 0.25 for i in range(4)}
    bits = SharedGrid.bits_for(127, 4)
    cfg = SecAggConfig("job-1", 7, 4, 3, 1.0, bits)
    r = setup(cfg, fixed_clients(cfg))
    grids = [SharedGrid.agree([50_000], [0.1], owners, str(i), 127) for i in range(4)]
    rng = np.random.default_rng(3)
    inputs = [rng.uniform(-0.025, 0.025, 50_000) for _ in range(4)]
    masked = {i: c.mask(inputs[i], grids[i]) for i, c in enumerate(r.clients) if i != 2}  # client 2 drops
    assert all(m.max() < 2**bits for m in masked.values())
    counts = np.bincount(masked[0], minlength=2**bits)  # its codes are a few levels: masked, all 512
    assert stats.chisquare(counts).pvalue > 1e-3
    reveals = [r.clients[i].reveal(request(r, set(masked))) for i in masked]
    total = unmask(cfg, r.public_keys, masked, reveals)
    codes = [grids[i].encode(inputs[i]) for i in masked]
    assert np.array_equal(total, (np.sum(codes, axis=0, dtype=np.uint64) % 2**bits).astype(np.uint32))
    reader = SharedGrid.agree([50_000], [0.1], owners, None, 127)
    summed = aggregate(cfg, r.public_keys, masked, reveals, reader)
    assert np.allclose(summed, sum(inputs[i] for i in masked), atol=3 * reader.step[0] / 2)
    with pytest.raises(BadRequest, match="a grid of 9 bits for a ring of 32"):
        config(4).encoding_for(reader)
