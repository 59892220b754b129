"""Parsed job specs, by job id, kept per process.

A job's spec never changes once the job is submitted (and ``JobSpec`` is frozen), yet every lease batch
parsed the spec of each job it leased for: pydantic's validation of the whole nested spec, plus the JSON
column decoded, was about a tenth of the lease writer's time in 3,000-node lease storms on PostgreSQL
(py-spy). Each spec is now parsed once per process and kept while recently used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from gpuflex.protocol.spec import JobSpec

KEPT = 4096  # specs kept per process: the jobs running at once on a large network, with room to spare


class SpecCache:
    """The ``size`` most recently used specs; safe to share between threads (the group commit's writers,
    the reaper, the routes)."""

    def __init__(self, size: int = KEPT):
        if size <= 0:
            raise ValueError(f"a cache of {size} specs keeps nothing")
        self.size = size
        self._specs: OrderedDict[str, JobSpec] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job_id: str) -> JobSpec | None:
        """The job's spec if it is kept, else None (the caller reads it from the database)."""
        with self._lock:
            spec = self._specs.get(job_id)
            if spec is not None:
                self._specs.move_to_end(job_id)
            return spec

    def parse(self, job_id: str, raw: dict) -> JobSpec:
        """The job's spec: the one kept, or ``raw`` (its ``jobs.spec`` column) parsed and kept."""
        if (spec := self.get(job_id)) is not None:
            return spec
        spec = JobSpec.model_validate(raw)  # outside the lock: the parse is the slow part
        with self._lock:
            self._specs[job_id] = spec
            if len(self._specs) > self.size:
                self._specs.popitem(last=False)
        return spec


SPECS = SpecCache()


def of(job) -> JobSpec:
    """The spec of ``job`` (a ``Job`` or a row with its ``id`` and ``spec``)."""
    return SPECS.parse(job.id, job.spec)
