"""The aggregator's arithmetic and screening, driven by hand-made contributions."""

import threading

import pytest
import torch

from gpuflex.errors import Conflict, GPUFlexError
from gpuflex.protocol.messages import ContributionSubmit
from gpuflex.protocol.spec import VerificationSpec
from gpuflex.train.aggregator import run_aggregator
from gpuflex.train.checkpoint import load_tensors, save_tensors
from gpuflex.train.compression import get_compressor
from gpuflex.train.data import ByteDataset, validation_batches
from gpuflex.train.outer import GlobalReplica, load_model
from gpuflex.train.recipes import build_model, evaluate, get_recipe
from gpuflex.train.transport import LocalTransport

from .helpers import POLL, task_config, tiny_spec


def _start(
    spec, corpus: bytes, live_workers: int, **config_fields
) -> tuple[LocalTransport, threading.Thread, list]:
    """An aggregator running in a thread over a fresh transport, once round 0 is out. It averages
    without verification: these contributions are hand-made, with no commitments. ``config_fields``
    replace fields of its task config."""
    spec = spec.model_copy(update={"verification": VerificationSpec(robust=False)})
    transport = LocalTransport(spec.rounds, live_workers)
    config = task_config(spec, transport.put_blob(corpus), "aggregator").model_copy(update=config_fields)
    out: list = []

    def run() -> None:
        try:
            out.append(run_aggregator(config, transport, poll_interval_s=POLL))
        except GPUFlexError as err:  # the test reads it: a thread's exception would be lost
            out.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    while transport.latest_round() is None:
        thread.join(POLL)
    return transport, thread, out


def _contribute(transport: LocalTransport, task: str, delta: dict | bytes, tokens: int, codec: str, loss=1.0):
    blob = delta if isinstance(delta, bytes) else get_compressor(codec).compress(delta)
    view = transport.for_task(task)
    submit = ContributionSubmit(round=0, delta=view.put_blob(blob), tokens=tokens, steps=1, train_loss=loss)
    assert view.submit_contribution(submit).accepted


def _poisoned(blob: bytes) -> bytes:
    """What a malicious node can send although no honest codec encodes it: NaN block scales."""
    tensors, metadata = load_tensors(blob)
    poisoned = {
        k: torch.full_like(v, float("nan")) if k.endswith(":scale") else v for k, v in tensors.items()
    }
    return save_tensors(poisoned, metadata)


def _params(spec) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in build_model(spec).named_parameters()}


def test_outer_step_is_nesterov_sgd_on_the_token_weighted_mean(corpus):
    spec = tiny_spec(rounds=1, compression="none")
    transport, thread, _ = _start(spec, corpus, live_workers=2)
    theta0 = _params(spec)
    _contribute(
        transport, "w0", {n: torch.full_like(p, 0.01) for n, p in theta0.items()}, 100, "none", loss=2.0
    )
    _contribute(
        transport, "w1", {n: torch.full_like(p, 0.05) for n, p in theta0.items()}, 300, "none", loss=4.0
    )
    thread.join(30)
    published = transport.history()[1]
    model = build_model(spec)
    assert load_model(model, transport.get_blob(published.checkpoint))["round"] == 1
    theta1 = {n: p.detach() for n, p in model.named_parameters()}
    mean = (0.01 * 100 + 0.05 * 300) / 400
    step = spec.outer_lr * (1 + spec.outer_momentum) * mean  # Nesterov's first step: g + μ·(buffer = g)
    for name, p in theta0.items():
        torch.testing.assert_close(theta1[name], p - step, rtol=0, atol=1e-6)
    assert published.contributions == 2
    assert published.train_loss == pytest.approx((2.0 * 100 + 4.0 * 300) / 400)


