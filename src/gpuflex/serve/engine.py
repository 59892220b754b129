"""The engine a provider's server task runs: requests in, streamed tokens and fingerprinted completions out.

Continuous batching: a background thread decodes one batch with a KV cache, a token per row per step;
between two steps the requests waiting join it (up to ``max_batch`` rows: each is prefilled alone and
its cache, left-padded to the batch's width, joins the batch's), and a request that ends leaves it (its
row leaves the batch and the cache). So a request waits for a free row, never for a whole batch to end:
with every request of a round held until the round's longest ended, ``bench/inference.py`` measured a
time to first token of 1.4 s (median) at 8 streams against 15 ms at one. transformers' continuous
batching (``generate_batch``, paged attention) was not used: it samples through its own logits
processors and returns no hidden states, and this engine needs both per-position seeded draws
(``sampling``) and the last layer's hidden states (``fingerprint``). A model whose cache is not made of
plain ``DynamicLayer``s (sliding windows, recurrent state) takes no one mid-batch: its requests wait for
the batch to end.

Each request's tokens stream as ``Event``s as they are drawn; it ends on an EOS token or a stop string
(finish reason ``stop``; the stop string is not in the text) or at ``max_tokens`` (``length``), and its
``Completion`` carries the tokens, the seed it was sampled with, the token counts to bill, and one
fingerprint per 32 output tokens. A request may carry ``resume``, the tokens a previous server already
sent: it continues from there, and since each draw depends only on (seed, position) and the logits, with
exactly the tokens the uninterrupted run would have given; its fingerprints cover the whole output.
A request nobody reads any more (its client went away) is ``cancel``led: it never joins the batch, or
its row leaves it at the next step, so its row goes to a request someone waits for.

Batching changes no output: rows are left-padded under an attention mask with their own position ids, so
each row computes what it would alone up to floating-point reassociation (tested: outputs alone, in one
batch, and joining a batch under way are equal).
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gpuflex.errors import BadRequest
from gpuflex.serve.detokenize import TextStream
from gpuflex.serve.fingerprint import Fingerprinter, prove_many
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams, choose

PAD = 0  # the id left padding feeds the model; masked out, so any id would do


class Cancelled(Exception):
    """The request was cancelled (its client went away) before it ended."""


@dataclass(frozen=True)
class Event:
    """One drawn token and the text it lets through (possibly ""); the last event has a finish reason."""

    token: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (max_tokens)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # drawn by this server: a resumed request's earlier tokens are not counted
    resumed_tokens: int  # tokens a previous server sent, prefilled here with the prompt


@dataclass(frozen=True)
class Completion:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # the whole output: resumed tokens first, then this server's
    text: str  # the whole output's text, as streamed (without the stop string)
    finish_reason: str
    params: SamplingParams  # as sampled, with the seed: what a verifier replays
    usage: Usage
    fingerprints: tuple[bytes, ...]  # one per 32 output tokens (``fingerprint``), over the whole output


class Request:
    """A submitted request. Iterate it for its events as they come, or wait for its ``result()``."""

    def __init__(self, model: ServedModel, prompt: list[int], params: SamplingParams, resume: list[int]):
        self.prompt, self.params, self.resume = prompt, params, resume
        self.completion: Completion | None = None
        self._model = model
        self._events: queue.SimpleQueue[Event | BaseException] = queue.SimpleQueue()
        self._ended = False
        self._error: BaseException | None = None
        self._tokens = list(resume)
        self._stream = TextStream(model.decode, params.stop)
        self._stream.feed(resume)
        if self._stream.stopped:
            raise BadRequest("resume already holds a stop string: that output has ended")
        self._fingerprinter = Fingerprinter()
        self._cancelled = False

    def cancel(self) -> None:
        """Stop generating for this request (its client went away): it is left out of the batch it has
        not joined yet, or its row leaves the batch at the next step. A listener gets ``Cancelled``. A
        request that ended stays as it is."""
        if self.completion is None and not self._cancelled:
            self._cancelled = True
            self._fail(Cancelled("the request was cancelled"))

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events not yet taken; raises what failed the request, or TimeoutError after ``timeout``
        seconds without one."""
        while not self._ended:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no token in {timeout} s") from None
            if isinstance(item, BaseException):
                self._ended, self._error = True, item
                raise item
            self._ended = item.finish_reason is not None
            yield item

    def result(self, timeout: float | None = None) -> Completion:
        """The completion, once every event has been taken (those left are taken here)."""
        for _ in self.events(timeout):
            pass
        if self.completion is None:
            assert self._error is not None
            raise self._error
        return self.completion

    def _take(self, token: int) -> bool:
        """Record the drawn token and stream it; True when the request has ended."""
        self._tokens.append(token)
        text = self._stream.push(token)
        if self._stream.stopped or token in self._model.eos:
            reason = "stop"
        elif len(self._tokens) == self.params.max_tokens:
            reason = "length"
        else:
            self._events.put(Event(token, text))
            return False
        text += self._stream.finish()
        self.completion = Completion(
            prompt=tuple(self.prompt),
            tokens=tuple(self._tokens),
            text=self._stream.output,
            finish_reason=reason,
            params=self.params,
            usage=Usage(len(self.prompt), len(self._tokens) - len(self.resume), len(self.resume)),
            fingerprints=self._fingerprinter.finish(),
        )
        self._events.put(Event(token, text, reason))
        return True

    def _fail(self, error: BaseException) -> None:
        self._events.put(error)


