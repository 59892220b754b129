"""Parsed specs of job rows, by job id, kept per process: a ``JobSpec`` for a training job, a
``DeploymentSpec`` for a deployment (the row's ``kind`` says which; ``load`` is the one place that reads it).

A job's spec never changes once the job is submitted (and ``JobSpec`` is frozen), yet every lease batch
parsed the spec of each job it leased for: pydantic's validation of the whole nested spec, plus the JSON
column decoded, was about a tenth of the lease writer's time in 3,000-node lease storms on PostgreSQL
(py-spy). Each spec is now parsed once per process and kept while recently used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from gpuflex.errors import Conflict
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec

Spec = JobSpec | DeploymentSpec
PARSERS: dict[str, type[Spec]] = {"training": JobSpec, "deployment": DeploymentSpec}  # by jobs.kind

KEPT = 4096  # specs kept per process: the jobs running at once on a large network, with room to spare


class SpecCache:
    """The ``size`` most recently used specs; safe to share between threads (the group commit's writers,
    the reaper, the routes)."""

    def __init__(self, size: int = KEPT):
        if size <= 0:
            raise ValueError(f"a cache of {size} specs keeps nothing")
        self.size = size
        self._specs: OrderedDict[str, Spec] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job_id: str) -> Spec | None:
        """The job's spec if it is kept, else None (the caller reads it from the database)."""
        with self._lock:
            spec = self._specs.get(job_id)
            if spec is not None:
                self._specs.move_to_end(job_id)
            return spec

    def parse(self, job_id: str, raw: dict, kind: str) -> Spec:
        """The job's spec: the one kept, or ``raw`` (its ``jobs.spec`` column) parsed as ``kind`` and kept."""
        if (spec := self.get(job_id)) is not None:
            return spec
        spec = PARSERS[kind].model_validate(raw)  # outside the lock: the parse is the slow part
        with self._lock:
            self._specs[job_id] = spec
            if len(self._specs) > self.size:
                self._specs.popitem(last=False)
        return spec


SPECS = SpecCache()


def load(job) -> Spec:
    """The spec of ``job`` (a ``Job`` or a row with its ``id``, ``spec`` and ``kind``), of either kind."""
    return SPECS.parse(job.id, job.spec, job.kind)


def of(job) -> JobSpec:
    """The spec of a training job; a deployment, which has no rounds, verdicts of training or training
    config, is a 409 for the task or caller that asked as if it had."""
    spec = load(job)
    if not isinstance(spec, JobSpec):
        raise Conflict(f"{job.id} is a deployment, not a training job")
    return spec


def deployment(job) -> DeploymentSpec:
    """The spec of a deployment (``services.deployments`` only hands it its own rows)."""
    spec = load(job)
    if not isinstance(spec, DeploymentSpec):
        raise Conflict(f"{job.id} is a training job, not a deployment")
    return spec
