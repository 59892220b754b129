"""Small helpers of the dashboard tests: serving an app, a fake model blob, one region of a page."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import uvicorn
from fastapi import FastAPI
from safetensors.numpy import save as save_safetensors

from gpuflex.localnet import free_port

MODEL_PARAMS = 40 * 25  # the fake model's numbers: one 40 x 25 fp32 tensor


def model_blob(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return save_safetensors({"w": rng.standard_normal((40, 25)).astype(np.float32)})


def text_of(html: str, element_id: str) -> str:
    """The markup from the element with this id to the next element that has an id of its own."""
    start = html.index(f'id="{element_id}"')
    following = re.search(r'\sid="[^"]+"', html[start + 4 :])
    return html[start : start + 4 + following.start()] if following else html[start:]


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a loopback port, in a thread of this process; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the coordinator failed to start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
