"""The inner optimizer: Muon takes the hidden matrices only; its parts are scheduled and stepped as one."""

import torch

from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.optimizers import hidden_matrices, inner_optimizer
from gpuflex.train.recipes import build_model, get_recipe
from gpuflex.train.schedule import lr_factor, set_lr

from .helpers import tiny_spec


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_muon_takes_the_hidden_matrices_not_embeddings_the_head_norms_or_biases():
    gpt = build_model(tiny_spec())  # its head is tied to the token embedding
    blocks = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert _names(gpt, hidden_matrices(gpt)) == [f"transformer.h.0.{m}.weight" for m in blocks]
    mlp = build_model(TrainingSpec(recipe="mlp-digits"), get_recipe("mlp-digits"))
    assert _names(mlp, hidden_matrices(mlp)) == ["0.weight", "2.weight"]  # 4.weight is the head


def test_the_schedule_sets_both_parts_and_one_step_moves_every_parameter():
    spec = tiny_spec(inner_optimizer="muon")
    model = build_model(spec)
    optimizer = inner_optimizer(model, spec)
    assert len(optimizer.parts) == 2 and len(optimizer.param_groups) == 2
    set_lr(optimizer, spec, 0.5)
    assert [g["lr"] for g in optimizer.param_groups] == [spec.lr * lr_factor(spec, 0.5)] * 2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = torch.randint(0, 256, (2, 16))
    model(inputs, inputs)[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    assert all(not torch.equal(before[n], p) and p.grad is None for n, p in model.named_parameters())
    assert len(optimizer.state) == len(before)
    adamw = inner_optimizer(model, tiny_spec())
    assert len(adamw.parts) == 1 and isinstance(adamw.parts[0], torch.optim.AdamW)
