"""Secure aggregation with DP and encryption on a real local network: three admitted owners, the aggregator
learns only the sum of their masked updates, and an owner killed after it shared its secrets in the last
round (while it trains, its masks committed) costs the round its update and nothing else: the round
completes with the exact sum of the other two (its pairwise masks rebuilt from their shares), and the job
finishes. With ``privacy.encrypt`` the job's key is sealed to each owner's node and the aggregator's, and
every blob the coordinator stores (updates, rounds, checkpoints) opens only with that key."""

from __future__ import annotations

import re

import pytest

from gpuflex.cli.keys import in_background, new_job_key
from gpuflex.localnet import LocalNetwork
from gpuflex.privacy.envelope import JOB_BLOB, decrypt_blob
from gpuflex.protocol.spec import parse_job_spec
from gpuflex.testing import wait_for

from . import test_federated
from .test_federated import _prepare, _spec, _start
from .test_network import FAST_LIVENESS, TERMINAL

pytestmark = pytest.mark.integration

ROUNDS = 2


def test_a_secure_dp_job_finishes_when_an_owner_dies_after_sharing_its_secrets(tmp_path, monkeypatch):
    monkeypatch.setitem(test_federated.OWNERS, "clinic", ("CANARY-clinic-77b0", ["bed", "pill", "vein"], 400))
    prepared = {name: _prepare(tmp_path, name) for name in ("hospital", "bank", "clinic")}
    plain = _spec(ROUNDS, 60).model_dump(mode="json", by_alias=True, exclude_none=True)
    plain["training"] |= {"inner_steps": 100_000, "round_seconds": 2}  # long enough to kill it mid-round
    plain["privacy"] = {
        "secure_aggregation": True,
        "dp": {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5},
        "encrypt": True,
    }
    spec = parse_job_spec(plain)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the consumer's sealing key lives under it
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        lab, _ = _start(net, prepared)
        key = new_job_key()
        job_id = lab.submit(spec, sealed_key=key.sealed).id
        sealed: list[str] = []
        stop_serving = in_background(lab, job_id, sealed.append)  # as `submit --watch` does
        last = ROUNDS - 1

        def bank_shared() -> bool:
            said = " on bank ("  # its worker's lines: "[worker 1 on bank (n-…)] …"
            line = f"round {last}: secure aggregation attempt 0: shared with 3 owners"
            return any(said in e.message and line in e.message for e in lab.logs(job_id))

        wait_for(bank_shared, 180, "bank to share its secrets in the last round")
        net.kill_agent("bank")  # mid-training: its masked update never comes
        job = wait_for(lambda: (j := lab.job(job_id)).state in TERMINAL and j, 120, "the job to end")
        stop_serving()
        log = [e.message for e in lab.logs(job_id)]
        assert job.state == "completed", log[-10:]
        assert [r.contributions for r in job.rounds_log[1:]] == [3, 2], log[-10:]
        unmasked = [x for x in log if "secure aggregation unmasked the sum of" in x]
        assert len(unmasked) == ROUNDS, unmasked
        assert (
            f"round {last}: secure aggregation unmasked the sum of 2 owners (1 dropped after sharing"
            in (unmasked[-1])
        ), unmasked
        assert job.privacy.epsilon is not None and job.privacy.epsilon > 0  # the accountant as ever
        assert not any("rejected contribution" in x for x in log), log
        for task in ("aggregator 0 on core", *(f"on {name} (" for name in prepared)):
            assert any(x.startswith("data key sealed to ") and task in x for x in sealed), (task, sealed)
        stored = [p for p in (net.root / "coordinator").rglob("*") if re.fullmatch("[0-9a-f]{64}", p.name)]
        assert len(stored) > 2 * ROUNDS  # each round's updates and state, and the checkpoints
        for path in stored:  # ciphertext under the job's key, every one (a plaintext blob fails to open)
            decrypt_blob(key.key, path.read_bytes(), JOB_BLOB)
