import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.market.index import OfferIndex
from gpuflex.market.matching import (
    NodeOffer,
    Requirements,
    cost_per_useful_tflop,
    place_aggregator,
    place_workers,
    unmet,
)
from gpuflex.protocol.spec import parse_job_spec


def offer(
    node_id="n1",
    *,
    kind="community",
    price=0.10,
    tflops=1.0,
    vram=16,
    gpus=("NVIDIA A100-SXM4",),
    region="eu",
    reliability=1.0,
):
    return NodeOffer(node_id, f"box-{node_id}", kind, price, tflops, vram, tuple(gpus), region, reliability)


def req(
    *, workers=2, vram=0, tflops=0, accelerators=(), region=None, max_price=0.50, min_core=0, fallback=True
):
    return Requirements(workers, vram, tflops, tuple(accelerators), region, max_price, min_core, fallback)


@pytest.mark.parametrize(
    ("o", "r", "reason"),
    [
        (offer(price=0.80), req(max_price=0.50), "price 0.80/h > max 0.50/h"),
        (offer(price=0.501), req(max_price=0.50), "price 0.501/h > max 0.50/h"),
        (offer(vram=8), req(vram=16), "vram 8 GB < 16 GB"),
        (offer(vram=7.5), req(vram=16), "vram 7.5 GB < 16 GB"),
        (offer(tflops=0.2), req(tflops=1.0), "tflops 0.2 < 1.0"),
        (offer(gpus=("RTX 4090",)), req(accelerators=["A100"]), "no GPU among [A100]"),
        (offer(gpus=()), req(accelerators=["A100", "H100"]), "no GPU among [A100, H100]"),
        (offer(region="us"), req(region="eu"), "region us != eu"),
    ],
)
def test_each_unmet_reason(o, r, reason):
    assert unmet(o, r) == [reason]


def test_all_reasons_together_and_none():
    bad = offer(price=0.8, vram=8, tflops=0.2, gpus=("GTX 1080",), region="us")
    r = req(vram=16, tflops=1.0, accelerators=["a100"], region="eu")
    assert unmet(bad, r) == [
        "price 0.80/h > max 0.50/h",
        "vram 8 GB < 16 GB",
        "tflops 0.2 < 1.0",
        "no GPU among [a100]",
        "region us != eu",
    ]
    assert unmet(offer(), r) == []


def test_limits_are_inclusive_and_accelerator_match_is_case_insensitive_substring():
    assert unmet(offer(price=0.5, vram=16, tflops=1.0), req(max_price=0.5, vram=16, tflops=1.0)) == []
    assert unmet(offer(gpus=("cpu", "NVIDIA A100-SXM4-80GB")), req(accelerators=["h100", "a100"])) == []
    assert unmet(offer(gpus=()), req(accelerators=[])) == []  # no accelerator asked: CPUs qualify
    assert unmet(offer(price=math.nan), req()) == ["price nan/h > max 0.50/h"]


def test_from_spec():
    spec = parse_job_spec(
        {
            "name": "j",
            "resources": {
                "workers": 3,
                "min_vram_gb": 8,
                "min_tflops": 2,
                "accelerators": ["A100", " "],
                "region": "eu",
                "min_core_workers": 1,
                "core_fallback": False,
            },
            "max_price_per_hour": 0.25,
        }
    )
    assert Requirements.from_spec(spec) == Requirements(3, 8, 2, ("A100",), "eu", 0.25, 1, False)
    assert Requirements(3, 8, 2, (), None, 0.25) == req(workers=3, vram=8, tflops=2, max_price=0.25)


def test_cost_per_useful_tflop():
    assert cost_per_useful_tflop(offer(price=0.05, tflops=0.25, reliability=0.8)) == pytest.approx(0.25)
    assert cost_per_useful_tflop(offer(tflops=0)) == math.inf
    assert cost_per_useful_tflop(offer(reliability=0)) == math.inf


def ids(choices):
    return [c.node_id for c in choices]


def test_workers_ranked_by_cost_per_useful_tflop():
    offers = [
        offer("cheap-slow", price=0.05, tflops=0.1),  # 0.5 per TFLOP
        offer("pricey-fast", price=0.40, tflops=4.0),  # 0.1
        offer("flaky", price=0.10, tflops=2.0, reliability=0.25),  # 0.2
    ]
    choices = place_workers(req(), offers, count=3, exclude=set()).choices
    assert ids(choices) == ["pricey-fast", "flaky", "cheap-slow"]
    assert choices[0].reason == (
        "rank 1 of 3 eligible community nodes by cost per useful TFLOP (0.400 credits/h ÷ 4 TFLOPS = 0.1)"
    )


