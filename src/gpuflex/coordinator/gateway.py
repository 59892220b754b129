"""The OpenAI gateway's backend: ``routes/openai.py``'s routes over deployments' replicas on providers.

A request's ``model`` is a deployment of the caller's (its name, id or id prefix; ``services.
deployments.servable``); a deployment's API key reaches only its own deployment, any other is a 403 and
nothing is counted. A priced key whose holder cannot pay is refused (402) before anything is sent
(``deployment_keys.ensure_payable``). The request goes to one of the deployment's replicas through this
process's ``Relay``; the replica encodes the prompt and checks it against the context, so every refusal
still comes before a token streams. A request served under a key counts on the key
(``deployment_keys.count``); one served to the owner's account token on the deployment's account-token
row (``count_account``), once; every completed request is drawn for audit at the deployment's
``audit_rate`` (``inference_audits``), in the same transaction. Each served request's tokens and
latency, and each refusal by its OpenAI error type and status, go to the deployment's Prometheus series
(``metrics.CoordinatorMetrics``).
"""

# No ``from __future__ import annotations``: FastAPI reads ``backend``'s ``Annotated`` dependency.

import secrets
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from gpuflex.coordinator.auth import Ctx, GatewayCaller, gateway_caller
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import Job
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.relay import REMOTE, Relay, RemoteGeneration
from gpuflex.coordinator.routes.openai import error_body
from gpuflex.coordinator.services import deployment_keys, deployments, inference_audits, specs
from gpuflex.errors import Forbidden, GPUFlexError
from gpuflex.protocol.relay import RelayParams, RelayPrompt, RelayRequest
from gpuflex.serve.backend import Generation, ModelCard, Prompt
from gpuflex.serve.engine import Completion
from gpuflex.serve.sampling import SamplingParams

T = TypeVar("T")
UNKNOWN = "unknown"  # the deployment label of a request whose model names none of the caller's


class GatewayBackend:
    """A ``serve.backend.Backend`` over the deployments ``caller`` may use."""

    def __init__(
        self, ctx: CoordinatorContext, relay: Relay, caller: GatewayCaller, metrics: CoordinatorMetrics
    ):
        self.ctx, self.relay, self.caller, self.metrics = ctx, relay, caller, metrics

    def models(self) -> list[ModelCard]:
        with self.ctx.read() as s:
            found = deployments.serving(s, self.caller.account_id)
        return [_card(d) for d in found if self.caller.deployment_id in (None, d.id)]

    def model(self, name: str) -> ModelCard:
        with self.ctx.read() as s:
            deployment = self._refusing(UNKNOWN, deployments.servable, s, self.caller.account_id, name)
        if self.caller.deployment_id not in (None, deployment.id):
            refused = Forbidden(
                f"this API key is for {self.caller.deployment_id}, not {deployment.id}: "
                "use that deployment's own key"
            )
            self._count_error(deployment.id, refused)
            raise refused
        return _card(deployment)

    def submit(self, model: str, prompt: Prompt, params: SamplingParams, *, fill: bool = False) -> Generation:
        return self._refusing(model, self._submit, model, prompt, params, fill)

    def _submit(self, model: str, prompt: Prompt, params: SamplingParams, fill: bool) -> Generation:
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
            if self.caller.key_id is not None:
                context = specs.deployment(s.get(Job, model)).context
                deployment_keys.ensure_payable(s, self.caller.key_id, context)
            live = deployments.live_replicas(s, model)
        began = time.perf_counter()
        generation = self.relay.submit(model, request, params, live)
        generation.on_done = lambda done: self._served(generation, done, time.perf_counter() - began)
        return generation

    def _served(self, generation: RemoteGeneration, done: Completion, seconds: float) -> None:
        """Count the request once (on its key, or the owner's account-token row) and draw it for audit,
        in one transaction."""
        deployment_id = generation.deployment_id
        prompt_tokens, completion_tokens = done.usage.prompt_tokens, done.usage.completion_tokens
        self.metrics.deployment_served(deployment_id, prompt_tokens, completion_tokens, seconds)
        with self.ctx.tx() as s:
            if self.caller.key_id is not None:
                deployment_keys.count(s, self.caller.key_id, prompt_tokens, completion_tokens)
            else:
                deployment_keys.count_account(s, deployment_id, prompt_tokens, completion_tokens)
            lease_id = generation.lease_id.removeprefix(REMOTE)
            inference_audits.sample(s, deployment_id, lease_id, done, self.ctx.now())

    def _refusing(self, deployment_id: str, call: Callable[..., T], *args: object) -> T:
        """``call(*args)``; a refusal it raises is counted on the deployment's error series first."""
        try:
            return call(*args)
        except GPUFlexError as err:
            self._count_error(deployment_id, err)
            raise

    def _count_error(self, deployment_id: str, err: GPUFlexError) -> None:
        status, body = error_body(err)
        self.metrics.deployment_errors.labels(deployment_id, body.error.type, str(status)).inc()


def _card(deployment: Job) -> ModelCard:
    return ModelCard(deployment.id, specs.deployment(deployment).context, int(deployment.created_at))


async def backend(
    request: Request, ctx: Ctx, caller: Annotated[GatewayCaller, Depends(gateway_caller)]
) -> GatewayBackend:
    """The routes' ``backend`` dependency: the gateway as the caller (authenticated once a request).
    async: it reads nothing, and FastAPI runs a plain ``def`` dependency in its thread pool (a hop)."""
    return GatewayBackend(ctx, request.app.state.relay, caller, request.app.state.metrics)
