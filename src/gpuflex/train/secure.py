"""Secure aggregation in the round protocol (``privacy.secure_aggregation``): ``privacy.secagg`` played
by a federated job's workers and aggregator over messages the coordinator relays (``SecAggPost``).

Round ``r``, attempt ``a`` (every message names both)::

    aggregator  roster    the worker tasks taking part (attempt 0: all the job's owners)
    worker      keys      its round key and transport key            (posted while it trains)
    worker      shares    its seed and key shares, one sealed bundle per roster member, in ONE message
    worker      contribution: the blob is ``attempt`` + its masked vector, a contribution as ever
    aggregator  request   the survivors: roster members whose masked vectors it sums
    worker      reveal    to the aggregator alone: seed shares of the survivors, key shares of the dropped
    aggregator  the sum; the outer step and round r + 1 as ever

What an owner masks is its share of the average: ``w_i / W · clip(Δ̂_i)`` (``Δ̂_i`` its compressed
pseudo-gradient as decoded, ``w_i`` its FedAvg weight, ``W`` the weight of every owner; the weights go to
every task of such a job), plus, under ``privacy.dp``, its share of the noise, ``N(0, σ² / t)`` with ``σ``
the plain mode's noise on the average (``dp.mean_noise_std``) and ``t`` the attempt's threshold: any
``t`` or more survivors' shares together carry at least ``σ²``. The aggregator learns the sum of the
survivors' shares: with DP that is DP-FedAvg's fixed-denominator average, already noised; without, it
scales it by ``W / Σ_survivors w_i``, the FedAvg of those that came.

The ring. Under a quantized ``training.compression`` (``GRID_CODECS``: int8, int4, int2) the owners
quantize on a ``fixedpoint.SharedGrid`` whose sum spans ``GRID_LEVELS`` (127, int8's) each way and mask
in a ring just wide enough for the sum of their codes (9 bits for up to 128 owners), bit-packed: an
upload costs about what the plain job's int8 update does. (A grid of int4's 7 levels, or 31, sends
fewer bits but trained worse in ``bench/federated_secagg.py``'s job: int4 and int2 keep int8's grid.)
The grid's per-tensor ranges are public facts the aggregator posts with each roster:
``HEADROOM`` times the largest value of each tensor of the last average it unmasked (round 0: ``lr ·
inner_steps``, about the most an Adam-type inner optimizer moves a weight; under DP at most the clip;
they shrink by up to ``SHRINK`` a round where that was too wide).
They tell the owners no more than the model's updates do, and a range set too low only delays an owner's
update: what the grid rounds or clamps away stays in the owner's error feedback (``masked_blob``'s
second half) and is sent in later rounds. Other compressions mask dense 32-bit fixed point
(``fixedpoint.FixedPoint``).

Dropouts. An owner that drops after its shares message (while training, after masking) is a dropped
client: the survivors' reveals rebuild its pairwise masks and the round carries the exact sum of the
others, as long as ``t`` survive (the threshold: ``privacy.secagg_threshold``, by default the smallest
majority ``n // 2 + 1``). One whose shares never came, once the live workers have all shared or the
round's timeout passes, is left out of attempt ``a + 1``, which starts over with fresh keys (at least
``secagg.MIN_CLIENTS`` members; with fewer the round waits for owners to come back). A shares message
carries all of an owner's bundles, and the coordinator refuses a shares message of a superseded attempt
and a new roster once the current one has all shared (``coordinator.services.secure``): so nobody masks
in an attempt that is later replaced, and a contribution, final as ever, is never of a dead attempt.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.privacy import secagg
from gpuflex.privacy.dp import clip as clip_to
from gpuflex.privacy.dp import mean_noise_std
from gpuflex.privacy.fixedpoint import WIDE_BITS, Layout, SharedGrid, flatten, unflatten
from gpuflex.privacy.masks import Share
from gpuflex.protocol.messages import (
    Contribution,
    ContributionSubmit,
    DPTask,
    RoundPublish,
    SecAggKind,
    SecAggMessage,
    SecAggPost,
    TaskConfig,
)
from gpuflex.protocol.spec import CompressionSpec, TrainingSpec
from gpuflex.train.compression.bitpack import MAX_BITS, pack, packed_size, unpack
from gpuflex.train.transport import LocalTransport, Transport

Delta = dict[str, torch.Tensor]
NO_DP_RANGE = 1.0  # without DP, each value of an owner's weighted delta is clipped to ±this (no L2 bound)
NOISE_RANGE = 8.0  # with DP, the range also holds this many standard deviations of the noise on a value
GRID_CODECS = frozenset({"int8", "int4", "int2"})  # the compressions whose owners mask on a shared grid
GRID_LEVELS = 127  # its levels each way of zero for the sum: an int8 code's (fewer cost int4 its loss)
HEADROOM = 2.0  # a tensor's range: this many times the largest value of its last average
SHRINK = 16.0  # but at least its last range over this (an average the grid rounded to zero shrinks it)
HURRY = 8  # after its own post a task first waits 1/HURRY of its poll interval (``_Mailbox``)
_MAGIC = b"GFSA"
_HEADER = struct.Struct(">4sH")  # magic, attempt


def value_range(weights: dict[str, int], dp: DPTask | None) -> float:
    """The fixed-point range every task of the job agrees on: what an owner's masked values can reach."""
    if dp is None:
        return NO_DP_RANGE
    share = max(weights.values()) / sum(weights.values())
    return share * dp.clip + NOISE_RANGE * mean_noise_std(
        dp.clip, dp.noise_multiplier, list(weights.values())
    )