class Engine:
    """Serves one model: ``submit`` from any thread; one background thread batches and decodes."""

    def __init__(self, model: ServedModel, *, max_batch: int = 8):
        self.model = model
        self.max_batch = max_batch
        self._waiting: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="gpuflex-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()) -> Request:
        """Queue a request (prompt ids, from ``ServedModel.encode`` or ``encode_chat``); a ``BadRequest``
        when it cannot be served. Without a seed, one is drawn (and reported in the completion)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        prompt, resume = list(prompt), list(resume)
        vocab = self.model.model.get_input_embeddings().num_embeddings
        for name, ids in (("prompt", prompt), ("resume", resume)):
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise BadRequest(f"{name} holds a token id outside this model's vocabulary of {vocab}")
        if not prompt:
            raise BadRequest("prompt is empty: it must hold at least one token")
        if len(resume) >= params.max_tokens:
            raise BadRequest(
                f"resume holds {len(resume)} tokens, max_tokens {params.max_tokens}: nothing left"
            )
        if self.model.eos.intersection(resume):
            raise BadRequest("resume holds an end-of-sequence token: that output has ended")
        self.model.check_fits(len(prompt), params.max_tokens)
        request = Request(self.model, prompt, params.seeded(), resume)
        self._waiting.put(request)
        return request

    def close(self) -> None:
        """Serve what was submitted, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._waiting.put(None)
            self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        running: _Running | None = None
        closing = False
        while not (closing and running is None):
            if running is None:
                first = self._waiting.get()  # idle: wait for work
                if first is None:
                    return
                joining = [first]
            else:
                joining = []
            if running is None:
                room = self.max_batch
            else:
                room = self.max_batch - running.size if running.admits else 0
            while not closing and len(joining) < room:
                if self._waiting.empty():
                    break
                if (request := self._waiting.get()) is None:
                    closing = True  # serve what came before it, then stop
                else:
                    joining.append(request)
            joining = [request for request in joining if not request._cancelled]
            if running is None and not joining:
                continue
            try:
                with torch.inference_mode():
                    if running is None:
                        running = _Running(self.model, joining)
                    elif joining:
                        running.admit(joining)
                    running.step()
            except Exception as err:  # the batch's requests fail; the engine serves the next ones
                for request in (running.requests if running else []) + joining:
                    if request.completion is None:
                        request._fail(err)
                running = None
                continue
            if not running.size:
                running = None


