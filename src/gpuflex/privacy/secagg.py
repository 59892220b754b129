"""One round of secure aggregation (Bonawitz et al., CCS 2017, all pairs): both sides of it.

The worker and the aggregator drive it over messages; here it is pure objects, so a test can play every
party. Clients are the indices ``0 .. n-1`` of the round's roster.

1. Each client makes a fresh X25519 key pair; the public keys are broadcast (``Client.public_key``).
2. Each client Shamir-shares (threshold ``t``) its self-mask seed and its private key, one bundle per
   holder (``Client.shares``), sealed to the holder's transport key, a second X25519 key of the round, so
   that rebuilding a dropped client's masking key opens none of the bundles meant for it
   (``Client.sealed_shares``, ``Client.hold_sealed``); the aggregator only forwards them.
3. Each client sends ``masked = encode(x) + PRG(seed) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)``
   mod 2^k (``Client.mask``; ``k = ring_bits``: 32 for ``FixedPoint``, fewer for a ``SharedGrid``, whose
   masks are the keystream's words mod 2^k, as uniform there since 2^k divides 2^32). Clients that
   send nothing are the round's dropped clients.
4. The aggregator asks the survivors to reveal, for each survivor, its seed share and, for each dropped
   client, its key share (``UnmaskRequest``); an honest client reveals one kind per client and never
   both (``Client.reveal`` refuses), so no client's lone input can be unmasked.
5. ``unmask`` removes the survivors' self masks and the dropped clients' leftover pairwise masks:
   what remains is the exact ring sum of the survivors' encoded inputs, and nothing else.

The roster is the clients whose keys and shares all arrived: one that drops before its shares reach
every holder leaves the round unfinishable, and the network layer starts the round again without it
(``Client.reveal`` says whose shares it lacks). A round survives up to ``n - t`` clients that drop
after step 2. With ``t > n/2`` an aggregator that tells some holders a client survived and others that
it dropped cannot gather ``t`` seed shares and ``t`` key shares of it: each honest holder answers one
kind per client, and ``2t > n``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gpuflex.errors import BadRequest, Conflict, Forbidden, SpecError
from gpuflex.privacy import envelope, masks
from gpuflex.privacy.fixedpoint import WIDE_BITS, FixedPoint, SharedGrid
from gpuflex.privacy.masks import Share

MIN_CLIENTS = 3  # with two, a survivor's sum is its own input the moment its peer drops


@dataclass(frozen=True)
class SecAggConfig:
    """A round's parameters; every party builds the same one from the job spec."""

    job_id: str
    round: int
    n: int
    threshold: int
    clip: float  # each coordinate is clipped to [-clip, clip] before encoding (the wide ring's)
    ring_bits: int = WIDE_BITS  # the ring masks and sums live in: 2^ring_bits

    def __post_init__(self) -> None:
        if self.n < MIN_CLIENTS:
            raise SpecError(f"secure aggregation needs at least {MIN_CLIENTS} workers, not {self.n}")
        low = self.n // 2 + 1
        if not low <= self.threshold <= self.n:
            raise SpecError(
                f"secure aggregation's threshold for {self.n} workers must lie in {low}..{self.n}, "
                f"not {self.threshold}"
            )
        FixedPoint(self.clip, self.n)
        if not 1 <= self.ring_bits <= WIDE_BITS:
            raise SpecError(f"secure aggregation's ring of {self.ring_bits} bits: out of range")

    @classmethod
    def default_threshold(cls, n: int) -> int:
        return n // 2 + 1

    @property
    def encoding(self) -> FixedPoint:
        return FixedPoint(self.clip, self.n)

    def encoding_for(self, grid: SharedGrid | None) -> FixedPoint | SharedGrid:
        """``grid`` if the round agreed one (it must fit the ring), else the wide fixed point."""
        if grid is None:
            return self.encoding
        if grid.ring_bits != self.ring_bits:
            raise BadRequest(f"a grid of {grid.ring_bits} bits for a ring of {self.ring_bits}")
        return grid

    @property
    def ring_mask(self) -> np.uint32:
        return np.uint32((1 << self.ring_bits) - 1)


def job_threshold(owners: int, asked: int | None = None) -> int:
    """A job's threshold for ``owners``: ``asked``, or the smallest majority; SpecError out of range."""
    t = asked or SecAggConfig.default_threshold(owners)
    SecAggConfig("check", 0, owners, t, 1.0)  # refuses fewer than 3 owners, or t out of range
    return t


def attempt_threshold(job: int, members: int) -> int:
    """The threshold of a round's attempt of ``members`` clients: the job's, or more where that is not a
    majority of a roster some owners were left out of."""
    return min(members, max(job, SecAggConfig.default_threshold(members)))


@dataclass(frozen=True)
class SharesFor:
    """What ``owner`` gives ``holder``: its points of the owner's self-mask seed and private key."""

    owner: int
    holder: int
    seed: list[Share]
    key: list[Share]


