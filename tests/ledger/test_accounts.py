import pytest

from gpuflex.errors import BadRequest
from gpuflex.ledger.accounts import PLATFORM_FEES, WORLD, consumer, escrow, may_go_negative, provider


def test_names():
    assert consumer("acct-1") == "consumer:acct-1"
    assert provider("n-abc") == "provider:n-abc"
    assert escrow("job-7") == "escrow:job-7"
    assert PLATFORM_FEES == "platform:fees"
    assert WORLD == "world"


def test_only_world_may_go_negative():
    assert may_go_negative(WORLD)
    for account in (consumer("a"), provider("n"), escrow("j"), PLATFORM_FEES):
        assert not may_go_negative(account)


@pytest.mark.parametrize("make", [consumer, provider, escrow])
def test_empty_id_refused(make):
    with pytest.raises(BadRequest):
        make("")
