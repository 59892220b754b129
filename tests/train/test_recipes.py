import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.train.model import CharGPT
from gpuflex.train.recipes import build_model, get_recipe

from .helpers import tiny_spec


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def test_same_seed_same_model_other_seed_other_model():
    a, b = build_model(tiny_spec(seed=7)), build_model(tiny_spec(seed=7))
    c = build_model(tiny_spec(seed=8))
    assert isinstance(a, CharGPT)
    assert all(torch.equal(v, _weights(b)[k]) for k, v in _weights(a).items())
    assert not torch.equal(_weights(a)["lm_head.weight"], _weights(c)["lm_head.weight"])


def test_building_leaves_the_global_rng_alone():
    before = torch.random.get_rng_state()
    build_model(tiny_spec())
    assert torch.equal(before, torch.random.get_rng_state())


def test_unknown_recipe_is_a_bad_request():
    assert get_recipe("char-gpt") is not None
    with pytest.raises(BadRequest, match="unknown recipe 'llama'"):
        get_recipe("llama")
