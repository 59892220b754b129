"""Placement, pure: a job that has not started is placed as a gang of its aggregator and min_workers
workers or not at all; once started it takes what it can; why its tasks wait, node by node."""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gpuflex.market.index import FAILS, FITS, HELD, NOT_CANDIDATE, OfferIndex
from gpuflex.market.matching import AGGREGATOR_CHECKS, WORKER_CHECKS, NodeOffer, Requirements
from gpuflex.market.placement import place_job, start_size, unstaked
from gpuflex.market.quotes import quote
from gpuflex.market.waiting import NAMED, Held, nodes_left_out, why_waiting
from gpuflex.protocol.spec import parse_job_spec

from .test_matching import offers_st, reqs_st

BUSY = Held("busy", "busy (worker, leased)")


def offer(node_id, *, kind="community", price=0.10, region="eu"):
    return NodeOffer(node_id, node_id, kind, price, 1.0, 16, (), region)


def req(workers=3, min_workers=None, **fields):
    return Requirements(workers, 0, 0, (), None, 0.5, min_workers=min_workers, **fields)


def market():
    return [offer("agg", kind="core", price=0.3), offer("c0"), offer("c1", price=0.11)]


def place(r, offers, *, started=False, placed=0, busy=frozenset(), aggregator=True, pricing="fixed"):
    return place_job(
        r,
        pricing,
        offers,
        aggregator=aggregator,
        workers=r.workers - placed,
        busy=set(busy),
        index=OfferIndex(offers),
        gang=start_size(r, started=started, placed=placed),
    )


def test_a_job_that_has_not_started_places_nothing_short_of_min_workers():
    decision = place(req(workers=3), market())
    assert decision.aggregator is None and decision.workers.choices == () and decision.chosen == set()
    short = decision.short
    assert (short.needed, short.no_aggregator, short.aggregator.node_id) == (3, False, "agg")
    assert [c.node_id for c in short.workers] == ["c0", "c1"]  # what it could have had


def test_with_min_workers_below_workers_it_starts_on_what_it_can_get():
    decision = place(req(workers=3, min_workers=2), market())
    assert decision.short is None and decision.aggregator.node_id == "agg"
    assert [c.node_id for c in decision.workers.choices] == ["c0", "c1"]


def test_once_started_it_takes_what_it_can_one_by_one():
    decision = place(req(workers=3), market(), started=True, placed=2, busy={"c0"}, aggregator=False)
    assert decision.short is None and [c.node_id for c in decision.workers.choices] == ["c1"]


def test_no_aggregator_means_no_worker_either_until_the_job_started():
    community = market()[1:]
    assert place(req(workers=2), community).short.no_aggregator
    started = place(req(workers=2), community, started=True, aggregator=True)
    assert started.aggregator is None and len(started.workers.choices) == 2


def test_start_size_is_what_min_workers_still_needs_until_the_job_started():
    assert start_size(req(workers=4), started=False, placed=0) == 4
    assert start_size(req(workers=4, min_workers=2), started=False, placed=1) == 1
    assert start_size(req(workers=4, min_workers=2), started=False, placed=3) == 0
    assert start_size(req(workers=4), started=True, placed=0) == 0


def test_a_first_auction_clears_for_what_it_can_get_from_min_workers_up():
    offers = [offer("agg", kind="core", price=0.3), *(offer(f"c{i}", price=0.1 * (i + 1)) for i in range(3))]
    cleared = place(req(workers=4, min_workers=3), offers, pricing="auction")
    assert cleared.clearing_price == 0.5  # every eligible ask won: the job's maximum
    assert sorted(c.node_id for c in cleared.workers.choices) == ["c0", "c1", "c2"]
    short = place(req(workers=4), offers, pricing="auction").short
    assert short.wait_reason == "the auction needs 4 eligible asks at most 0.500/h and has 3"


@given(
    reqs_st, offers_st, st.integers(0, 8), st.booleans(), st.sets(st.text("abcdef", min_size=1, max_size=3))
)
def test_the_index_and_the_scan_place_a_job_alike(r, offers, gang, aggregator, busy):
    """Same gang decision, same choices and reasons, with or without the index."""
    workers = r.workers
    scan = place_job(r, "fixed", offers, aggregator=aggregator, workers=workers, busy=busy, gang=gang)
    index = OfferIndex(offers)
    indexed = place_job(
        r, "fixed", offers, aggregator=aggregator, workers=workers, busy=busy, gang=gang, index=index
    )
    assert indexed == scan
    if scan.short is not None:
        assert scan.chosen == set() and gang > 0


