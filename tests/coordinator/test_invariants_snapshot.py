"""The invariant checker reads the database as of one moment: a write that commits between two of its
reads must not look like a broken invariant (a chaos test with two replicas failed so on PostgreSQL)."""

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from gpuflex.client import Client
from gpuflex.coordinator.db import Job, Round
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import check_invariants


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_round_published_between_the_checker_s_reads_is_not_a_broken_invariant(coordinator):
    alice = Client(coordinator.url, Client(coordinator.url).create_account("alice").token)
    alice.deposit(5)
    job_id = alice.submit(JobSpec(name="j", budget=1), alice.upload(b"x" * 1000)).id
    ours = coordinator.ctx.engine.pool
    published = []

    def publish_before_rounds_are_read(conn, cursor, statement, *_):
        """Round 0 of the job, committed as ``rounds.publish`` does, once the checker has read the job."""
        if conn.engine.pool is ours or published or "FROM rounds" not in statement:
            return
        published.append(0)
        with coordinator.ctx.tx() as s:
            s.add(Round(job_id=job_id, round=0, state_hash="0" * 64, published_at=0.0))
            s.get(Job, job_id).round = 0

    event.listen(Engine, "before_cursor_execute", publish_before_rounds_are_read)
    try:
        problems = check_invariants(coordinator.ctx.settings.database_url)
    finally:
        event.remove(Engine, "before_cursor_execute", publish_before_rounds_are_read)
    assert published == [0]
    assert problems == []
    assert check_invariants(coordinator.ctx.settings.database_url) == []  # and a later read sees it whole
