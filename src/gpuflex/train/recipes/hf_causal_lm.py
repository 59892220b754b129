"""hf-causal-lm: a transformers GPT-2 or Llama, built from a config (no weights are downloaded).

The shape comes from the job's ``model`` section (``architecture``: gpt2 | llama); the vocabulary is
the 256 byte values, so no tokenizer is needed either. Data and loss are char-gpt's.
"""

from __future__ import annotations

from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.data import VOCAB_SIZE
from gpuflex.train.recipes import Batch, Recipe
from gpuflex.train.recipes.char_gpt import byte_data, next_byte_loss


def _transformers():
    try:
        import transformers
    except ImportError:
        raise BadRequest("recipe hf-causal-lm needs transformers: pip install 'gpuflex[recipes]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def build(spec: TrainingSpec) -> nn.Module:
    t, m = _transformers(), spec.model
    if m.architecture == "llama":
        config = t.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=m.n_embd,
            intermediate_size=4 * m.n_embd,
            num_hidden_layers=m.n_layer,
            num_attention_heads=m.n_head,
            num_key_value_heads=m.n_head,
            max_position_embeddings=m.block_size,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        return t.LlamaForCausalLM(config)
    config = t.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=m.block_size,
        n_embd=m.n_embd,
        n_layer=m.n_layer,
        n_head=m.n_head,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        bos_token_id=None,
        eos_token_id=None,
    )
    return t.GPT2LMHeadModel(config)


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return next_byte_loss(model(input_ids=inputs).logits, targets)


RECIPE = Recipe(name="hf-causal-lm", build_model=build, build_data=byte_data, loss=_loss)
