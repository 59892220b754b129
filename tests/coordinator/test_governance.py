"""Stake-weighted governance through the real API: propose, vote, the reaper's tally, values in force.

The fixture's voting period is 10 s and its clock moves; node signatures are checked against that
clock, so each test moves it by well under a minute.
"""

from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from gpuflex.auth.signing import NodeKey
from gpuflex.cli.main import app
from gpuflex.client import Client, NodeClient
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Lease
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound, SpecError, Unauthorized
from gpuflex.ledger import accounts
from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import verify_chain
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

VOTING_S = 10  # the fixture's governance_voting_period_s


def _stake(node, credits: float) -> None:
    node.stake(credits)


def _register(client, name: str) -> m.NodeRegistered:
    return client.register(
        m.NodeRegister(
            name=name,
            public_key=client.key.public_key_hex,
            price_per_hour=0.1,
            hardware=m.HardwareProfile(cpu_model="test cpu", cpu_cores=2, ram_gb=4),
            benchmark=m.BenchmarkResult(tflops_fp32=1, mem_bandwidth_gbps=10),
        )
    )


def _proposal(coordinator, parameter="platform_fee_bps", value=2000, effective_in_s=VOTING_S + 10):
    at = datetime.fromtimestamp(coordinator.clock() + effective_in_s, UTC)
    return m.ProposalCreate(parameter=parameter, value=value, effective_at=at, reason="test")


def _staked_nodes(coordinator, **stakes):
    """Nodes with stake: "core" is a core node; "idle" asks more than any job here pays."""
    nodes = {}
    for name, credits in stakes.items():
        nodes[name] = coordinator.node(name, core=name == "core", price=100 if name == "idle" else 36)
        _stake(nodes[name], credits)
    return nodes


def _spec() -> JobSpec:
    return JobSpec.model_validate(
        {"name": "t", "resources": {"workers": 1}, "budget": 5, "max_price_per_hour": 40, "training": {}}
    )


def _run_job(coordinator, consumer, nodes):
    """A job holding a lease on each of ``nodes`` (an aggregator on the core node, one worker)."""
    job = consumer.submit(_spec(), consumer.upload(b"corpus " * 100))
    grants = [node.lease() for node in nodes]
    assert all(grants), "every node should hold one of the job's two tasks"
    return job, grants


def _fee_and_costs(coordinator, journal, job_id):
    (settlement,) = (e for e in journal if e.kind == "settlement" and e.memo.startswith(f"job {job_id} "))
    fee = dict(settlement.postings)[accounts.PLATFORM_FEES]
    with coordinator.ctx.tx() as s:
        costs = list(s.scalars(select(Lease.cost_micro).where(Lease.job_id == job_id)))
    return fee, costs


def _fee(parameters) -> m.ParameterInfo:
    return next(p for p in parameters if p.name == "platform_fee_bps")


