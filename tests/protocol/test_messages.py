import base64
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


def test_a_trace_travels_as_base64_of_its_hashes_and_64_of_them_fit_a_kilobyte():
    trace = [f"{i:016x}" for i in range(m.MAX_TRACE)]
    c = m.Commitment(seed=2**63 - 1, start="a" * 64, data="b" * 64, every=8, trace=trace, device="cuda:12.0")
    c = c.model_copy(update={"residual": "1" * 16, "residual_out": "2" * 16, "chain": 10**6})
    wire = c.model_dump_json()
    assert len(wire) < 1024 and isinstance(c.model_dump(mode="json")["trace"], str)
    assert m.Commitment.model_validate_json(wire) == c and c.model_dump()["trace"] == trace
    over = base64.b64encode(bytes(8 * (m.MAX_TRACE + 1))).decode()
    for bad in ("not base64!", "AAAA", over):  # not base64; 3 bytes; 65 hashes
        with pytest.raises(ValidationError):
            m.Commitment.model_validate({**c.model_dump(mode="json"), "trace": bad})
