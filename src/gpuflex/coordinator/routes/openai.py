"""The OpenAI-compatible face: ``POST /completions``, ``POST /chat/completions``, ``GET /models`` (mount
it under ``/v1``), over any ``gpuflex.serve.backend.Backend``.

``create_router(backend, authorize)`` takes both as FastAPI dependencies, so the same routes serve an
engine in this process (``gpuflex serve DIR``: a ``LocalBackend`` and one API key) and, later, a
deployment's replicas on providers behind the coordinator (an account's token and the deployments
service). The router answers its own errors as OpenAI's error object, whatever app mounts it: its route
class turns every ``gpuflex.errors`` error into ``{"error": {...}}`` with the status the error carries,
and the body is parsed here, after the key is checked, so malformed JSON is a 400 in that shape (not
FastAPI's 422) and nobody without the key learns what the body should have been.

Generation blocks (the engine's queue), so it never runs on the event loop: encoding, submitting and
waiting for a completion run in the thread pool, and a stream's events are read by a thread of its own,
whose lines the loop writes as they come, those that came together in one write (not a hop to the thread
pool and back per token). Everything that can refuse a request (model, fields, context, ranges) refuses
it before a stream starts, so a refusal is always a 4xx; only a failure while generating reaches a
streaming client, as an ``error`` event. A client that goes away cancels its generation.
Bodies are read up to ``MAX_BODY_BYTES``.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' ``Annotated`` dependencies, which
# are local to ``create_router``, from the live annotations.

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from gpuflex.errors import (
    BadRequest,
    GPUFlexError,
    InsufficientFunds,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
)
from gpuflex.protocol import openai as o
from gpuflex.serve.backend import Backend, Generation, ModelCard, Prompt
from gpuflex.serve.engine import Completion
from gpuflex.serve.sampling import SamplingParams

Body = TypeVar("Body", bound=BaseModel)

# Bodies are read up to this: the longest context's prompt as JSON text fits many times over, and a body
# is held whole in memory while it is parsed.
MAX_BODY_BYTES = 4 << 20

# How often a request waiting for its whole completion looks whether its client is still there.
DISCONNECT_POLL_S = 0.5

# SamplingParams's refusals begin with the field they name; the error object names it as ``param``.
_SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens", "stop", "seed")


class Refused(BadRequest):
    """A 400 that names the field at fault (``param``) and, where OpenAI has one, its ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def error_body(exc: GPUFlexError) -> tuple[int, o.ErrorResponse]:
    """An error's status and its OpenAI error object."""
    param = code = None
    kind = "invalid_request_error"
    if isinstance(exc, Refused):
        param, code = exc.param, exc.code
    elif isinstance(exc, NotFound):
        param, code = "model", "model_not_found"
    elif isinstance(exc, Unauthorized):
        code = "invalid_api_key"
    elif isinstance(exc, RateLimited):
        kind = code = "rate_limit_exceeded"
    elif isinstance(exc, InsufficientFunds):  # a priced key whose holder cannot pay: OpenAI's out of credit
        kind = code = "insufficient_quota"
    elif isinstance(exc, BadRequest):
        first = exc.message.split(" ", 1)[0]
        param = first if first in _SAMPLING_FIELDS else None
        code = "context_length_exceeded" if "context" in exc.message else None
    return exc.status_code, o.ErrorResponse(
        error=o.Error(message=exc.message, type=kind, param=param, code=code)
    )


def _error_response(exc: GPUFlexError) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body.model_dump(), status_code=status)


