"""A served model: a ``save_pretrained`` directory loaded once, its context, and prompts as token ids.

The engine decodes with it and the verifier prefills with it, so both read prompts the same way: a plain
prompt is the tokenizer's encoding of the string (with its special tokens, such as BOS); chat messages go
through the tokenizer's chat template, or ``FALLBACK_CHAT_TEMPLATE`` when it has none (the models users
fine-tune from a base checkpoint often do not). The weights load in the dtype they were saved in, on CUDA
when there is one, else the CPU; nothing is downloaded (``local_files_only``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gpuflex.errors import BadRequest

ROLES = ("system", "user", "assistant")

# Each message as a role line and its content, then the assistant's line that the model continues.
FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ServedModel:
    model: torch.nn.Module  # in eval mode; call it under torch.inference_mode
    tokenizer: object  # a transformers tokenizer
    device: torch.device
    context: int  # tokens it attends over: prompt + output must fit (max_position_embeddings)
    eos: frozenset[int]  # token ids that end an output

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device | None = None) -> ServedModel:
        import transformers

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        eos = model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        context = model.config.max_position_embeddings
        return cls(model.to(device).eval(), tokenizer, device, context, frozenset(eos))

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
