"""A deployment's replica, inside the task subprocess: the model loaded once, one engine, and the line to
the coordinator's gateway (``protocol.relay``), held open from this side (a provider never listens).

    with served_directory(config.model, fetch, cache) as directory:   # through the node's cache
        Replica(LocalBackend(Engine(...), ...), sender).serve(poller, should_stop)

It tells the coordinator what it does until it serves (downloading, loading the model); its first poll of
the relay makes it live: a deployment answers only once a replica polls.

The poll thread long-polls for work and starts each request on the engine (``LocalBackend.submit``:
encoded here, checked against the context, refused with an ``error`` event); a thread per request streams
its events into one outbox; the sender thread posts what the outbox holds. A post costs both ends far more
than a token, so the sender posts at most every ``POST_INTERVAL_S`` (the tokens drawn meanwhile, by every
request, go together), except at once for what a client waits on: a request's first token, its end, its
refusal. That keeps a replica under its lease's rate limit; a 429 all the same is waited out and the
events are sent again, never dropped. The lease is renewed by the agent's heartbeats, as a worker's.
"""

from __future__ import annotations

import base64
import logging
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuflex.client import TaskClient
from gpuflex.data.cache import ShardCache
from gpuflex.errors import GPUFlexError, RateLimited
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.protocol.messages import ServerConfig
from gpuflex.protocol.relay import MAX_RELAY_BATCH, RelayCompletion, RelayEvent, RelayRequest
from gpuflex.protocol.spec import ModelSpec, TrainingSpec
from gpuflex.serve import cheats
from gpuflex.serve.backend import Generation, LocalBackend, Prompt
from gpuflex.serve.engine import Cancelled, Completion, Engine
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams
from gpuflex.train.export import export_hf
from gpuflex.train.pretrained import model_directory

log = logging.getLogger("gpuflex.server")

POLL_WAIT_S = 10.0  # a poll returns at once with work; this bounds how long a stop waits for one
POST_INTERVAL_S = 0.02  # events are posted at most this often, but at once when a client waits on one


def run_server(
    config: ServerConfig,
    poller: TaskClient,
    sender: TaskClient,
    cache: ShardCache | None,
    should_stop: Callable[[], bool],
) -> str:
    """Serve the deployment's model until told to stop; ``poller`` and ``sender`` are two connections
    with the task's token (a poll waiting must not hold up the events)."""
    poller.relay_phase("downloading")  # the replica is live only from its first poll, once it answers
    with served_directory(config.model, poller.get_blob, cache) as directory:
        poller.relay_phase("loading")
        model = ServedModel.load(directory, dtype=config.dtype)
        if config.adversary is not None:  # testing only: a cheating provider (``cheats.SERVING``)
            log.warning("TESTING ONLY: replica %d plays adversary %r", config.replica, config.adversary)
            model = cheats.SERVING[config.adversary](model)
        engine = Engine(model, max_batch=config.max_batch)
        try:
            replica = Replica(LocalBackend(engine, config.job_id, config.context), sender)
            log.info(
                "replica %d of %s serving (%s, %s)", config.replica, config.job_id, model.device, model.dtype
            )
            replica.serve(poller, should_stop)
        finally:
            engine.close()
    return f"served {replica.served} requests"


@contextmanager
def served_directory(
    model: DeployedModel, fetch: Callable[[str], bytes], cache: ShardCache | None
) -> Iterator[Path]:
    """The model directory to serve: an uploaded one (its files through the node's cache), or a training
    job's checkpoint written over the directory that job tuned (LoRA adapters merged)."""
    if model.training is None:
        uploaded = ModelSpec(from_=model.from_, uploaded=model.uploaded, size=model.size)
        with model_directory(TrainingSpec(recipe="hf-causal-lm", model=uploaded), fetch, cache) as directory:
            assert directory is not None, "an uploaded model has a directory"
            yield directory
        return
    assert model.checkpoint is not None, "a job's model is pinned with its checkpoint"
    with (
        model_directory(model.training, fetch, cache) as base,
        tempfile.TemporaryDirectory(prefix="gpuflex-served-") as out,
    ):
        assert base is not None, "a served job tuned a model directory"
        merge = model.training.lora is not None
        yield export_hf(fetch(model.checkpoint), model.training, base, Path(out), merge=merge)


