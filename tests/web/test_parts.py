"""The dashboard's pure parts: statistics, providers' dashboard tokens, and JSON log lines."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from gpuflex.coordinator.web import tokens
from gpuflex.coordinator.web.stats import Traffic, ddp_bytes, median, safetensors_params
from gpuflex.errors import Unauthorized
from gpuflex.jsonlog import JsonFormatter, TextFormatter


def test_the_price_index_is_the_median_asking_price():
    assert median([0.4, 0.1, 0.2]) == 0.2
    assert median([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.25)
    assert median([]) is None


def test_parameters_are_counted_from_the_safetensors_header():
    blob = save_safetensors(
        {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32), "c": np.zeros((), np.float32)}
    )
    assert safetensors_params(blob) == 12 + 5 + 1
    assert safetensors_params(b"not safetensors at all") == 0
    assert safetensors_params(b"") == 0


def test_ddp_sends_two_fp32_copies_of_the_gradient_per_worker_step():
    assert ddp_bytes(params=1000, worker_steps=30) == 1000 * 4 * 2 * 30
    assert Traffic(exchanged=1000, ddp=50_000, params=10).saving == 50
    assert Traffic(exchanged=0, ddp=None, params=None).saving is None


def test_a_dashboard_token_names_its_node_until_it_expires():
    token = tokens.issue("secret", "n-123", "link", expires_at=100.0)
    assert tokens.verify("secret", token, "link", now=99.0) == "n-123"
    with pytest.raises(Unauthorized, match="expired"):
        tokens.verify("secret", token, "link", now=101.0)
    with pytest.raises(Unauthorized, match="not a dashboard sign-in link"):
        tokens.verify("secret", token, "session", now=99.0)
    with pytest.raises(Unauthorized, match="not valid"):
        tokens.verify("another secret", token, "link", now=99.0)


@pytest.mark.parametrize("bad", ["", "gfxdash_", "gfx_abc", "gfxdash_e30.", "gfxdash_e30.xyz", "gfxdash_é.ü"])
def test_malformed_dashboard_tokens_are_refused(bad):
    with pytest.raises(Unauthorized):
        tokens.verify("secret", bad, "link", now=0.0)


def _record(**extra) -> logging.LogRecord:
    record = logging.LogRecord(
        "gpuflex.coordinator", logging.INFO, __file__, 1, "lease %s", ("granted",), None
    )
    record.__dict__.update(extra)
    return record


def test_json_log_lines_carry_job_and_node_ids_as_fields():
    line = JsonFormatter({"node_id": "n-static"}).format(_record(job_id="j-1", lease_id="l-2", secret="x"))
    data = json.loads(line)
    assert (
        data["msg"] == "lease granted" and data["level"] == "info" and data["logger"] == "gpuflex.coordinator"
    )
    assert (data["job_id"], data["lease_id"], data["node_id"]) == ("j-1", "l-2", "n-static")
    assert "secret" not in data and data["ts"].endswith("Z")


def test_text_log_lines_append_the_ids():
    line = TextFormatter().format(_record(job_id="j-1", node_id="n-9"))
    assert line.endswith("lease granted job_id=j-1 node_id=n-9")
