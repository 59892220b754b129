"""The SDK: the one way CLI, agent and task subprocesses reach the coordinator (HTTP).

- ``http``      the shared HTTP session: base URL, timeouts, retries, errors as ``gpuflex.errors``
- ``consumer``  ``Client``: accounts, wallet, jobs (API token); offers, ledger, verdicts, governance
                reads (no token needed)
- ``node``      ``NodeClient``: register, heartbeat, lease, report, propose and vote (Ed25519-signed)
- ``task``      ``TaskClient``: the round protocol for a task subprocess (lease-scoped token);
                it satisfies ``gpuflex.train.transport.Transport`` by shape, without importing it
"""

from gpuflex.client.consumer import Client
from gpuflex.client.node import NodeClient
from gpuflex.client.task import TaskClient

__all__ = ["Client", "NodeClient", "TaskClient"]
