"""Secure aggregation in the round protocol (``train.secure``), every party in one process over a
``LocalTransport``: the aggregator gets the exact weighted sum and nothing else, an owner that drops
after sharing costs nothing but its update, one whose shares never came starts the round over without it,
and the relay refuses what would let an attempt be replaced after someone masked in it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.privacy.helpers import setup

from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.privacy.fixedpoint import flatten
from gpuflex.privacy.secagg import SecAggConfig
from gpuflex.protocol.messages import DPTask, SecAggPost, TaskConfig
from gpuflex.protocol.spec import JobSpec, TrainingSpec
from gpuflex.train.compression.bitpack import packed_size
from gpuflex.train.secure import (
    Roster,
    SecureWorker,
    Session,
    _Mailbox,
    agreed_grid,
    next_ranges,
    pack_masked,
    rehearse,
    ring_bits,
    unpack_masked,
)
from gpuflex.train.transport import LocalTransport

HASH = "0" * 64


def _delta(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((3, 4), value), "b.bias": torch.linspace(-value, value, 5)}


def play(weights: dict[str, int], values: dict[str, float], **kwargs):
    return rehearse({t: _delta(values[t]) for t in weights}, weights, **kwargs)


def _flat(delta: dict[str, torch.Tensor]) -> np.ndarray:
    return flatten(delta)[0]


WEIGHTS = {"t-a": 100, "t-b": 300, "t-c": 200, "t-d": 400}
VALUES = {"t-a": 0.01, "t-b": -0.02, "t-c": 0.03, "t-d": 0.005}


def _fedavg(tasks: list[str]) -> np.ndarray:
    total = sum(WEIGHTS[t] for t in tasks)
    return sum(WEIGHTS[t] / total * _flat(_delta(VALUES[t])) for t in tasks)


def test_the_aggregator_gets_the_token_weighted_mean_and_sees_only_masked_vectors():
    mean, hub = play(WEIGHTS, VALUES)
    assert np.allclose(_flat(mean), _fedavg(list(WEIGHTS)), atol=1e-7)
    for c in hub.contributions(0).contributions:  # what was uploaded: no trace of the owner's delta
        _, masked = unpack_masked(hub.get_blob(c.delta), 17)
        assert not np.allclose(masked.astype(np.float64), 0) and masked.max() > 2**30
    assert any("unmasked the sum of 4 owners" in m for _, m in hub.logs())


def test_an_owner_that_drops_after_sharing_leaves_the_exact_mean_of_the_others():
    mean, hub = play(WEIGHTS, VALUES, vanish_after_sharing=frozenset({"t-b"}))
    assert np.allclose(_flat(mean), _fedavg(["t-a", "t-c", "t-d"]), atol=1e-7)
    assert any("3 owners (1 dropped after sharing" in m for _, m in hub.logs()), hub.logs()


def test_an_owner_whose_shares_never_came_is_left_out_of_a_fresh_attempt():
    mean, hub = play(WEIGHTS, VALUES, never_share=frozenset({"t-c"}))
    assert np.allclose(_flat(mean), _fedavg(["t-a", "t-b", "t-d"]), atol=1e-7)
    log = [m for _, m in hub.logs()]
    assert any("restarts (attempt 1) without t-c" in m for m in log), log


@pytest.mark.parametrize("compression", ["none", "int8"])  # the wide ring, the shared grid's
def test_under_dp_the_owners_noise_shares_add_up_to_the_plain_modes_noise(compression):
    dp = DPTask(clip=1.0, noise_multiplier=0.5, rounds=1)
    weights = {"t-a": 1, "t-b": 1, "t-c": 1}
    zero = {"w": torch.zeros(4096)}  # enough coordinates that the sample std is within 2% of the true one
    mean, _ = rehearse(dict.fromkeys(weights, zero), weights, dp=dp, compression=compression)
    noise = _flat(mean)
    # each of 3 owners adds N(0, σ²/t), t = 2; σ = z·C·max w/Σw = 0.5/3: the sum's std is σ·sqrt(3/2),
    # where one owner's full σ would read as σ·sqrt(2) (15% more) and no noise as 0
    sigma = 0.5 / 3
    assert noise.std() == pytest.approx(sigma * np.sqrt(1.5), rel=0.08)


def test_the_relay_refuses_what_would_break_an_attempt():
    hub = LocalTransport(rounds=1, live_workers=3, task_id="agg")
    post = lambda view, **kw: view.post_secagg(SecAggPost(round=0, **kw))  # noqa: E731
    post(hub, attempt=0, kind="roster", body='{"tasks": ["t-a", "t-b", "t-c"]}')
    a, b, c, d = (hub.for_task(t) for t in ("t-a", "t-b", "t-c", "t-d"))
    with pytest.raises(Forbidden, match="not in attempt 0's roster"):
        post(d, attempt=0, kind="keys", body="{}")
    with pytest.raises(Forbidden, match="a keys message is a worker's to post"):
        post(hub, attempt=0, kind="keys", body="{}")
    with pytest.raises(BadRequest, match="a reveal goes to the aggregator alone"):
        post(a, attempt=0, kind="reveal", body="{}")
    with pytest.raises(Forbidden, match="a roster message is the aggregator's to post"):
        post(a, attempt=1, kind="roster", body='{"tasks": []}')
    post(a, attempt=0, kind="shares", body='{"x": 1}')
    post(a, attempt=0, kind="shares", body='{"x": 1}')  # a retry
    with pytest.raises(Conflict, match="already posted its shares"):
        post(a, attempt=0, kind="shares", body='{"x": 2}')
    post(b, attempt=0, kind="shares", body="{}")
    post(hub, attempt=1, kind="roster", body='{"tasks": ["t-a", "t-b"]}')
    with pytest.raises(Conflict, match="attempt 0 is not the current one"):
        post(c, attempt=0, kind="shares", body="{}")  # too late: nobody can mask in attempt 0 any more
    post(a, attempt=1, kind="shares", body="{}")
    post(b, attempt=1, kind="shares", body="{}")
    with pytest.raises(Conflict, match="every owner of attempt 1 shared: it goes on"):
        post(hub, attempt=2, kind="roster", body='{"tasks": ["t-a"]}')  # someone may have masked already
    post(a, attempt=1, kind="reveal", body='{"seeds": 1}', to="aggregator")
    seen = [(m.attempt, m.kind, m.sender) for m in c.secagg_messages(0).messages]  # a reveal: not to t-c
    assert seen == [
        (0, "roster", "agg"),
        (0, "shares", "t-a"),
        (0, "shares", "t-b"),
        (1, "roster", "agg"),
        (1, "shares", "t-a"),
        (1, "shares", "t-b"),
    ]
    assert [m.kind for m in hub.secagg_messages(0).messages][-1] == "reveal"  # the aggregator reads it


@pytest.mark.parametrize(
    ("job", "says"),
    [
        ({"privacy": {"secure_aggregation": True}}, "privacy.secure_aggregation masks owners' updates in a"),
        (
            {"privacy": {"secagg_threshold": 3}},
            "privacy.secagg_threshold needs privacy.secure_aggregation: true",
        ),
        (
            {
                "privacy": {"secure_aggregation": True},
                "data": {"federated": "n"},
                "training": {"overlap": True},
            },
            "privacy.secure_aggregation does not combine with training.overlap yet",
        ),
    ],
)
def test_secure_aggregation_outside_a_synchronous_federated_job_is_refused_with_the_spec(job, says):
    with pytest.raises(ValueError, match=says):
        JobSpec.model_validate({"name": "j", **job})


def test_under_int8_owners_mask_packed_9_bit_words_and_the_mean_is_exact_to_the_shared_grid():
    step = TrainingSpec().lr * TrainingSpec().inner_steps / 127  # round 0's range over int8's levels
    for gone in (frozenset(), frozenset({"t-b"})):
        mean, hub = play(WEIGHTS, VALUES, compression="int8", vanish_after_sharing=gone)
        came = [t for t in WEIGHTS if t not in gone]
        scale = sum(WEIGHTS.values()) / sum(WEIGHTS[t] for t in came)  # FedAvg over those that came
        assert np.max(np.abs(_flat(mean) - _fedavg(came))) <= len(came) * step / 2 * scale
        for c in hub.contributions(0).contributions:
            blob = hub.get_blob(c.delta)
            assert len(blob) == 6 + packed_size(17, 9)  # 9 bits a value, where the wide ring takes 32
            assert unpack_masked(blob, 17, 9)[1].max() < 2**9


def test_what_the_shared_grid_rounds_or_clamps_away_goes_back_to_the_owners_error_feedback():
    weights = {"t-a": 1, "t-b": 1, "t-c": 2}
    config = TaskConfig(
        job_id="j",
        task_id="t-c",
        role="worker",
        worker_index=2,
        num_workers=3,
        training=TrainingSpec(compression="int8"),
        weights=weights,
        secure_aggregation=2,
    )
    worker = SecureWorker(config, mailbox=None)
    r = setup(SecAggConfig("j", 0, 3, 2, worker.range, ring_bits(worker.levels, 3)))
    roster = Roster(0, tuple(weights), (0.09,))
    delta = {"w": torch.linspace(-0.2, 0.2, 101, dtype=torch.float64)}  # past the range: clamped
    blob, dropped = worker.masked_blob(Session(0, roster, r.clients[2]), delta)
    vector, layout = flatten(delta)
    grid = agreed_grid(127, roster, layout, weights, None, 2, "t-c")
    delivered = grid.decode_sum(grid.encode(0.5 * vector)) / 0.5  # t-c's share of the average: 1/2
    assert np.allclose(delivered + _flat(dropped), vector)
    assert _flat(dropped)[0] < -0.1 and np.abs(_flat(dropped)[40:61]).max() <= grid.step[0]
    assert len(blob) == 6 + packed_size(101, 9)


def test_the_grid_follows_the_average_up_and_down_within_bounds():
    mean = {"a": torch.tensor([0.5, -1.0]), "b": torch.zeros(3), "c": torch.tensor([1e-6])}
    assert next_ranges(mean, (1.0, 1.0, 1.0), None) == (2.0, 1.0 / 16, 1.0 / 16)
    assert next_ranges(mean, (1.0, 1.0, 1.0), DPTask(clip=0.3, noise_multiplier=1.0, rounds=1)) == (
        0.3,
        1.0 / 16,
        1.0 / 16,
    )


@pytest.mark.parametrize("bits", [9, 10, 32])
def test_masked_words_pack_to_their_bits_and_back(bits):
    words = np.random.default_rng(bits).integers(0, 2**bits, 1001, dtype=np.uint64).astype(np.uint32)
    blob = pack_masked(3, words, bits)
    assert len(blob) == 6 + (4 * 1001 if bits == 32 else packed_size(1001, bits))
    attempt, back = unpack_masked(blob, 1001, bits)
    assert attempt == 3 and np.array_equal(back, words)
    with pytest.raises(BadRequest, match="not a masked vector of 1000 values"):
        unpack_masked(blob, 1000, bits)


def test_a_task_reads_soon_after_its_own_post_and_backs_off_to_its_poll_interval():
    hub = LocalTransport(rounds=1, live_workers=3, task_id="agg")
    box = _Mailbox(hub, poll_interval_s=0.08, should_stop=lambda: False)
    waits = []
    for _ in range(2):  # idle, it reads once a poll interval
        waits.append(box.wait_s)
        box.pause()
    box.post(0, 0, "roster", {"tasks": ["t-a", "t-b", "t-c"]})  # an answer to this is due soon
    for _ in range(5):
        waits.append(box.wait_s)
        box.pause()
    assert waits == pytest.approx([0.08, 0.08, 0.01, 0.02, 0.04, 0.08, 0.08])
