"""Secure aggregation in the round protocol (``train.secure``), every party in one process over a
``LocalTransport``: the aggregator gets the exact weighted sum and nothing else, an owner that drops
after sharing costs nothing but its update, one whose shares never came starts the round over without it,
and the relay refuses what would let an attempt be replaced after someone masked in it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.privacy.fixedpoint import flatten
from gpuflex.protocol.messages import DPTask, SecAggPost
from gpuflex.protocol.spec import JobSpec
from gpuflex.train.secure import rehearse, unpack_masked
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


def test_under_dp_the_owners_noise_shares_add_up_to_the_plain_modes_noise():
    dp = DPTask(clip=1.0, noise_multiplier=0.5, rounds=1)
    weights = {"t-a": 1, "t-b": 1, "t-c": 1}
    values = dict.fromkeys(weights, 0.0)
    mean, _ = play(weights, values, dp=dp)
    noise = _flat(mean)
    # each of 3 owners adds N(0, σ²/t), t = 2; σ = z·C·max w/Σw = 0.5/3: the sum's std is σ·sqrt(3/2)
    sigma = 0.5 / 3
    assert noise.std() == pytest.approx(sigma * np.sqrt(1.5), rel=0.5)


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
