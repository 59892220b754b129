"""Fingerprints of an output: TOPLOC's idea (arXiv:2501.16007), built here.

For every chunk of ``CHUNK`` output tokens the provider takes the last layer's hidden states it computed
while decoding them (output token i is drawn from the hidden state at the position before it, so the
prefill already holds the first one and no extra forward is needed), flattens the chunk, and keeps the
``TOP_K`` entries of largest magnitude. The map flat index -> value (bf16 bits) is encoded as the
polynomial through the points ``(index mod m, bits)`` over GF(``PRIME``), with ``m`` the largest modulus
at most ``PRIME`` that keeps the indices distinct; the proof is ``m`` and the polynomial's coefficients,
2 bytes each: 258 bytes per chunk (fewer when a short last chunk holds fewer than ``TOP_K`` values).

A verifier recomputes the hidden states by one prefill, takes its own top-k, and evaluates the polynomial
at its own indices (``compare``): where its top-k and the provider's share an index the polynomial gives
the provider's value, elsewhere a field element unrelated to it. So agreement of values tells which
indices are shared, and on those the exponents and mantissas say how close the two computations were.

Every finite bf16 value's bits are below ``PRIME`` (65521 > 0xFF80, -inf's bits), so bits are field
elements as they are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

CHUNK = 32  # output tokens per proof
TOP_K = 128  # values each proof pins
PRIME = 65521  # the largest prime below 2**16: coefficients and the modulus fit 2 bytes
AGREE = 1 / 8  # a claimed value within this relative distance of the verifier's marks a shared index


@cache
def _inverses() -> np.ndarray:
    """Every element's inverse in GF(PRIME) (Fermat: a^(p-2)), one vectorized pass; 0 maps to 0. Kept as
    uint16 (128 kB, cache-resident: a batch's proofs gather from it at random)."""
    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result.astype(np.uint16)


def top_k(hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The flat indices of one chunk's ``TOP_K`` largest-magnitude values (fewer if it holds fewer), and
    the values' bf16 bits."""
    indices, bits = _top_k(hidden[None])
    return indices[0], bits[0]


def _top_k(chunks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``top_k`` of each of a stack of equally shaped chunks, in one call: arrays of (chunks, k)."""
    flat = chunks.detach().reshape(len(chunks), -1).float()
    k = min(TOP_K, flat.shape[1])
    indices = torch.topk(flat.abs(), k, dim=1, sorted=False).indices
    bits = flat.gather(1, indices).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return indices.cpu().numpy(), bits.cpu().numpy()


def _modulus(indices: np.ndarray) -> int:
    """The largest m <= PRIME under which the indices stay distinct (a random set of 128 takes one or two
    tries: most moduli this large are injective on it)."""
    for m in range(PRIME, len(indices) - 1, -1):
        if len(np.unique(indices % m)) == len(indices):
            return m
    raise AssertionError("no modulus keeps the indices distinct")  # m = len(indices) always would


def interpolate(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """The coefficients (lowest degree first) of the polynomial of degree < n through the n points (xs, ys)
    over GF(PRIME); given (chunks, n) arrays, one polynomial per row. Newton's divided differences, then
    expanded, each stage vectorized over the points and the rows (numpy's per-call cost, not arithmetic,
    is most of a proof's time: a batch's chunks share the calls)."""
    xs, c = np.atleast_2d(xs).astype(np.int64) % PRIME, np.atleast_2d(ys).astype(np.int64) % PRIME
    n = xs.shape[1]
    # every difference xs[i + j] - xs[i] the divided differences divide by, inverted in one gather (a
    # negative difference indexes from the table's end: the inverse of its residue)
    at = np.arange(n)
    later = np.minimum(at[:, None] + at[None, :], n - 1)
    inverse = _inverses()[xs[:, later] - xs[:, None, :]]
    for j in range(1, n):
        c[:, j:] = (c[:, j:] - c[:, j - 1 : -1]) * inverse[:, j, : n - j] % PRIME
    # poly = c[n-1]; then poly = poly * (x - xs[j]) + c[j] for j down to 0. Column 0 of ``shifted`` holds
    # c[j] where poly * x would read below degree 0, so each step is one vector operation.
    shifted = np.zeros((len(c), n + 1), dtype=np.int64)
    shifted[:, 1] = c[:, n - 1]
    for j in range(n - 2, -1, -1):
        top = n - j  # the new degree + 1
        shifted[:, 0] = c[:, j]
        shifted[:, 1 : top + 1] = (shifted[:, :top] - xs[:, j : j + 1] * shifted[:, 1 : top + 1]) % PRIME
    poly = shifted[:, 1:]
    return poly if np.ndim(ys) == 2 else poly[0]


def evaluate(coefficients: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The polynomial at each of ``xs`` (Horner's rule, vectorized over the points)."""
    xs = xs.astype(np.int64) % PRIME
    value = np.zeros(len(xs), dtype=np.int64)
    for c in coefficients[::-1]:
        value = (value * xs + int(c)) % PRIME
    return value


def prove_many(chunks: list[torch.Tensor]) -> list[bytes]:
    """The proofs of equally shaped chunks (tokens x hidden size each), computed together."""
    if not chunks:
        return []
    indices, bits = _top_k(torch.stack(chunks))
    moduli = [_modulus(row) for row in indices]
    coefficients = interpolate(indices % np.array(moduli)[:, None], bits)
    return [struct.pack(f"<H{len(c)}H", m, *c.tolist()) for m, c in zip(moduli, coefficients, strict=True)]


def prove(hidden: torch.Tensor) -> bytes:
    """One chunk's proof from its hidden states (tokens x hidden size)."""
    return prove_many([hidden])[0]


def prove_all(hidden: torch.Tensor) -> tuple[bytes, ...]:
    """The proofs of an output whose hidden states (one row per output token) are all at hand."""
    return tuple(prove(hidden[start : start + CHUNK]) for start in range(0, len(hidden), CHUNK))


def proofs_for(tokens: int) -> int:
    return -(-tokens // CHUNK)


class Fingerprinter:
    """One request's hidden states, cut into chunks as they arrive, and the chunks' proofs in order. The
    engine proves the full chunks of all its requests together (``take_full``, ``prove_many``)."""

    def __init__(self) -> None:
        self.proofs: list[bytes] = []
        self._rows: list[torch.Tensor] = []
        self._full: list[torch.Tensor] = []

    def add(self, hidden: torch.Tensor) -> None:
        """The hidden states (rows) of the next output positions."""
        for row in hidden.reshape(-1, hidden.shape[-1]):
            self._rows.append(row)
            if len(self._rows) == CHUNK:
                self._full.append(torch.stack(self._rows))
                self._rows = []

    def take_full(self) -> list[torch.Tensor]:
        """The full chunks not yet proven; their proofs must be appended to ``proofs`` in order."""
        full, self._full = self._full, []
        return full

    def finish(self) -> tuple[bytes, ...]:
        """Every proof: those of the chunks still unproven, then of the last, short one."""
        self.proofs += prove_many(self.take_full())
        if self._rows:
            self.proofs.append(prove(torch.stack(self._rows)))
            self._rows = []
        return tuple(self.proofs)


@dataclass(frozen=True)
class ChunkComparison:
    """One chunk, the provider's proof against the verifier's own hidden states."""

    k: int  # the verifier's top-k size
    common: int  # of its top-k indices, those whose claimed value agrees with its own (shared indices)
    exponent_mismatches: int  # shared indices whose sign or exponent differ
    mantissa_diffs: tuple[int, ...]  # |mantissa difference| in bf16 ulps where sign and exponent agree


def decode(proof: bytes, k: int) -> tuple[int, np.ndarray]:
    """A proof's modulus and coefficients; ValueError when it cannot be a proof of ``k`` values."""
    if len(proof) != 2 + 2 * k:
        raise ValueError(f"a proof of {k} values has {2 + 2 * k} bytes, not {len(proof)}")
    m, *coefficients = struct.unpack(f"<H{k}H", proof)
    if not k <= m <= PRIME:
        raise ValueError(f"its modulus {m} is outside [{k}, {PRIME}]")
    return m, np.array(coefficients, dtype=np.int64)


def compare(proof: bytes, hidden: torch.Tensor) -> ChunkComparison:
    """Evaluate the provider's polynomial at the verifier's own top-k indices and compare the values."""
    indices, own = top_k(hidden)
    m, coefficients = decode(proof, len(indices))
    claimed = evaluate(coefficients, indices % m)
    as_float = _bf16_values(claimed), _bf16_values(own)
    shared = np.abs(as_float[0] - as_float[1]) <= AGREE * np.abs(as_float[1])
    sign_exponent = (claimed >> 7) == (own >> 7)
    mantissa = np.abs((claimed & 0x7F) - (own & 0x7F))
    return ChunkComparison(
        k=len(indices),
        common=int(shared.sum()),
        exponent_mismatches=int((shared & ~sign_exponent).sum()),
        mantissa_diffs=tuple(mantissa[shared & sign_exponent].tolist()),
    )


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as float64 (NaN for NaN patterns, which then agree with nothing)."""
    with np.errstate(invalid="ignore"):  # a claimed signalling NaN pattern is just another disagreement
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
