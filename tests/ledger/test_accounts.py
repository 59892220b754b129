import pytest

from gpuflex.errors import BadRequest
from gpuflex.ledger.accounts import (
    PLATFORM_FEES,
    SLASHED,
    STAKES,
    WORLD,
    consumer,
    escrow,
    held,
    held_for_job,
    may_go_negative,
    provider,
    stake,
)


def test_names():
    assert consumer("acct-1") == "consumer:acct-1"
    assert provider("n-abc") == "provider:n-abc"
    assert escrow("job-7") == "escrow:job-7"
    assert stake("n-abc") == "stake:n-abc" and stake("n-abc").startswith(STAKES)
    assert held("j-1", "n-abc").startswith(held_for_job("j-1"))
    assert held("j-1", "n-abc") == "held:j-1/n-abc"
    assert PLATFORM_FEES == "platform:fees"
    assert SLASHED == "platform:slashed"
    assert WORLD == "world"


def test_only_world_may_go_negative():
    assert may_go_negative(WORLD)
    for account in (consumer("a"), provider("n"), escrow("j"), stake("n"), held("j", "n"), PLATFORM_FEES):
        assert not may_go_negative(account)


@pytest.mark.parametrize("make", [consumer, provider, escrow, stake])
def test_empty_id_refused(make):
    with pytest.raises(BadRequest):
        make("")


@pytest.mark.parametrize(("job", "node"), [("", "n"), ("j", ""), ("j/x", "n"), ("j", "n/x")])
def test_a_held_account_names_one_job_and_one_node(job, node):
    with pytest.raises(BadRequest):
        held(job, node)