def test_ties_break_on_price_then_node_id():
    offers = [
        offer("b", price=0.2, tflops=2),
        offer("a", price=0.2, tflops=2),
        offer("c", price=0.1, tflops=1),
    ]
    assert ids(place_workers(req(), offers, count=3, exclude=set()).choices) == ["c", "a", "b"]
    assert ids(place_workers(req(), list(reversed(offers)), count=3, exclude=set()).choices) == [
        "c",
        "a",
        "b",
    ]


def test_price_cap_and_exclude_and_count():
    offers = [offer("over", price=0.6, tflops=100), offer("x", tflops=3), offer("y", tflops=2), offer("z")]
    assert ids(place_workers(req(max_price=0.5), offers, count=5, exclude={"x"}).choices) == ["y", "z"]
    assert ids(place_workers(req(), offers, count=1, exclude=set()).choices) == ["x"]
    assert place_workers(req(), offers, count=0, exclude=set()).choices == ()
    with pytest.raises(BadRequest):
        place_workers(req(), offers, count=-1, exclude=set())


def test_community_first_core_as_fallback():
    offers = [
        offer("core-fast", kind="core", tflops=50),
        offer("comm-1", tflops=1),
        offer("comm-2", tflops=2),
    ]
    assert ids(place_workers(req(), offers, count=2, exclude=set()).choices) == ["comm-2", "comm-1"]
    choices = place_workers(req(), offers, count=3, exclude=set()).choices
    assert ids(choices) == ["comm-2", "comm-1", "core-fast"]
    assert "rank 1 of 1 eligible core node" in choices[2].reason
    assert "core node because only 2 eligible community nodes" in choices[2].reason
    assert place_workers(req(), offers, count=4, exclude=set()).wait_reason is None  # just out of nodes


def test_one_choice_per_node():
    offers = [offer("n1", price=0.3), offer("n1", price=0.1), offer("n2", price=0.2)]
    choices = place_workers(req(), offers, count=3, exclude=set()).choices
    assert ids(choices) == ["n1", "n2"]
    assert "0.100 credits/h" in choices[0].reason


def test_aggregator_is_the_cheapest_eligible_core_node():
    offers = [
        offer("comm", kind="community", price=0.01),
        offer("core-a", kind="core", price=0.30),
        offer("core-b", kind="core", price=0.20, tflops=0, vram=0, gpus=()),  # compute needs do not apply
        offer("core-c", kind="core", price=0.20),
        offer("core-over", kind="core", price=0.90),
        offer("core-us", kind="core", price=0.05, region="us"),
    ]
    r = req(vram=16, tflops=1, accelerators=["A100"], region="eu", max_price=0.5)
    choice = place_aggregator(r, offers, exclude=set())
    assert choice.node_id == "core-b"  # tie with core-c on price, broken by node_id
    assert (
        choice.reason
        == "cheapest of 3 eligible core nodes at 0.200 credits/h (aggregator runs only on core nodes)"
    )
    assert place_aggregator(r, offers, exclude={"core-b"}).node_id == "core-c"
    assert place_aggregator(r, offers, exclude={"core-a", "core-b", "core-c"}) is None
    assert place_aggregator(req(), [offer("comm")], exclude=set()) is None
    one = place_aggregator(req(), [offer("solo", kind="core")], exclude=set())
    assert (
        one.reason
        == "cheapest of 1 eligible core node at 0.100 credits/h (aggregator runs only on core nodes)"
    )


def test_the_core_quota_comes_first_even_when_community_nodes_are_free():
    offers = [
        offer("core-a", kind="core", price=0.3),
        offer("core-b", kind="core", price=0.2),
        offer("core-c", kind="core", price=0.4),
        offer("comm-1", price=0.01),
        offer("comm-2", price=0.02),
    ]
    placement = place_workers(req(workers=3, min_core=2), offers, count=3, exclude=set())
    assert ids(placement.choices) == ["core-b", "core-a", "comm-1"]
    assert placement.choices[0].reason == (
        "core node: the job asks for at least 2 core workers; rank 1 of 3 eligible core nodes "
        "by cost per useful TFLOP (0.200 credits/h ÷ 1 TFLOPS = 0.2)"
    )
    assert placement.choices[1].reason.startswith(
        "core node: the job asks for at least 2 core workers; rank 2"
    )
    assert placement.choices[2].reason.startswith("rank 1 of 2 eligible community nodes")
    assert placement.wait_reason is None


