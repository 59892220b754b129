"""What an OpenAI-compatible face needs from whatever serves model M, and the first such thing: an engine
in the same process.

``Backend`` is the seam between the HTTP routes (``gpuflex.coordinator.routes.openai``) and where the
tokens come from. It lives here, not in ``gpuflex.protocol``, because its currency is this package's own
types (``SamplingParams`` in; ``Event``s and a ``Completion`` out), which the wire contract below it may
not import. ``LocalBackend`` wraps one ``Engine``; the gateway's backend will reach a deployment's
replicas on providers and give the routes the same events and completion.

Every refusal is a ``gpuflex.errors`` error: ``NotFound`` for a model not served, ``BadRequest`` for the
rest (an empty prompt, one too long for the context, a token id outside the vocabulary), each saying why.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuflex.errors import BadRequest, NotFound
from gpuflex.serve.engine import Completion, Engine, Event
from gpuflex.serve.sampling import SamplingParams


@dataclass(frozen=True)
class ModelCard:
    name: str
    context: int  # prompt and output together fit in this many tokens
    created: int  # unix seconds: when it began to be served


class Generation(Protocol):
    """A submitted request: its events as they come (blocking), then its completion."""

    def __iter__(self) -> Iterator[Event]: ...

    def result(self) -> Completion: ...

    def cancel(self) -> None:
        """Stop generating: nobody will read the rest. Nothing happens once it has ended."""
        ...


class Backend(Protocol):
    def models(self) -> list[ModelCard]:
        """The models served, each once."""
        ...

    def model(self, name: str) -> ModelCard:
        """The model called ``name``; ``NotFound`` when none is."""
        ...

    def encode(self, model: str, prompt: str | Sequence[int]) -> list[int]:
        """A plain prompt (text, or token ids as given) as ids that leave room for an output."""
        ...

    def encode_chat(self, model: str, messages: list[dict]) -> list[int]:
        """Chat messages (``role``, ``content``) as ids ending where the reply begins, room left for it."""
        ...

    def submit(self, model: str, prompt: Sequence[int], params: SamplingParams) -> Generation:
        """Start generating; a ``BadRequest`` when prompt and ``max_tokens`` overrun the context."""
        ...


class LocalBackend:
    """One ``Engine`` in this process, serving its model under ``name``."""

    def __init__(self, engine: Engine, name: str):
        self.engine = engine
        self.card = ModelCard(name, engine.model.context, int(time.time()))

    def models(self) -> list[ModelCard]:
        return [self.card]

    def model(self, name: str) -> ModelCard:
        if name != self.card.name:
            raise NotFound(f"the model {name!r} does not exist: this server serves {self.card.name!r}")
        return self.card

    def encode(self, model: str, prompt: str | Sequence[int]) -> list[int]:
        card = self.model(model)
        ids = self.engine.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return _leaves_room(ids, card)

    def encode_chat(self, model: str, messages: list[dict]) -> list[int]:
        card = self.model(model)
        return _leaves_room(self.engine.model.encode_chat(messages), card)

    def submit(self, model: str, prompt: Sequence[int], params: SamplingParams) -> Generation:
        self.model(model)
        return self.engine.submit(prompt, params)


def _leaves_room(ids: list[int], card: ModelCard) -> list[int]:
    if not ids:
        raise BadRequest("prompt is empty: it must hold at least one token")
    if len(ids) >= card.context:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens long; this model's context is {card.context} tokens, "
            f"so a prompt may hold at most {card.context - 1}"
        )
    return ids