class Replica:
    """Requests from the relay onto one backend, and their events back."""

    def __init__(self, backend: LocalBackend, sender: TaskClient):
        self.backend, self.sender = backend, sender
        self.served = 0
        self._outbox: queue.SimpleQueue[tuple[RelayEvent, bool] | None] = queue.SimpleQueue()  # urgent?
        self._running: dict[str, Generation] = {}
        self._lock = threading.Lock()

    def serve(self, poller: TaskClient, should_stop: Callable[[], bool]) -> None:
        sending = threading.Thread(target=self._send, name="relay-sender", daemon=True)
        sending.start()
        try:
            while not should_stop():
                work = poller.relay_poll(POLL_WAIT_S)
                for request_id in work.cancel:
                    with self._lock:
                        generation = self._running.pop(request_id, None)
                    if generation is not None:
                        generation.cancel()
                for request in work.requests:
                    self._start(request)
        finally:
            self._outbox.put(None)
            sending.join(timeout=5)

    def _start(self, request: RelayRequest) -> None:
        prompt = request.prompt
        try:
            p = request.params
            params = SamplingParams(p.temperature, p.top_p, p.max_tokens, tuple(p.stop), p.seed)
            generation = self.backend.submit(
                self.backend.card.name,
                Prompt(
                    text=prompt.text,
                    ids=None if prompt.ids is None else tuple(prompt.ids),
                    messages=None if prompt.messages is None else tuple(prompt.messages),
                ),
                params,
                fill=request.fill,
                resume=request.resume,
            )
        except GPUFlexError as err:
            self._outbox.put((_error(request.id, err), True))
            return
        with self._lock:
            self._running[request.id] = generation
        self._outbox.put((RelayEvent(id=request.id, kind="started"), False))  # goes with the first token
        threading.Thread(target=self._stream, args=(request.id, generation), daemon=True).start()

    def _stream(self, request_id: str, generation: Generation) -> None:
        try:
            first = True
            for event in generation:
                token = RelayEvent(
                    id=request_id,
                    kind="token",
                    token=event.token,
                    text=event.text,
                    finish_reason=event.finish_reason,
                )
                self._outbox.put((token, first))
                first = False
            done = RelayEvent(id=request_id, kind="done", completion=_completion(generation.result()))
            self._outbox.put((done, True))
            with self._lock:
                self.served += 1
        except Cancelled:
            pass  # its client went away: nobody reads the rest
        except GPUFlexError as err:
            self._outbox.put((_error(request_id, err), True))
        except Exception as err:
            log.exception("request %s failed", request_id)
            failed = RelayEvent(id=request_id, kind="error", status=500, message=f"generation failed: {err}")
            self._outbox.put((failed, True))
        finally:
            with self._lock:
                self._running.pop(request_id, None)

    def _send(self) -> None:
        """Post the outbox's events until the end mark: a batch goes ``POST_INTERVAL_S`` after its first
        event, or at once with an urgent one (and whatever else waits then)."""
        batch: list[RelayEvent] = []
        closing = False
        while not closing or batch:
            due, urgent = time.monotonic(), False  # a batch held back by a 429 goes at once
            while not (closing or urgent) and len(batch) < MAX_RELAY_BATCH:
                wait = max(0.0, due - time.monotonic()) if batch else None  # None: until an event comes
                try:
                    item = self._outbox.get(timeout=wait)
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    continue
                if not batch:
                    due = time.monotonic() + POST_INTERVAL_S
                batch.append(item[0])
                urgent = item[1]
            while not closing and len(batch) < MAX_RELAY_BATCH:  # what else waits goes along
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                else:
                    batch.append(item[0])
            if batch:
                sent = self._post(batch[:MAX_RELAY_BATCH])
                batch = batch[MAX_RELAY_BATCH:] if sent else batch

    def _post(self, events: list[RelayEvent]) -> bool:
        """Post ``events``; False when the coordinator asked to wait (429): waited out, to be sent again."""
        try:
            self.sender.relay_events(events)
        except RateLimited as err:
            log.warning("events held back: %s", err.message)
            time.sleep(max(err.retry_after_s, POST_INTERVAL_S))
            return False
        except GPUFlexError as err:
            log.warning("events of %d requests not delivered: %s", len({e.id for e in events}), err.message)
        return True


def _error(request_id: str, err: GPUFlexError) -> RelayEvent:
    return RelayEvent(id=request_id, kind="error", status=err.status_code, message=err.message)


def _completion(done: Completion) -> RelayCompletion:
    assert done.params.seed is not None, "a completion reports the seed it was sampled with"
    return RelayCompletion(
        prompt=list(done.prompt),
        tokens=list(done.tokens),
        text=done.text,
        finish_reason=done.finish_reason,
        seed=done.params.seed,
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
        resumed_tokens=done.usage.resumed_tokens,
        fingerprints=[base64.b64encode(f).decode() for f in done.fingerprints],
    )