@dataclass(frozen=True)
class UnmaskRequest:
    """The aggregator's view after step 3: who sent a masked vector and who did not."""

    survivors: frozenset[int]
    dropped: frozenset[int]


@dataclass(frozen=True)
class Reveal:
    """A holder's answer: seed shares of the survivors, key shares of the dropped."""

    holder: int
    seeds: dict[int, list[Share]]
    keys: dict[int, list[Share]]


@dataclass
class Client:
    """One client's side of a round; a fresh one per round (its keys and seed are per round)."""

    config: SecAggConfig
    index: int
    # fresh and random unless a test or a drill fixes them
    key: X25519PrivateKey = field(default_factory=masks.new_private_key, repr=False)
    seed: bytes = field(default_factory=lambda: os.urandom(masks.SEED_BYTES), repr=False)
    transport_key: X25519PrivateKey = field(default_factory=masks.new_private_key, repr=False)
    _roster: tuple[bytes, ...] = ()
    _held: dict[int, SharesFor] = field(default_factory=dict, repr=False)
    _revealed: dict[int, str] = field(default_factory=dict)  # owner -> "seed" | "key"
    _masked: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.config.n:
            raise BadRequest(f"client {self.index} is not in a round of {self.config.n}")

    @property
    def public_key(self) -> bytes:
        return masks.public_bytes(self.key)

    def shares(self, public_keys: Sequence[bytes]) -> list[SharesFor]:
        """Step 2: take the roster's public keys; one bundle of shares per holder (this client too)."""
        if len(public_keys) != self.config.n or len(set(public_keys)) != self.config.n:
            raise BadRequest(f"the roster needs {self.config.n} distinct public keys, got {len(public_keys)}")
        if public_keys[self.index] != self.public_key:
            raise BadRequest(f"the roster's key for client {self.index} is not this client's")
        if self._roster:  # a second sharing would hand holders points of two polynomials
            raise Conflict(f"client {self.index} already shared its secrets this round")
        self._roster = tuple(public_keys)
        t, n = self.config.threshold, self.config.n
        seed = masks.split(self.seed, t, n)
        key = masks.split(masks.private_bytes(self.key), t, n)
        return [SharesFor(self.index, h, seed[h], key[h]) for h in range(n)]

    @property
    def transport_public_key(self) -> bytes:
        return masks.public_bytes(self.transport_key)

    def sealed_shares(
        self, public_keys: Sequence[bytes], transport_keys: Sequence[bytes]
    ) -> dict[int, bytes]:
        """Step 2 as it goes on the wire: each holder's bundle sealed to its transport key."""
        if len(transport_keys) != self.config.n:
            raise BadRequest(f"the roster needs {self.config.n} transport keys, got {len(transport_keys)}")
        return {
            b.holder: envelope.seal(
                _pack(b), transport_keys[b.holder], _bundle_info(self.config, b.owner, b.holder)
            )
            for b in self.shares(public_keys)
        }

    def hold_sealed(self, owner: int, sealed: bytes) -> None:
        info = _bundle_info(self.config, owner, self.index)
        what, use = (
            f"share bundle from client {owner}",
            f"for another round or holder than client {self.index}",
        )
        self.hold(_unpack(envelope.unseal(sealed, self.transport_key, info, what, use), owner, self.index))

    def hold(self, bundle: SharesFor) -> None:
        if bundle.holder != self.index or not 0 <= bundle.owner < self.config.n:
            raise BadRequest(f"shares from {bundle.owner} for {bundle.holder} handed to client {self.index}")
        self._held[bundle.owner] = bundle

    def mask(self, values: np.ndarray, grid: SharedGrid | None = None) -> np.ndarray:
        """Step 3: the encoded (on ``grid`` if given), masked vector (uint32 below 2^ring_bits); uniform
        noise to anyone without the masks."""
        if not self._roster:
            raise Conflict("a client masks only after the roster's public keys (Client.shares)")
        if self._masked:  # two inputs under one mask: their difference would show through
            raise Conflict(f"client {self.index} already masked an input this round")
        cfg = self.config
        out = cfg.encoding_for(grid).encode(values)
        self._masked = True
        out += masks.expand(masks.self_mask_key(self.seed, cfg.job_id, cfg.round, self.index), out.size)
        for v, peer in enumerate(self._roster):
            if v == self.index:
                continue
            key = masks.pairwise_key(self.key, peer, cfg.job_id, cfg.round, self.index, v)
            pad = masks.expand(key, out.size)
            if v > self.index:
                out += pad
            else:
                out -= pad
        return out & cfg.ring_mask

    def reveal(self, request: UnmaskRequest) -> Reveal:
        """Step 4: shares for the aggregator, refusing any request that would expose one client whole."""
        cfg = self.config
        everyone = frozenset(range(cfg.n))
        if request.survivors & request.dropped:
            both = sorted(request.survivors & request.dropped)
            raise Forbidden(f"refused: clients {both} named both survivor and dropped (seed and key)")
        if request.survivors | request.dropped != everyone:
            raise BadRequest(f"an unmask request must name each of the {cfg.n} clients once")
        if len(request.survivors) < cfg.threshold:
            raise BadRequest(
                f"refused: {len(request.survivors)} survivors, fewer than the threshold {cfg.threshold}"
            )
        if self.index not in request.survivors:
            raise BadRequest(f"client {self.index} is named dropped, so it reveals nothing")
        wanted = {u: "seed" for u in request.survivors} | {u: "key" for u in request.dropped}
        clash = sorted(u for u, kind in wanted.items() if self._revealed.get(u, kind) != kind)
        if clash:
            raise Forbidden(f"refused: revealing clients {clash}'s other secret would expose their inputs")
        missing = sorted(everyone - self._held.keys())
        if missing:
            raise Conflict(f"client {self.index} holds no shares from clients {missing}")
        self._revealed.update(wanted)
        return Reveal(
            self.index,
            seeds={u: self._held[u].seed for u in request.survivors},
            keys={u: self._held[u].key for u in request.dropped},
        )


