import hashlib

import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import ModelSpec
from gpuflex.train.checkpoint import (
    bytes_to_state,
    load_into,
    load_tensors,
    save_tensors,
    sha256,
    state_to_bytes,
)
from gpuflex.train.model import CharGPT

from .helpers import TINY_MODEL


def _model(seed: int) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(TINY_MODEL)


def test_round_trip_is_exact():
    state = _model(0).state_dict()
    restored = bytes_to_state(state_to_bytes(state))
    assert restored.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(restored[name], tensor), name
        assert restored[name].dtype == tensor.dtype


def test_loads_into_a_fresh_model_and_keeps_weights_tied():
    source, fresh = _model(0), _model(1)
    idx = torch.randint(0, 256, (2, 16))
    assert not torch.equal(source(idx)[0], fresh(idx)[0])
    load_into(fresh, state_to_bytes(source.state_dict()))
    assert torch.equal(source(idx)[0], fresh(idx)[0])
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_serialisation_is_deterministic():
    model = _model(3)
    assert state_to_bytes(model.state_dict()) == state_to_bytes(model.state_dict())


def test_a_blob_that_does_not_fit_the_model_is_a_bad_request():
    other = CharGPT(ModelSpec(n_layer=1, n_head=2, n_embd=16, block_size=32))
    with pytest.raises(BadRequest, match="does not fit"):
        load_into(_model(0), state_to_bytes(other.state_dict()))


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, b"not safetensors at all", b"\x80\x04\x95pickle"])
def test_garbage_is_a_bad_request(data):
    with pytest.raises(BadRequest, match="not a safetensors blob"):
        bytes_to_state(data)


def test_metadata_round_trips():
    tensors, metadata = load_tensors(save_tensors({"a": torch.ones(2)}, {"k": "v"}))
    assert metadata == {"k": "v"}
    assert torch.equal(tensors["a"], torch.ones(2))


def test_sha256_is_the_hex_digest():
    assert sha256(b"abc") == hashlib.sha256(b"abc").hexdigest()
