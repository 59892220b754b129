"""What a deployment's replica serves: a training job's LoRA checkpoint is written over the model directory
the job tuned, from the blobs alone, and answers as the tuned model did; an uploaded directory is served as
it was saved. A replica posts its events batched, what a client waits on at once, and a rate-limited
post's events again."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from gpuflex.agent.server import Replica, served_directory
from gpuflex.errors import RateLimited
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.protocol.relay import RelayEvent
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.serve.model import ServedModel
from gpuflex.testing import save_llama
from gpuflex.train.checkpoint import sha256
from gpuflex.train.export import export_hf
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.pretrained import bundle_model
from gpuflex.train.recipes import build_model, get_recipe

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _logits(directory, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ServedModel.load(directory, device="cpu", dtype="fp32").model(input_ids=ids).logits


def _job(
    model_dir, lora: dict | None
) -> tuple[TrainingSpec, dict[str, bytes], GlobalReplica, torch.nn.Module]:
    """A job tuning ``model_dir`` as the CLI submits it: its spec, the blobs of its model directory, the
    global replica its checkpoint comes from, and a model to write the replica's weights into."""
    spec = {"recipe": "hf-causal-lm", "model": {"from": str(model_dir)}, "lora": lora}
    training, bundle, parts = bundle_model(model_dir, TrainingSpec.model_validate(spec), 64 * 1024)
    blobs = {p.sha256: p.read() for p in parts} | {sha256(bundle.to_bytes()): bundle.to_bytes()}
    model = build_model(training, get_recipe("hf-causal-lm").from_directory(model_dir))
    return training, blobs, GlobalReplica(model, training), model


def test_a_jobs_lora_checkpoint_is_served_merged_over_the_directory_it_tuned(tmp_path):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50])
    training, blobs, replica, model = _job(model_dir, LORA)
    with torch.no_grad():
        for p in replica.parameters().values():
            p.normal_(0, 0.2)  # adapters that change the answers
    checkpoint = replica.to_bytes()
    blobs[sha256(checkpoint)] = checkpoint
    ids = torch.tensor([[5, 9, 12, 7]])
    replica.write_to(model)
    with torch.no_grad():
        tuned = model.eval()(input_ids=ids).logits
    from_job = DeployedModel(
        job="j-1", checkpoint=sha256(checkpoint), training=training, size=training.model.size
    )
    with served_directory(from_job, blobs.__getitem__, None) as directory:
        assert not (directory / "adapter_config.json").exists()  # merged: a plain model to serve
        torch.testing.assert_close(_logits(directory, ids), tuned, rtol=1e-4, atol=1e-4)
    uploaded = DeployedModel(from_=str(model_dir), uploaded=training.model.uploaded, size=training.model.size)
    with served_directory(uploaded, blobs.__getitem__, None) as directory:
        torch.testing.assert_close(_logits(directory, ids), _logits(model_dir, ids))
        assert not torch.allclose(_logits(directory, ids), tuned, atol=1e-3)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_job_of_a_bf16_model_is_served_in_bf16_though_it_trained_in_fp32(tmp_path, lora):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50], dtype="bfloat16")
    training, blobs, replica, _ = _job(model_dir, lora)
    assert {p.dtype for p in replica.parameters().values()} == {torch.float32}
    checkpoint = replica.to_bytes()
    blobs[sha256(checkpoint)] = checkpoint
    from_job = DeployedModel(
        job="j-1", checkpoint=sha256(checkpoint), training=training, size=training.model.size
    )
    with served_directory(from_job, blobs.__getitem__, None) as directory:
        assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
        served = ServedModel.load(directory, device="cpu")
        assert {p.dtype for p in served.model.parameters()} == {torch.bfloat16}
    if lora is not None:  # an adapter, unmerged, is left as peft writes it
        out = export_hf(checkpoint, training, model_dir, tmp_path / "adapter")
        assert {t.dtype for t in load_file(out / "adapter_model.safetensors").values()} == {torch.float32}


class _Coordinator:
    """The relay's end of a replica's posts: what each post carried, and when; 429 to the first
    ``refuse`` posts."""

    def __init__(self, refuse: int = 0):
        self.posts: list[tuple[float, list[str]]] = []
        self.refuse = refuse

    def relay_events(self, events: list[RelayEvent]) -> None:
        if self.refuse:
            self.refuse -= 1
            raise RateLimited("too many requests from lease:l-1", retry_after_s=0.0)
        self.posts.append((time.monotonic(), [f"{e.kind}:{e.token}" for e in events]))


def _sent(coordinator: _Coordinator, events: list[tuple[RelayEvent, bool]], gaps_s: list[float]) -> None:
    """``events`` (each with whether a client waits on it) put in a replica's outbox, each followed by its
    gap in ``gaps_s``."""
    replica = Replica(backend=None, sender=coordinator)  # type: ignore[arg-type]  # only sends here
    sending = threading.Thread(target=replica._send)
    sending.start()
    for event, gap_s in zip(events, gaps_s, strict=True):
        replica._outbox.put(event)
        time.sleep(gap_s)
    replica._outbox.put(None)
    sending.join(timeout=10)


def _all(coordinator: _Coordinator) -> list[str]:
    return list(itertools.chain.from_iterable(what for _, what in coordinator.posts))


def test_a_replica_posts_tokens_together_but_what_a_client_waits_on_at_once(monkeypatch):
    interval = 0.3  # long beside a loaded machine's scheduling delays, which once took a 2 ms test apart
    monkeypatch.setattr("gpuflex.agent.server.POST_INTERVAL_S", interval)
    started = RelayEvent(id="r", kind="started")
    tokens = [RelayEvent(id="r", kind="token", token=i) for i in range(100)]
    done = RelayEvent(id="r", kind="done")
    coordinator = _Coordinator()
    stream = [(started, False), (tokens[0], True)] + [(t, False) for t in tokens[1:]] + [(done, True)]
    # the first token half an interval before the next: a sender that held it for its interval would
    # carry more with it; then a token every 10 ms, 99 in about a second
    _sent(coordinator, stream, gaps_s=[0, interval / 2] + [0.01] * (len(stream) - 2))
    posts = [what for _, what in coordinator.posts]
    assert posts[0] == ["started:None", "token:0"]  # the first token at once, with its start
    assert _all(coordinator) == [f"{e.kind}:{e.token}" for e, _ in stream]  # each once, in order
    assert any(len(p) > 1 for p in posts[1:])  # tokens drawn within an interval go together
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(coordinator.posts[:-1])]
    assert min(gaps) >= interval * 0.9


def test_events_a_rate_limited_post_carried_are_sent_again():
    coordinator = _Coordinator(refuse=2)
    events = [(RelayEvent(id="r", kind="token", token=i), True) for i in range(3)]
    _sent(coordinator, events, gaps_s=[0.0] * len(events))
    assert _all(coordinator) == ["token:0", "token:1", "token:2"]
