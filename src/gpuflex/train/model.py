"""CharGPT: a nanoGPT-style byte-level decoder, small enough to train on a CPU in minutes.

Token and position embeddings, pre-LayerNorm blocks of causal self-attention
(``F.scaled_dot_product_attention``) and a 4x MLP, and an output head tied to the token
embedding. The default shape has about 255k parameters::

    from gpuflex.protocol.spec import ModelSpec
    logits, loss = CharGPT(ModelSpec())(inputs, targets)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuflex.protocol.spec import ModelSpec
from gpuflex.train.data import VOCAB_SIZE

# -- defaults -----------------------------------------------------------------------------
# The shape is a ModelSpec (gpuflex.protocol.spec), which a job spec may override. Its defaults:
#   n_layer = 2        transformer blocks; two already learn Python's syntax well beyond bigrams
#   n_head = 4         attention heads, each 96 / 4 = 24 wide
#   n_embd = 96        residual stream width: ~255k parameters in all, a CPU step takes milliseconds
#   block_size = 64    context in bytes: about one line of code
#   dropout = 0.0      no dropout: a few thousand steps on megabytes of text do not overfit
# Fixed here:
#   vocab = 256        bytes: no tokenizer to ship, and any text is a corpus
INIT_STD = 0.02  # GPT-2's initialisation of linear and embedding weights
BIAS = True  # biases in linear layers and LayerNorms, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_head = spec.n_head
        self.dropout = spec.dropout
        self.c_attn = nn.Linear(spec.n_embd, 3 * spec.n_embd, bias=BIAS)
        self.c_proj = nn.Linear(spec.n_embd, spec.n_embd, bias=BIAS)
        self.resid_dropout = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, 2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.c_fc = nn.Linear(spec.n_embd, 4 * spec.n_embd, bias=BIAS)
        self.c_proj = nn.Linear(4 * spec.n_embd, spec.n_embd, bias=BIAS)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd, bias=BIAS)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.n_embd, bias=BIAS)
        self.mlp = MLP(spec)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """The decoder. ``forward(idx, targets)`` returns the logits and, given targets, the mean loss."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB_SIZE, spec.n_embd),
                "wpe": nn.Embedding(spec.block_size, spec.n_embd),
                "drop": nn.Dropout(spec.dropout),
                "h": nn.ModuleList(Block(spec) for _ in range(spec.n_layer)),
                "ln_f": nn.LayerNorm(spec.n_embd, bias=BIAS),
            }
        )
        self.lm_head = nn.Linear(spec.n_embd, VOCAB_SIZE, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one matrix reads and writes bytes
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, scaled down by depth as in GPT-2
                nn.init.normal_(p, mean=0.0, std=INIT_STD / math.sqrt(2 * spec.n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        t = idx.shape[1]
        assert t <= self.spec.block_size, f"sequence of {t} is longer than block_size {self.spec.block_size}"
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))

    def num_params(self) -> int:
        """Parameters counted once each (the tied embedding too)."""
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