class OpenAIRoute(APIRoute):
    """A route whose errors, from its dependencies or its body, are OpenAI error objects."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except GPUFlexError as exc:
                return _error_response(exc)
            except RequestValidationError as exc:  # a query or path parameter: the body is parsed here
                return _error_response(Refused(_problems(exc.errors())))

        return answer


def api_key_check(key: str | None) -> Callable:
    """A dependency that lets through only ``Authorization: Bearer <key>``; everyone when ``key`` is None."""

    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise Unauthorized(
                "missing or incorrect API key: send the key this server was started with, "
                "as Authorization: Bearer KEY (the openai client's api_key)"
            )

    return check


def create_router(backend: Callable[..., Backend], authorize: Callable[..., Any]) -> APIRouter:
    """The routes over the backend ``backend`` gives, for callers ``authorize`` lets through (both
    FastAPI dependencies; ``authorize`` raises ``Unauthorized`` for the others)."""
    Served = Annotated[Backend, Depends(backend)]
    router = APIRouter(
        route_class=OpenAIRoute,
        dependencies=[Depends(authorize)],
        tags=["openai"],
        responses={status: {"model": o.ErrorResponse} for status in (400, 401, 402, 404, 413, 429)},
    )

    @router.get("/models")
    async def list_models(served: Served) -> o.ModelList:
        return o.ModelList(data=[_model(card) for card in served.models()])

    @router.get("/models/{name:path}")
    async def get_model(name: str, served: Served) -> o.Model:
        return _model(served.model(name))

    @router.post("/completions", openapi_extra=_documented(o.CompletionRequest))
    async def completions(request: Request, served: Served) -> Response:
        body = await _parse(request, o.CompletionRequest)
        card, generation = await _submit(served, body, partial(_prompt, body.prompt), body.max_tokens)
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": card.name}
        if body.stream:
            return _stream(_completion_chunks(generation, head, body.include_usage), generation)

        def whole(done: Completion) -> o.Completion:
            choice = o.CompletionChoice(text=done.text, finish_reason=done.finish_reason)
            return o.Completion(**head, choices=[choice], usage=_usage(done))

        return await _answer(request, generation, whole)

    @router.post("/chat/completions", openapi_extra=_documented(o.ChatCompletionRequest))
    async def chat_completions(request: Request, served: Served) -> Response:
        body = await _parse(request, o.ChatCompletionRequest)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        card, generation = await _submit(served, body, partial(_chat_prompt, body.messages), asked)
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": card.name}
        if body.stream:
            return _stream(_chat_chunks(generation, head, body.include_usage), generation)

        def whole(done: Completion) -> o.ChatCompletion:
            message = o.ResponseMessage(content=done.text)
            choice = o.ChatChoice(message=message, finish_reason=done.finish_reason)
            return o.ChatCompletion(**head, choices=[choice], usage=_usage(done))

        return await _answer(request, generation, whole)

    return router


def _documented(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its own (``_parse``): ``model``'s schema, inline
    (a route's schema cannot add to the document's components)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        return [inline(value) for value in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def _parse(request: Request, model: type[Body]) -> Body:
    """The body as ``model``; a ``Refused`` naming what is wrong (not JSON, a field's type, a field asking
    for what is not served)."""
    try:
        data = json.loads(await _read(request))
    except (ValueError, UnicodeDecodeError) as err:
        raise Refused(f"the body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise Refused("the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        problems = err.errors()
        raise Refused(_problems(problems), param=_where(problems[0]["loc"])) from None
    if found := body.unsupported():
        raise Refused(found[1], param=found[0])
    return body


# Where a problem is, as OpenAI's ``param``: a field's path, without FastAPI's "body"/"query" or the
# member of a union pydantic tried ("prompt.str", "prompt.list[int]": both are "prompt").
_NOT_A_PLACE = {"body", "query", "path", "str", "int", "float", "bool"}


async def _read(request: Request) -> bytes:
    """The body, refused with a 413 as soon as it passes ``MAX_BODY_BYTES`` (declared or streamed)."""
    too_large = PayloadTooLarge(f"the body is over {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _where(loc: tuple) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _NOT_A_PLACE or "[" in p))]
    return ".".join(parts) or "body"


def _problems(problems: list[dict]) -> str:
    """One line: each field's first problem (a union field fails once for each member)."""
    seen: dict[str, str] = {}
    for problem in problems:
        seen.setdefault(_where(problem["loc"]), problem["msg"])
    return "; ".join(f"{where}: {msg}" for where, msg in seen.items())


def _prompt(prompt: str | list) -> Prompt:
    """One prompt, as text or token ids; OpenAI's batches of prompts are refused (one choice a request)."""
    if not isinstance(prompt, str) and not all(isinstance(t, int) for t in prompt):
        if len(prompt) != 1:
            raise Refused(f"prompt holds {len(prompt)} prompts: send one prompt per request", param="prompt")
        prompt = prompt[0]
    return Prompt(text=prompt) if isinstance(prompt, str) else Prompt(ids=tuple(prompt))


def _chat_prompt(messages: list[o.ChatMessage]) -> Prompt:
    return Prompt(messages=tuple(_messages(messages)))


def _messages(messages: list[o.ChatMessage]) -> list[dict]:
    """Messages as the model's chat template takes them: text parts joined, ``developer`` as ``system``."""
    plain = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise Refused(f"messages[{i}].content: only text parts are served", param="messages")
            content = "".join(part.text or "" for part in content)
        role = "system" if message.role == "developer" else message.role
        plain.append({"role": role, "content": content})
    return plain


