"""What an OpenAI-compatible face needs from whatever serves model M, and the first such thing: an engine
in the same process.

``Backend`` is the seam between the HTTP routes (``gpuflex.coordinator.routes.openai``) and where the
tokens come from. It lives here, not in ``gpuflex.protocol``, because its currency is this package's own
types (``SamplingParams`` in; ``Event``s and a ``Completion`` out), which the wire contract below it may
not import. ``LocalBackend`` wraps one ``Engine``; the coordinator's gateway reaches a deployment's
replicas on providers and gives the routes the same events and completion.

A ``Prompt`` is encoded where the model's tokenizer is, inside ``submit``: the gateway holds no model, so a
deployment's replica encodes it (with ``LocalBackend`` over its engine) and refuses it there, before any
token streams, when it leaves no room in the context.

Every refusal is a ``gpuflex.errors`` error: ``NotFound`` for a model not served, ``BadRequest`` for the
rest (an empty prompt, one too long for the context, a token id outside the vocabulary), each saying why.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpuflex.errors import BadRequest, NotFound
from gpuflex.serve.engine import Completion, Engine, Event
from gpuflex.serve.sampling import SamplingParams


@dataclass(frozen=True)
class ModelCard:
    name: str
    context: int  # prompt and output together fit in this many tokens
    created: int  # unix seconds: when it began to be served


@dataclass(frozen=True)
class Prompt:
    """What to complete, exactly one of: text or token ids (``/completions``), or chat messages
    (``/chat/completions``: ``role`` and ``content`` each, through the model's chat template)."""

    text: str | None = None
    ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None


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

    def submit(self, model: str, prompt: Prompt, params: SamplingParams, *, fill: bool = False) -> Generation:
        """Encode ``prompt`` and start generating; with ``fill`` the output may take the rest of the
        context (``params.max_tokens`` is not used). A ``BadRequest`` when the prompt is empty, leaves no
        room for an output, or with ``max_tokens`` overruns the context."""
        ...


class LocalBackend:
    """One ``Engine`` in this process, serving its model under ``name``; ``context`` caps the model's own
    (a deployment's limit)."""

    def __init__(self, engine: Engine, name: str, context: int | None = None):
        self.engine = engine
        limit = engine.model.context if context is None else min(context, engine.model.context)
        self.card = ModelCard(name, limit, int(time.time()))

    def models(self) -> list[ModelCard]:
        return [self.card]

    def model(self, name: str) -> ModelCard:
        if name != self.card.name:
            raise NotFound(f"the model {name!r} does not exist: this server serves {self.card.name!r}")
        return self.card

    def submit(
        self,
        model: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        fill: bool = False,
        resume: Sequence[int] = (),
    ) -> Generation:
        """As ``Backend.submit``; ``resume``: output tokens another server already sent, continued after
        (``Engine.submit``)."""
        card = self.model(model)
        ids = _leaves_room(self._encode(prompt), card)
        if fill:
            params = replace(params, max_tokens=card.context - len(ids))
        elif len(ids) + params.max_tokens > card.context:
            raise BadRequest(
                f"the prompt's {len(ids)} tokens plus max_tokens {params.max_tokens} exceed this model's "
                f"context of {card.context} tokens"
            )
        return self.engine.submit(ids, params, resume)

    def _encode(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            return self.engine.model.encode_chat(list(prompt.messages))
        if prompt.text is not None:
            return self.engine.model.encode(prompt.text)
        return list(prompt.ids or ())


def _leaves_room(ids: list[int], card: ModelCard) -> list[int]:
    if not ids:
        raise BadRequest("prompt is empty: it must hold at least one token")
    if len(ids) >= card.context:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens long; this model's context is {card.context} tokens, "
            f"so a prompt may hold at most {card.context - 1}"
        )
    return ids