def shared_levels(compression: CompressionSpec, owners: int) -> int | None:
    """The levels of the job's shared grid, or None: the wide ring (a dense codec, or too many owners
    for a packed ring)."""
    if compression.method not in GRID_CODECS or SharedGrid.bits_for(GRID_LEVELS, owners) > MAX_BITS:
        return None
    return GRID_LEVELS


def ring_bits(levels: int | None, owners: int) -> int:
    return WIDE_BITS if levels is None else SharedGrid.bits_for(levels, owners)


def noise_share_std(dp: DPTask, weights: dict[str, int], threshold: int) -> float:
    """Each owner's share of the DP noise: any ``threshold`` of them carry the plain mode's variance."""
    return mean_noise_std(dp.clip, dp.noise_multiplier, list(weights.values())) / math.sqrt(threshold)


def first_ranges(spec: TrainingSpec, layout: Layout, dp: DPTask | None) -> tuple[float, ...]:
    """Round 0's ranges, before any average is known: ``lr · inner_steps`` (clip-bounded under DP)."""
    bound = spec.lr * spec.inner_steps
    return (bound if dp is None else min(bound, dp.clip),) * len(layout.names)


def next_ranges(mean: Delta, last: tuple[float, ...], dp: DPTask | None) -> tuple[float, ...]:
    """The ranges for the next round from the average just unmasked (its tensors in name order) and the
    ``last`` ranges: they follow the average up (by at most ``HEADROOM`` a round, as the grid clamps) and
    down (by at most ``SHRINK``), and stay positive."""
    names = sorted(mean)
    top = np.array([float(mean[n].detach().abs().max()) if mean[n].numel() else 0.0 for n in names])
    ranges = np.maximum(HEADROOM * top, np.asarray(last) / SHRINK)
    if dp is not None:
        ranges = np.minimum(ranges, dp.clip)
    return tuple(float(r) for r in ranges)


def agreed_grid(
    levels: int | None,
    roster: Roster,
    layout: Layout,
    weights: dict[str, int],
    dp: DPTask | None,
    threshold: int,
    owner: str | None,
) -> SharedGrid | None:
    """The attempt's shared grid (None: the wide ring), the same for every party; ``owner``'s limits."""
    if levels is None:
        return None
    total = sum(weights.values())
    span = 0.0 if dp is None else NOISE_RANGE * noise_share_std(dp, weights, threshold)
    shares = {t: w / total for t, w in weights.items()}
    return SharedGrid.agree(layout.sizes, list(roster.ranges), shares, owner, levels, span)