def test_fallback_core_nodes_rank_after_the_quota():
    offers = [offer("core-a", kind="core", price=0.1), offer("core-b", kind="core", price=0.2)]
    choices = place_workers(req(min_core=1), offers, count=2, exclude=set()).choices
    assert ids(choices) == ["core-a", "core-b"]
    assert choices[0].reason.startswith("core node: the job asks for at least 1 core worker; rank 1 of 2")
    assert choices[1].reason.startswith("rank 2 of 2 eligible core nodes")
    assert choices[1].reason.endswith("; core node because only 0 eligible community nodes")


def test_slots_the_quota_needs_wait_for_a_core_node_instead_of_going_to_community():
    offers = [offer("core-a", kind="core"), *(offer(f"comm-{i}") for i in range(5))]
    placement = place_workers(req(workers=3, min_core=2), offers, count=3, exclude=set())
    assert ids(placement.choices) == ["core-a", "comm-0"]
    assert (
        placement.wait_reason
        == "the job asks for at least 2 core workers (1 so far) and no eligible core node is free"
    )
    later = place_workers(req(workers=3, min_core=2), offers, count=1, exclude={"core-a"}, core_already=1)
    assert later.choices == ()
    assert (
        later.wait_reason
        == "the job asks for at least 2 core workers (1 so far) and no eligible core node is free"
    )


def test_workers_already_on_core_count_toward_the_quota():
    offers = [offer("core-a", kind="core", price=0.01), offer("comm-1", price=0.2)]
    r = req(workers=3, min_core=1)
    assert ids(place_workers(r, offers, count=1, exclude=set()).choices) == ["core-a"]
    replacement = place_workers(r, offers, count=1, exclude=set(), core_already=1).choices
    assert ids(replacement) == ["comm-1"]
    assert replacement[0].reason.startswith("rank 1 of 1 eligible community node ")


WAITS_FOR_COMMUNITY = "no eligible community node is free and the job forbids core fallback"


def test_forbidden_fallback_leaves_workers_waiting_for_community_nodes():
    offers = [offer("core-fast", kind="core", tflops=50), offer("comm-1")]
    placement = place_workers(req(workers=3, fallback=False), offers, count=3, exclude=set())
    assert ids(placement.choices) == ["comm-1"]
    assert placement.wait_reason == WAITS_FOR_COMMUNITY
    alone = place_workers(req(workers=3, fallback=False), offers, count=1, exclude={"comm-1"})
    assert alone.choices == ()
    assert alone.wait_reason == WAITS_FOR_COMMUNITY
    no_core_either = place_workers(req(fallback=False), offers, count=2, exclude={"core-fast"})
    assert no_core_either.wait_reason is None  # the rule held nobody back: there was no core node to use


def test_forbidden_fallback_still_honours_the_quota():
    offers = [
        offer("core-a", kind="core", price=0.1),
        offer("core-b", kind="core", price=0.2),
        offer("comm-1"),
    ]
    placement = place_workers(req(workers=3, min_core=1, fallback=False), offers, count=3, exclude=set())
    assert ids(placement.choices) == ["core-a", "comm-1"]
    assert placement.wait_reason == WAITS_FOR_COMMUNITY


HOURS = [None, 0.0, 5.0, None, -1.0, 48.0] * 2  # open-ended, ran out, some left

offers_st = st.lists(
    st.builds(
        NodeOffer,
        node_id=st.text("abcdef", min_size=1, max_size=3),
        name=st.just("box"),
        kind=st.sampled_from(["core", "community"]),
        price_per_hour=st.floats(0, 2),
        tflops=st.floats(0, 100),
        vram_gb=st.sampled_from([0, 8, 16, 24, 80]),
        gpus=st.lists(st.sampled_from(["NVIDIA A100", "RTX 4090", "H100 SXM", "cpu"]), max_size=2).map(tuple),
        region=st.sampled_from(["eu", "us"]),
        reliability=st.floats(0, 1),
        kernels=st.sampled_from([(), ("nf4", "int8", "adamw8bit"), ("adamw8bit",)]),
    ),
    max_size=12,
    unique_by=lambda o: o.node_id,
)
reqs_st = st.builds(
    Requirements,
    workers=st.integers(1, 8),
    min_vram_gb=st.sampled_from([0, 8, 16]),
    min_tflops=st.floats(0, 50),
    accelerators=st.lists(st.sampled_from(["a100", "4090", "H100"]), max_size=2).map(tuple),
    region=st.sampled_from([None, "eu", "us"]),
    max_price_per_hour=st.floats(0.01, 2),
    min_core_workers=st.integers(0, 4),
    core_fallback=st.booleans(),
    gpu_vram_gb=st.sampled_from([0.0, 12.0, 30.0]),
    devices=st.sampled_from([1, 2]),
    kernels=st.sampled_from([(), ("nf4",), ("adamw8bit",)]),
)


