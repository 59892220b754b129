"""Small helpers of the dashboard tests: serving an app, a fake model blob, one region of a page."""

from __future__ import annotations

import re

import numpy as np
from safetensors.numpy import save as save_safetensors

MODEL_PARAMS = 40 * 25  # the fake model's numbers: one 40 x 25 fp32 tensor


def model_blob(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return save_safetensors({"w": rng.standard_normal((40, 25)).astype(np.float32)})


def text_of(html: str, element_id: str) -> str:
    """The markup from the element with this id to the next element that has an id of its own."""
    start = html.index(f'id="{element_id}"')
    following = re.search(r'\sid="[^"]+"', html[start + 4 :])
    return html[start : start + 4 + following.start()] if following else html[start:]