# what a message a task cannot trust may raise when it is read: a worker's bad keys or shares, a bad reveal
MALFORMED = (BadRequest, Forbidden, KeyError, TypeError, ValueError)


def _say(err: Exception) -> str:
    return err.message if isinstance(err, BadRequest | Forbidden) else f"{type(err).__name__}: {err}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as err:
        raise BadRequest(f"not base64: {err}") from None


def _shares_out(shares: list[Share]) -> list[str]:
    return [_b64(struct.pack(">I", x) + y) for x, y in shares]


def _shares_in(items: list[str]) -> list[Share]:
    out = []
    for item in items:
        raw = _unb64(item)
        if len(raw) != 20:
            raise BadRequest(f"a share of {len(raw)} bytes, not 20")
        out.append((struct.unpack(">I", raw[:4])[0], raw[4:]))
    return out


def pack_masked(attempt: int, masked: np.ndarray, bits: int = WIDE_BITS) -> bytes:
    """A contribution's blob: the attempt, then the masked words, ``bits`` each (packed below 32)."""
    if bits == WIDE_BITS:
        words = masked.astype("<u4").tobytes()
    else:
        words = pack(torch.from_numpy(masked.astype(np.int64)), bits).numpy().tobytes()
    return _HEADER.pack(_MAGIC, attempt) + words


def unpack_masked(blob: bytes, size: int, bits: int = WIDE_BITS) -> tuple[int, np.ndarray]:
    """The attempt and the masked vector of a contribution's blob; BadRequest if it is not one of ``size``
    words of ``bits``."""
    length = 4 * size if bits == WIDE_BITS else packed_size(size, bits)
    if len(blob) != _HEADER.size + length or blob[:4] != _MAGIC:
        raise BadRequest(f"not a masked vector of {size} values of {bits} bits ({len(blob)} bytes)")
    _, attempt = _HEADER.unpack_from(blob)
    if bits == WIDE_BITS:
        return attempt, np.frombuffer(blob, dtype="<u4", offset=_HEADER.size).astype(np.uint32)
    data = torch.from_numpy(np.frombuffer(blob, dtype=np.uint8, offset=_HEADER.size).copy())
    return attempt, unpack(data, bits, size).numpy().astype(np.uint32)


@dataclass(frozen=True)
class Roster:
    attempt: int
    tasks: tuple[str, ...]  # client i of the attempt is tasks[i]
    ranges: tuple[float, ...] = ()  # the shared grid's per-tensor ranges (none: the wide ring)

    def body(self) -> dict:
        return {"tasks": list(self.tasks)} | ({"ranges": list(self.ranges)} if self.ranges else {})


