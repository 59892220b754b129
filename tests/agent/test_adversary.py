"""A (testing-only) cheating agent hands its adversary to its worker tasks, and to nothing else."""

from gpuflex.agent.daemon import Agent, AgentConfig
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import TrainingSpec


def _grant(role: str) -> m.LeaseGrant:
    config = m.TaskConfig(
        job_id="j-1", task_id="t-1", role=role, worker_index=0, num_workers=1, training=TrainingSpec()
    )
    return m.LeaseGrant(
        lease_id="l-1",
        task_id="t-1",
        job_id="j-1",
        role=role,
        epoch=1,
        expires_at=0,
        task_token="x",
        task=config,
    )


def _agent(tmp_path, adversary: str | None) -> Agent:
    return Agent(
        AgentConfig(
            coordinator_url="http://127.0.0.1:9",
            name="a",
            data_dir=tmp_path,
            price_per_hour=0.1,
            adversary=adversary,
        )
    )


def test_a_cheating_agents_workers_play_its_adversary(tmp_path):
    agent = _agent(tmp_path, "scaled")
    assert agent._task_config(_grant("worker")).adversary == "scaled"
    assert agent._task_config(_grant("aggregator")).adversary is None


def test_an_honest_agent_runs_its_tasks_as_leased(tmp_path):
    grant = _grant("worker")
    assert _agent(tmp_path, None)._task_config(grant) is grant.task
