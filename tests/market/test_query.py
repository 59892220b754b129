"""The offer query language: what each term means, sorting, and errors that point at the bad token."""

import contextlib
import math
import operator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.market.query import QueryError, parse, parse_order, select
from gpuflex.protocol.messages import Offer


def offer(node_id="n1", **kw) -> Offer:
    fields = {
        "name": f"box-{node_id}",
        "kind": "community",
        "device": "cuda",
        "gpu": "NVIDIA GeForce RTX 4090",
        "vram_gb": 24.0,
        "tflops": 80.0,
        "price_per_hour": 0.4,
        "region": "eu",
        "state": "online",
        "reliability": 0.9,
        "hours": None,
    }
    return Offer(node_id=node_id, **{**fields, **kw})


def ids(offers) -> list[str]:
    return [o.node_id for o in offers]


MARKET = [
    offer(
        "a100", gpu="NVIDIA A100-SXM4", vram_gb=80, tflops=150, price_per_hour=1.2, region="us", kind="core"
    ),
    offer("4090", hours=48.0),
    offer("3060", gpu="RTX 3060", vram_gb=12, tflops=25, price_per_hour=0.1, reliability=0.6, hours=6.0),
    offer("cpu", device="cpu", gpu=None, vram_gb=0, tflops=0.5, price_per_hour=0.01, reliability=None),
    offer("gone", price_per_hour=0.05, state="lost", region="EU"),
]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", ["cpu", "3060", "4090", "a100", "gone"]),
        ("   ", ["cpu", "3060", "4090", "a100", "gone"]),
        ("vram>=16 price<=0.5", ["4090", "gone"]),
        ("vram >= 16   price <= .5 state=online", ["4090"]),
        ("tflops>25", ["4090", "a100", "gone"]),
        ("tflops<25", ["cpu"]),
        ("tflops=25", ["3060"]),
        ("tflops==25", ["3060"]),
        ("tflops!=25", ["cpu", "4090", "a100", "gone"]),
        ("vram in [12, 80]", ["3060", "a100"]),
        ("region=EU", ["cpu", "3060", "4090", "gone"]),  # words compare case-insensitively
        ("region in [us, ap]", ["a100"]),
        ("region != eu", ["a100"]),
        ("kind in [core]", ["a100"]),
        ("kind=community device=cpu", ["cpu"]),
        ("gpu=4090", ["4090", "gone"]),  # a case-insensitive substring of the GPU's name
        ('gpu="rtx 3060"', ["3060"]),
        ("gpu in ['a100', 3060]", ["3060", "a100"]),
        ("gpu!=rtx", ["cpu", "a100"]),  # no GPU is not an RTX
        ("reliability>=0.9", ["4090", "a100", "gone"]),  # unknown reliability satisfies only !=
        ("reliability!=0.9", ["cpu", "3060"]),
        ("hours>=24", ["cpu", "4090", "a100", "gone"]),  # open-ended satisfies any hours>=
        ("hours<24", ["3060"]),
        ("name=box-cpu", ["cpu"]),
        ("state in [lost, left]", ["gone"]),
        ("VRAM>=80", ["a100"]),
    ],
)
def test_each_kind_of_term(query, expected):
    assert ids(select(MARKET, parse(query))) == expected


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("", ["cpu", "3060", "4090", "a100", "gone"]),  # online first, cheapest
        ("price", ["cpu", "gone", "3060", "4090", "a100"]),
        ("-tflops", ["a100", "4090", "gone", "3060", "cpu"]),
        ("+vram, -price", ["cpu", "3060", "4090", "gone", "a100"]),  # ties keep the default order
        ("-reliability,price", ["gone", "4090", "a100", "3060", "cpu"]),  # unknown last, either way
        ("reliability", ["3060", "4090", "a100", "gone", "cpu"]),
        ("hours", ["3060", "4090", "cpu", "a100", "gone"]),  # open-ended counts as infinitely long
        ("-hours", ["cpu", "a100", "gone", "4090", "3060"]),
        ("-gpu", ["3060", "4090", "gone", "a100", "cpu"]),  # a missing GPU sorts last
    ],
)
def test_orders(order, expected):
    assert ids(select(MARKET, parse(""), parse_order(order))) == expected


@pytest.mark.parametrize(
    ("query", "reason", "caret"),
    [
        ("vrm>=16 price<=0.5", "unknown field 'vrm' (known: vram, tflops, price", "^^^"),
        ("vram>=16 vram", "missing operator after 'vram'", "         " + " " * 4 + "^"),
        ("vram 16", "missing operator after 'vram', got '16'", "     ^^"),
        ("vram=>16", "unknown operator '=>'", "    ^^"),
        ("vram<>16", "unknown operator '<>'", "    ^^"),
        ("vram ! 16", "unknown operator '!'", "     ^"),
        ("vram>=lots", "'vram' is a number, got 'lots'", "      ^^^^"),
        ("vram>=16GB", "'vram' is a number, got '16GB'", "      ^^^^"),
        ("vram>=", "missing value for 'vram'", "      ^"),
        ("region in [eu, us", "unterminated '['", "          ^^^^^^^"),
        ("region in [eu,", "unterminated '['", "          ^^^^"),
        ("region in eu", "'in' needs a list like [a, b], got 'eu'", "          ^^"),
        ("region in", "'in' needs a list like [a, b]", "       ^^"),
        ("region in [eu us]", "expected ',' or ']' in the list, got 'us'", "              ^^"),
        ("vram in [16, big]", "'vram' is a number, got 'big'", "             ^^^"),
        ('gpu="RTX 4090', 'unterminated quote "', "    ^^^^^^^^^"),
        ("region>=eu", "'region' is a word: compare it with = != or in [...]", "      ^^"),
        ("kind=cor", "unknown kind 'cor' (one of: core, community)", "     ^^^"),
        ("vram>=16 ]", "expected a field name, got ']'", "         ^"),
    ],
)
def test_a_bad_query_names_the_problem_and_points_at_it(query, reason, caret):
    with pytest.raises(QueryError) as err:
        parse(query)
    first, shown, marks = err.value.message.split("\n")
    assert first.startswith(f"bad query at column {err.value.position + 1}: ")
    assert reason in first
    assert shown == f"  {query}"
    assert marks == f"  {caret}"
    assert isinstance(err.value, BadRequest) and err.value.status_code == 400