def _bundle_info(config: SecAggConfig, owner: int, holder: int) -> bytes:
    job = config.job_id.encode()
    return b"gpuflex/secagg/shares" + struct.pack(
        f">I{len(job)}sQII", len(job), job, config.round, owner, holder
    )


def _pack(bundle: SharesFor) -> bytes:
    shares = [*bundle.seed, *bundle.key]
    head = struct.pack(">IIBB", bundle.owner, bundle.holder, len(bundle.seed), len(bundle.key))
    return head + b"".join(struct.pack(">I16s", x, y) for x, y in shares)


def _unpack(data: bytes, owner: int, holder: int) -> SharesFor:
    got_owner, got_holder, n_seed, n_key = struct.unpack_from(">IIBB", data)
    if (got_owner, got_holder) != (owner, holder) or len(data) != 10 + 20 * (n_seed + n_key):
        raise BadRequest(f"a share bundle that is not client {owner}'s for client {holder}")
    shares = [struct.unpack_from(">I16s", data, 10 + 20 * i) for i in range(n_seed + n_key)]
    return SharesFor(owner, holder, shares[:n_seed], shares[n_seed:])


def unmask(
    config: SecAggConfig,
    public_keys: Sequence[bytes],
    masked: dict[int, np.ndarray],
    reveals: Sequence[Reveal],
) -> np.ndarray:
    """Step 5: the ring sum (uint32, mod 2^ring_bits) of the survivors' encoded inputs, exactly."""
    survivors = frozenset(masked)
    if not survivors <= frozenset(range(config.n)):
        raise BadRequest(f"masked vectors from clients {sorted(survivors)}, not all in a round of {config.n}")
    dropped = frozenset(range(config.n)) - survivors
    t = config.threshold
    if len(survivors) < t:
        raise BadRequest(f"{len(survivors)} masked vectors, fewer than the threshold {t}: the round fails")
    usable = list({r.holder: r for r in reveals if r.holder in survivors}.values())
    if len({r.holder for r in usable}) < t:
        raise BadRequest(f"shares from {len(usable)} survivors, fewer than the threshold {t}")
    for r in usable:
        if r.seeds.keys() != survivors or r.keys.keys() != dropped:
            raise Forbidden(f"refused: client {r.holder}'s reveal does not match the survivors and dropped")
    sizes = {v.shape for v in masked.values()}
    if len(sizes) != 1:
        raise BadRequest(f"masked vectors of different shapes: {sorted(sizes)}")
    total = np.zeros(sizes.pop(), dtype=np.uint32)
    for vector in masked.values():
        total += vector.astype(np.uint32, copy=False)
    for u in survivors:
        seed = masks.combine([r.seeds[u] for r in usable], t)
        total -= masks.expand(masks.self_mask_key(seed, config.job_id, config.round, u), total.size)
    for u in dropped:
        key = X25519PrivateKey.from_private_bytes(masks.combine([r.keys[u] for r in usable], t))
        if masks.public_bytes(key) != public_keys[u]:
            raise BadRequest(f"the shares of client {u}'s key do not reconstruct its public key")
        for v in survivors:
            pair = masks.pairwise_key(key, public_keys[v], config.job_id, config.round, u, v)
            pad = masks.expand(pair, total.size)
            # survivor v added +pad for a higher peer and -pad for a lower one; take that back
            if u > v:
                total -= pad
            else:
                total += pad
    return total & config.ring_mask


def aggregate(
    config: SecAggConfig,
    public_keys: Sequence[bytes],
    masked: dict[int, np.ndarray],
    reveals: Sequence[Reveal],
    grid: SharedGrid | None = None,
) -> np.ndarray:
    """The float sum of the survivors' (clipped, rounded) inputs, on ``grid`` if the round agreed one."""
    total = unmask(config, public_keys, masked, reveals)
    return config.encoding_for(grid).decode_sum(total, len(masked))