class _Running:
    """The batch being decoded: its requests, their KV cache, attention mask and last position ids, and
    the logits each row draws its next token from."""

    def __init__(self, served: ServedModel, requests: list[Request]):
        self.served = served
        self.requests = requests
        self.logits, self.cache, self.mask, self.position = _prefill(served, requests)
        from transformers.cache_utils import DynamicLayer

        # only plain layers can be left-padded and joined: a sliding window or a recurrent state cannot
        self.admits = all(type(layer) is DynamicLayer for layer in self.cache.layers)

    @property
    def size(self) -> int:
        return len(self.requests)

    def admit(self, requests: list[Request]) -> None:
        """Prefill ``requests`` and add them as rows: every cache and mask left-padded to one width."""
        logits, cache, mask, position = _prefill(self.served, requests)
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.position = torch.cat([self.position, position])
        self.logits = torch.cat([self.logits, logits])
        self.requests = self.requests + requests

    def step(self) -> None:
        """Draw each row's next token; the rows that ended leave; one forward for the rest."""
        logits = self.logits.float().cpu()  # one transfer a step; sampling runs on the CPU
        tokens = [choose(logits[row], r.params, len(r._tokens)) for row, r in enumerate(self.requests)]
        ended = [r._cancelled or r._take(token) for r, token in zip(self.requests, tokens, strict=True)]
        keep = [row for row, done in enumerate(ended) if not done]
        if len(keep) < self.size:  # the finished rows leave the batch and the cache
            self.requests, tokens = [self.requests[row] for row in keep], [tokens[row] for row in keep]
            if not keep:
                return
            index = torch.tensor(keep, device=self.served.device)
            self.cache.batch_select_indices(index)
            self.mask, self.position = self.mask[index], self.position[index]
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        self.position = self.position + 1
        with _last_hidden(self.served.model) as hidden:
            out = self.served.model(
                input_ids=torch.tensor(tokens, device=self.served.device)[:, None],
                attention_mask=self.mask,
                position_ids=self.position,
                **{_cache_keyword(type(self.served.model)): self.cache},
                use_cache=True,
            )
        self.logits = out.logits[:, -1]
        for row, request in enumerate(self.requests):
            request._fingerprinter.add(hidden[0][row, -1])
        _prove_full(self.requests)


@contextmanager
def _last_hidden(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The last layer's hidden states (after the final norm: what ``hidden_states[-1]`` holds) of the
    forward calls made inside, from a hook on the decoder: ``output_hidden_states`` would keep every
    layer's, a whole prefill's activations over again."""
    caught: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _args: object, output: object) -> None:
        caught[:] = [output[0]]  # the decoder's last_hidden_state

    handle = model.get_decoder().register_forward_hook(keep)
    try:
        yield caught
    finally:
        handle.remove()


@functools.cache
def _cache_keyword(model_type: type) -> str:
    """The name ``forward`` takes the KV cache by: transformers 5.2x renamed ``past_key_values`` to
    ``cache``, and the releases before it swallow an unknown ``cache`` into ``**kwargs``, decoding every
    token with no context (garbage that the verifier rightly convicts)."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros before it along ``dim`` up to ``width`` (masked out, so any value would do)."""
    short = width - t.shape[dim]
    if not short:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _prefill(served: ServedModel, batch: list[Request]):
    """One forward over the batch's prompts (and resumed tokens), left-padded: each row's last logits, the
    KV cache, the attention mask and each row's last position id."""
    import transformers

    sequences = [r.prompt + r.resume for r in batch]
    width = max(map(len, sequences))
    ids = torch.tensor([[PAD] * (width - len(s)) + s for s in sequences], device=served.device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=served.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = transformers.DynamicCache(config=served.model.config)
    with _last_hidden(served.model) as hidden:
        out = served.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{_cache_keyword(type(served.model)): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    for row, request in enumerate(batch):
        # output position j is drawn from the hidden state before it: the resumed ones' and the next one's
        request._fingerprinter.add(hidden[0][row, width - len(request.resume) - 1 :])
    _prove_full(batch)
    return out.logits[:, -1], cache, mask, positions[:, -1:]


def _prove_full(batch: list[Request]) -> None:
    """Prove the chunks the batch's requests have filled, in one ``prove_many``: the rows of a batch fill
    theirs on the same step, and proving them together costs little more than proving one."""
    pending = [(r, chunk) for r in batch for chunk in r._fingerprinter.take_full()]
    for (request, _), proof in zip(pending, prove_many([c for _, c in pending]), strict=True):
        request._fingerprinter.proofs.append(proof)
