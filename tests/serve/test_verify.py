"""Verification: honest outputs pass whatever thread count and batch produced them; every cheat of
``gpuflex.serve.cheats`` fails, on the check that should catch it. In float32, and in bf16 by its own
thresholds (``Thresholds.for_dtype``)."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from gpuflex.serve import cheats
from gpuflex.serve.engine import Completion, Engine
from gpuflex.serve.sampling import SamplingParams
from gpuflex.serve.verify import Finding, Thresholds, verify

from .helpers import generate, threads

FINGERPRINTS = "top values|exponent|hidden states"  # the reasons the fingerprint checks give
SAMPLING = "tokens"  # the sampling check's


@pytest.fixture(scope="module")
def served(served):
    """The tiny model without an end-of-sequence token: every output runs to max_tokens, two chunks."""
    return replace(served, eos=frozenset())


def asked(count: int, temperature: float = 1.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=64, seed=100 + i) for i in range(count)]


def prompts_of(served, conversations) -> list[list[int]]:
    return [served.encode_chat(c) for c in conversations]


def judge(
    served, prompts, params, claims: list[Completion], *, tokens=None, fingerprints=None
) -> list[Finding]:
    """Each claim checked against the request as asked (its prompt, its settings with the reported seed)."""
    with threads(
        1
    ):  # two only where the test is about thread counts: the box is shared, and two wait on each other
        return [
            verify(
                served,
                prompt,
                list(tokens[i] if tokens else claim.tokens),
                replace(asked_params, seed=claim.params.seed),
                fingerprints[i] if fingerprints else claim.fingerprints,
            )
            for i, (prompt, asked_params, claim) in enumerate(zip(prompts, params, claims, strict=True))
        ]


@pytest.fixture(scope="module")
def honest(served, conversations) -> list[Completion]:
    return generate(served, prompts_of(served, conversations), asked(len(conversations)), batch=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(("batch", "prover_threads", "verifier_threads"), [(1, 1, 2), (4, 2, 1)])
def test_honest_outputs_pass(served, conversations, temperature, batch, prover_threads, verifier_threads):
    prompts, params = prompts_of(served, conversations), asked(len(conversations), temperature)
    claims = generate(served, prompts, params, batch=batch, threads_n=prover_threads)
    with threads(verifier_threads):
        findings = [
            verify(served, prompt, list(claim.tokens), claim.params, claim.fingerprints)
            for prompt, claim in zip(prompts, claims, strict=True)
        ]
    assert all(f.ok for f in findings), [f for f in findings if not f.ok]


def test_a_resumed_output_passes(served, conversations, honest):
    prompt, first = served.encode_chat(conversations[0]), honest[0]
    with Engine(served) as engine:
        resumed = engine.submit(prompt, first.params, resume=first.tokens[:40]).result(timeout=60)
    assert resumed.tokens == first.tokens
    assert verify(served, prompt, list(resumed.tokens), resumed.params, resumed.fingerprints).ok


@pytest.mark.parametrize(
    ("cheat", "caught_by"),
    [
        ("a smaller model", FINGERPRINTS),
        ("int8 weights", FINGERPRINTS),
        ("int4 weights", FINGERPRINTS),
        ("a lower temperature", SAMPLING),
        ("a higher temperature", SAMPLING),
        ("greedy for sampled", SAMPLING),
        ("random tokens, fingerprinted", SAMPLING),
        ("random tokens, fingerprints copied", FINGERPRINTS),
        ("another request's output", FINGERPRINTS),
        ("the system message dropped", FINGERPRINTS),
    ],
)
def test_a_cheat_is_caught(served, conversations, honest, cheat, caught_by):
    prompts, params = prompts_of(served, conversations), asked(len(conversations))
    tokens = fingerprints = None
    if cheat in ("a smaller model", "int8 weights", "int4 weights"):
        model = {
            "a smaller model": lambda: cheats.drop_layers(served, 1),
            "int8 weights": lambda: cheats.quantize(served, 8),
            "int4 weights": lambda: cheats.quantize(served, 4),
        }[cheat]()
        claims = generate(model, prompts, params, batch=4)
    elif cheat in ("a lower temperature", "a higher temperature", "greedy for sampled"):
        temperature = {"a lower temperature": 0.7, "a higher temperature": 1.3, "greedy for sampled": 0.0}[
            cheat
        ]
        claims = generate(served, prompts, [replace(p, temperature=temperature) for p in params], batch=4)
    elif cheat.startswith("random tokens"):
        rng = random.Random(0)
        claims = honest
        tokens = [[rng.randrange(len(served.tokenizer)) for _ in c.tokens] for c in honest]
        if cheat.endswith("fingerprinted"):
            fingerprints = [cheats.refingerprint(served, p, t) for p, t in zip(prompts, tokens, strict=True)]
    elif cheat == "another request's output":
        claims = honest
        tokens = [list(c.tokens) for c in honest[1:] + honest[:1]]
        fingerprints = [c.fingerprints for c in honest[1:] + honest[:1]]
    else:
        altered = [served.encode_chat(cheats.drop_system(c)) for c in conversations]
        claims = generate(served, altered, params, batch=4)
    findings = judge(served, prompts, params, claims, tokens=tokens, fingerprints=fingerprints)
    assert not any(f.ok for f in findings), [f for f in findings if f.ok]
    assert all(re.search(caught_by, f.reason) for f in findings), [f.reason for f in findings]


def test_a_malformed_claim_fails(served, conversations, honest):
    prompt, claim = served.encode_chat(conversations[0]), honest[0]
    tokens, fingerprints = list(claim.tokens), claim.fingerprints
    assert not verify(served, prompt, tokens, claim.params, fingerprints[:-1]).ok
    assert (
        "malformed"
        in verify(served, prompt, tokens, claim.params, (fingerprints[0][:-2], *fingerprints[1:])).reason
    )
    assert "seed" in verify(served, prompt, tokens, replace(claim.params, seed=None), fingerprints).reason
    assert not verify(served, prompt, [], claim.params, ()).ok


@pytest.fixture(scope="module")
def served_bf16(served_bf16):
    return replace(served_bf16, eos=frozenset())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(("batch", "prover_threads", "verifier_threads"), [(1, 1, 2), (4, 2, 1)])
def test_honest_bf16_outputs_pass_by_bf16s_thresholds(
    served_bf16, conversations, temperature, batch, prover_threads, verifier_threads
):
    prompts, params = prompts_of(served_bf16, conversations), asked(len(conversations), temperature)
    claims = generate(served_bf16, prompts, params, batch=batch, threads_n=prover_threads)
    with threads(verifier_threads):
        findings = {
            dtype: [
                verify(served_bf16, prompt, list(claim.tokens), claim.params, claim.fingerprints, thresholds)
                for prompt, claim in zip(prompts, claims, strict=True)
            ]
            for dtype, thresholds in (("bf16", None), ("fp32", Thresholds()))
        }
    assert all(f.ok for f in findings["bf16"]), [f for f in findings["bf16"] if not f.ok]
    assert not all(f.ok for f in findings["fp32"])  # bf16 rounds apart where float32 agrees


@pytest.mark.parametrize("cheat", ["a smaller model", "int8 weights", "int4 weights"])
def test_a_cheaper_model_is_caught_in_bf16(served_bf16, conversations, cheat):
    model = {
        "a smaller model": lambda: cheats.drop_layers(served_bf16, 1),
        "int8 weights": lambda: cheats.quantize(served_bf16, 8),
        "int4 weights": lambda: cheats.quantize(served_bf16, 4),
    }[cheat]()
    prompts, params = prompts_of(served_bf16, conversations), asked(len(conversations))
    claims = generate(model, prompts, params, batch=4)
    findings = judge(served_bf16, prompts, params, claims)
    assert not any(f.ok for f in findings), [f for f in findings if f.ok]
    assert all(re.search(FINGERPRINTS, f.reason) for f in findings), [f.reason for f in findings]