async def _submit(
    served: Backend, body: Any, prompt: Callable[[], Prompt], max_tokens: int | None
) -> tuple[ModelCard, Generation]:
    """The model asked for, and its generation started (encoded and checked against the context where
    the model is); a chat request without ``max_tokens`` may fill the context. In the thread pool, in one
    go: finding the model may read the database. Refused in this order: the model, the prompt, the
    sampling settings."""

    def start() -> tuple[ModelCard, Generation]:
        card = served.model(body.model)
        asked = prompt()
        given = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": body.stop,
            "seed": body.seed,
            "max_tokens": max_tokens,
        }
        params = SamplingParams(**{name: value for name, value in given.items() if value is not None})
        fill = max_tokens is None and asked.messages is not None
        return card, served.submit(card.name, asked, params, fill=fill)

    return await run_in_threadpool(start)


async def _result(request: Request, generation: Generation) -> Completion | None:
    """The completion; None when the client went away before it (looked at every
    ``DISCONNECT_POLL_S``), and the generation is cancelled."""
    waiting = asyncio.ensure_future(run_in_threadpool(generation.result))
    while not (await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            generation.cancel()
            with contextlib.suppress(Exception):  # it ends now, refused as cancelled
                await waiting
            return None
    return waiting.result()


def _model(card: ModelCard) -> o.Model:
    return o.Model(id=card.name, created=card.created)


def _usage(done: Completion) -> o.Usage:
    prompt, output = done.usage.prompt_tokens, done.usage.completion_tokens
    return o.Usage(prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output)


async def _answer(
    request: Request, generation: Generation, whole: Callable[[Completion], BaseModel]
) -> Response:
    """A non-streamed request's response: ``whole`` of its completion, or 499 if the client left first."""
    done = await _result(request, generation)
    if done is None:
        return Response(status_code=499)  # nobody reads it: the client closed the request
    return _json(whole(done))


def _json(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"))


def _stream(events: Iterator[BaseModel], generation: Generation) -> StreamingResponse:
    """Server-sent events: each chunk as ``data: {...}``, then ``data: [DONE]``. A failure while
    generating is sent as an error event (the status is long gone) and ends the stream; a client that
    goes away cancels the generation (the response's task is cancelled where it awaits the next line)."""

    def lines() -> Iterator[str]:
        try:
            for chunk in events:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except GPUFlexError as err:
            yield f"data: {error_body(err)[1].model_dump_json()}\n\n"
            return
        except Exception as err:
            failed = o.ErrorResponse(error=o.Error(message=f"generation failed: {err}", type="server_error"))
            yield f"data: {failed.model_dump_json()}\n\n"
            return
        yield "data: [DONE]\n\n"

    async def sent() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue[str | None] = asyncio.Queue()  # None: the last line was sent

        def put(line: str | None) -> None:
            with contextlib.suppress(RuntimeError):  # the server is gone: nobody reads it
                loop.call_soon_threadsafe(ready.put_nowait, line)

        def pump() -> None:
            try:
                for line in lines():
                    put(line)
            finally:
                put(None)

        threading.Thread(target=pump, name="sse", daemon=True).start()
        try:
            while (line := await ready.get()) is not None:
                taken = [line]  # the lines that came meanwhile go in the same write
                while not ready.empty() and (line := ready.get_nowait()) is not None:
                    taken.append(line)
                yield "".join(taken)
                if line is None:
                    return
        finally:
            generation.cancel()  # nothing, when it ended

    return StreamingResponse(
        sent(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _chat_chunks(generation: Generation, head: dict, include_usage: bool) -> Iterator[o.ChatCompletionChunk]:
    def chunk(delta: o.Delta, finish_reason: str | None = None) -> o.ChatCompletionChunk:
        return o.ChatCompletionChunk(
            **head, choices=[o.ChunkChoice(delta=delta, finish_reason=finish_reason)]
        )

    yield chunk(o.Delta(role="assistant", content=""))
    for event in generation:
        if event.text:
            yield chunk(o.Delta(content=event.text))
        if event.finish_reason:
            yield chunk(o.Delta(), event.finish_reason)
    if include_usage:
        yield o.ChatCompletionChunk(**head, choices=[], usage=_usage(generation.result()))


def _completion_chunks(generation: Generation, head: dict, include_usage: bool) -> Iterator[o.Completion]:
    for event in generation:
        if event.text or event.finish_reason:
            choice = o.CompletionChoice(text=event.text, finish_reason=event.finish_reason)
            yield o.Completion(**head, choices=[choice])
    if include_usage:
        yield o.Completion(**head, choices=[], usage=_usage(generation.result()))
