"""A whole secure-aggregation round played by one test: every client and the aggregator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuflex.privacy.secagg import Client, Reveal, SecAggConfig, UnmaskRequest, unmask


@dataclass
class Round:
    config: SecAggConfig
    clients: list[Client]
    public_keys: list[bytes]


def setup(config: SecAggConfig, clients: list[Client] | None = None) -> Round:
    """Steps 1 and 2: keys broadcast, shares handed out."""
    clients = clients or [Client(config, i) for i in range(config.n)]
    keys = [c.public_key for c in clients]
    for c in clients:
        for bundle in c.shares(keys):
            clients[bundle.holder].hold(bundle)
    return Round(config, clients, keys)


def request(r: Round, survivors: set[int]) -> UnmaskRequest:
    return UnmaskRequest(frozenset(survivors), frozenset(range(r.config.n)) - frozenset(survivors))


def play(r: Round, inputs: list[np.ndarray], dropped: set[int] = frozenset()) -> np.ndarray:
    """Steps 3 to 5; clients in ``dropped`` drop after sharing, before masking."""
    masked = {i: c.mask(inputs[i]) for i, c in enumerate(r.clients) if i not in dropped}
    req = request(r, set(masked))
    reveals: list[Reveal] = [r.clients[i].reveal(req) for i in masked]
    return unmask(r.config, r.public_keys, masked, reveals)
