"""The event engine: nodes come and go, jobs arrive, the market places them, leases end, rounds finish.

One heap of timed events, processed in time order; every decision is the network's own function:

- placement: ``market.placement.place_job`` (what ``services.market.place_pending`` calls), on the
  candidate index's best few nodes (``sim.index``); a job that has not started is placed as a gang
  of its aggregator and ``min_workers`` workers, or waits (``placement.start_size``);
- reliability: ``market.reputation.score`` of each node's record (beats, presence, lease ends), taken
  whenever the node becomes free;
- liveness: a node that dies silently is noticed at ``market.liveness.noticed_at`` (the reaper pass
  that finds it lost or its lease expired), with no heartbeat simulated one by one; its lease is
  metered to its last beat, as ``services.leases.expire_for_node`` does. Nodes beat at
  ``market.liveness.fleet_interval_s`` of the fleet online at the time (a large fleet beats slower,
  so its crashes are noticed later), a node's beats counted at the interval in force when it leaves;
- metering: ``ledger.metering.lease_cost_micro`` at ``market.pricing.lease_price``;
- a round's length: ``market.pricing.round_seconds`` on the slowest member's ``step_seconds``, over the
  slowest link (a worker's own, or the aggregator's shared by all workers).

Each grant, published round and completed job books its blobs in the data-plane account
(``sim.dataplane``), which decides nothing.

What it simplifies, on purpose: a placed task is leased at once (an agent polls within a heartbeat);
a worker that joins mid-round contributes from the next round; a job's budget is checked when a
stretch of rounds ends (a stretch never runs past the point where the budget might run out); a
node's reliability is re-read when it becomes free, not continuously; a job's aggregator and
workers exchange over the slower of their links, not over a simulated network.

Events: ``UP`` (a session starts), ``DOWN`` (it ends: a clean leave, or a silent crash), ``NOTICED``
(the reaper ends a crashed node's lease), ``ARRIVE`` (a job), ``ROUND`` (a stretch of rounds ends:
one event for all the rounds whose members do not change; a member who comes, goes or dies cuts
it short, ``_interrupt``), ``PLACE`` (a placement pass on the reaper's beat), ``SAMPLE`` (the
report's time series), ``FAULT`` (an injected crash of a lease holder, for validation against a
real network).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpuflex.ledger.metering import lease_cost_micro
from gpuflex.market import reputation
from gpuflex.market.liveness import Liveness, fleet_interval_s, last_beat_before, next_pass_after, noticed_at
from gpuflex.market.matching import Requirements
from gpuflex.market.placement import place_job, start_size
from gpuflex.market.pricing import (
    ROUND_OVERHEAD_S,
    lease_price,
    round_seconds,
    step_seconds,
    trained_count,
)
from gpuflex.protocol.money import to_micro
from gpuflex.protocol.spec import JobSpec
from gpuflex.sim.dataplane import DataPlane
from gpuflex.sim.index import CandidateIndex
from gpuflex.sim.population import Churn, Population
from gpuflex.sim.scenario import Scenario

UP, DOWN, NOTICED, ARRIVE, ROUND, PLACE, SAMPLE, FAULT = range(8)
WINDOW_S = 60.0  # the event heap holds one window of time; later events wait in one list per window
AGGREGATOR, WORKERS = 1, 2  # what a waiting job lacks (bits of ``Job.queued``)
NO_JOB = -1
GONE = -1.0  # ``online_since`` of a node that said goodbye (presence is counted again when it is back)


@dataclass(frozen=True)
class Fault:
    """Once job ``job``'s round ``after_round`` is published, the lowest-numbered live node holding
    one of its ``role`` leases crashes and stays away (as ``LocalNetwork.kill_agent`` strikes)."""

    job: int
    after_round: int
    role: str  # worker | aggregator


@dataclass
class Job:
    id: int
    template: int
    cls: int
    spec: JobSpec
    arrived_at: float
    epochs: list[int]  # per task; task 0 is the aggregator
    pending: list[int]  # worker tasks waiting for a node
    aggregator: int = NO_JOB  # node
    workers: dict[int, int] = field(default_factory=dict)  # node -> task
    granted_at: dict[int, float] = field(default_factory=dict)  # node -> when, of each live lease
    last_worker_grant: float = -math.inf  # the latest grant of a worker lease, live or not
    workers_down: int = 0  # workers that died and are not yet noticed
    # what the round time reads of each worker, kept with the job: looking them up in the per-node
    # arrays at every change of members costs more than keeping them
    worker_tflops: dict[int, float] = field(default_factory=dict)
    worker_bandwidth: dict[int, float] = field(default_factory=dict)
    worker_latency: dict[int, float] = field(default_factory=dict)
    core_workers: int = 0
    clearing: float | None = None
    rounds_done: int = 0
    round_version: int = 0
    round_started: float = 0.0  # when the stretch in flight began
    round_s: float = 0.0
    stretch: int = 0  # rounds in the stretch in flight
    in_flight: bool = False
    members_changed: bool = True  # the round time is recomputed only when the members change
    rate_micro: int = 0  # the live leases' prices summed, micro-credits per hour
    state: str = "pending"
    started_at: float | None = None
    finished_at: float | None = None
    cost_micro: int = 0
    worker_rounds: int = 0  # contributions in published rounds
    queued: int = 0  # AGGREGATOR | WORKERS: the queues it waits in

    @property
    def reassignments(self) -> int:
        """Leases beyond each task's first: what the coordinator counts as re-leases."""
        return sum(max(e - 1, 0) for e in self.epochs)


