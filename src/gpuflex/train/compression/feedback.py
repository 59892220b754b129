"""Error feedback: compression with memory, so a lossy codec loses nothing over rounds, only delays it.

The sender keeps per tensor a residual ``e``, what compression has not delivered yet::

    e ← decay·e + Δ          # this round's pseudo-gradient, plus what earlier rounds left out
    c = decode(encode(e))    # what the receivers will apply
    e ← e - c                # what they will not, kept for the next round

so the sum of everything sent equals the sum of every Δ minus the current residual, which stays
bounded. ``decay`` < 1 forgets old residual geometrically (SparseLoCo uses it in place of outer
momentum). Workers keep one for their uplink; the aggregator keeps one for the downlink, applies
the ``decoded`` half of ``compress_with_echo`` to its own model, and sends the blob, whose decoding
every replica then reproduces bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from gpuflex.train.compression.base import Compressor


def with_residual(
    delta: Mapping[str, Tensor], residual: Mapping[str, Tensor], decay: float
) -> dict[str, Tensor]:
    """``delta + decay·residual`` in fp32 on the CPU: what error feedback compresses. One definition, so
    that an auditor re-deriving a worker's blob from its training and residual gets it bit for bit."""
    corrected = {}
    for name, d in delta.items():
        d = d.detach().to("cpu", torch.float32)
        e = residual.get(name)
        corrected[name] = d.clone() if e is None else torch.add(d, e, alpha=decay)
    return corrected


class ErrorFeedback:
    """One sender's residual over a ``compressor``; ``residual`` maps tensor names to what is owed, and
    ``compressions`` counts the blobs it has been carried through (a worker commits to both)."""

    def __init__(self, compressor: Compressor, decay: float = 1.0):
        assert 0 < decay <= 1, f"decay {decay}"
        self.compressor = compressor
        self.decay = decay
        self.residual: dict[str, Tensor] = {}
        self.compressions = 0
        self._previous: dict[str, Tensor] = {}

    def compress(self, delta: Mapping[str, Tensor]) -> bytes:
        """The blob for ``delta`` plus the residual; the residual becomes what that blob leaves out."""
        return self.compress_with_echo(delta)[0]

    def compress_with_echo(self, delta: Mapping[str, Tensor]) -> tuple[bytes, dict[str, Tensor]]:
        """As ``compress``, with what the receivers will decode from the blob (exactly)."""
        corrected = with_residual(delta, self.residual, self.decay)
        blob, decoded = self.compressor.compress_with_echo(corrected)
        self._previous = self.residual
        self.residual = {name: corrected[name] - decoded[name] for name in corrected}
        self.compressions += 1
        return blob, decoded

    def owe(self, dropped: Mapping[str, Tensor]) -> None:
        """Add to the residual what a later encoding of the last blob's decoding dropped (secure
        aggregation's shared grid), so that it too is sent in a later round."""
        for name, lost in dropped.items():
            self.residual[name] = self.residual[name] + lost.detach().to("cpu", torch.float32)

    def revert(self) -> None:
        """Undo the last ``compress``: its blob was not used (refused as stale), nor is its residual."""
        self.residual = self._previous
        self.compressions -= 1
