"""The OpenAI-compatible wire contract: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Requests take the fields OpenAI's clients send and ignore the others (a client built for OpenAI sends
``user``, ``metadata``, ``store`` and more: refusing them would refuse the client). What would change the
answer and is not served here (several choices, logprobs, tools, penalties, a JSON mode, …) is refused
by ``unsupported()``, naming the field; the schema states what such a field may hold (``_Only``: its
default, or what means the same), and so what a batch of prompts or a part that is not text may. The
ranges (temperature, top_p, max_tokens, seed) are checked
once, by ``gpuflex.serve.sampling.SamplingParams``, where the engine needs them.

Errors are OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: its clients raise
their typed errors from it (``BadRequestError``, ``NotFoundError``, ``AuthenticationError``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema


def _only(*schemas: dict) -> WithJsonSchema:
    """A field's schema: any of ``schemas``, what the server serves of what the field's type takes."""
    return WithJsonSchema({"anyOf": list(schemas)} if len(schemas) > 1 else schemas[0])


NULL, EMPTY_LIST, EMPTY_OBJECT = (
    {"type": "null"},
    {"type": "array", "maxItems": 0},
    {"type": "object", "maxProperties": 0},
)


class _Tolerant(BaseModel):
    """A request body: unknown fields are ignored (OpenAI's clients send many), known ones typed."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Tolerant):
    include_usage: bool = False


class ContentPart(_Tolerant):
    model_config = ConfigDict(json_schema_extra={"required": ["type", "text"]})  # only text is served

    type: Annotated[str, _only({"const": "text"})]
    text: Annotated[str | None, _only({"type": "string"})] = None


class ChatMessage(_Tolerant):
    role: str
    content: str | list[ContentPart] | None = None


class _Common(_Tolerant):
    """What both endpoints take, with OpenAI's meaning; ``None`` is the engine's default."""

    model: str = Field(max_length=256)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # refused unless at their default (``unsupported``): accepted here only to say so by name
    n: Annotated[int | None, _only({"const": 1}, NULL)] = None
    logprobs: Annotated[Any, _only({"enum": [False, 0]}, NULL)] = None
    logit_bias: Annotated[dict[str, Any] | None, _only(EMPTY_OBJECT, NULL)] = None
    presence_penalty: Annotated[float | None, _only({"const": 0}, NULL)] = None
    frequency_penalty: Annotated[float | None, _only({"const": 0}, NULL)] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> tuple[str, str] | None:
        """The first field asking for what is not served here, and why; None when there is none."""
        if self.n not in (None, 1):
            return "n", "n must be 1: one choice per request is served"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not served"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported: leave it 0"
        return None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    top_logprobs: Annotated[int | None, _only(NULL)] = None
    tools: Annotated[list[Any] | None, _only(EMPTY_LIST, NULL)] = None
    tool_choice: Annotated[Any, _only({"const": "none"}, NULL)] = None
    functions: Annotated[list[Any] | None, _only(EMPTY_LIST, NULL)] = None
    function_call: Annotated[Any, _only({"const": "none"}, NULL)] = None
    response_format: Annotated[
        dict[str, Any] | None,
        _only(
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
            EMPTY_OBJECT,
            NULL,
        ),
    ] = None
    audio: Annotated[Any, _only(NULL)] = None

    def unsupported(self) -> tuple[str, str] | None:
        if found := super().unsupported():
            return found
        if self.top_logprobs is not None:
            return "top_logprobs", "logprobs are not served"
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name, f"{name} (function calling) are not supported"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                return name, f"{name} is not supported: no tools are served"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "response_format other than text (JSON mode, schemas) is not supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        return None


class CompletionRequest(_Common):
    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]],
        _only(  # one prompt a request (``_prompt``): a batch holds one
            {"type": "string"},
            {"type": "array", "items": {"type": "integer"}},
            {"type": "array", "items": {"type": "string"}, "maxItems": 1},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "maxItems": 1},
        ),
    ]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: Annotated[int | None, _only({"const": 1}, NULL)] = None
    echo: Annotated[bool, _only({"const": False})] = False
    suffix: Annotated[str | None, _only({"type": "string", "maxLength": 0}, NULL)] = None

    def unsupported(self) -> tuple[str, str] | None:
        if found := super().unsupported():
            return found
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # the last chunk's (with no choices) when stream_options.include_usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None  # None on a streamed chunk that does not end the output
    logprobs: None = None


class Completion(BaseModel):
    """A text completion; streamed, each chunk is one of these too (``object`` stays ``text_completion``,
    as OpenAI sends it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gpuflex"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Error(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error
