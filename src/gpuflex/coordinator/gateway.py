"""The OpenAI gateway's backend: ``routes/openai.py``'s routes over deployments' replicas on providers.

A request's ``model`` is a deployment of the caller's (its name, id or id prefix; ``services.
deployments.servable``); a deployment's API key reaches only its own deployment, any other is a 403 and
nothing is counted. The request goes to one of the deployment's replicas through this process's
``Relay``; the replica encodes the prompt and checks it against the context, so every refusal still comes
before a token streams. A request served under a key counts on the key (``deployment_keys.count``).
"""

# No ``from __future__ import annotations``: FastAPI reads ``backend``'s ``Annotated`` dependency.

import secrets
from typing import Annotated

from fastapi import Depends, Request

from gpuflex.coordinator.auth import Ctx, GatewayCaller, gateway_caller
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import Job
from gpuflex.coordinator.relay import Relay
from gpuflex.coordinator.services import deployment_keys, deployments, specs
from gpuflex.errors import Forbidden
from gpuflex.protocol.relay import RelayParams, RelayPrompt, RelayRequest
from gpuflex.serve.backend import Generation, ModelCard, Prompt
from gpuflex.serve.engine import Completion
from gpuflex.serve.sampling import SamplingParams


class GatewayBackend:
    """A ``serve.backend.Backend`` over the deployments ``caller`` may use."""

    def __init__(self, ctx: CoordinatorContext, relay: Relay, caller: GatewayCaller):
        self.ctx, self.relay, self.caller = ctx, relay, caller

    def models(self) -> list[ModelCard]:
        with self.ctx.read() as s:
            found = deployments.serving(s, self.caller.account_id)
        return [_card(d) for d in found if self.caller.deployment_id in (None, d.id)]

    def model(self, name: str) -> ModelCard:
        with self.ctx.read() as s:
            deployment = deployments.servable(s, self.caller.account_id, name)
        if self.caller.deployment_id not in (None, deployment.id):
            raise Forbidden(
                f"this API key is for {self.caller.deployment_id}, not {deployment.id}: "
                "use that deployment's own key"
            )
        return _card(deployment)

    def submit(self, model: str, prompt: Prompt, params: SamplingParams, *, fill: bool = False) -> Generation:
        params = params.seeded()  # chosen here: a request moved off a lost replica goes on with it
        request = RelayRequest(
            id=secrets.token_hex(12),
            prompt=RelayPrompt(
                text=prompt.text,
                ids=None if prompt.ids is None else list(prompt.ids),
                messages=None if prompt.messages is None else list(prompt.messages),
            ),
            params=RelayParams(
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_tokens,
                stop=list(params.stop),
                seed=params.seed,
            ),
            fill=fill,
        )
        with self.ctx.read() as s:
            live = deployments.live_replicas(s, model)
        generation = self.relay.submit(model, request, params, live)
        if self.caller.key_id is not None:
            generation.on_done = self._count
        return generation

    def _count(self, done: Completion) -> None:
        assert self.caller.key_id is not None, "only a key's requests are counted"
        with self.ctx.tx() as s:
            deployment_keys.count(
                s, self.caller.key_id, done.usage.prompt_tokens, done.usage.completion_tokens
            )


def _card(deployment: Job) -> ModelCard:
    return ModelCard(deployment.id, specs.deployment(deployment).context, int(deployment.created_at))


async def backend(
    request: Request, ctx: Ctx, caller: Annotated[GatewayCaller, Depends(gateway_caller)]
) -> GatewayBackend:
    """The routes' ``backend`` dependency: the gateway as the caller (authenticated once a request).
    async: it reads nothing, and FastAPI runs a plain ``def`` dependency in its thread pool (a hop)."""
    return GatewayBackend(ctx, request.app.state.relay, caller)