@dataclass
class Counters:
    events: int = 0
    grants: int = 0
    crashes_noticed: int = 0
    paid_worker_s: float = 0.0  # worker lease seconds, to the last renewal or now
    useful_worker_s: float = 0.0  # worker seconds in rounds that were published


@dataclass
class Sample:
    t: float
    online: int
    busy: int
    running_jobs: int
    waiting_jobs: int
    paid_worker_s: float
    useful_worker_s: float


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        *,
        nodes: int | None = None,
        hours: float | None = None,
        seed: int | None = None,
        arrivals: Sequence[tuple[float, int]] | None = None,
        faults: Sequence[Fault] = (),
    ):
        self.scenario = scenario
        self.horizon = (scenario.hours if hours is None else hours) * 3600
        self.rng = np.random.default_rng(scenario.seed if seed is None else seed)
        self.pop = Population.draw(scenario, scenario.nodes if nodes is None else nodes, self.rng)
        self.churn = Churn(scenario, self.rng)
        self.templates = [t.spec for t in scenario.jobs.templates]
        self.template_cdf = list(itertools.accumulate(t.share for t in scenario.jobs.templates))
        self.exchanged = [trained_count(s.training) for s in self.templates]  # a round's, as quotes count
        self.template_requirements = [Requirements.from_spec(s) for s in self.templates]
        self.requirements, self.template_class = _classes(self.template_requirements)
        auction = [False] * len(self.requirements)
        for spec, c in zip(self.templates, self.template_class, strict=True):
            auction[c] = auction[c] or spec.pricing == "auction"
        self.index = CandidateIndex(self.pop, self.requirements, auction)
        # Per node, in flat arrays of bytes, 64-bit ints and doubles: at a million nodes a list's boxed
        # values lie scattered over memory and most lookups miss the cache.
        n = self.pop.n
        self.online = bytearray(n)
        self.busy_job = array("q", [NO_JOB]) * n
        self.session = array("q", [0]) * n
        self.session_start = array("d", [0.0]) * n
        self.last_beat = array("d", [0.0]) * n
        self.beats = array("q", [0]) * n
        self.presence_s = array("d", [0.0]) * n
        self.online_since = array("d", [GONE]) * n
        self.good = array("q", [0]) * n
        self.bad = array("q", [0]) * n
        self.price_micro = array("q", [0]) * n
        self.tflops = array("d", self.pop.tflops.tolist())
        self.bandwidth = array("d", self.pop.bandwidth.tolist())
        self.latency = array("d", self.pop.latency_s.tolist())
        self.ask_micro = array("q", [to_micro(p) for p in self.pop.price.tolist()])
        self.utc_offset = array("d", self.pop.utc_offset_h.tolist())
        self.budget_micro = [to_micro(s.budget) for s in self.templates]
        self.jobs: list[Job] = []
        # per requirement class, two heaps of job ids (placed in id order): jobs that lack an
        # aggregator, jobs that lack workers
        self.queues: list[tuple[list[int], list[int]]] = [([], []) for _ in self.requirements]
        self.n_waiting = 0
        self.no_workers: set[int] = set()  # classes whose worker pools ran dry
        self.no_aggregator: set[int] = set()  # classes with no aggregator left
        self.n_online = self.n_busy = self.n_running = 0
        self._interval = (-1, 0.0)  # (fleet online, heartbeat interval): ``_interval_s``
        self.count = Counters()
        self.samples: list[Sample] = []
        self.traffic = DataPlane(self.templates, n, self.horizon, scenario.sample_every_s)
        self.traffic.run_deployments(
            [(d.spec, round(d.per_1000_nodes * n / 1000)) for d in scenario.deployments],
            self.churn.mean_session_s(),
        )
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []  # this window's events
        self._later: list[list[tuple[float, int, int, int, int]]] = [
            [] for _ in range(int(self.horizon // WINDOW_S) + 1)
        ]
        self._window = 0
        self._seq = 0
        self._place_at: float | None = None
        self._arrivals = arrivals
        self._faults = list(faults)
        self._never_back: set[int] = set()
        self._leased_workers = 0
        self._leased_since = 0.0

    @property
    def rules(self) -> Liveness:
        """The heartbeat rules now: the base interval stretched to the fleet online, as the coordinator's."""
        return Liveness(self._interval_s(), self.scenario.network.heartbeat_misses)

    def _interval_s(self) -> float:
        """``rules.interval_s``, without building the rules, and kept while the fleet online stays the
        same size (reliability reads it whenever a node is freed)."""
        if self._interval[0] != self.n_online:
            net = self.scenario.network
            beat_s, max_rate = net.heartbeat_interval_s, net.heartbeat_max_rate_per_s
            self._interval = (self.n_online, fleet_interval_s(beat_s, self.n_online, max_rate))
        return self._interval[1]

    # -- the loop ---------------------------------------------------------------------------------

    def _at(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        """Schedule an event: into the heap if it falls in the window being run, else into its window's
        list (a heap of one window is small enough to stay in cache; a heap of every node's next event
        is not). An event past the horizon would never run: it is dropped."""
        if t > self.horizon:
            return
        self._seq += 1
        event, window = (t, self._seq, kind, a, b), int(t // WINDOW_S)
        if window <= self._window:
            heapq.heappush(self._heap, event)
        else:
            self._later[window].append(event)

    def _next_window(self) -> bool:
        """The heap ran dry: it takes the next window's events (all later than any so far, since a
        window is a range of time); False when none are left."""
        while self._window + 1 < len(self._later):
            self._window += 1
            events, self._later[self._window] = self._later[self._window], []
            if events:
                self._heap.extend(events)
                heapq.heapify(self._heap)
                return True
        return False

    def run(self, progress: Callable[[float], None] | None = None) -> Simulation:
        self._start()
        handlers = (  # by kind
            self._up,
            self._down,
            self._noticed,
            self._arrive,
            self._round_done,
            self._place,
            self._sample,
            self._fault,
        )
        heap, pop = self._heap, heapq.heappop
        next_progress = 0.0
        while heap or self._next_window():
            t, _, kind, a, b = pop(heap)
            assert t >= self.now, f"event at {t} after {self.now}: time runs one way"
            self.now = t
            self.count.events += 1
            handlers[kind](a, b)
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress = t + 600
        self.now = self.horizon
        for job in self.jobs:  # the rounds of stretches still in flight that are over by now
            if job.state == "running":
                self._interrupt(job)
        self._sample(0, 0)
        return self

    def _start(self) -> None:
        churn = self.churn
        on_share = churn.mean_session_s() / (churn.mean_session_s() + churn.mean_offline_s())
        # as Python numbers: a numpy float in an event time would make every later one numpy, and
        # each comparison in the event heap ten times slower
        starts_online = (self.rng.random(self.pop.n) < on_share).tolist()
        residual = self.rng.random(self.pop.n).tolist()
        for i in range(self.pop.n):
            if i < self.pop.n_core or starts_online[i]:
                self._up(i, 0, session_s=None if i < self.pop.n_core else churn.session_s() * residual[i])
            else:
                self._at(churn.offline_s(0.0, self.utc_offset[i]) * residual[i], UP, i)
        if self._arrivals is None:
            self._at(self._next_arrival(), ARRIVE, -1)
        else:
            for t, template in self._arrivals:
                self._at(t, ARRIVE, template)
        self._at(0.0, SAMPLE)

    # -- nodes ------------------------------------------------------------------------------------

    def _up(self, i: int, _: int = 0, *, session_s: float | None = -1.0) -> None:
        if self.online[i] or i in self._never_back:
            return
        if self.busy_job[i] != NO_JOB:  # back before its crash was noticed: registering ends its lease
            self._end_lease(i, "expired", self.last_beat[i])
        self.online[i] = True
        self.n_online += 1
        self.session[i] += 1
        self.session_start[i] = self.now
        if self.online_since[i] == GONE:
            self.online_since[i] = self.now
        self._free(i)
        if session_s == -1.0:
            session_s = self.churn.session_s()
        if session_s is not None:
            self._at(self.now + session_s, DOWN, i, self.session[i])

    def _down(self, i: int, session: int, *, crash: bool | None = None, back: bool = True) -> None:
        if not self.online[i] or self.session[i] != session:
            return
        crash = self.churn.crashes() if crash is None else crash
        if self.busy_job[i] != NO_JOB:  # the rounds it took part in are over
            job = self.jobs[self.busy_job[i]]
            self._interrupt(job)
            job.workers_down += i in job.workers
        self.online[i] = False
        self.n_online -= 1
        self.session[i] += 1
        self.index.remove(i)
        interval_s = self._interval_s()
        last = last_beat_before(self.now, self.session_start[i], interval_s)
        self.last_beat[i] = last
        self.beats[i] += round((last - self.session_start[i]) / interval_s) + 1
        if crash and self.busy_job[i] != NO_JOB:  # silent: the coordinator learns it from missed beats
            net = self.scenario.network
            seen = noticed_at(
                self.now,
                self.session_start[i],
                self.rules,
                lease_ttl_s=net.lease_ttl_s,
                reaper_interval_s=net.reaper_interval_s,
            )
            self._at(seen, NOTICED, i, self.session[i])
        elif not crash:  # a clean leave: the task is handed back (released), the node says goodbye
            if self.busy_job[i] != NO_JOB:
                self._end_lease(i, "released", self.now)
            self.presence_s[i] += self.now - self.online_since[i]
            self.online_since[i] = GONE
        if back:
            self._at(self.now + self.churn.offline_s(self.now, self.utc_offset[i]), UP, i)

    def _noticed(self, i: int, session: int) -> None:
        if self.session[i] == session and self.busy_job[i] != NO_JOB:
            self.count.crashes_noticed += 1
            self._end_lease(i, "expired", self.last_beat[i])

    def _fault(self, fault_index: int, _: int) -> None:
        fault = self._faults[fault_index]
        job = self.jobs[fault.job]
        holders = [job.aggregator] if fault.role == "aggregator" else sorted(job.workers)
        holders = [i for i in holders if i != NO_JOB and self.online[i]]
        if job.state == "running" and holders:
            self._never_back.add(holders[0])
            self._down(holders[0], self.session[holders[0]], crash=True, back=False)

    def _next_fault_round(self, job: Job) -> int | None:
        """The next round after which a fault strikes this job: a stretch must end there."""
        due = [f.after_round for f in self._faults if f.job == job.id and f.after_round > job.rounds_done]
        return min(due, default=None)

    def reliability(self, i: int) -> float:
        present = self.presence_s[i]
        if self.online_since[i] != GONE:
            present += self.now - self.online_since[i]
        beats, interval_s = self.beats[i], self._interval_s()
        if self.online[i]:
            beats += int((self.now - self.session_start[i]) / interval_s) + 1
        record = reputation.Record.of(
            heartbeats=beats,
            present_s=present,
            heartbeat_interval_s=interval_s,
            lease_ends={"completed": self.good[i], "expired": self.bad[i]},
            audits_passed=0,
            audits_failed=0,
        )
        return reputation.score(record)

    def _free(self, i: int) -> None:
        """Node ``i`` is online with nothing to do: it goes on offer, and waiting jobs get a look."""
        self.index.add(i, self.reliability(i))
        if self.n_waiting:
            self._want_placement()

    # -- leases -----------------------------------------------------------------------------------

    def _grant(self, job: Job, i: int, task: int) -> None:
        assert self.busy_job[i] == NO_JOB, f"node {i} is already leased"
        self.index.remove(i)
        self.busy_job[i] = job.id
        self.n_busy += 1
        self.count.grants += 1
        job.epochs[task] += 1
        first = task == 0 and job.epochs[0] == 1
        self.traffic.task_started(self.now, job.template, i, job.rounds_done, first_aggregator=first)
        role = "aggregator" if task == 0 else "worker"
        clearing = None if job.clearing is None else to_micro(job.clearing)
        self.price_micro[i] = lease_price(role, self.ask_micro[i], clearing)
        self._interrupt(job)
        job.members_changed = True
        job.rate_micro += self.price_micro[i]
        job.granted_at[i] = self.now
        if task == 0:
            job.aggregator = i
        else:
            self._count_leased_workers(+1)
            job.workers[i] = task
            job.last_worker_grant = self.now
            job.worker_tflops[i] = self.tflops[i]
            job.worker_bandwidth[i] = self.bandwidth[i]
            job.worker_latency[i] = self.latency[i]
            job.core_workers += i < self.pop.n_core
        if job.started_at is None:
            job.started_at, job.state = self.now, "running"
            self.n_running += 1
        if not job.in_flight:
            self._start_round(job)

    def _end_lease(self, i: int, how: str, until: float) -> None:
        """End node ``i``'s lease (``completed``, ``released`` or ``expired``), metered to ``until``; its
        task goes back to the market unless the job is over."""
        job = self.jobs[self.busy_job[i]]
        if job.state == "running":
            self._interrupt(job)
        seconds = max(0.0, until - job.granted_at.pop(i))
        job.cost_micro += lease_cost_micro(seconds, self.price_micro[i])
        job.members_changed = True
        job.rate_micro -= self.price_micro[i]
        self.busy_job[i] = NO_JOB
        self.n_busy -= 1
        if how == "expired":
            self.bad[i] += 1
        else:
            self.good[i] += 1
        if i == job.aggregator:
            job.aggregator = NO_JOB
            if job.in_flight:  # the round in flight is lost; a successor resumes from the last one
                job.in_flight = False
                job.round_version += 1
        else:
            self._count_leased_workers(-1)
            task = job.workers.pop(i)
            job.workers_down -= not self.online[i]
            del job.worker_tflops[i], job.worker_bandwidth[i], job.worker_latency[i]
            job.core_workers -= i < self.pop.n_core
            if job.state in ("pending", "running"):
                job.pending.append(task)
        if job.state in ("pending", "running"):
            self._wait(job)
        if self.online[i]:
            self._free(i)

    # -- jobs -------------------------------------------------------------------------------------

    def _next_arrival(self) -> float:
        per_s = self.scenario.jobs.arrivals_per_hour_per_1000_nodes * self.pop.n / 1000 / 3600
        return self.now + self.churn.rng.exponential(1 / per_s)

    def _arrive(self, template: int, _: int) -> None:
        if template < 0:  # the Poisson stream: draw this one's template, schedule the next
            template = bisect.bisect_right(self.template_cdf, self.churn.uniform() * self.template_cdf[-1])
            self._at(self._next_arrival(), ARRIVE, -1)
        spec = self.templates[template]
        workers = spec.resources.workers
        job = Job(
            id=len(self.jobs),
            template=template,
            cls=self.template_class[template],
            spec=spec,
            arrived_at=self.now,
            epochs=[0] * (workers + 1),
            pending=list(range(1, workers + 1)),
        )
        self.jobs.append(job)
        self._wait(job)

    def _wait(self, job: Job, *, place: bool = True) -> None:
        """Queue the job for what it lacks: an aggregator, workers, or both (one queue each per class)."""
        was_waiting = bool(job.queued)
        for need, lacking in ((AGGREGATOR, job.aggregator == NO_JOB), (WORKERS, bool(job.pending))):
            if lacking and not job.queued & need:
                job.queued |= need
                heapq.heappush(self.queues[job.cls][need - 1], job.id)
        self.n_waiting += bool(job.queued) - was_waiting
        if place and job.queued:
            self._want_placement()

    def _want_placement(self) -> None:
        if self._place_at is None:
            self._place_at = next_pass_after(self.now, self.scenario.network.reaper_interval_s)
            self._at(self._place_at, PLACE)

    def _dry(self, c: int, need: int) -> bool:
        return c in (self.no_aggregator if need == AGGREGATOR else self.no_workers)

    def _place(self, _: int, __: int) -> None:
        """A placement pass: jobs with unplaced tasks, in order of submission (``place_pending``).

        A class whose pool of aggregators or of workers ran dry stays dry until a node joins it
        (``index.gained_*``): a pass looks only at jobs that could now be placed, not at every
        waiting job every second."""
        self._place_at = None
        self.no_workers -= self.index.gained_workers
        self.no_aggregator -= self.index.gained_aggregators
        self.index.gained_workers.clear()
        self.index.gained_aggregators.clear()
        heads = [
            (queue[0], c, need)
            for c, queues in enumerate(self.queues)
            for need, queue in zip((AGGREGATOR, WORKERS), queues, strict=True)
            if queue and not self._dry(c, need)
        ]
        heapq.heapify(heads)
        requeue: list[Job] = []
        while heads:
            job_id, c, need = heapq.heappop(heads)
            queue = self.queues[c][need - 1]
            heapq.heappop(queue)
            job = self.jobs[job_id]
            was_waiting = bool(job.queued)
            job.queued &= ~need
            self.n_waiting -= was_waiting and not job.queued
            if job.state in ("pending", "running"):
                need_aggregator = job.aggregator == NO_JOB and c not in self.no_aggregator
                need_workers = 0 if c in self.no_workers else len(job.pending)
                req = self.template_requirements[job.template]
                gang = start_size(req, started=job.state == "running", placed=len(job.workers))
                # a job that has not started is placed whole or not at all: never from a dry pool
                whole = need_workers >= gang and (need_aggregator or job.aggregator != NO_JOB)
                if (need_aggregator or need_workers) and (not gang or whole):
                    self._place_job(job, need_aggregator, need_workers, gang)
                requeue.append(job)
            if queue and not self._dry(c, need):
                heapq.heappush(heads, (queue[0], c, need))
        for job in requeue:  # what they still lack waits for a node to join their class (``_free``)
            if job.state in ("pending", "running"):
                self._wait(job, place=False)

    def _place_job(self, job: Job, need_aggregator: bool, need_workers: int, gang: int) -> None:
        req = self.template_requirements[job.template]
        candidates = self.index.candidates(
            job.cls,
            aggregator=need_aggregator,
            workers=need_workers,
            all_workers=req.workers,
            auction=job.spec.pricing == "auction",
            clearing=job.clearing,
            need_core=req.min_core_workers > job.core_workers,
            max_price=req.max_price_per_hour,
        )
        decision = place_job(
            req,
            job.spec.pricing,
            candidates.offers,
            aggregator=need_aggregator,
            workers=need_workers,
            busy=set(),
            core_already=job.core_workers,
            clearing_price=job.clearing,
            gang=gang,
        )
        self.index.give_back(candidates, {_node(n) for n in decision.chosen})
        if (short := decision.short) is not None:
            # what it could not have is gone from the pool only when nothing at all was found: the nodes
            # it did find stay free for a job that needs fewer, as on the network
            if short.no_aggregator:
                self.no_aggregator.add(job.cls)
            if need_workers and not short.workers and short.aggregator is None:
                self.no_workers.add(job.cls)
            return
        if need_aggregator and decision.aggregator is None:
            self.no_aggregator.add(job.cls)
        if need_workers and len(decision.workers.choices) < need_workers:
            self.no_workers.add(job.cls)
        if decision.clearing_price is not None:
            job.clearing = decision.clearing_price
        if decision.aggregator is not None:
            self._grant(job, _node(decision.aggregator.node_id), 0)
        for choice in decision.workers.choices:
            self._grant(job, _node(choice.node_id), job.pending.pop(0))

    def _start_round(self, job: Job) -> None:
        """Start a stretch of rounds: as many as will run with these members (all of them, unless a
        member changes, which cuts it short: ``_interrupt``), up to the job's end or the point where
        its budget might run out, whichever comes first. One event per stretch, not per round."""
        if job.aggregator == NO_JOB or not job.workers:
            return
        if job.members_changed:
            job.round_s = self._round_s(job)
            job.members_changed = False
        rounds = job.spec.training.rounds - job.rounds_done
        if job.rate_micro > 0:
            budget_left = self.budget_micro[job.template] - job.cost_micro - self._live_cost_bound(job)
            per_round = job.rate_micro * job.round_s / 3600
            rounds = min(rounds, max(1, math.floor(budget_left / per_round)))
        if self._faults and (fault_round := self._next_fault_round(job)) is not None:
            rounds = min(rounds, fault_round - job.rounds_done)
        self._stretch(job, self.now, rounds)

    def _stretch(self, job: Job, start: float, rounds: int) -> None:
        job.round_version += 1
        job.round_started = start
        job.stretch = rounds
        job.in_flight = True
        self._at(start + rounds * job.round_s, ROUND, job.id, job.round_version)

    def _interrupt(self, job: Job) -> None:
        """A member came, went or died: the rounds of the stretch already over are done, and the one in
        flight ends as it would have (its contributors: members since its start still up)."""
        if not job.in_flight or job.stretch <= 1:
            return
        over = min(math.floor((self.now - job.round_started) / job.round_s), job.stretch - 1)
        if over > 0:
            self._credit(job, over)
        self._stretch(job, job.round_started + over * job.round_s, 1)

    def _credit(self, job: Job, rounds: int) -> None:
        """``rounds`` rounds published, each with the members present since the stretch began."""
        if not self.online[job.aggregator]:  # died, not yet noticed: nothing is published
            return
        start, online, granted_at = job.round_started, self.online, job.granted_at
        if job.last_worker_grant <= start:  # every worker was there from the start: those still up
            contributors = len(job.workers) - job.workers_down
        else:
            contributors = len([i for i in job.workers if online[i] and granted_at[i] <= start])
        if contributors:
            before = job.rounds_done
            self.traffic.rounds_published(job.template, start, job.round_s, before, rounds, contributors)
            job.rounds_done += rounds
            job.worker_rounds += rounds * contributors
            self.count.useful_worker_s += job.round_s * rounds * contributors
            for index, fault in enumerate(self._faults):
                if fault.job == job.id and before < fault.after_round <= job.rounds_done:
                    self._at(self.now, FAULT, index)

    def _round_s(self, job: Job) -> float:
        agg = job.aggregator
        spec = job.spec.training
        slowest = min(job.worker_tflops.values())
        link = min(min(job.worker_bandwidth.values()), self.bandwidth[agg] / len(job.workers))
        latency = max(job.worker_latency.values()) + self.latency[agg]
        return round_seconds(
            spec,
            step_seconds(spec, slowest),
            self.exchanged[job.template],
            link_bytes_per_s=link,
            overhead_s=ROUND_OVERHEAD_S + 2 * latency,
        )

    def _round_done(self, job_id: int, version: int) -> None:
        job = self.jobs[job_id]
        if job.round_version != version or job.state != "running":
            return
        job.in_flight = False
        if not self.online[job.aggregator]:  # died, not yet noticed: nothing is published
            return
        self._credit(job, job.stretch)
        if job.rounds_done >= job.spec.training.rounds:
            self._finish(job, "completed")
        elif self._over_budget(job):
            self._finish(job, "completed" if job.rounds_done > 0 else "failed")
        else:
            self._start_round(job)

    def _live_cost_bound(self, job: Job) -> float:
        """At least what the job's live leases have cost so far: their summed rates since the oldest."""
        oldest = min(job.granted_at.values(), default=self.now)
        return job.rate_micro * (self.now - oldest) / 3600

    def _over_budget(self, job: Job) -> bool:
        """Has the job spent its budget (``jobs.enforce_limits``)? Metered lease by lease only when the
        bound below says it might have: the live leases cost at most their summed rates since the
        oldest grant."""
        budget = self.budget_micro[job.template]
        if job.cost_micro + self._live_cost_bound(job) < budget:
            return False
        price = self.price_micro
        metered = sum(lease_cost_micro(self.now - at, price[i]) for i, at in job.granted_at.items())
        return job.cost_micro + metered >= budget

    def _count_leased_workers(self, change: int) -> None:
        """Keep the integral of leased workers over time: the worker-seconds paid for."""
        self.count.paid_worker_s += self._leased_workers * (self.now - self._leased_since)
        self._leased_workers += change
        self._leased_since = self.now

    def _finish(self, job: Job, state: str) -> None:
        job.state, job.finished_at = state, self.now
        if state == "completed":
            self.traffic.job_completed(self.now, job.template)
        self.n_running -= 1
        self.n_waiting -= bool(job.queued)
        job.queued = 0  # its queue entries are dropped when they surface
        job.round_version += 1
        holders = ([job.aggregator] if job.aggregator != NO_JOB else []) + list(job.workers)
        for i in holders:
            self._end_lease(i, "completed", self.now)
        for members in (
            job.workers,
            job.granted_at,
            job.worker_tflops,
            job.worker_bandwidth,
            job.worker_latency,
        ):
            members.clear()  # emptied one by one, a dict keeps its table; a million nodes' jobs add up

    def _sample(self, _: int, __: int) -> None:
        self._count_leased_workers(0)
        self.samples.append(
            Sample(
                self.now,
                self.n_online,
                self.n_busy,
                self.n_running,
                self.n_waiting,
                self.count.paid_worker_s,
                self.count.useful_worker_s,
            )
        )
        if self.now < self.horizon:
            self._at(self.now + self.scenario.sample_every_s, SAMPLE)


def _node(node_id: str) -> int:
    return int(node_id[1:])


def _classes(requirements: list[Requirements]) -> tuple[list[Requirements], list[int]]:
    """One requirement class per distinct requirement set (the worker counts aside): jobs of one class
    draw from the same pools of the candidate index."""
    classes: list[Requirements] = []
    of_template = []
    for each in requirements:
        req = replace(each, workers=0, min_workers=None)
        if req not in classes:
            classes.append(req)
        of_template.append(classes.index(req))
    return classes, of_template
