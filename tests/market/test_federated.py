"""The federated placement rule: which owners a federated job uses, and why each node was or was not."""

import pytest

from gpuflex.errors import BadRequest
from gpuflex.market.federated import OfferedDataset, OwnerNode, choose_owners


def _node(node_id, *datasets, admits=("lab",)):
    offered = tuple(OfferedDataset(name, tokens, 2, f"{node_id:0>64}") for name, tokens in datasets)
    return OwnerNode(node_id, f"{node_id}-name", offered, frozenset(admits))


def test_one_owner_per_node_that_offers_the_name_and_admits_the_consumer_each_with_its_reason():
    nodes = [
        _node("n3", ("notes", 300)),
        _node("n1", ("notes", 100), ("scans", 5)),
        _node("n2", ("notes", 200), admits=("bank",)),
        _node("n4", ("scans", 400)),
        _node("n5"),  # offers no private data: not a line of its own
    ]
    found = choose_owners("notes", "lab", nodes)
    assert [(o.node_id, o.dataset.tokens) for o in found.used] == [("n1", 100), ("n3", 300)]
    assert found.reasons == (
        "n1-name (n1): used: offers notes (100 tokens) and admits lab",
        "n2-name (n2): not used: does not admit consumer lab",
        "n3-name (n3): used: offers notes (300 tokens) and admits lab",
        "n4-name (n4): not used: offers no dataset notes",
    )


def test_a_name_nobody_offers_and_owners_that_admit_nobody_like_us_are_one_line_each():
    with pytest.raises(BadRequest, match="no online node offers a private dataset named 'notes'"):
        choose_owners("notes", "lab", [_node("n1", ("scans", 5)), _node("n2")])
    with pytest.raises(BadRequest, match="no online owner of 'notes' admits account 'lab'"):
        choose_owners("notes", "lab", [_node("n1", ("notes", 5), admits=("bank",))])


def test_an_owner_asking_more_than_the_price_cap_is_not_used_and_says_so():
    cheap, dear = _node("n1", ("notes", 100)), _node("n2", ("notes", 200))
    dear = OwnerNode(dear.node_id, dear.name, dear.datasets, dear.consumers, price_per_hour=0.9)
    found = choose_owners("notes", "lab", [cheap, dear], max_price_per_hour=0.5)
    assert [o.node_id for o in found.used] == ["n1"]
    assert (
        found.reasons[1] == "n2-name (n2): not used: asks 0.900 credits/h, more than max_price_per_hour 0.500"
    )
    with pytest.raises(BadRequest, match="every online owner of 'notes' that admits 'lab' asks more than"):
        choose_owners("notes", "lab", [dear], max_price_per_hour=0.5)


def test_an_owner_outside_the_jobs_region_is_not_used_and_says_so():
    eu, us = _node("n1", ("notes", 100)), _node("n2", ("notes", 200))
    eu = OwnerNode(eu.node_id, eu.name, eu.datasets, eu.consumers, region="eu")
    us = OwnerNode(us.node_id, us.name, us.datasets, us.consumers, region="us")
    found = choose_owners("notes", "lab", [eu, us], region="EU")
    assert [o.node_id for o in found.used] == ["n1"]
    assert found.reasons[1] == (
        "n2-name (n2): not used: in region us; resources.region keeps the job's data in EU"
    )
    with pytest.raises(BadRequest, match="no online owner of 'notes' that admits 'lab' is in region 'eu'"):
        choose_owners("notes", "lab", [us], region="eu")
