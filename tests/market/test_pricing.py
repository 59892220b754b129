"""Pricing, pure: the sealed-bid reverse auction (units and hypothesis properties) and quotes."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.market import calibration, pricing
from gpuflex.market.matching import NodeOffer, Requirements
from gpuflex.market.pricing import (
    Ask,
    auction_pool,
    clear_auction,
    parameter_count,
    place_auction,
    place_replacement,
)
from gpuflex.market.quotes import quote
from gpuflex.protocol.spec import parse_job_spec


def offer(node_id, *, kind="community", price=0.10, tflops=1.0, region="eu"):
    return NodeOffer(node_id, f"box-{node_id}", kind, price, tflops, 16, (), region)


def spec(**fields):
    return parse_job_spec({"name": "q", "max_price_per_hour": 0.5, "budget": 10.0, **fields})


# -- the auction ----------------------------------------------------------------------------------


def test_the_k_lowest_asks_win_and_are_paid_the_next_ask():
    asks = [Ask("a", 0.30), Ask("b", 0.10), Ask("c", 0.20), Ask("d", 0.25)]
    clearing = clear_auction(asks, 2, max_price=0.5)
    assert [a.node_id for a in clearing.winners] == ["b", "c"]
    assert clearing.price == 0.25 and clearing.eligible == 4


def test_with_exactly_k_eligible_asks_the_price_is_the_jobs_maximum():
    asks = [Ask("a", 0.10), Ask("b", 0.20), Ask("too-dear", 0.60)]
    clearing = clear_auction(asks, 2, max_price=0.5)
    assert [a.node_id for a in clearing.winners] == ["a", "b"] and clearing.price == 0.5


def test_too_few_eligible_asks_do_not_clear_and_say_why():
    clearing = clear_auction([Ask("a", 0.10), Ask("b", 0.90)], 2, max_price=0.5)
    assert clearing.winners == () and clearing.price is None
    assert clearing.short == "the auction needs 2 eligible asks at most 0.500/h and has 1"


def test_ties_go_to_the_cheaper_useful_tflop_then_the_node_id():
    asks = [Ask("z", 0.10, 0.5), Ask("y", 0.10, 0.1), Ask("x", 0.10, 0.5), Ask("w", 0.20, 0.0)]
    clearing = clear_auction(asks, 2, max_price=1.0)
    assert [a.node_id for a in clearing.winners] == ["y", "x"] and clearing.price == 0.10


def test_an_auction_needs_a_winner():
    with pytest.raises(BadRequest, match="k >= 1"):
        clear_auction([Ask("a", 0.1)], 0, max_price=1.0)


prices = st.floats(min_value=0, max_value=2, allow_nan=False).map(lambda x: round(x, 3))
asks_st = st.lists(prices, min_size=1, max_size=12).map(
    lambda ps: [Ask(f"n{i:02d}", p) for i, p in enumerate(ps)]
)


@given(asks=asks_st, k=st.integers(1, 6), max_price=prices)
def test_the_price_covers_every_winner_within_the_maximum_and_winners_are_the_lowest(asks, k, max_price):
    clearing = clear_auction(asks, k, max_price)
    eligible = sorted(a.price for a in asks if a.price <= max_price)
    if len(eligible) < k:
        assert clearing.price is None and clearing.winners == ()
        return
    assert len(clearing.winners) == k
    assert all(w.price <= clearing.price <= max_price for w in clearing.winners)
    assert sorted(w.price for w in clearing.winners) == eligible[:k]
    losers = [a for a in asks if a not in clearing.winners]
    assert all(a.price >= max(w.price for w in clearing.winners) for a in losers)


def _utility(asks, k, max_price, who, cost):
    clearing = clear_auction(asks, k, max_price)
    won = any(w.node_id == who for w in clearing.winners)
    return clearing.price - cost if won else 0.0


@given(asks=asks_st, k=st.integers(1, 6), max_price=prices, data=st.data())
def test_asking_your_true_cost_is_never_worse_than_any_other_ask(asks, k, max_price, data):
    i = data.draw(st.integers(0, len(asks) - 1))
    cost, lie = asks[i].price, data.draw(prices)
    truthful = _utility(asks, k, max_price, asks[i].node_id, cost)
    lying = [*asks[:i], Ask(asks[i].node_id, lie), *asks[i + 1 :]]
    assert _utility(lying, k, max_price, asks[i].node_id, cost) <= truthful + 1e-12


def test_core_nodes_bid_only_when_community_nodes_cannot_fill_the_job():
    offers = [offer("c1", price=0.2), offer("c2", price=0.3), offer("k1", kind="core", price=0.1)]
    enough = Requirements.from_spec(spec(resources={"workers": 2}))
    assert {o.node_id for o in auction_pool(enough, offers, set())} == {"c1", "c2"}
    short = Requirements.from_spec(spec(resources={"workers": 3}))
    assert {o.node_id for o in auction_pool(short, offers, set())} == {"c1", "c2", "k1"}
    forbidden = Requirements.from_spec(spec(resources={"workers": 3, "core_fallback": False}))
    assert {o.node_id for o in auction_pool(forbidden, offers, set())} == {"c1", "c2"}


def test_auction_placement_says_each_winners_ask_and_the_clearing_price():
    offers = [offer("a", price=0.1), offer("b", price=0.2), offer("c", price=0.25), offer("busy", price=0.01)]
    req = Requirements.from_spec(spec(resources={"workers": 2}))
    placement, price = place_auction(req, offers, count=2, exclude={"busy"})
    assert price == 0.25
    assert [c.node_id for c in placement.choices] == ["a", "b"]
    assert placement.choices[0].reason == (
        "won the auction at ask 0.100, clearing price 0.250 credits/h (2 lowest of 3 eligible asks)"
    )


def test_a_replacement_must_ask_at_most_the_clearing_price():
    offers = [offer("dear", price=0.3, tflops=10), offer("cheap", price=0.2)]
    req = Requirements.from_spec(spec(resources={"workers": 1}))
    placement = place_replacement(req, offers, 0.25, count=1, exclude=set())
    assert [c.node_id for c in placement.choices] == ["cheap"]
    assert placement.choices[0].reason.startswith(
        "replacement paid the auction's clearing price 0.250 credits/h; rank 1 of 1 eligible community node"
    )


# -- model sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "training",
    [
        {"recipe": "char-gpt"},
        {"recipe": "char-gpt", "model": {"n_layer": 3, "n_head": 2, "n_embd": 64, "block_size": 32}},
        {"recipe": "mlp-digits", "model": {"n_layer": 3, "n_embd": 40}},
        {"recipe": "hf-causal-lm", "model": {"architecture": "gpt2", "n_embd": 32, "n_head": 2}},
        {"recipe": "hf-causal-lm", "model": {"architecture": "llama", "n_embd": 32, "n_head": 2}},
    ],
)
def test_the_parameter_formula_counts_what_the_recipe_builds(training):
    pytest.importorskip("torch")
    if training["recipe"] != "char-gpt":
        pytest.importorskip("transformers" if training["recipe"] == "hf-causal-lm" else "sklearn")
    from gpuflex.train.recipes import build_model

    t = spec(training=training).training
    model = build_model(t)
    assert parameter_count(t) == sum(p.numel() for p in model.parameters())


def test_the_default_char_gpt_has_254592_parameters_and_a_user_recipe_an_unknown_count():
    assert parameter_count(spec().training) == 254_592
    user = spec(training={"recipe": "user", "recipe_file": "r.py"}).training
    assert parameter_count(user) is None


# -- quotes ---------------------------------------------------------------------------------------

P = 254_592  # the default char-gpt
TOKENS = 32 * 64
STEP_FLOPS = 6 * P * TOKENS
FIXED_S, BUDGET_OVERRUN = calibration.PRIOR_FIXED_S, calibration.PRIOR_BUDGET_OVERRUN
EXCHANGE_S = 2 * P * 1.0 / pricing.LINK_BYTES_PER_S + pricing.ROUND_OVERHEAD_S  # int8: a byte a value


def _market():
    return [
        offer("agg", kind="core", price=0.4, tflops=1.0),
        offer("fast", price=0.2, tflops=2.0),
        offer("slow", price=0.1, tflops=0.5),
        offer("spare", price=0.3, tflops=0.25),
    ]


def test_a_step_counted_job_waits_for_its_slowest_worker_and_pays_every_chosen_node():
    job = spec(resources={"workers": 2}, training={"rounds": 10, "inner_steps": 100})
    q = quote(job, _market())
    assert q.placeable and q.problems == ()
    assert [(n.role, n.node_id) for n in q.nodes] == [
        ("aggregator", "agg"),
        ("worker", "fast"),  # 0.2/h ÷ 2 TFLOPS beats 0.1/h ÷ 0.5 TFLOPS
        ("worker", "slow"),
    ]
    step_on_slow = STEP_FLOPS / (0.5e12 * pricing.EFFICIENCY)
    assert q.nodes[2].seconds_per_step == pytest.approx(step_on_slow)
    assert q.duration_s == pytest.approx(FIXED_S + 10 * (100 * step_on_slow + EXCHANGE_S))
    assert q.cost == pytest.approx((0.4 + 0.1 + 0.2) * q.duration_s / 3600)
    assert q.budget_lasts_s is None


def test_the_range_spans_the_efficiency_and_a_replacement_on_the_slowest_spare():
    job = spec(resources={"workers": 2}, training={"rounds": 10, "inner_steps": 100})
    q = quote(job, _market())
    # uncalibrated, the range is the model's time over and times the prior's factor, and the high end
    # has the slowest spare replace a worker, losing a round
    slow_round = 100 * STEP_FLOPS / (0.5e12 * pricing.EFFICIENCY) + EXCHANGE_S
    spare_round = 100 * STEP_FLOPS / (0.25e12 * pricing.EFFICIENCY) + EXCHANGE_S
    factor = math.exp(calibration.PRIOR_SPREAD)
    assert q.duration_low_s == pytest.approx((FIXED_S + 10 * slow_round) / factor)
    assert q.duration_high_s == pytest.approx((FIXED_S + 11 * spare_round) * factor)
    # fixed pricing: the replacement is paid as the priciest spare (0.3) instead of the cheapest worker (0.1)
    assert q.cost_high == pytest.approx((0.4 + 0.3 + 0.2) * q.duration_high_s / 3600)
    assert q.cost_low < q.cost < q.cost_high


def test_an_auction_quote_pays_every_worker_the_clearing_price_and_the_aggregator_its_own():
    job = spec(resources={"workers": 2}, training={"rounds": 10, "inner_steps": 100}, pricing="auction")
    q = quote(job, _market())
    assert q.clearing_price == 0.3  # the third-lowest ask
    assert [(n.node_id, n.ask, n.paid) for n in q.nodes] == [
        ("agg", 0.4, 0.4),
        ("slow", 0.1, 0.3),  # lowest ask first
        ("fast", 0.2, 0.3),
    ]
    assert q.cost == pytest.approx((0.4 + 0.3 + 0.3) * q.duration_s / 3600)


def test_a_time_budgeted_round_ends_at_its_budget():
    job = spec(resources={"workers": 2}, training={"rounds": 4, "inner_steps": 100_000, "round_seconds": 30})
    q = quote(job, _market())
    assert q.duration_s == pytest.approx(FIXED_S + 4 * (30 + EXCHANGE_S) * BUDGET_OVERRUN)


def test_a_user_recipe_is_quoted_only_when_time_budgeted():
    user = {"recipe": "user", "recipe_file": "r.py", "rounds": 3}
    with pytest.raises(BadRequest, match=r"set training\.round_seconds"):
        quote(spec(training=user), _market())
    q = quote(spec(resources={"workers": 2}, training={**user, "round_seconds": 20}), _market())
    assert q.duration_s == pytest.approx(FIXED_S + 3 * (20 + pricing.ROUND_OVERHEAD_S) * BUDGET_OVERRUN)


def test_the_cost_is_capped_by_the_budget_which_says_when_it_runs_out():
    job = spec(resources={"workers": 2}, training={"rounds": 1000, "inner_steps": 100}, budget=0.01)
    q = quote(job, _market())
    assert q.cost == 0.01 and q.cost_high == 0.01
    assert q.budget_lasts_s == pytest.approx(0.01 / 0.7 * 3600) and q.budget_lasts_s < q.duration_s


def _shirking(verification: dict):
    job = spec(
        resources={"workers": 2}, training={"rounds": 100, "inner_steps": 100, "verification": verification}
    )
    return quote(job, _market())


def test_a_quote_says_in_how_many_rounds_shirking_pays_and_the_slash_that_deters_it():
    q = _shirking({"audit_rate": 0.05, "slash": 0.0})
    round_pay = 0.2 * q.duration_s / 100 / 3600  # the best-paid worker ("fast") a round
    # without a slash only the held pay deters: in round r it risks 0.05 x r rounds' pay, less than one
    # round's pay while r < 20
    assert q.shirking_pays_rounds == 19
    assert q.slash_to_deter == pytest.approx(round_pay * 19)
    deterred = _shirking({"audit_rate": 0.05, "slash": q.slash_to_deter * 1.0001})
    assert deterred.shirking_pays_rounds == 0
    # half that slash (9.5 rounds' pay): round 10 risks 0.05 x 19.5 = 0.975 of its pay, round 11 1.025
    assert _shirking({"audit_rate": 0.05, "slash": q.slash_to_deter * 0.5}).shirking_pays_rounds == 10
    assert _shirking({"audit_rate": 0.5, "slash": 0.0}).shirking_pays_rounds == 1  # only round 1


@given(
    rate=st.floats(0.001, 1.0),
    slash=st.floats(0.0, 100.0),
    round_pay=st.floats(1e-6, 10.0),
    rounds=st.integers(1, 100_000),
)
def test_shirking_pays_in_the_rounds_it_counts_and_no_later_and_the_slash_to_deter_ends_them(
    rate, slash, round_pay, rounds
):
    training = spec(
        training={"rounds": rounds, "verification": {"audit_rate": rate, "slash": slash}}
    ).training
    n = pricing.shirking_pays_rounds(training, round_pay)

    def risk(r: int, slash: float = slash) -> float:  # over the gain, per share shirked, in round r
        return rate * (slash + r * round_pay) / round_pay

    assert 0 <= n <= rounds
    assert n == 0 or risk(n) < 1 + 1e-9  # the last round it counts pays (up to rounding)
    assert n == rounds or risk(n + 1) > 1 - 1e-9  # and the next does not
    assert risk(1, pricing.slash_to_deter(training.verification, round_pay)) > 1 - 1e-9


def test_shirking_pays_in_every_round_of_a_job_that_audits_nothing():
    for verification in ({"audit_rate": 0.0}, {"robust": False}):
        q = _shirking(verification)
        assert q.shirking_pays_rounds == 100 and q.slash_to_deter is None


def test_a_job_that_cannot_be_placed_says_why_node_by_node():
    offers = [offer("a", price=0.9), offer("b", price=0.1, region="us")]
    q = quote(spec(resources={"workers": 2, "region": "eu"}), offers)
    assert not q.placeable and q.cost is None and q.duration_s is None
    assert q.problems == (
        "no core node can host the aggregator, and 0 of the 2 workers this job needs to start "
        "(resources.min_workers) can be placed now: aggregator: no core node is online; "
        "workers: box-b: region us != eu, box-a: price 0.90/h > max 0.50/h",
    )
