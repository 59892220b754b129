"""Ids taken whole or by any unique prefix, through the real API: a consumer's jobs (among its own only),
the node an operator slashes, a governance proposal. An ambiguous prefix is a 409 naming the matches.
(``tests/cli/test_jobs_cli.py`` runs the same through the CLI.)"""

from datetime import UTC, datetime

import pytest

from gpuflex.client import Client
from gpuflex.errors import Conflict, NotFound
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec


def _unique_prefix(own: str, others: list[str]) -> str:
    return next(own[:n] for n in range(3, len(own)) if not any(o.startswith(own[:n]) for o in others))


def test_a_job_is_found_by_a_unique_prefix_among_its_owners_jobs_only(coordinator):
    alice, bob = coordinator.consumer("alice", deposit=10), coordinator.consumer("bob", deposit=10)
    spec = JobSpec(name="t", budget=1)
    mine = [alice.submit(spec, alice.upload(b"text " * 100)).id for _ in range(2)]
    theirs = bob.submit(spec, bob.upload(b"text " * 100)).id
    first = _unique_prefix(mine[0], [mine[1]])
    assert alice.job(first).id == mine[0] and alice.cancel(first).id == mine[0]
    with pytest.raises(Conflict, match=f"job id j- is ambiguous: {', '.join(sorted(mine))} begin with it"):
        alice.logs("j-")
    assert bob.job("j-").id == theirs  # alice's jobs are not bob's to match
    with pytest.raises(NotFound, match=f"no job {theirs}"):
        alice.job(theirs)
    with pytest.raises(NotFound):
        alice.job("j-%")  # a LIKE wildcard is a character like any other


def test_the_operator_slashes_a_node_and_nodes_vote_on_a_proposal_by_prefix(coordinator):
    nodes = [coordinator.node(f"n{i}") for i in range(2)]
    ids = [n.key.node_id for n in nodes]
    operator = Client(coordinator.url, coordinator.ctx.settings.resolved_operator_token())
    verdict = m.SlashRequest(node_id=_unique_prefix(ids[0], ids[1:]), amount=1, evidence="faked work")
    assert operator.slash(verdict).node_id == ids[0]
    with pytest.raises(Conflict, match="node id n- is ambiguous"):
        operator.slash(verdict.model_copy(update={"node_id": "n-"}))
    nodes[1].stake(20)
    at = datetime.fromtimestamp(coordinator.clock() + 60, UTC)
    proposal = nodes[1].propose(
        m.ProposalCreate(parameter="platform_fee_bps", value=2000, effective_at=at, reason="test")
    )
    prefix = proposal.id[:6]
    assert coordinator.consumer("carol").proposal(prefix).id == proposal.id
    assert nodes[1].vote(prefix, "yes").proposal_id == proposal.id