def test_a_passed_fee_change_applies_to_settlements_from_its_effective_time(coordinator):
    alice = coordinator.consumer("alice", deposit=20)
    nodes = _staked_nodes(coordinator, core=50, worker=30, idle=20)
    proposal = nodes["core"].propose(_proposal(coordinator, value=2000, effective_in_s=VOTING_S + 10))
    assert (proposal.state, proposal.value, proposal.proposer) == ("open", 2000, nodes["core"].key.node_id)
    votes = {
        name: nodes[name].vote(proposal.id, choice)
        for name, choice in (("core", "yes"), ("worker", "no"), ("idle", "abstain"))
    }
    assert votes["worker"].weight == 30 and votes["idle"].choice == "abstain"
    running = alice.proposal(proposal.id)
    assert [v.node_id for v in running.votes] == [nodes[n].key.node_id for n in ("core", "worker", "idle")]
    assert (running.tally.yes, running.tally.no, running.tally.abstain, running.tally.total_stake) == (
        50,
        30,
        20,
        100,
    )
    assert running.tally.passed and running.state == "open"

    before, before_grants = _run_job(coordinator, alice, [nodes["core"], nodes["worker"]])
    coordinator.clock.advance(VOTING_S + 1)  # voting closed; not yet in force
    for node, grant in zip((nodes["core"], nodes["worker"]), before_grants, strict=True):
        node.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    nodes["idle"].heartbeat([])
    reap_once(coordinator.ctx)
    decided = alice.proposal(proposal.id)
    assert decided.state == "passed" and decided.tallied_at is not None
    fee = _fee(alice.parameters())
    assert (fee.value, fee.source) == (1000, "setting")
    assert [(c.proposal_id, c.value) for c in fee.scheduled] == [(proposal.id, 2000)]
    alice.cancel(before.id)  # settled before the change takes effect: the old fee

    after, _ = _run_job(coordinator, alice, [nodes["core"], nodes["worker"]])
    coordinator.clock.advance(10)  # past effective_at
    fee = _fee(alice.parameters())
    assert (fee.value, fee.source, fee.scheduled) == (2000, proposal.id, [])
    alice.cancel(after.id)

    journal = from_export(alice.ledger())
    assert verify_chain(journal).ok
    for job, bps in ((before, 1000), (after, 2000)):
        fee, costs = _fee_and_costs(coordinator, journal, job.id)
        assert all(costs) and fee == sum(cost * bps // 10_000 for cost in costs)
    steps = [e for e in journal if e.kind == "governance"]
    assert [e.postings for e in steps] == [()] * 5  # a proposal, three votes, a tally; no money moved
    assert all(proposal.id in e.memo and "platform_fee_bps = 2000 bps" in e.memo for e in steps)
    assert f"node {nodes['core'].key.node_id} proposes" in steps[0].memo
    assert f"node {nodes['worker'].key.node_id} votes no with a weight of 30 credits" in steps[2].memo
    assert "passed: yes 50, no 30, abstain 20 of 100 credits of stake (quorum 40% met)" in steps[4].memo


def test_governed_heartbeat_rules_reach_agents_and_judge_liveness(coordinator):
    coordinator.clock.freeze()  # effective 1 s after voting closes: a loaded machine's seconds must not pass
    alice = coordinator.consumer("alice")
    nodes = _staked_nodes(coordinator, a=10)
    other = coordinator.node("other")
    proposal = nodes["a"].propose(_proposal(coordinator, "heartbeat_interval_s", 10, VOTING_S + 1))
    nodes["a"].vote(proposal.id, "yes")
    assert nodes["a"].heartbeat([]).heartbeat_interval_s == 2  # the setting, until the change
    coordinator.clock.advance(VOTING_S + 2)  # past its effective time (on a frozen clock, not just at it)
    for node in (nodes["a"], other):
        node.heartbeat([])
    reap_once(coordinator.ctx)
    assert alice.proposal(proposal.id).state == "passed"
    assert other.heartbeat([]).heartbeat_interval_s == 10
    assert _register(other, "other").heartbeat_interval_s == 10
    coordinator.clock.advance(8)  # lost after 6 s under the old rules; 30 s (10 s x 3) now
    reap_once(coordinator.ctx)
    assert {o.name: o.state for o in alice.offers()} == {"a": "online", "other": "online"}


def test_no_quorum_and_a_no_majority_are_rejected_and_change_nothing(coordinator):
    alice = coordinator.consumer("alice")
    nodes = _staked_nodes(coordinator, small=10, big=90)
    unheard = nodes["small"].propose(_proposal(coordinator, value=3000))
    nodes["small"].vote(unheard.id, "yes")  # 10 of 100 voted: under the 40% quorum
    refused = nodes["small"].propose(_proposal(coordinator, value=4000))
    nodes["small"].vote(refused.id, "yes")
    nodes["big"].vote(refused.id, "no")
    tie = nodes["big"].propose(_proposal(coordinator, value=5000))
    nodes["big"].vote(tie.id, "abstain")
    nodes["small"].vote(tie.id, "abstain")  # quorum met, yes does not beat no (0 to 0)
    coordinator.clock.advance(VOTING_S + 11)  # past close and past their effective times
    reap_once(coordinator.ctx)
    assert {p.id: p.state for p in alice.proposals()} == {
        unheard.id: "rejected",
        refused.id: "rejected",
        tie.id: "rejected",
    }
    assert not alice.proposal(unheard.id).tally.quorum_met
    assert alice.proposal(refused.id).tally.quorum_met
    fee = _fee(alice.parameters())
    assert (fee.value, fee.source, fee.scheduled) == (1000, "setting", [])
    journal = from_export(alice.ledger())
    assert verify_chain(journal).ok
    outcomes = [e.memo for e in journal if e.kind == "governance" and " rejected: " in e.memo]
    assert [o.split()[1] for o in outcomes] == [unheard.id, refused.id, tie.id]  # in order of closing
    assert "yes 10, no 0, abstain 0 of 100 credits of stake (quorum 40% not met); no change" in outcomes[0]
    assert "yes 10, no 90, abstain 0 of 100 credits of stake (quorum 40% met); no change" in outcomes[1]
    reap_once(coordinator.ctx)  # tallied once: a second pass writes nothing
    assert len(alice.ledger().entries) == len(journal)


def test_bad_governance_input_is_a_clear_4xx_and_writes_nothing(coordinator):
    alice = coordinator.consumer("alice")
    nodes = _staked_nodes(coordinator, rich=50, poor=5)
    broke = coordinator.node("broke")
    entries = len(alice.ledger().entries)
    cases = [
        (BadRequest, "unknown parameter 'lease_ttl_s'", _proposal(coordinator, "lease_ttl_s", 5)),
        (BadRequest, "within 0..10000 bps", _proposal(coordinator, value=10_001)),
        (
            BadRequest,
            "heartbeat_misses takes a whole number",
            _proposal(coordinator, "heartbeat_misses", 2.5),
        ),
        (BadRequest, "too early", _proposal(coordinator, effective_in_s=VOTING_S - 1)),
    ]
    for error, message, proposal in cases:
        with pytest.raises(error, match=message):
            nodes["rich"].propose(proposal)
    with pytest.raises(Forbidden, match=r"proposing needs 10 credits of stake; node .* has 5"):
        nodes["poor"].propose(_proposal(coordinator))
    with pytest.raises(Forbidden, match="has no stake"):
        broke.propose(_proposal(coordinator))
    raw = {"parameter": "audit_rate", "value": 0.5, "reason": "x", "effective_at": "2099-01-01T00:00:00"}
    with pytest.raises(SpecError, match=r"effective_at: .*timezone"):
        nodes["rich"].http.request("POST", "/v1/governance/proposals", json=raw)
    with pytest.raises(SpecError, match="value"):
        nodes["rich"].http.request("POST", "/v1/governance/proposals", json={**raw, "value": True})
    assert len(alice.ledger().entries) == entries  # nothing written by any of them

    proposal = nodes["rich"].propose(_proposal(coordinator, "audit_rate", 0.25))
    assert proposal.value == 0.25
    with pytest.raises(NotFound, match="no proposal gp-nope"):
        nodes["rich"].vote("gp-nope", "yes")
    with pytest.raises(NotFound, match="no proposal gp-nope"):
        alice.proposal("gp-nope")
    with pytest.raises(SpecError, match="choice"):
        nodes["rich"].http.request(
            "POST", f"/v1/governance/proposals/{proposal.id}/votes", json={"choice": "y"}
        )
    with pytest.raises(Forbidden, match="no stake"):
        broke.vote(proposal.id, "yes")
    nodes["rich"].vote(proposal.id, "yes")
    with pytest.raises(Conflict, match=r"already voted .* votes are final"):
        nodes["rich"].vote(proposal.id, "no")
    assert alice.proposal(proposal.id).tally.yes == 50  # the first vote stands
    coordinator.clock.advance(VOTING_S)
    with pytest.raises(Conflict, match="closed"):
        nodes["poor"].vote(proposal.id, "no")  # closed even before the reaper has tallied it
    reap_once(coordinator.ctx)
    with pytest.raises(Conflict, match="closed"):
        nodes["poor"].vote(proposal.id, "no")


def test_anyone_reads_but_only_signed_nodes_propose_and_vote(coordinator):
    alice = coordinator.consumer("alice")
    nodes = _staked_nodes(coordinator, n=50)
    proposal = nodes["n"].propose(_proposal(coordinator))
    as_alice = alice.http
    with pytest.raises(Unauthorized, match="unknown node"):
        as_alice.request("POST", f"/v1/governance/proposals/{proposal.id}/votes", json={"choice": "yes"})
    with pytest.raises(Unauthorized, match="unknown node"):
        as_alice.request(
            "POST", "/v1/governance/proposals", json=_proposal(coordinator).model_dump(mode="json")
        )
    for path in (
        "/v1/governance/parameters",
        "/v1/governance/proposals",
        f"/v1/governance/proposals/{proposal.id}",
    ):
        assert coordinator.http.get(path).status_code == 200  # anyone reads, with no credentials
        assert nodes["n"].http.request("GET", path).status_code == 200
        assert as_alice.request("GET", path).status_code == 200
    assert [p.name for p in alice.parameters()] == [
        "platform_fee_bps",
        "heartbeat_interval_s",
        "heartbeat_misses",
        "min_stake",
        "audit_rate",
    ]
    assert alice.proposal(proposal.id).votes == []


def test_the_cli_proposes_and_votes_as_a_provider_and_reads_as_a_consumer(coordinator, tmp_path):
    token = Client(coordinator.url).create_account("alice").token
    alice = Client(coordinator.url, token)
    data_dir = tmp_path / "agent"
    node = NodeClient(coordinator.url, NodeKey.load_or_create(data_dir / "node.key"))
    _register(node, "cli-node")
    _stake(node, 50)
    as_node = ["--data-dir", str(data_dir), "--url", coordinator.url]
    as_alice = ["--url", coordinator.url, "--token", token]
    runner = CliRunner()

    hours = (VOTING_S + 60) / 3600
    args = [
        "governance",
        "propose",
        "audit_rate",
        "0.1",
        "--effective-in",
        str(hours),
        "--reason",
        "audit more",
    ]
    result = runner.invoke(app, [*args, *as_node])
    assert result.exit_code == 0, result.output
    (proposal,) = alice.proposals()
    assert (proposal.parameter, proposal.value, proposal.reason) == ("audit_rate", 0.1, "audit more")
    assert proposal.id in result.output

    result = runner.invoke(app, ["governance", "vote", proposal.id, "yes", *as_node])
    assert result.exit_code == 0, result.output
    assert "voted yes" in result.output and "50 credits" in result.output
    assert alice.proposal(proposal.id).tally.yes == 50
    result = runner.invoke(app, ["governance", "vote", proposal.id, "maybe", *as_node])
    assert result.exit_code != 0 and "maybe" in result.output

    listed = runner.invoke(app, ["governance", "proposals", *as_alice], env={"COLUMNS": "300"})
    assert listed.exit_code == 0 and proposal.id in listed.output and "audit_rate" in listed.output
    shown = runner.invoke(app, ["governance", "parameters", *as_alice], env={"COLUMNS": "300"})
    assert shown.exit_code == 0 and "platform_fee_bps" in shown.output and "1000 bps" in shown.output

    missing = runner.invoke(app, ["governance", "vote", proposal.id, "no", "--data-dir", str(tmp_path / "x")])
    assert missing.exit_code != 0 and "no node key at" in str(missing.exception)


def test_a_node_cannot_unstake_while_its_vote_is_still_open(coordinator):
    voter = _staked_nodes(coordinator, voter=20)["voter"]
    proposal = voter.propose(_proposal(coordinator))
    voter.vote(proposal.id, "yes")
    with pytest.raises(Conflict, match="vote still open"):
        voter.unstake(5)  # moved to another node, the same stake could vote twice
    coordinator.clock.advance(VOTING_S + 1)
    reap_once(coordinator.ctx)
    assert voter.unstake(5).stake == 15