def _body(message: SecAggMessage) -> dict:
    try:
        body = json.loads(message.body)
    except ValueError as err:
        raise BadRequest(f"a {message.kind} message that is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"a {message.kind} message that is not a JSON object")
    return body


def newest_roster(messages: list[SecAggMessage]) -> Roster | None:
    rosters = [m for m in messages if m.kind == "roster"]
    if not rosters:
        return None
    newest = max(rosters, key=lambda m: m.attempt)
    body = _body(newest)
    return Roster(newest.attempt, tuple(body["tasks"]), tuple(float(r) for r in body.get("ranges", ())))


def _of(messages: list[SecAggMessage], attempt: int, kind: SecAggKind) -> dict[str, SecAggMessage]:
    """The ``kind`` messages of ``attempt``, by sender."""
    return {m.sender: m for m in messages if m.attempt == attempt and m.kind == kind}


@dataclass
class _Mailbox:
    """One task's side of the relay: post, read, and wait between reads.

    The waits start short after the task's own post or upload (``hurry``), since that is when an answer is
    due (the reveals after the aggregator's request, the request after the round's last masked upload),
    and double up to ``poll_interval_s``: the unmask round trip sits on the round's critical path, and a
    task that just asked should not sleep a whole interval before it looks for the answer; it costs a few
    more reads per round.
    """

    transport: Transport
    poll_interval_s: float
    should_stop: Callable[[], bool]
    seen: dict[int, list[SecAggMessage]] = field(default_factory=dict)  # by round: what was read so far
    lock: threading.Lock = field(default_factory=threading.Lock)  # a worker reads from two threads
    wait_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.wait_s = self.poll_interval_s

    def post(self, round: int, attempt: int, kind: SecAggKind, body: dict, to: str = "*") -> None:
        self.transport.post_secagg(
            SecAggPost(round=round, attempt=attempt, kind=kind, to=to, body=json.dumps(body))
        )
        self.hurry()

    def hurry(self) -> None:
        self.wait_s = self.poll_interval_s / HURRY

    def read(self, round: int) -> list[SecAggMessage]:
        """Every message of ``round`` this task may read; only the new ones cross the wire."""
        with self.lock:  # a task works on one round, or two with overlap: older ones are forgotten
            self.seen = {r: v for r, v in self.seen.items() if r >= round - 1}
            seen = self.seen.setdefault(round, [])
            seen += self.transport.secagg_messages(round, seen[-1].seq if seen else -1).messages
            return list(seen)

    def closed(self, round: int) -> bool:
        latest = self.transport.latest_round()
        return latest is not None and (latest.round > round or latest.finished)

    def pause(self) -> None:
        time.sleep(self.wait_s)
        self.wait_s = min(2 * self.wait_s, self.poll_interval_s)


@dataclass
class Session:
    """This worker's client in one attempt of a round, once every member's shares are held."""

    round: int
    roster: Roster
    client: secagg.Client


@dataclass
class SecureWorker:
    """A worker's side: keys and shares while it trains (``prepare``), its masked share of the average as
    its contribution's blob (``masked_blob``), then its answer to the unmask request (``reveal``)."""

    config: TaskConfig
    mailbox: _Mailbox
    weight: float = field(init=False)
    range: float = field(init=False)
    levels: int | None = field(init=False)  # the shared grid's (None: the wide ring)

    def __post_init__(self) -> None:
        weights = self.config.weights or {}
        if self.config.task_id not in weights:
            raise Conflict("secure aggregation: this worker's task has no weight in the job's config")
        self.weight = weights[self.config.task_id] / sum(weights.values())
        self.range = value_range(weights, self.config.dp)
        self.levels = shared_levels(self.config.training.compression, len(weights))

    @classmethod
    def start(
        cls, config: TaskConfig, transport: Transport, poll_interval_s: float, should_stop: Callable[[], bool]
    ) -> SecureWorker:
        return cls(config, _Mailbox(transport, poll_interval_s, should_stop))

    def prepare(self, round: int) -> Session | None:
        """Steps 1 and 2 in the newest attempt of ``round`` that names this task; None if the round closes
        (or the task stops) first."""
        box, me = self.mailbox, self.config.task_id
        client: secagg.Client | None = None
        roster: Roster | None = None
        shared = False
        while not box.should_stop() and not box.closed(round):
            messages = box.read(round)
            newest = newest_roster(messages)
            if newest is not None and newest != roster:
                roster, client, shared = newest, None, False
                if me in roster.tasks:
                    client = self._client(round, roster)
                    keys = {"key": _b64(client.public_key), "transport": _b64(client.transport_public_key)}
                    try:
                        box.post(round, roster.attempt, "keys", keys)
                    except Conflict:  # an earlier run of this task took part in this attempt
                        client = None
            if client is not None and roster is not None:
                try:
                    shared = shared or self._share(round, roster, client, messages)
                    held = shared and self._hold(roster, client, messages)
                except MALFORMED as err:  # a member's keys or bundle do not open: it cannot take part
                    box.transport.log(f"round {round}: secure aggregation: a bad message: {_say(err)}")
                    return None
                if held:
                    box.transport.log(
                        f"round {round}: secure aggregation attempt {roster.attempt}: shared with "
                        f"{len(roster.tasks)} owners"
                    )
                    return Session(round, roster, client)
            box.pause()
        return None

    def _client(self, round: int, roster: Roster) -> secagg.Client:
        n = len(roster.tasks)
        t = secagg.attempt_threshold(self.config.secure_aggregation or 0, n)
        bits = ring_bits(self.levels, len(self.config.weights or {}))
        config = secagg.SecAggConfig(
            self.config.job_id, _round_id(round, roster.attempt), n, t, self.range, bits
        )
        return secagg.Client(config, roster.tasks.index(self.config.task_id))

    def _share(
        self, round: int, roster: Roster, client: secagg.Client, messages: list[SecAggMessage]
    ) -> bool:
        """Step 2 once every member's keys are in: all this task's sealed bundles in one message."""
        keys = _of(messages, roster.attempt, "keys")
        if not set(roster.tasks) <= keys.keys():
            return False
        bodies = [_body(keys[t]) for t in roster.tasks]
        public = [_unb64(b["key"]) for b in bodies]
        transport = [_unb64(b["transport"]) for b in bodies]
        sealed = client.sealed_shares(public, transport)
        try:
            bundles = {roster.tasks[holder]: _b64(box) for holder, box in sealed.items()}
            self.mailbox.post(round, roster.attempt, "shares", bundles)
        except Conflict:  # the attempt was superseded meanwhile: the next read brings the new roster
            return False
        return True

    def _hold(self, roster: Roster, client: secagg.Client, messages: list[SecAggMessage]) -> bool:
        """Every member's bundle for this task, opened and held; False while some are missing."""
        shares = _of(messages, roster.attempt, "shares")
        if not set(roster.tasks) <= shares.keys():
            return False
        me = self.config.task_id
        for owner, task in enumerate(roster.tasks):
            client.hold_sealed(owner, _unb64(_body(shares[task])[me]))
        return True

    def masked_blob(self, session: Session, decoded: Delta) -> tuple[bytes, Delta]:
        """Step 3: this owner's share of the average (and of the noise), masked, as a contribution blob;
        and what the ring's encoding dropped of ``decoded`` (in its units), for the error feedback."""
        dp, weights, config = self.config.dp, self.config.weights or {}, session.client.config
        if dp is not None:  # what this owner releases is within the bound, residual or not
            decoded = clip_to(decoded, dp.clip)[0]
        vector, layout = flatten(decoded)
        vector = vector * self.weight
        if dp is not None:
            std = noise_share_std(dp, weights, config.threshold)
            vector = vector + np.random.default_rng().normal(0.0, std, vector.size)  # OS-seeded
        me = self.config.task_id
        grid = agreed_grid(self.levels, session.roster, layout, weights, dp, config.threshold, me)
        encoding = config.encoding_for(grid)
        dropped = (vector - encoding.decode_sum(encoding.encode(vector), 1)) / self.weight
        blob = pack_masked(session.roster.attempt, session.client.mask(vector, grid), config.ring_bits)
        return blob, unflatten(dropped, layout)

    def reveal(self, session: Session) -> None:
        """Step 4: answer the aggregator's request for this attempt, once; gives up when the round closes."""
        box, round = self.mailbox, session.round
        box.hurry()  # its masked update is up: it may be the round's last
        while not box.should_stop() and not box.closed(round):
            requests = _of(box.read(round), session.roster.attempt, "request")
            if requests:
                survivors = _body(next(iter(requests.values())))["survivors"]
                index = {t: i for i, t in enumerate(session.roster.tasks)}
                chosen = frozenset(index[t] for t in survivors if t in index)
                request = secagg.UnmaskRequest(chosen, frozenset(index.values()) - chosen)
                try:
                    answer = session.client.reveal(request)
                except (BadRequest, Forbidden, Conflict) as err:
                    box.transport.log(f"round {round}: secure aggregation: no reveal: {err.message}")
                    return
                body = {
                    "seeds": {session.roster.tasks[u]: _shares_out(s) for u, s in answer.seeds.items()},
                    "keys": {session.roster.tasks[u]: _shares_out(s) for u, s in answer.keys.items()},
                }
                box.post(round, session.roster.attempt, "reveal", body, to="aggregator")
                return
            box.pause()


def _round_id(round: int, attempt: int) -> int:
    """What binds a round's masks and sealed bundles: the round and its attempt (fresh keys each)."""
    return round * 1024 + attempt


@dataclass
class SecureAggregator:
    """The aggregator's side: rosters, the survivors' request, and the unmasked sum as the round's mean."""

    mailbox: _Mailbox
    job_id: str
    weights: dict[str, int]
    threshold: int
    range: float
    layout: Layout
    dp: DPTask | None
    timeout_s: float
    levels: int | None  # the shared grid's (None: the wide ring)
    ranges: tuple[float, ...]  # the grid's ranges for the next round's roster (() for the wide ring)
    roster: Roster = field(default_factory=lambda: Roster(0, ()))
    began: float = 0.0  # when the current attempt was posted
    waiting_logged: bool = False

    @classmethod
    def start(
        cls,
        transport: Transport,
        job_id: str,
        weights: dict[str, int],
        threshold: int,
        dp: DPTask | None,
        params: Delta,
        spec: TrainingSpec,
        poll_interval_s: float,
        should_stop: Callable[[], bool],
    ) -> SecureAggregator:
        layout = flatten(params)[1]
        levels = shared_levels(spec.compression, len(weights))
        return cls(
            _Mailbox(transport, poll_interval_s, should_stop),
            job_id,
            weights,
            threshold,
            value_range(weights, dp),
            layout,
            dp,
            spec.round_timeout_s,
            levels,
            first_ranges(spec, layout, dp) if levels is not None else (),
        )

    def open(self, round: int) -> None:
        """Post attempt 0 of ``round`` (or find the attempt a predecessor posted): every owner."""
        found = newest_roster(self.mailbox.read(round))
        self.roster = found or Roster(0, tuple(sorted(self.weights)), self.ranges)
        if found is None:
            self.mailbox.post(round, 0, "roster", self.roster.body())
        self.began, self.waiting_logged = time.monotonic(), False

    def expected(self) -> int:
        return len(self.roster.tasks)

    def tend(self, round: int, live_workers: int) -> None:
        """Start the round over without the members whose keys (or, once all keys are in, shares) never
        came, once as many members as there are live workers have sent theirs or the timeout passed; with
        fewer than 3 left, wait for owners to come back (past the timeout, every owner gets another try)."""
        messages = self.mailbox.read(round)
        everyone = set(self.roster.tasks)
        keyed = set(_of(messages, self.roster.attempt, "keys")) & everyone
        shared = set(_of(messages, self.roster.attempt, "shares")) & everyone
        if shared == everyone:
            return
        ready = shared if keyed == everyone else keyed  # past step 1, those that shared; else those keyed
        late = time.monotonic() - self.began >= self.timeout_s
        if not late and len(ready) < live_workers:
            return
        members = tuple(t for t in self.roster.tasks if t in ready)
        if len(members) < secagg.MIN_CLIENTS:
            if not self.waiting_logged:
                self.mailbox.transport.log(
                    f"round {round}: secure aggregation waits: {len(members)} owner(s) shared their "
                    f"secrets, and a round needs {secagg.MIN_CLIENTS}"
                )
                self.waiting_logged = True
            if not late:
                return
            members = tuple(sorted(self.weights))  # past the timeout: every owner gets another chance
        left_out = sorted(set(self.roster.tasks) - set(members))
        attempt = Roster(self.roster.attempt + 1, members, self.roster.ranges)
        try:
            self.mailbox.post(round, attempt.attempt, "roster", attempt.body())
        except Conflict:  # the last shares came in meanwhile: this attempt goes on
            return
        self.roster = attempt
        self.began = time.monotonic()
        if left_out:
            self.mailbox.transport.log(
                f"round {round}: secure aggregation restarts (attempt {self.roster.attempt}) without "
                f"{', '.join(left_out)}: their keys or shares did not reach every owner"
            )

    def parse(self, blob: bytes) -> np.ndarray | None:
        """A contribution's masked vector if it belongs to the current attempt (None: another's)."""
        bits = ring_bits(self.levels, len(self.weights))
        attempt, masked = unpack_masked(blob, self.layout.size, bits)
        return masked if attempt == self.roster.attempt else None

    def mean(self, round: int, used: list[tuple[Contribution, np.ndarray]]) -> Delta | None:
        """The round's average from its masked vectors: request the reveals, unmask, decode; the zero
        update (logged) if too few survive; None if told to stop first."""
        box, roster = self.mailbox, self.roster
        index = {t: i for i, t in enumerate(roster.tasks)}
        survivors = sorted((c.task_id for c, _ in used if c.task_id in index), key=index.__getitem__)
        t = secagg.attempt_threshold(self.threshold, len(roster.tasks))
        zero = unflatten(np.zeros(self.layout.size), self.layout)
        if len(survivors) < t:
            box.transport.log(
                f"round {round}: {len(survivors)} masked updates, fewer than the threshold {t}: "
                "nothing can be unmasked, the model stays"
            )
            return zero
        asked = _of(box.read(round), roster.attempt, "request")
        if asked:  # a predecessor asked already (this aggregator is its replacement): the same survivors
            survivors = [t for t in _body(next(iter(asked.values())))["survivors"] if t in index]
            used = [(c, v) for c, v in used if c.task_id in survivors]
        else:
            box.post(round, roster.attempt, "request", {"survivors": survivors})
        deadline = time.monotonic() + self.timeout_s
        while not box.should_stop():
            messages = box.read(round)
            keys = {s: _body(m) for s, m in _of(messages, roster.attempt, "keys").items()}
            reveals = _of(messages, roster.attempt, "reveal")
            if len(reveals.keys() & set(survivors)) >= t:
                try:
                    return self._unmask(round, roster, survivors, used, keys, reveals)
                except MALFORMED as err:
                    box.transport.log(
                        f"round {round}: secure aggregation could not unmask ({_say(err)}): the model stays"
                    )
                    return zero
            if time.monotonic() >= deadline:
                box.transport.log(
                    f"round {round}: {len(reveals)} owners revealed their shares, fewer than the "
                    f"threshold {t}: nothing can be unmasked, the model stays"
                )
                return zero
            box.pause()
        return None

    def _unmask(
        self,
        round: int,
        roster: Roster,
        survivors: list[str],
        used: list[tuple[Contribution, np.ndarray]],
        keys: dict[str, dict],
        reveals: dict[str, SecAggMessage],
    ) -> Delta:
        index = {t: i for i, t in enumerate(roster.tasks)}
        n = len(roster.tasks)
        config = secagg.SecAggConfig(
            self.job_id,
            _round_id(round, roster.attempt),
            n,
            secagg.attempt_threshold(self.threshold, n),
            self.range,
            ring_bits(self.levels, len(self.weights)),
        )
        grid = agreed_grid(self.levels, roster, self.layout, self.weights, self.dp, config.threshold, None)
        public = [_unb64(keys[t]["key"]) for t in roster.tasks]
        answers = []
        for task, message in sorted(reveals.items()):
            if task not in survivors:
                continue
            body = _body(message)
            answers.append(
                secagg.Reveal(
                    index[task],
                    seeds={index[u]: _shares_in(s) for u, s in body["seeds"].items() if u in index},
                    keys={index[u]: _shares_in(s) for u, s in body["keys"].items() if u in index},
                )
            )
        masked = {index[c.task_id]: v for c, v in used if c.task_id in index}
        total = secagg.aggregate(config, public, masked, answers, grid)
        dropped = n - len(masked)
        self.mailbox.transport.log(
            f"round {round}: secure aggregation unmasked the sum of {len(masked)} owners"
            + (
                f" ({dropped} dropped after sharing: their masks rebuilt from the others' shares)"
                if dropped
                else ""
            )
        )
        if self.dp is None:  # FedAvg over those that came: the sum was over all owners' weight
            came = sum(self.weights[c.task_id] for c, _ in used if c.task_id in index)
            total = total * (sum(self.weights.values()) / came)
        mean = unflatten(total, self.layout)
        if self.levels is not None:
            self.ranges = next_ranges(mean, roster.ranges, self.dp)
        return mean


def rehearse(
    deltas: dict[str, Delta],
    weights: dict[str, int],
    *,
    dp: DPTask | None = None,
    compression: str = "none",
    vanish_after_sharing: frozenset[str] = frozenset(),
    never_share: frozenset[str] = frozenset(),
    timeout_s: float = 5.0,
    poll_interval_s: float = 0.005,
) -> tuple[Delta, LocalTransport]:
    """One round played in this process, each owner (``deltas``' keys, its decoded pseudo-gradient) on a
    thread, the aggregator here, over a ``LocalTransport`` with the job's rules: an owner in
    ``vanish_after_sharing`` is gone once its shares are out, one in ``never_share`` never comes. The
    round's mean, and the hub (its logs, its contributions); ``compression`` picks the ring (``int8``: the
    shared grid, round 0's ranges). For tests and ``bench/federated_secagg.py``."""
    hub = LocalTransport(rounds=1, live_workers=len(weights), task_id="aggregator")
    state = "0" * 64
    hub.publish_round(RoundPublish(round=0, state_hash=state, checkpoint=hub.put_blob(b"round 0")))
    threshold = secagg.job_threshold(len(weights))
    spec = TrainingSpec(round_timeout_s=timeout_s, compression=compression)
    like = next(iter(deltas.values()))
    stop = threading.Event()
    aggregator = SecureAggregator.start(
        hub, "rehearsal", weights, threshold, dp, like, spec, poll_interval_s, stop.is_set
    )
    aggregator.open(0)

    def owner(task: str) -> None:
        view = hub.for_task(task)
        config = TaskConfig(
            job_id="rehearsal",
            task_id=task,
            role="worker",
            worker_index=sorted(weights).index(task),
            num_workers=len(weights),
            training=spec,
            weights=weights,
            dp=dp,
            secure_aggregation=threshold,
        )
        worker = SecureWorker.start(config, view, poll_interval_s, stop.is_set)
        session = worker.prepare(0)
        if session is None or task in vanish_after_sharing:
            return
        blob, _ = worker.masked_blob(session, deltas[task])
        digest = view.put_blob(blob)
        view.submit_contribution(ContributionSubmit(round=0, delta=digest, tokens=1, steps=1, train_loss=1.0))
        worker.reveal(session)

    threads = [
        threading.Thread(target=owner, args=(t,), daemon=True) for t in weights if t not in never_share
    ]
    for t in threads:
        t.start()
    live = len(weights) - len(never_share)  # as the coordinator counts them while the others share
    coming = live - len(vanish_after_sharing)
    try:
        deadline = time.monotonic() + timeout_s * 3
        while time.monotonic() < deadline:  # the gatherer's loop, cut down
            aggregator.tend(0, live)
            listing = hub.contributions(0).contributions
            used = [(c, v) for c in listing if (v := aggregator.parse(hub.get_blob(c.delta))) is not None]
            if len(used) >= coming:
                break
            time.sleep(poll_interval_s)
        mean = aggregator.mean(0, sorted(used, key=lambda x: x[0].task_id))
        assert mean is not None, "the rehearsal is never told to stop before its end"
        update = hub.put_blob(b"round 1")
        hub.publish_round(RoundPublish(round=1, state_hash=state, update=update, checkpoint=update))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout_s)
    return mean, hub
