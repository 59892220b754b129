"""A (testing-only) cheating agent hands a training adversary to its worker tasks and a serving one
(``serve-…``) to its server tasks, and to nothing else."""

from gpuflex.agent.daemon import Agent, AgentConfig
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.protocol.spec import TrainingSpec


def _grant(role: str) -> m.LeaseGrant:
    if role == "server":
        model = DeployedModel(job="j-0")
        config = m.ServerConfig(job_id="d-1", task_id="t-1", replica=0, model=model, context=64, max_batch=1)
    else:
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
    assert agent._task_config(_grant("server")).adversary is None  # a training kind: served honestly


def test_a_cheating_agents_replicas_serve_its_cheaper_model_and_its_workers_train_honestly(tmp_path):
    agent = _agent(tmp_path, "serve-int8")
    assert agent._task_config(_grant("server")).adversary == "serve-int8"
    assert agent._task_config(_grant("worker")).adversary is None


def test_an_honest_agent_runs_its_tasks_as_leased(tmp_path):
    grant = _grant("worker")
    assert _agent(tmp_path, None)._task_config(grant) is grant.task