def test_the_message_of_the_brief():
    with pytest.raises(QueryError) as err:
        parse("vrm>=16 price<=0.5")
    assert err.value.message == (
        "bad query at column 1: unknown field 'vrm' "
        "(known: vram, tflops, price, reliability, hours, region, kind, gpu, device, state, name)\n"
        "  vrm>=16 price<=0.5\n"
        "  ^^^"
    )


@pytest.mark.parametrize(
    ("order", "reason", "caret"),
    [
        ("prce", "unknown sort key 'prce'", "^^^^"),
        ("price, -tflps", "unknown sort key '-tflps'", "       ^^^^^^"),
        ("price,,tflops", "empty sort key", "      ^"),
        ("-", "unknown sort key '-'", "^"),
    ],
)
def test_a_bad_order_points_at_the_key(order, reason, caret):
    with pytest.raises(QueryError) as err:
        parse_order(order)
    first, shown, marks = err.value.message.split("\n")
    assert first.startswith("bad order at column") and reason in first
    assert (shown, marks) == (f"  {order}", f"  {caret}")


# -- properties -------------------------------------------------------------------------------------

NUMERIC = {
    "vram": lambda o: o.vram_gb,
    "tflops": lambda o: o.tflops,
    "price": lambda o: o.price_per_hour,
    "reliability": lambda o: o.reliability,
    "hours": lambda o: math.inf if o.hours is None else o.hours,
}
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "=": operator.eq}
REGIONS = ["eu", "us", "ap"]

offers_st = st.lists(
    st.builds(
        offer,
        node_id=st.text("abcdef", min_size=1, max_size=4),
        kind=st.sampled_from(["core", "community"]),
        vram_gb=st.sampled_from([0.0, 8.0, 16.0, 24.0, 80.0]),
        tflops=st.floats(0, 200),
        price_per_hour=st.floats(0, 5),
        region=st.sampled_from(REGIONS),
        state=st.sampled_from(["online", "lost", "left"]),
        reliability=st.floats(0, 1),
        hours=st.none() | st.floats(0, 1000),
    ),
    max_size=10,
    unique_by=lambda o: o.node_id,
)
numeric_terms = st.tuples(
    st.sampled_from(sorted(NUMERIC)), st.sampled_from(sorted(OPS)), st.sampled_from([0, 0.5, 1, 16, 24, 100])
)
region_terms = st.lists(st.sampled_from(REGIONS), min_size=1, max_size=3, unique=True)
kind_terms = st.sampled_from(["core", "community"])


@given(
    offers_st,
    st.lists(numeric_terms, max_size=4),
    st.none() | region_terms,
    st.none() | kind_terms,
    st.sampled_from(["", " ", "  \t"]),
)
def test_any_query_of_valid_terms_filters_as_the_python_predicates_do(offers, numeric, regions, kind, gap):
    terms = [f"{field}{gap}{op}{gap}{value}" for field, op, value in numeric]
    if regions is not None:
        terms.append(f"region in [{', '.join(regions)}]")
    if kind is not None:
        terms.append(f"kind={kind}")

    def wanted(o: Offer) -> bool:
        return (
            all(OPS[op](NUMERIC[field](o), value) for field, op, value in numeric)
            and (regions is None or o.region in regions)
            and (kind is None or o.kind == kind)
        )

    got = select(offers, parse(" ".join(terms)))
    assert {o.node_id for o in got} == {o.node_id for o in offers if wanted(o)}


@given(offers_st, st.lists(st.tuples(st.sampled_from(sorted(NUMERIC)), st.booleans()), max_size=3))
def test_an_order_sorts_as_python_does(offers, keys):
    order = ",".join(f"{'-' if desc else ''}{field}" for field, desc in keys)
    got = select(offers, parse(""), parse_order(order))
    for field, desc in keys:  # sorted by the first key; the rest only break its ties
        values = [NUMERIC[field](o) for o in got]
        assert values == sorted(values, reverse=desc)
        break
    assert sorted(ids(got)) == sorted(ids(offers))


@given(st.text(max_size=40) | st.text("vramgpuin<>=!.[], '\"0123456789", max_size=30))
def test_garbage_raises_only_the_typed_error(text):
    try:
        query = parse(text)
    except QueryError as err:
        assert 0 <= err.position <= len(text)
        assert err.message.count("\n") == 2
    else:
        select(MARKET, query)  # a query that parses can always be run
    with contextlib.suppress(QueryError):
        parse_order(text)
