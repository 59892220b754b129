"""Federated jobs through the real API: owners announce private datasets; a job gets one worker per online
owner that admits its account, each tied to its owner's node; the log says why each node was or was not
used; bad input is one line before money moves; a lost owner's worker waits for it; secure aggregation's
messages are relayed by the relay's rules."""

import json

import pytest
from sqlalchemy import func, select

from gpuflex.auth.signing import node_id_for
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import SecAggMessage
from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec


def _dataset(name: str, tokens: int, seed: str) -> m.PrivateDataset:
    return m.PrivateDataset(name=name, tokens=tokens, shards=2, manifest=seed * 64)


def _spec(**extra) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "fed", "data": {"federated": "notes"}, "budget": 1.0, "max_price_per_hour": 0.5, **extra}
    )


def _owners(coordinator):
    """A core node, three owners (b does not admit lab) and a node that offers another name."""
    nodes = {
        "core": coordinator.node("core", core=True, price=0.3),
        "a": coordinator.node("a", private_data=[_dataset("notes", 1000, "a")], consumers=["lab"]),
        "b": coordinator.node("b", private_data=[_dataset("notes", 5000, "b")], consumers=["bank"]),
        "c": coordinator.node("c", private_data=[_dataset("notes", 3000, "c")], consumers=["lab", "bank"]),
        "d": coordinator.node("d", private_data=[_dataset("scans", 10, "d")], consumers=["lab"]),
        "spare": coordinator.node("spare", price=0.01),  # cheap and free, but holds no data
    }
    return nodes, {node_id_for(n.key.public_key_hex): name for name, n in nodes.items()}


def test_a_federated_job_runs_one_worker_on_each_admitting_owner_and_only_there(coordinator):
    nodes, names = _owners(coordinator)
    lab = coordinator.consumer("lab", deposit=5)
    job = lab.submit(_spec(resources={"workers": 9, "min_workers": 1}))
    detail = lab.job(job.id)
    assert detail.spec.resources.workers == 2  # one per admitting owner; resources.workers is ignored
    owners = sorted((names[o.node_id], o.dataset, o.tokens) for o in detail.owners)
    assert owners == [("a", "notes", 1000), ("c", "notes", 3000)]
    log = [e.message for e in lab.logs(job.id)]
    assert any(
        f"({node_id_for(nodes['b'].key.public_key_hex)}): not used: does not admit consumer lab" in x
        for x in log
    ), log
    assert any("not used: offers no dataset notes" in x and "d (" in x for x in log), log
    assert not any("spare" in x for x in log)  # a node with no private data is not a line of its own

    assert nodes["spare"].lease() is None  # the cheapest free node never gets a federated worker
    aggregator = nodes["core"].lease()
    assert aggregator.role == "aggregator"
    owner_of = {o.task_id: (names[o.node_id], o.tokens) for o in detail.owners}
    assert aggregator.task.weights == {task: tokens for task, (_, tokens) in owner_of.items()}
    grants = {name: nodes[name].lease() for name in ("a", "c")}
    for name, grant in grants.items():
        assert owner_of[grant.task_id][0] == name
        assert grant.task.federated == "notes" and grant.task.dataset == name * 64  # its owner's manifest
    for task in (t for t in lab.job(job.id).tasks if t.role == "worker"):
        assert task.placement == (
            f"owner {owner_of[task.id][0]} of notes ({owner_of[task.id][1]:,} tokens): "
            "the only node that holds this worker's data"
        )

    # a's worker is handed back, and a leaves: its task waits for a; it never moves to a free node
    gone = grants["a"]
    nodes["a"].report(gone.lease_id, m.LeaseReport(epoch=gone.epoch, outcome="released"))
    nodes["a"].leave()
    reap_once(coordinator.ctx)
    assert nodes["spare"].lease() is None
    task = next(t for t in lab.job(job.id).tasks if t.id == gone.task_id)
    assert task.node_id is None and task.placement.startswith("waits for its owner"), task.placement
    assert "not online" in task.placement
    coordinator.node("a", consumers=["lab"], key=nodes["a"].key)  # back, but without its data
    assert nodes["a"].lease() is None
    task = next(t for t in lab.job(job.id).tasks if t.id == gone.task_id)
    assert task.placement == (
        "waits for its owner a (it no longer offers notes as it did): its data is there and nowhere else"
    )
    coordinator.node("a", private_data=[_dataset("notes", 1000, "a")], consumers=["lab"], key=nodes["a"].key)
    back = nodes["a"].lease()
    assert back is not None and back.task_id == gone.task_id


