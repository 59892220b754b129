"""DP-FedAvg on a real local network (the federated test's two admitted owners, unequal sizes): a job with
``privacy.dp`` completes, ``gpuflex job show`` reports ε growing round by round within the target, and a
job whose target allows fewer rounds than it asked stops after the last round within it and says so."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from gpuflex.localnet import LocalNetwork
from gpuflex.privacy.dp import Accountant
from gpuflex.testing import wait_for

from .test_federated import _prepare, _spec, _start
from .test_network import FAST_LIVENESS, TERMINAL

pytestmark = pytest.mark.integration

DELTA = 1e-5


def _show(net: LocalNetwork, token: str, job_id: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", "job", "show", job_id, "--url", net.url, "--token", token],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"}, check=True,
    ).stdout  # fmt: skip


def test_dp_jobs_account_epsilon_by_round_and_stop_before_passing_their_target(tmp_path):
    prepared = {name: _prepare(tmp_path, name) for name in ("hospital", "bank")}
    accountant = Accountant(2.0, DELTA)
    capped_target = (accountant.epsilon(2) + accountant.epsilon(3)) / 2  # 2 rounds fit, a third would not
    within = _spec(3, 60, privacy={"dp": {"clip": 0.5, "target_epsilon": 20, "delta": DELTA}})
    capped = _spec(
        5,
        60,
        privacy={
            "dp": {"clip": 0.5, "noise_multiplier": 2.0, "target_epsilon": capped_target, "delta": DELTA}
        },
    )
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        lab, token = _start(net, prepared)
        spec_file = tmp_path / "capped.yaml"  # one through the CLI, as a user submits
        spec_file.write_text(yaml.safe_dump(capped.model_dump(mode="json", by_alias=True, exclude_none=True)))
        submitted = subprocess.run(
            [sys.executable, "-m", "gpuflex", "submit", str(spec_file), "--url", net.url, "--token", token],
            capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"}, check=True,
        ).stdout  # fmt: skip
        # 2 owners, noise multiplier 2: the noise on an average outweighs it, and the submitter is told
        warning = re.search(
            r"privacy\.dp: warning: .* times the clip 0\.5 .*with 2 owners the model may", submitted
        )
        assert warning, submitted
        ids = [lab.submit(within).id, re.search(r"submitted job (j-\w+)", submitted).group(1)]
        jobs = [
            wait_for(lambda i=i: (j := lab.job(i)).state in TERMINAL and j, 240, "a job to end") for i in ids
        ]
        for job in jobs:
            assert job.state == "completed", [e.message for e in lab.logs(job.id)][-10:]
            assert job.rounds_log[-1].contributions == 2 and job.train_loss is not None

        done, stopped = jobs
        spent = [r.epsilon for r in done.rounds_log]
        assert spent[0] == 0 and spent == sorted(spent) and len(set(spent)) == 4  # grows every round
        assert done.round == 3 and 0 < spent[-1] <= 20
        assert done.privacy.epsilon == spent[-1] and done.privacy.rounds == 3
        shown = _show(net, token, done.id)
        assert re.search(rf"privacy\.dp: ε {spent[-1]:.3f} spent of target 20 \(δ 1e-05\)", shown), shown
        for r in done.rounds_log:  # the rounds table's ε column
            assert re.search(rf"│ {r.round} .*│ {r.epsilon:.3f} *│", shown), shown

        assert stopped.round == 2 and stopped.spec.training.rounds == 5  # stopped short of what it asked
        assert stopped.privacy.epsilon == pytest.approx(accountant.epsilon(2))
        assert stopped.privacy.epsilon <= capped_target
        assert [r.epsilon for r in stopped.rounds_log] == pytest.approx(
            [accountant.epsilon(r) for r in range(3)]
        )
        log = [e.message for e in lab.logs(stopped.id)]
        assert any(
            "the target allows 2 of the 5 rounds asked: the job stops after round 2" in x for x in log
        ), log
        assert any(x.startswith("privacy.dp: stopped after round 2 of 5") for x in log), log
        assert stopped.rounds_log[-1].checkpoint is not None  # its last round carries the full state
        shown = _show(net, token, stopped.id)
        assert f"of target {capped_target:g}" in shown and "; 2 rounds" in shown, shown
