"""A served model: a ``save_pretrained`` directory loaded once, its context, and prompts as token ids.

The engine decodes with it and the verifier prefills with it, so both read prompts the same way: a plain
prompt is the tokenizer's encoding of the string (with its special tokens, such as BOS); chat messages go
through the tokenizer's chat template, or ``FALLBACK_CHAT_TEMPLATE`` when it has none (the models users
fine-tune from a base checkpoint often do not). The weights load on CUDA when there is one, else the CPU,
in the dtype asked (``serving_dtype``; the KV cache follows the weights); nothing is downloaded
(``local_files_only``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from gpuflex.errors import BadRequest

log = logging.getLogger(__name__)

Dtype = Literal["bf16", "fp16", "fp32"]
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAVED = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # config.json's dtype names
ROLES = ("system", "user", "assistant")

# Each message as a role line and its content, then the assistant's line that the model continues.
FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def serving_dtype(asked: str, saved: str | None, device: torch.device) -> Dtype:
    """The dtype a model is served in. ``auto``: the checkpoint's when it is 16-bit, else bf16 (an fp32
    checkpoint, what training writes, would double the weights' and the cache's memory for digits sampling
    does not need). fp16 needs CUDA, as in training (``train.precision.effective``): elsewhere fp32, which
    of the CPU's dtypes computes closest to a GPU's fp16, so a CPU auditor of fp16 replicas judges fairly."""
    dtype = asked if asked != "auto" else saved if saved in ("bf16", "fp16") else "bf16"
    if dtype not in DTYPES:
        raise BadRequest(f"dtype {asked!r}: give auto, bf16, fp16 or fp32")
    if dtype == "fp16" and device.type != "cuda":
        log.warning("fp16 needs CUDA: the model is served in fp32 on %s", device)
        return "fp32"
    return dtype  # type: ignore[return-value]  # a key of DTYPES


@dataclass(frozen=True)
class ServedModel:
    model: torch.nn.Module  # in eval mode; call it under torch.inference_mode
    tokenizer: object  # a transformers tokenizer
    device: torch.device
    context: int  # tokens it attends over: prompt + output must fit (max_position_embeddings)
    eos: frozenset[int]  # token ids that end an output
    dtype: Dtype  # the weights' and the KV cache's

    @classmethod
    def load(
        cls, directory: str | Path, device: str | torch.device | None = None, dtype: str = "auto"
    ) -> ServedModel:
        """The model in ``directory``, its weights cast as they load (never a whole fp32 copy first)."""
        import transformers

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        saved = SAVED.get(str(getattr(config, "dtype", None)).removeprefix("torch."))
        served = serving_dtype(dtype, saved, device)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=DTYPES[served], local_files_only=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        context = model.config.max_position_embeddings
        return cls(model.to(device).eval(), tokenizer, device, context, frozenset(eos), served)

    def encode(self, prompt: str) -> list[int]:
        """A plain prompt's ids."""
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise BadRequest("prompt is empty: it must hold at least one token")
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages' ids, through the chat template, ending where the assistant's reply begins."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise BadRequest(f"messages[{i}].content must be a string")
        text = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            chat_template=None if self.tokenizer.chat_template else FALLBACK_CHAT_TEMPLATE,
            add_generation_prompt=True,
            tokenize=False,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt and output together would overrun the context."""
        if prompt_tokens + max_tokens > self.context:
            raise BadRequest(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} exceed this model's "
                f"context of {self.context} tokens"
            )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``ids``: the last layer's hidden states and the logits at every position."""
        with torch.inference_mode():
            out = self.model(torch.tensor([ids], device=self.device), output_hidden_states=True)
        return out.hidden_states[-1][0], out.logits[0]