@pytest.mark.parametrize(
    ("consumer", "spec", "says"),
    [
        ("lab", _spec(data={"federated": "gene"}), "no online node offers a private dataset named 'gene'"),
        ("stranger", _spec(), "no online owner of 'notes' admits account 'stranger'"),
        (
            "lab",
            _spec(resources={"workers": 3, "min_workers": 3}),
            "min_workers is 3, and only 2 online owner",
        ),
        (
            "lab",
            _spec(privacy={"dp": {"clip": 1, "noise_multiplier": 0.3, "target_epsilon": 1, "delta": 1e-5}}),
            "privacy.dp: one round at noise multiplier 0.3 already spends",
        ),
        (
            "lab",
            _spec(
                training={"rounds": 10_000},
                privacy={"dp": {"clip": 1, "target_epsilon": 0.01, "delta": 1e-5}},
            ),
            "over 10000 rounds needs a noise multiplier above 100",
        ),
        (
            "lab",
            _spec(privacy={"secure_aggregation": True}),
            "privacy.secure_aggregation with 2 owner.s. of the data: secure aggregation needs at least 3 "
            "workers, not 2",
        ),
    ],
)
def test_bad_federated_input_is_one_line_and_no_money_moves(coordinator, consumer, spec, says):
    _owners(coordinator)
    client = coordinator.consumer(consumer, deposit=5)
    with pytest.raises(BadRequest, match=says):
        client.submit(spec)
    assert client.balance().balance == 5
    assert client.jobs() == []


def test_a_federated_job_starts_only_once_min_workers_owners_can_run_together(coordinator):
    nodes, names = _owners(coordinator)
    lab = coordinator.consumer("lab", deposit=5)
    job = lab.submit(_spec())  # min_workers: all of its 2 owners
    nodes["c"].leave()
    reap_once(coordinator.ctx)
    assert nodes["a"].lease() is None and nodes["core"].lease() is None  # nothing runs on half the owners
    detail = lab.job(job.id)
    assert detail.state == "pending"
    why = {
        names[o.node_id]: next(t.placement for t in detail.tasks if t.id == o.task_id) for o in detail.owners
    }
    assert why == {
        "a": "waits: the job starts once its aggregator and min_workers owners can run together",
        "c": "waits for its owner c (not online): its data is there and nowhere else",
    }
    coordinator.node("c", private_data=[_dataset("notes", 3000, "c")], consumers=["lab"], key=nodes["c"].key)
    assert {nodes[n].lease().role for n in ("core", "a", "c")} == {"aggregator", "worker"}
    assert lab.job(job.id).state == "running"


def test_an_owner_outside_the_jobs_region_is_not_used_and_the_log_says_so(coordinator):
    coordinator.node("core", core=True, price=0.3, region="eu")
    eu = coordinator.node("eu", region="eu", private_data=[_dataset("notes", 100, "e")], consumers=["lab"])
    us = coordinator.node("us", region="us", private_data=[_dataset("notes", 900, "f")], consumers=["lab"])
    lab = coordinator.consumer("lab", deposit=5)
    job = lab.submit(_spec(resources={"region": "eu"}))
    assert [o.node_id for o in lab.job(job.id).owners] == [node_id_for(eu.key.public_key_hex)]
    log = [e.message for e in lab.logs(job.id)]
    us_id = node_id_for(us.key.public_key_hex)
    assert f"owner us ({us_id}): not used: in region us; resources.region keeps the job's data in eu" in log
    with pytest.raises(BadRequest, match="no online owner of 'notes' that admits 'lab' is in region 'ap'"):
        lab.submit(_spec(resources={"region": "ap"}))
    assert lab.balance().balance == pytest.approx(4.0)  # only the first job's budget moved


