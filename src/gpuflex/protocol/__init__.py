"""The wire contract. Coordinator, agent and client all import it; it imports nothing of ours.

- ``spec``      the job spec (YAML), validated strictly: unknown keys are errors
- ``deployment`` the deployment spec: a model served by replicas, as strict
- ``messages``  every request and response body of the HTTP API
- ``money``     credits <-> micro-credits, the one conversion used everywhere
- ``openai``    the OpenAI-compatible inference API's bodies, chunks and error object
"""

from gpuflex.protocol.spec import JobSpec, load_job_spec

__all__ = ["JobSpec", "load_job_spec"]
