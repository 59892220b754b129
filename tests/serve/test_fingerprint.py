"""Fingerprints: the polynomial goes through its points, a proof is 258 bytes per 32 tokens, and a
comparison tells the same hidden states from nearby and from unrelated ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflex.serve.fingerprint import (
    CHUNK,
    PRIME,
    TOP_K,
    Fingerprinter,
    compare,
    decode,
    evaluate,
    interpolate,
    prove,
    prove_all,
    prove_many,
)


def test_the_polynomial_goes_through_its_points():
    rng = np.random.default_rng(0)
    xs = rng.choice(PRIME, TOP_K, replace=False)
    ys = rng.integers(0, PRIME, TOP_K)
    assert (evaluate(interpolate(xs, ys), xs) == ys).all()


@pytest.mark.parametrize("hidden_size", [64, 4096])  # 4096: flat indices beyond the field, so mod m < PRIME
def test_a_chunk_proof_is_258_bytes_and_matches_its_own_hidden_states(hidden_size):
    hidden = torch.randn(CHUNK, hidden_size, generator=torch.Generator().manual_seed(0))
    proof = prove(hidden)
    assert len(proof) == 2 + 2 * TOP_K == 258
    same = compare(proof, hidden)
    assert (same.k, same.common, same.exponent_mismatches) == (TOP_K, TOP_K, 0)
    assert set(same.mantissa_diffs) == {0}


def test_chunks_proven_together_get_the_proofs_they_get_alone():
    chunks = [torch.randn(CHUNK, 64) for _ in range(3)]
    assert prove_many(chunks) == [prove(chunk) for chunk in chunks]


def test_a_short_last_chunk_pins_what_it_holds():
    hidden = torch.randn(66, 32)
    proofs = prove_all(hidden)
    assert [len(p) for p in proofs] == [258, 258, 2 + 2 * 2 * 32]  # 2 tokens x 32 values < TOP_K
    fingerprinter = Fingerprinter()
    for row in hidden:
        fingerprinter.add(row)
    assert fingerprinter.finish() == proofs


def test_a_comparison_tells_near_from_unrelated_hidden_states():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(CHUNK, 64, generator=generator)
    proof = prove(hidden)
    near = compare(proof, hidden * (1 + 0.02 * torch.randn(hidden.shape, generator=generator)))
    assert near.common > 0.9 * TOP_K
    assert np.mean(near.mantissa_diffs) > 1  # a 2% change is a few bf16 ulps (1/128 of a binade each)
    unrelated = compare(proof, torch.randn(CHUNK, 64, generator=generator))
    assert unrelated.common < 0.1 * TOP_K


def test_a_malformed_proof_is_refused():
    proof = prove(torch.randn(CHUNK, 64))
    with pytest.raises(ValueError, match="bytes"):
        decode(proof[:-2], TOP_K)
    with pytest.raises(ValueError, match="modulus"):
        decode(b"\x01\x00" + proof[2:], TOP_K)