@given(
    reqs_st,
    offers_st,
    st.integers(0, 12),
    st.sets(st.text("abcdef", min_size=1, max_size=3), max_size=3),
    st.integers(0, 4),
)
def test_placement_properties(r, offers, count, exclude, core_already):
    placement = place_workers(r, offers, count=count, exclude=exclude, core_already=core_already)
    chosen = ids(placement.choices)
    by_id = {o.node_id: o for o in offers}
    eligible = [o for o in offers if not unmet(o, r) and o.node_id not in exclude]
    assert len(chosen) == len(set(chosen)) <= count
    assert all(not unmet(by_id[n], r) and n not in exclude for n in chosen)
    owed = min(max(r.min_core_workers - core_already, 0), count)
    quota = min(owed, sum(o.kind == "core" for o in eligible))
    on_core = [n for n in chosen if by_id[n].kind == "core"]
    assert chosen[:quota] == on_core[:quota], "the core quota comes first"
    if not r.core_fallback:
        assert len(on_core) <= owed, "a core node was placed beyond the quota though fallback is forbidden"
    community = [o for o in eligible if o.kind == "community"]
    picked = [by_id[n] for n in chosen if by_id[n].kind == "community"]
    skipped = [o for o in community if o.node_id not in chosen]
    assert len(picked) <= count - owed, "a slot the core quota needs went to a community node"
    for p in picked:
        assert all(cost_per_useful_tflop(s) >= cost_per_useful_tflop(p) for s in skipped)
    if len(on_core) > owed:
        assert not skipped, "a core node fell back in while an eligible community node was left out"
    assert chosen[quota : quota + len(picked)] == [o.node_id for o in picked], "then community nodes"
    if placement.wait_reason is None:
        assert len(chosen) == min(count, len(eligible)), "workers left waiting without a reason"
    else:
        assert len(chosen) < count


def test_a_node_whose_offered_hours_ran_out_gets_no_new_task():
    spent = NodeOffer("spent", "box", "core", 0.01, 9.0, 80, ("NVIDIA A100",), "eu", 1.0, hours_left=0.0)
    fresh = NodeOffer("fresh", "box", "core", 0.20, 1.0, 80, ("NVIDIA A100",), "eu", 1.0, hours_left=0.5)
    assert unmet(spent, req()) == ["availability ran out (the provider offered it for a limited time)"]
    assert unmet(fresh, req()) == []
    assert [c.node_id for c in place_workers(req(), [spent, fresh], count=2, exclude=set()).choices] == [
        "fresh"
    ]
    assert place_aggregator(req(), [spent, fresh], exclude=set()).node_id == "fresh"
    assert place_aggregator(req(), [spent], exclude=set()) is None


@given(
    reqs_st,
    offers_st.map(lambda offers: [replace(o, hours_left=h) for o, h in zip(offers, HOURS, strict=False)]),
    st.integers(0, 12),
    st.sets(st.text("abcdef", min_size=1, max_size=3), max_size=3),
    st.integers(0, 4),
)
def test_the_offer_index_places_exactly_as_the_scan(r, offers, count, exclude, core_already):
    """Same nodes, same order, same reasons, same wait: the index is only faster."""
    want = place_workers(r, offers, count=count, exclude=exclude, core_already=core_already)
    got = OfferIndex(offers).place_workers(r, count=count, exclude=exclude, core_already=core_already)
    assert got == want


@given(reqs_st, offers_st, st.sets(st.text("abcdef", min_size=1, max_size=3), max_size=4), st.data())
def test_busy_nodes_kept_in_the_index_are_excluded_as_the_scan_excludes_them(r, offers, busy, data):
    index = OfferIndex(offers)
    index.set_busy(busy)
    freed = data.draw(st.sets(st.sampled_from(sorted(busy)), max_size=2) if busy else st.just(set()))
    index.set_busy(freed, busy=False)
    extra = data.draw(st.sets(st.text("abcdef", min_size=1, max_size=3), max_size=2))
    want = place_workers(r, offers, count=r.workers, exclude=(busy - freed) | extra)
    assert index.place_workers(r, count=r.workers, exclude=extra) == want