@given(reqs_st, offers_st, st.sets(st.text("abcdef", min_size=1, max_size=3)), st.booleans())
def test_the_index_tells_each_offer_the_first_reason_matching_finds(r, offers, held, aggregator):
    index = OfferIndex(offers)
    codes = index.reasons(r, aggregator=aggregator, held=held)
    checks = AGGREGATOR_CHECKS if aggregator else WORKER_CHECKS
    for o, code in zip(index.offers, codes, strict=True):
        failed = [i for i, check in enumerate(checks) if check(o, r)]
        if aggregator and o.kind != "core":
            assert code == NOT_CANDIDATE
        elif o.node_id in held:
            assert code == HELD
        else:
            assert code == (FAILS + failed[0] if failed else FITS), (o, failed)


def test_nodes_left_out_are_named_in_rank_order_then_counted_by_kind():
    offers = [
        offer(f"n{i:02}", price=0.10 + i / 1000, region="us" if i % 3 == 2 else "eu") for i in range(12)
    ]
    held = {f"n{i:02}": BUSY for i in range(0, 12, 3)}
    chosen = [f"n{i:02}" for i in range(1, 12, 3)]  # the rest of the eu nodes
    told = nodes_left_out(
        OfferIndex(offers), replace(req(), region="eu"), aggregator=False, held=held, chosen=chosen
    )
    named = ", ".join(
        f"n{i:02}: busy (worker, leased)" if i % 3 == 0 else f"n{i:02}: region us != eu"
        for i in (0, 2, 3, 5, 6, 8)
    )
    assert NAMED == 6 and told == f"{named}, and 2 more: 1 busy, 1 in another region"


def test_a_core_node_is_the_only_candidate_for_the_aggregator():
    index = OfferIndex(market()[1:])
    assert nodes_left_out(index, req(), aggregator=True, held={}) == "no core node is online"


def test_why_waiting_tells_the_gang_once_for_every_task_and_the_rest_after_the_start():
    offers = market()
    index = OfferIndex(offers)
    gang = place(req(workers=3), offers)
    agg, workers = why_waiting(index, req(workers=3), gang, aggregator=True, workers=3, held={})
    assert agg is workers and str(workers) == (
        "2 of the 3 workers this job needs to start (resources.min_workers) can be placed now (on c0, c1): "
        "agg: kept for this job's aggregator"
    )
    started = place(req(workers=3, min_workers=2), offers)
    held = {n: BUSY for n in started.chosen}
    agg, workers = why_waiting(index, req(workers=3), started, aggregator=True, workers=3, held=held)
    assert agg is None and workers.headline == "no free node qualifies"
    assert workers.nodes == ", ".join(f"{n}: {BUSY.reason}" for n in ("c0", "c1", "agg"))


def test_unstaked_community_nodes_are_held_with_their_stake():
    offers = market()
    held = unstaked(offers, {"c0": 1_000_000, "c1": 400_000}, 1_000_000)
    assert held == {"c1": Held("stake below min_stake", "stake 0.4 < min_stake 1 credits")}
    assert unstaked(offers, {}, 0) == {}


def test_a_quote_short_of_workers_beyond_min_workers_says_who_would_wait():
    spec = parse_job_spec(
        {"name": "q", "resources": {"workers": 3, "min_workers": 2}, "max_price_per_hour": 0.5}
    )
    q = quote(spec, market())
    assert q.placeable and [n.node_id for n in q.nodes] == ["agg", "c0", "c1"]
    assert q.waiting == (
        "1 of the 3 workers would wait, and join when a node frees: no free node qualifies: "
        "c0: would run one of this job's workers, c1: would run one of this job's workers, "
        "agg: would host this job's aggregator",
    )
    busy = quote(spec, market(), held={"agg": BUSY})
    assert busy.problems == (f"no core node can host the aggregator: agg: {BUSY.reason}",)