def test_secure_aggregation_hands_its_tasks_the_threshold_and_weights_and_relays_their_messages(coordinator):
    nodes, _ = _owners(coordinator)
    nodes["e"] = coordinator.node("e", private_data=[_dataset("notes", 2000, "e")], consumers=["lab"])
    lab = coordinator.consumer("lab", deposit=5)
    too_high = _spec(privacy={"secure_aggregation": True, "secagg_threshold": 4})
    with pytest.raises(BadRequest, match=r"with 3 owner\(s\) of the data: .* must lie in 2\.\.3, not 4"):
        lab.submit(too_high)
    assert lab.balance().balance == 5 and lab.jobs() == []
    job = lab.submit(_spec(privacy={"secure_aggregation": True}))
    grants = {n: nodes[n].lease() for n in ("core", "a", "c", "e")}
    weights = {o.task_id: o.tokens for o in lab.job(job.id).owners}
    assert len(weights) == 3
    for grant in grants.values():  # a majority of 3; every task knows every owner's weight
        assert grant.task.secure_aggregation == 2 and grant.task.weights == weights
    agg, a, c, e = (coordinator.task(grants[n]) for n in ("core", "a", "c", "e"))
    agg.publish_round(m.RoundPublish(round=0, state_hash="0" * 64, checkpoint=agg.put_blob(b"round 0")))
    roster = json.dumps({"tasks": sorted(weights)})
    agg.post_secagg(m.SecAggPost(round=0, attempt=0, kind="roster", body=roster))
    a.post_secagg(m.SecAggPost(round=0, attempt=0, kind="keys", body='{"key": "k"}'))
    a.post_secagg(m.SecAggPost(round=0, attempt=0, kind="reveal", to="aggregator", body="{}"))
    with pytest.raises(Conflict, match="already posted its keys of attempt 0"):
        a.post_secagg(m.SecAggPost(round=0, attempt=0, kind="keys", body='{"key": "other"}'))
    with pytest.raises(Forbidden, match="a roster message is the aggregator's to post"):
        c.post_secagg(m.SecAggPost(round=0, attempt=1, kind="roster", body=roster))
    with pytest.raises(Conflict, match="round 1 is not open"):
        c.post_secagg(m.SecAggPost(round=1, attempt=0, kind="keys", body="{}"))
    seen = e.secagg_messages(0).messages  # not a's reveal: that is the aggregator's alone
    assert [(x.kind, x.sender) for x in seen] == [
        ("roster", grants["core"].task_id),
        ("keys", grants["a"].task_id),
    ]
    assert [x.kind for x in e.secagg_messages(0, after=seen[0].seq).messages] == ["keys"]
    assert [x.kind for x in agg.secagg_messages(0).messages] == ["roster", "keys", "reveal"]

    one = agg.put_blob(b"round 1")  # the round those messages aggregated is published: nothing keeps them
    agg.publish_round(m.RoundPublish(round=1, state_hash="1" * 64, update=one, checkpoint=one))
    assert agg.secagg_messages(0).messages == []
    with coordinator.ctx.tx() as s:
        assert s.scalar(select(func.count()).select_from(SecAggMessage)) == 0
    agg.post_secagg(m.SecAggPost(round=1, attempt=0, kind="roster", body=roster))  # the next round's
    lab.cancel(job.id)  # nor once the job ends
    with coordinator.ctx.tx() as s:
        assert s.scalar(select(func.count()).select_from(SecAggMessage)) == 0
