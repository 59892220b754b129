"""The relay between the coordinator's gateway and a deployment's replicas: requests down, events up.

A provider never listens, so a replica (a ``server`` task, with its lease's task token) holds the line
open from its side: it long-polls ``GET /v1/task/relay`` for ``RelayWork`` (requests to serve, requests
to cancel), which answers as soon as there is some, and posts what its engine produces to
``POST /v1/task/relay/events`` as ``RelayEvents``, batched while the previous post is in flight; before
its first poll it says what it is doing (``RelayPhase``: downloading, loading the model). Each
request gets ``started`` (the replica encoded it and it fits) or ``error`` first, then ``token`` events
and one ``done`` with the completion, whose fingerprints are base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpuflex.protocol.messages import Message

MAX_RELAY_BATCH = 256  # requests or events in one message
RequestId = Annotated[str, Field(min_length=1, max_length=64)]
# a proof of 32 tokens (``serve.fingerprint``: at most 258 bytes), base64: what an audit keeps of it
Fingerprint = Annotated[str, Field(max_length=344, description="base64 of at most 258 bytes")]


# What a replica does before it serves, as it tells (``POST /v1/task/relay/phase``); its first poll makes
# it ``serving``: only then is it live, and its deployment ``running``.
ReplicaPhase = Literal["downloading", "loading"]


class RelayPhase(Message):
    phase: ReplicaPhase


class RelayPrompt(Message):
    """What to complete, one of: text, token ids, chat messages (``serve.backend.Prompt``)."""

    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


class RelayParams(Message):
    """``serve.sampling.SamplingParams`` as sent; the replica checks them again."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None


class RelayRequest(Message):
    id: RequestId
    prompt: RelayPrompt
    params: RelayParams
    fill: bool = Field(False, description="the output may take the rest of the context (max_tokens unused)")
    resume: list[int] = Field(
        default_factory=list,
        description="output tokens a lost replica already sent: continue after them (same seed)",
    )


class RelayWork(Message):
    """A poll's answer: requests to start and requests to stop (their clients went away)."""

    requests: Annotated[list[RelayRequest], Field(max_length=MAX_RELAY_BATCH)] = Field(default_factory=list)
    cancel: Annotated[list[RequestId], Field(max_length=MAX_RELAY_BATCH)] = Field(default_factory=list)


class RelayCompletion(Message):
    """``serve.engine.Completion`` as sent: what the gateway answers and bills with, and what an audit
    re-checks (prompt, tokens, seed, fingerprints)."""

    prompt: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    seed: int
    prompt_tokens: int
    completion_tokens: int
    resumed_tokens: int = 0
    fingerprints: list[Fingerprint] = Field(default_factory=list, description="one per 32 output tokens")


class RelayEvent(Message):
    id: RequestId
    kind: Literal["started", "token", "done", "error"]
    token: int | None = None
    text: str = ""
    finish_reason: str | None = None
    completion: RelayCompletion | None = Field(None, description="with done")
    status: int | None = Field(None, description="with error: the HTTP status it stands for")
    message: str = Field("", description="with error: why")


class RelayEvents(Message):
    events: Annotated[list[RelayEvent], Field(max_length=MAX_RELAY_BATCH)]
