from pathlib import Path

import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.train.model import CharGPT
from gpuflex.train.recipes import build_model, for_task, get_recipe
from gpuflex.train.transport import LocalTransport

from .helpers import TINY_MODEL, ThreadedJob, task_config, tiny_spec


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


EXAMPLE = Path(__file__).parents[2] / "examples" / "recipes" / "byte_bigram.py"


def _train_briefly(spec, corpus: bytes | None, code: bytes | None = None, workers: int = 2):
    """A whole job of the recipe on a LocalTransport; returns the published rounds."""
    transport = LocalTransport(spec.rounds, live_workers=workers)
    dataset = transport.put_blob(corpus) if corpus is not None else None
    recipe_code = transport.put_blob(code) if code is not None else None
    with ThreadedJob(transport, spec, dataset, num_workers=workers, recipe_code=recipe_code) as job:
        running = [job.start("worker", i) for i in range(workers)]
        assert job.start("aggregator").result(timeout=120)["finished"]
        assert all(w.result(timeout=120)["finished"] for w in running)
    return transport.history()


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_hf_causal_lm_builds_from_a_config_and_learns(corpus, architecture):
    model_spec = TINY_MODEL.model_copy(update={"architecture": architecture})
    history = _train_briefly(tiny_spec(recipe="hf-causal-lm", model=model_spec, rounds=2), corpus)
    assert history[-1].val_loss < history[0].val_loss - 0.3


def test_mlp_digits_brings_its_own_data_and_learns():
    spec = tiny_spec(recipe="mlp-digits", rounds=3, inner_steps=20, batch_size=32, lr=0.01)
    history = _train_briefly(spec, corpus=None)
    assert history[-1].val_loss < 0.7 * history[0].val_loss


def test_a_user_recipe_file_trains_like_a_built_in_one(corpus):
    spec = tiny_spec(recipe="user", recipe_file=str(EXAMPLE), rounds=2, lr=0.05)
    history = _train_briefly(spec, corpus, code=EXAMPLE.read_bytes())
    assert history[-1].val_loss < history[0].val_loss - 0.3


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        (b"def build_model(spec): ...\ndef loss(m, b): ...", "must define build_data"),
        (b"def (:", "failed to load: SyntaxError"),
        (b"raise RuntimeError('no')", "failed to load: RuntimeError"),
    ],
)
def test_a_broken_user_recipe_is_a_clear_error(code, problem):
    with pytest.raises(BadRequest, match=problem):
        get_recipe("user", code)
    with pytest.raises(BadRequest, match="needs its code"):
        get_recipe("user")


def test_a_recipe_that_needs_a_dataset_refuses_a_job_without_one():
    config = task_config(tiny_spec(), None, "worker")
    with pytest.raises(BadRequest, match="trains on a dataset"):
        for_task(config, lambda digest: b"")
