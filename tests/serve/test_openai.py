"""The OpenAI-compatible face, through the official ``openai`` client against ``gpuflex serve``'s app on
loopback: chat and completions, streamed as the whole, seeds, stop strings, the model list, and every bad
input as the client's typed error with a message that says what was wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from fastapi import FastAPI
from typer.testing import CliRunner

from gpuflex.cli import serve as serve_cli
from gpuflex.cli.main import app as cli_app
from gpuflex.coordinator.routes.openai import MAX_BODY_BYTES, api_key_check, create_router
from gpuflex.errors import BadRequest
from gpuflex.localnet import free_port
from gpuflex.serve.backend import ModelCard
from gpuflex.serve.engine import Completion, Event, Usage
from gpuflex.serve.sampling import SamplingParams
from gpuflex.testing import serve

NAME, KEY = "tiny", "sk-test-key"


@pytest.fixture(scope="module")
def url(model_dir):
    app, engine = serve_cli.create_app(model_dir, NAME, KEY, max_batch=4)
    try:
        with serve(app) as base:
            yield f"{base}/v1"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(conversations) -> list[dict]:
    return conversations[0]


def test_the_model_list_names_the_served_model(client, served):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_a_chat_completion_counts_its_tokens(client, served, chat):
    answer = client.chat.completions.create(model=NAME, messages=chat, max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and answer.model == NAME
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(served.encode_chat(chat))
    assert 0 < answer.usage.completion_tokens <= 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client, served, chat):
    answer = client.chat.completions.create(model=NAME, messages=chat, temperature=0)
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= served.context


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_greedy_stream_joins_to_the_whole_answer_and_counts_usage_once(client, chat, kind):
    if kind == "chat":
        ask = {"model": NAME, "messages": chat, "max_tokens": 30, "temperature": 0}
        whole = client.chat.completions.create(**ask)
        text = whole.choices[0].message.content
        chunks = list(
            client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
    else:
        ask = {"model": NAME, "prompt": chat[1]["content"], "max_tokens": 30, "temperature": 0}
        whole = client.completions.create(**ask)
        text = whole.choices[0].text
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) > 3 and text
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert usages == [whole.usage]
    assert chunks[-1].usage == whole.usage and not chunks[-1].choices


def test_a_stream_without_include_usage_carries_none(client, chat):
    chunks = list(client.chat.completions.create(model=NAME, messages=chat, max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_seed_reproduces_the_sampled_answer(client, chat):
    def ask(seed: int) -> str:
        answer = client.chat.completions.create(
            model=NAME, messages=chat, max_tokens=24, temperature=1.0, seed=seed
        )
        return answer.choices[0].message.content

    assert ask(7) == ask(7)
    assert len({ask(seed) for seed in range(4)}) > 1  # the seed decides: others draw otherwise


def test_the_answer_ends_before_a_stop_string(client, chat):
    prompt = chat[1]["content"]
    long = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0).choices[0]
    assert long.finish_reason == "length" and len(long.text) > 12
    stop = long.text[8:11]
    for given in (stop, [stop, "\x00never"]):
        cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=given)
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == (
            long.text[: long.text.index(stop)],
            "stop",
        )


def test_token_ids_are_a_prompt_too(client, served, chat):
    prompt = chat[1]["content"]
    as_text = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    as_ids = client.completions.create(model=NAME, prompt=served.encode(prompt), max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text


def _refused(call, error: type[openai.APIStatusError], *words: str) -> dict:
    with pytest.raises(error) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict), body
    for word in words:
        assert word in body["message"], body
    return body


def test_an_unknown_model_is_not_found(client, chat):
    body = _refused(
        lambda: client.chat.completions.create(model="gpt-5", messages=chat),
        openai.NotFoundError,
        "gpt-5",
        NAME,
    )
    assert (body["code"], body["param"]) == ("model_not_found", "model")


def test_a_prompt_longer_than_the_context_is_refused_with_the_limit(client, served, chat):
    long = " ".join([chat[1]["content"]] * 60)
    assert len(served.encode(long)) > served.context
    body = _refused(
        lambda: client.completions.create(model=NAME, prompt=long),
        openai.BadRequestError,
        str(served.context),
    )
    assert body["code"] == "context_length_exceeded"
    short = chat[1]["content"]
    _refused(
        lambda: client.completions.create(model=NAME, prompt=short, max_tokens=served.context),
        openai.BadRequestError,
        f"context of {served.context} tokens",
    )


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", 0, ["max_tokens", "at least 1"]),
        ("max_tokens", -3, ["max_tokens"]),
        ("temperature", 2.5, ["temperature", "between 0 and 2"]),
        ("temperature", -1, ["temperature"]),
        ("top_p", 0, ["top_p"]),
        ("top_p", 1.5, ["top_p"]),
        ("seed", -1, ["seed"]),
        ("n", 2, ["n must be 1"]),
        ("logprobs", True, ["logprobs"]),
        ("tools", [{"type": "function", "function": {"name": "f"}}], ["tools"]),
        ("presence_penalty", 0.5, ["presence_penalty"]),
        ("temperature", "hot", ["temperature"]),
    ],
)
def test_a_bad_field_is_a_400_naming_it(client, chat, field, value, words):
    body = _refused(
        lambda: client.chat.completions.create(
            model=NAME, messages=chat, max_tokens=4, extra_body={field: value}
        ),
        openai.BadRequestError,
        *words,
    )
    assert body["param"] == field
    assert body["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(client, chat):
    answer = client.chat.completions.create(
        model=NAME, messages=chat, max_tokens=3, user="someone", extra_body={"no_such_field": 1}
    )
    assert answer.choices[0].message.content is not None


def test_bad_messages_are_refused(client):
    _refused(
        lambda: client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "hi"}]),
        openai.BadRequestError,
        "messages[0].role",
    )
    _refused(
        lambda: client.chat.completions.create(model=NAME, messages=[]), openai.BadRequestError, "messages"
    )


def test_malformed_json_is_a_400_error_object(url):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b'{"model": "tiny", "messages": [', b"[1, 2]", b"\xff\xfe"):
        answer = httpx.post(f"{url}/chat/completions", content=body, headers=headers)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("the body")


def test_a_body_over_the_limit_is_a_413_error_object(url):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    huge = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    for sent in (huge, iter([huge[:1000], huge[1000:]])):  # declared, then streamed without a length
        answer = httpx.post(f"{url}/completions", content=sent, headers=headers)
        assert answer.status_code == 413, answer.text
        assert str(MAX_BODY_BYTES) in answer.json()["error"]["message"]


def test_a_missing_or_wrong_key_is_a_401(url, chat):
    wrong = openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0)
    body = _refused(lambda: wrong.models.list(), openai.AuthenticationError, "API key")
    assert body["code"] == "invalid_api_key"
    assert "sk-wrong" not in body["message"] and KEY not in body["message"]
    _refused(
        lambda: wrong.chat.completions.create(model=NAME, messages=chat),
        openai.AuthenticationError,
        "API key",
    )
    answer = httpx.post(f"{url}/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert answer.status_code == 401  # the key first: nobody without it learns about the body


def test_the_cli_refuses_a_public_address_without_a_key(model_dir):
    result = CliRunner().invoke(cli_app, ["serve", str(model_dir), "--host", "0.0.0.0"])
    assert result.exit_code != 0
    assert isinstance(result.exception, BadRequest)
    assert "--api-key" in result.exception.message and "0.0.0.0" in result.exception.message
    for host in ("127.0.0.1", "localhost", "::1"):
        serve_cli.check_exposure(host, None)
    serve_cli.check_exposure("0.0.0.0", "a-key")
    with pytest.raises(BadRequest, match="empty"):
        serve_cli.check_exposure("0.0.0.0", " ")


class _Gated:
    """A generation whose first token waits for ``gate``, and that fails after it when ``fail``."""

    def __init__(self, gate: threading.Event, fail: bool):
        self.gate, self.fail = gate, fail
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[Event]:
        assert self.gate.wait(30), "the gate never opened"
        yield Event(1, "a")
        if self.fail:
            raise RuntimeError("the provider went away")
        yield Event(2, "b", "stop")

    def result(self) -> Completion:
        usage = Usage(prompt_tokens=3, completion_tokens=2, resumed_tokens=0)
        params = SamplingParams(seed=1)
        return Completion((1, 2, 3), (1, 2), "ab", "stop", params, usage, ())

    def cancel(self) -> None:
        self.cancelled.set()


class _Endless(_Gated):
    """A generation that goes on, a token every 10 ms, until it is cancelled (30 s at most)."""

    def __iter__(self) -> Iterator[Event]:
        for _ in range(3000):
            if self.cancelled.is_set():
                return
            time.sleep(0.01)
            yield Event(1, "a")
        raise AssertionError("never cancelled")

    def result(self) -> Completion:
        assert self.cancelled.wait(30), "never cancelled"
        raise RuntimeError("cancelled")


class _FakeBackend:
    """Tokens from anywhere: the routes need only the ``Backend`` protocol."""

    def __init__(self, fail: bool = False, endless: bool = False):
        self.gate, self.fail, self.endless = threading.Event(), fail, endless
        self.submitted: list[_Gated] = []

    def models(self) -> list[ModelCard]:
        return [self.model("fake")]

    def model(self, name: str) -> ModelCard:
        return ModelCard(name, 64, 0)

    def submit(self, model: str, prompt, params: SamplingParams, *, fill: bool = False) -> _Gated:
        self.submitted.append((_Endless if self.endless else _Gated)(self.gate, self.fail))
        return self.submitted[-1]


@contextmanager
def _fake_server(backend: _FakeBackend) -> Iterator[openai.OpenAI]:
    app = FastAPI()
    app.include_router(create_router(lambda: backend, api_key_check(None)), prefix="/v1")
    with serve(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="any", max_retries=0, timeout=10)


def test_a_waiting_stream_does_not_block_other_requests():
    backend = _FakeBackend()
    with _fake_server(backend) as client:
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], stream=True
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"  # the stream is open, its generation waiting
        assert [m.id for m in client.models.list()] == ["fake"]  # answered meanwhile: the loop is free
        backend.gate.set()
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ab"


def test_a_failure_while_streaming_reaches_the_client_as_an_error():
    backend = _FakeBackend(fail=True)
    backend.gate.set()
    with _fake_server(backend) as client:
        stream = client.completions.create(model="fake", prompt="x", stream=True)
        with pytest.raises(openai.APIError, match="the provider went away"):
            list(stream)


def test_gpuflex_serve_answers_its_printed_example_and_stops_on_ctrl_c(model_dir):
    port = free_port()
    command = [sys.executable, "-m", "gpuflex", "serve", str(model_dir), "--port", str(port)]
    command += ["--name", NAME]
    env = {**os.environ, "COLUMNS": "200"}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        printed = []
        for line in server.stderr:  # up to the last line of the banner
            printed.append(line)
            if "Ctrl-C stops it" in line:
                break
        banner = "".join(printed)
        base = f"http://127.0.0.1:{port}/v1"
        assert f"at {base}, without a key, on loopback only" in banner, banner
        example = [line.strip() for line in printed if line.startswith("  ") and "curl" not in line]
        python = "\n".join(line for line in example if not line.startswith(("-H", "-d")))
        scope: dict = {}
        exec(python, scope)  # the printed openai example, as a user would paste it
        assert scope["answer"].model == NAME and scope["answer"].choices[0].message.content
        server.send_signal(signal.SIGINT)
        rest = server.communicate(timeout=30)[1]
        assert server.returncode == 0, rest
        assert "stopped" in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_client_that_goes_away_cancels_its_generation():
    backend = _FakeBackend(endless=True)
    with _fake_server(backend) as client:
        stream = client.completions.create(model="fake", prompt="x", stream=True)
        assert next(iter(stream)).choices[0].text == "a"
        stream.close()  # the client went away mid-answer
        impatient = client.with_options(timeout=1)
        with pytest.raises(openai.APITimeoutError):  # and one that stopped waiting for a whole answer
            impatient.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        assert len(backend.submitted) == 2
        for generation in backend.submitted:
            assert generation.cancelled.wait(10), "a generation went on for nobody"


def test_the_openapi_schema_documents_the_bodies_and_the_errors():
    app = FastAPI()
    app.include_router(create_router(lambda: _FakeBackend(), api_key_check(None)), prefix="/v1")
    paths = app.openapi()["paths"]
    chat = paths["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "max_completion_tokens", "stream_options"} <= set(body["properties"])
    assert "role" in json.dumps(body["properties"]["messages"])  # the messages' own schema, inline
    assert (
        "prompt"
        in paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"][
            "properties"
        ]
    )
    assert {"400", "401", "404", "413"} <= set(chat["responses"])
