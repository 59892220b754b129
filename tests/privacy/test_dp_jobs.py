"""DP on a federated job: the spec's refusals, the worker's clip, the noise of an average with unequal
owners, and the coordinator's ledger (ε by round) and stop rule. The API-level refusal (before money
moves) is in tests/coordinator/test_federated.py; the end-to-end runs in
tests/integration/test_federated_dp.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tests.train.helpers import synthetic_corpus, tiny_spec

from gpuflex.coordinator.services import dp as ledger
from gpuflex.errors import SpecError
from gpuflex.privacy.dp import Accountant, for_job, l2_norm, mean_noise_std, noise_for_target, rounds_run
from gpuflex.protocol.messages import DPTask, TaskConfig
from gpuflex.protocol.spec import JobSpec, parse_job_spec
from gpuflex.train.aggregator import private_mean
from gpuflex.train.compression import get_compressor
from gpuflex.train.recipes import get_recipe
from gpuflex.train.worker import Replica


def _job(dp: dict, *, rounds: int = 8, data: dict | None = None) -> JobSpec:
    return parse_job_spec(
        {
            "name": "dp",
            "data": data or {"federated": "notes"},
            "training": {"rounds": rounds},
            "privacy": {"dp": dp},
        }
    )


@pytest.mark.parametrize(
    ("dp", "says"),
    [
        ({"clip": 0, "noise_multiplier": 1}, "privacy.dp.clip: Input should be greater than 0"),
        ({"clip": 1, "noise_multiplier": 1000}, "privacy.dp.noise_multiplier: Input should be less than or"),
        ({"clip": 1, "noise_multiplier": -1}, "privacy.dp.noise_multiplier: Input should be greater than 0"),
        ({"clip": 1, "target_epsilon": 0, "delta": 1e-5}, "privacy.dp.target_epsilon: Input should be great"),
        (
            {"clip": 1, "target_epsilon": 500, "delta": 1e-5},
            "privacy.dp.target_epsilon: Input should be less",
        ),
        ({"clip": 1, "target_epsilon": 4, "delta": 1}, "privacy.dp.delta: Input should be less than 1"),
        ({"clip": 1, "target_epsilon": 4}, "privacy.dp: Value error, target_epsilon needs delta"),
        ({"clip": 1}, "privacy.dp: Value error, give noise_multiplier, or target"),
        ({"noise_multiplier": 1}, "privacy.dp.clip: Field required"),
        ({"clip": 1, "noise_multiplier": 1, "sigma": 2}, "privacy.dp.sigma: unknown field"),
    ],
)
def test_dp_settings_out_of_range_are_refused_in_one_line_naming_the_field(dp, says):
    with pytest.raises(SpecError, match=f"^invalid job spec: {says}") as err:
        _job(dp)
    assert "\n" not in str(err.value)


def test_dp_on_a_job_that_is_not_federated_is_refused():
    with pytest.raises(SpecError, match=r"privacy\.dp protects owners' data in a federated job"):
        _job({"clip": 1, "noise_multiplier": 1}, data={"source": "stdlib"})
    assert _job({"clip": 1, "noise_multiplier": 1}).privacy.dp.clip == 1  # federated: fine


def test_what_only_the_accountant_knows_is_refused_at_submit_in_one_line():
    first_round_too_much = _job({"clip": 1, "noise_multiplier": 0.3, "target_epsilon": 1, "delta": 1e-5})
    with pytest.raises(SpecError, match=r"one round at noise multiplier 0.3 already spends ε=\S+, over the"):
        ledger.submitted(first_round_too_much)
    unreachable = _job({"clip": 1, "target_epsilon": 0.01, "delta": 1e-5}, rounds=10_000)
    with pytest.raises(SpecError, match="needs a noise multiplier above 100"):
        ledger.submitted(unreachable)
    meaningless = _job({"clip": 1, "noise_multiplier": 1e-3, "delta": 1e-5})
    with pytest.raises(SpecError, match=r"over 8 rounds spends ε=4.4e\+06, past 100, where the guarantee"):
        ledger.submitted(meaningless)
    assert ledger.submitted(_job({"clip": 1, "noise_multiplier": 1e-3}))  # unaccounted: allowed


def test_a_target_alone_sets_the_noise_for_every_round_asked():
    spec = _job({"clip": 0.5, "target_epsilon": 4, "delta": 1e-5}, rounds=20)
    plan = ledger.plan(spec)
    assert plan.noise_multiplier == pytest.approx(noise_for_target(4, 1e-5, 20))
    assert ledger.last_round(spec) == 20  # every round asked fits: the noise was chosen for them
    assert ledger.epsilon(spec, 20) <= 4 < Accountant(plan.noise_multiplier * 0.98, 1e-5).epsilon(20)
    assert "the least keeping every round within the target" in ledger.submitted(spec)
    assert ledger.stopped(spec, 20) is None


def test_epsilon_grows_by_round_and_the_job_stops_before_the_round_past_its_target():
    spec = _job({"clip": 1, "noise_multiplier": 2.0, "target_epsilon": 3, "delta": 1e-5}, rounds=50)
    spent = [ledger.epsilon(spec, r) for r in range(0, 51)]
    assert spent[0] == 0 and all(a < b for a, b in itertools.pairwise(spent))
    last = ledger.last_round(spec)
    assert 1 <= last < 50
    assert spent[last] <= 3 < spent[last + 1]  # the last round within it, and not one more
    assert ledger.task(spec) == DPTask(clip=1, noise_multiplier=2.0, rounds=last)
    status = ledger.status(spec, published=last)
    assert (status.epsilon, status.target_epsilon, status.delta, status.rounds) == (
        spent[last],
        3,
        1e-5,
        last,
    )
    assert f"the target allows {last} of the 50 rounds asked" in ledger.submitted(spec)
    stopped = ledger.stopped(spec, last)
    assert stopped.startswith(f"privacy.dp: stopped after round {last} of 50: ε {spent[last]:.3g} spent")
    assert f"round {last + 1} would spend ε {spent[last + 1]:.3g}, over the target 3" in stopped


def test_without_delta_nothing_is_accounted_and_every_round_runs():
    spec = _job({"clip": 1, "noise_multiplier": 1.0}, rounds=7)
    assert ledger.last_round(spec) == 7 and ledger.epsilon(spec, 7) is None
    assert ledger.status(spec, 3).epsilon is None
    assert ledger.submitted(spec).endswith("no delta: ε is not accounted")
    assert rounds_run(None, 7) == 7 and rounds_run(for_job(spec.privacy.dp, 7), 7) == 7


def test_noise_that_outweighs_the_clipped_average_is_said_at_submit_and_enough_owners_silence_it():
    spec = _job({"clip": 0.5, "noise_multiplier": 1.0})  # char-gpt's default shape: 254,592 parameters
    few = ledger.noise_warning(spec, [1000, 2000, 1000])  # std z·C·max w/Σw = 0.25: norm 0.25·√254,592
    assert few is not None and few.startswith("privacy.dp: warning: ")
    assert "noise of std 0.25 on each of its 254,592 parameters, a norm about 252 times the clip 0.5" in few
    assert "with 3 owners the model may learn little or diverge" in few
    assert "about 10 times the clip" in ledger.noise_warning(spec, [1] * 50)  # std 0.5/50: a norm of 5.05
    assert ledger.noise_warning(spec, [1] * 60) is None  # 0.5/60: a norm of 4.2, 8.4 times the clip: some
    # noise averages out over the rounds' momentum


def test_the_noise_is_calibrated_to_the_largest_owners_share_of_the_weight():
    z, c = 1.5, 0.2
    assert mean_noise_std(c, z, [1, 1, 1, 1]) == pytest.approx(z * c / 4)  # equal weights: z C / n
    assert mean_noise_std(c, z, [1, 3]) == pytest.approx(z * c * 0.75)  # not z C / 2: the large owner
    assert mean_noise_std(c, z, [1000, 10, 10]) == pytest.approx(z * c * 1000 / 1020)
    with pytest.raises(SpecError):
        mean_noise_std(c, z, [])


def _delta(value: float, size: int = 50_000) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size,), value / math.sqrt(size))}  # L2 norm |value|


def test_one_owners_contribution_moves_the_average_by_at_most_its_share_of_the_clip_and_the_noise_covers_it():
    weights, clip = [1.0, 3.0], 1.0
    quiet = DPTask(clip=clip, noise_multiplier=1e-12, rounds=1)  # noise negligible: the average itself
    both = private_mean([(1.0, _delta(5.0)), (3.0, _delta(7.0))], weights, quiet)
    without_large = private_mean([(1.0, _delta(5.0))], weights, quiet)  # it dropped out: fixed denominator
    moved = math.sqrt(float((both["w"] - without_large["w"]).pow(2).sum()))
    assert moved == pytest.approx(0.75 * clip, rel=1e-4)  # its share of the weight times the clip, not 7 C
    assert math.sqrt(float(both["w"].pow(2).sum())) == pytest.approx(clip, rel=1e-4)  # both clipped to C
    g = torch.Generator().manual_seed(1)
    noisy = private_mean(
        [(1.0, _delta(0.0)), (3.0, _delta(0.0))],
        weights,
        DPTask(clip=clip, noise_multiplier=2.0, rounds=1),
        g,
    )
    assert float(noisy["w"].std()) == pytest.approx(2.0 * 0.75 * clip, rel=0.02)  # z times that sensitivity


def test_an_owners_worker_clips_its_pseudo_gradient_before_compressing_it_and_keeps_the_residual():
    spec, recipe, corpus = (
        tiny_spec(inner_steps=4, compression="int8"),
        get_recipe("char-gpt"),
        synthetic_corpus(),
    )
    dp = DPTask(clip=0.01, noise_multiplier=1.0, rounds=3)
    config = TaskConfig(
        job_id="j", task_id="w", role="worker", worker_index=0, num_workers=2, training=spec, dp=dp
    )
    replica = Replica(config, recipe, recipe.build_data(corpus, spec, 0, 2))
    result = replica.train_round(replica.global_params(), 0, lambda: False)
    assert l2_norm(result.delta) > 10 * dp.clip  # the bound bites
    blob, _ = replica.seal(result)
    shapes = {n: t.shape for n, t in result.delta.items()}
    sent = get_compressor(spec.compression).decompress(blob, shapes=shapes)
    assert l2_norm(sent) == pytest.approx(dp.clip, rel=0.02)  # the clipped delta, as int8 carries it
    residual = replica.feedback.residual  # what int8 lost of the clipped delta stays here
    assert l2_norm(residual) < 0.05 * dp.clip
    unclipped = Replica(config.model_copy(update={"dp": None}), recipe, recipe.build_data(corpus, spec, 0, 2))
    plain = get_compressor(spec.compression).decompress(unclipped.seal(result)[0], shapes=shapes)
    assert l2_norm(plain) > 10 * dp.clip  # without DP the same delta goes out whole