def test_a_federated_aggregator_weights_each_owner_by_its_dataset_not_its_round_tokens(corpus):
    """FedAvg: both owners ran the same steps (equal round tokens); the larger dataset counts more. The
    aggregator holds no data, so it publishes no validation loss."""
    spec = tiny_spec(rounds=1, compression="none")
    weights = {"w0": 1_000, "w1": 3_000}
    transport, thread, _ = _start(
        spec, corpus, live_workers=2, federated="notes", dataset=None, weights=weights
    )
    theta0 = _params(spec)
    for task, value in (("w0", 0.01), ("w1", 0.05)):
        _contribute(transport, task, {n: torch.full_like(p, value) for n, p in theta0.items()}, 256, "none")
    thread.join(30)
    published = transport.history()[1]
    model = build_model(spec)
    load_model(model, transport.get_blob(published.checkpoint))
    mean = (0.01 * 1_000 + 0.05 * 3_000) / 4_000
    step = spec.outer_lr * (1 + spec.outer_momentum) * mean
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta0[name] - step, rtol=0, atol=1e-6)
    assert (published.val_loss, transport.history()[0].val_loss) == (None, None)


def test_unusable_contributions_are_skipped(corpus):
    spec = tiny_spec(rounds=1, round_timeout_s=0.3)
    transport, thread, out = _start(spec, corpus, live_workers=4)
    theta0 = _params(spec)
    zeros = {n: torch.zeros_like(p) for n, p in theta0.items()}
    misshapen = {**zeros, "transformer.wte.weight": torch.zeros(3, 3)}
    _contribute(transport, "garbage", {"x": torch.ones(3)}, 10, "int8")
    _contribute(transport, "poisoned", _poisoned(get_compressor("int8").compress(zeros)), 10, "int8")
    _contribute(transport, "misshapen", misshapen, 10, "int8")
    _contribute(transport, "good", zeros, 10, "int8")
    thread.join(30)
    history = transport.history()
    assert history[1].contributions == 1 and out[0].contributions == 1
    assert history[1].state_hash == history[0].state_hash  # a zero step leaves the model unchanged
    rejected = {m.split(":")[0] for _, m in transport.logs() if m.startswith("rejected")}
    assert rejected == {f"rejected contribution of task {t}" for t in ("garbage", "poisoned", "misshapen")}


def test_a_slow_round_is_waited_for_while_a_worker_is_live(corpus):
    spec = tiny_spec(rounds=1, round_timeout_s=0.2)
    transport, thread, out = _start(spec, corpus, live_workers=1)
    thread.join(1.0)  # five round timeouts with nothing in: a live worker may still be training
    assert thread.is_alive() and not out
    _contribute(transport, "w0", {n: torch.zeros_like(p) for n, p in _params(spec).items()}, 1, "int8")
    thread.join(30)
    assert out[0].finished


def test_a_round_nobody_is_left_to_contribute_to_ends_with_an_error(corpus):
    spec = tiny_spec(rounds=2, round_timeout_s=0.3)
    transport, thread, out = _start(spec, corpus, live_workers=1)
    transport.set_live_workers(0)  # the only worker left (or was excluded), and nobody re-leases it here
    thread.join(30)
    assert not thread.is_alive(), "the aggregator waits for a round nobody can contribute to"
    assert isinstance(out[0], Conflict) and "round 0: no worker left to contribute" in out[0].message


def test_round_zero_is_the_seeded_model_with_its_validation_loss(corpus):
    spec = tiny_spec(rounds=1)
    transport, thread, _ = _start(spec, corpus, live_workers=1)
    model = build_model(spec)
    val = validation_batches(ByteDataset(corpus, 32).val, spec.eval_batches, spec.batch_size, 32)
    round0 = transport.history()[0]
    assert round0.val_loss == pytest.approx(evaluate(get_recipe("char-gpt"), model, val))
    replica = GlobalReplica(build_model(spec), spec)
    assert replica.load(transport.get_blob(round0.checkpoint))["round"] == 0
    assert replica.state_hash() == round0.state_hash and round0.update is None
    _contribute(transport, "w0", {n: torch.zeros_like(p) for n, p in _params(spec).items()}, 1, "int8")
    thread.join(30)
    assert transport.latest_round().finished
