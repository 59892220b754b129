from __future__ import annotations

import pytest

from .helpers import synthetic_corpus


@pytest.fixture(scope="session")
def corpus() -> bytes:
    return synthetic_corpus()
