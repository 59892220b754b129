import math

import pytest
import torch

from gpuflex.protocol.spec import ModelSpec, TrainingSpec
from gpuflex.train.data import VOCAB_SIZE
from gpuflex.train.model import CharGPT

from .helpers import TINY_MODEL


def test_forward_shapes_and_initial_loss_is_near_uniform():
    model = CharGPT(TINY_MODEL)
    idx = torch.randint(0, VOCAB_SIZE, (3, TINY_MODEL.block_size))
    targets = torch.randint(0, VOCAB_SIZE, idx.shape)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, TINY_MODEL.block_size, VOCAB_SIZE)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.1  # small init: close to a uniform guess
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, VOCAB_SIZE)
    assert loss is None


def test_default_param_count_is_a_few_hundred_thousand():
    model = CharGPT(ModelSpec())
    assert 100_000 <= model.num_params() <= 1_000_000
    assert model.num_params() == sum(p.numel() for _, p in model.named_parameters())


def test_output_head_is_tied_to_the_token_embedding():
    model = CharGPT(TINY_MODEL)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # counted and optimised once


def test_attention_is_causal():
    model = CharGPT(TINY_MODEL).eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % VOCAB_SIZE
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_longer_than_block_size_is_refused():
    model = CharGPT(TINY_MODEL)
    with pytest.raises(AssertionError, match="block_size"):
        model(torch.zeros(1, TINY_MODEL.block_size + 1, dtype=torch.long))


def test_a_few_steps_lower_the_loss():
    model = CharGPT(TINY_MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TrainingSpec().lr)
    idx = torch.tensor([list(b"hello world, hello world, hello world, hello world")[:33]])
    first = None
    for _ in range(30):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first - 1.0
