"""``gpuflex serve DIR``: a model directory served on this machine behind an OpenAI-compatible API.

One in-process ``Engine`` over the directory (what ``gpuflex job fetch --format hf`` writes; a LoRA
adapter is merged into the base it names first, ``train.export.whole_model``), the OpenAI
routes (``gpuflex.coordinator.routes.openai``) under ``/v1``, on uvicorn. Without ``--api-key`` anyone
who reaches the port may use it, so it then listens on loopback only; a public address needs a key.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpuflex.cli.options import Dtype
from gpuflex.errors import BadRequest

console = Console(stderr=True, soft_wrap=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to serve a non-loopback address without an API key: anyone who reached it could use it."""
    if api_key is None and not is_loopback(host):
        raise BadRequest(
            f"--host {host} would let anyone who reaches it use this model: give --api-key KEY "
            "(clients send it as their api_key), or serve on 127.0.0.1"
        )
    if api_key is not None and not api_key.strip():
        raise BadRequest("--api-key is empty: give a key clients will send")


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (an address listening on all interfaces is reached on
    loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def examples(base: str, name: str, key: str) -> str:
    """How to call it: curl, and the openai package."""
    hello = '[{"role": "user", "content": "Hello"}]'
    return (
        f"\n  curl {base}/chat/completions -H 'Authorization: Bearer {key}' \\\n"
        f'    -H \'Content-Type: application/json\' -d \'{{"model": "{name}", "messages": {hello}}}\'\n'
        f"\n  from openai import OpenAI\n"
        f'  client = OpenAI(base_url="{base}", api_key="{key}")\n'
        f'  answer = client.chat.completions.create(model="{name}", messages={hello})\n'
        f"  print(answer.choices[0].message.content)\n"
        f"\nCtrl-C stops it."
    )


def create_app(directory: Path, name: str, api_key: str | None, max_batch: int, dtype: str = "auto"):
    """The app and its engine (the caller closes it): the OpenAI routes over the model in ``directory``."""
    import transformers
    from fastapi import FastAPI

    from gpuflex.coordinator.routes.openai import api_key_check, create_router
    from gpuflex.serve.backend import LocalBackend
    from gpuflex.serve.engine import Engine
    from gpuflex.serve.model import ServedModel
    from gpuflex.train.export import whole_model

    if not directory.is_dir():
        raise BadRequest(f"{directory}: no such directory")
    transformers.logging.disable_progress_bar()  # one line says it is loading; a bar per file adds nothing
    with whole_model(directory) as root:
        try:
            engine = Engine(ServedModel.load(root, dtype=dtype), max_batch=max_batch)
        except (OSError, ValueError) as err:
            raise BadRequest(f"cannot load the model in {directory}: {err}") from None
    backend = LocalBackend(engine, name)
    app = FastAPI(title=f"gpuflex serve {name}")
    app.include_router(create_router(lambda: backend, api_key_check(api_key)), prefix="/v1")
    return app, engine


def serve(
    directory: Annotated[
        Path,
        typer.Argument(
            help="a save_pretrained model directory, or a LoRA adapter over one "
            "(gpuflex job fetch --format hf -o DIR)"
        ),
    ],
    name: Annotated[
        str | None, typer.Option(help="the model's name in requests \\[default: DIR's name]")
    ] = None,
    host: Annotated[
        str, typer.Option(help="address to listen on (not loopback: needs --api-key)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[
        str | None, typer.Option(help="the key clients must send (Authorization: Bearer KEY)")
    ] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="requests decoded together at most")] = 8,
    dtype: Dtype = "auto",
) -> None:
    """Serve a model directory on this machine with an OpenAI-compatible API (/v1/chat/completions,
    /v1/completions, /v1/models). Ctrl-C stops it."""
    import uvicorn

    check_exposure(host, api_key)
    name = name or directory.resolve().name
    console.print(f"loading {escape(str(directory))} …")
    app, engine = create_app(directory, name, api_key, max_batch, dtype)
    model = engine.model
    console.print(
        f"serving {escape(name)} ({model.device}, {model.dtype}, context {model.context} tokens) at "
        f"{base_url(host, port)}, "
        + ("with its API key" if api_key else "without a key, on loopback only (--api-key KEY requires one)"),
        highlight=False,
    )
    console.print(escape(examples(base_url(host, port), name, api_key or "none")), highlight=False)
    try:
        uvicorn.run(
            app, host=host, port=port, log_level="warning", log_config=None, timeout_graceful_shutdown=5
        )
    finally:
        engine.close()
    console.print("stopped")
