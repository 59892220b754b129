import math

import pytest
from pydantic import ValidationError

from gpuflex.protocol import messages as m


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_diverged_loss_is_reported_as_unknown(loss):
    msg = m.ContributionSubmit(round=0, delta="a" * 64, tokens=1, steps=1, train_loss=loss)
    assert msg.train_loss is None
    assert "NaN" not in msg.model_dump_json()


@pytest.mark.parametrize("amount", [math.nan, math.inf])
def test_other_floats_must_be_finite(amount):
    with pytest.raises(ValidationError, match="amount"):
        m.Deposit(amount=amount)


def test_unknown_fields_are_refused_in_every_message():
    with pytest.raises(ValidationError, match="extra"):
        m.Heartbeat(leases=[], cpu=3)
