"""A trusted group's exchange over ``torch.distributed``: no aggregator, no blob store.

The relay (``Transport``) is for strangers: every pseudo-gradient goes through an aggregator that
checks it. Inside a group that trusts itself (a provider's own machines, the platform's core nodes,
the DDP baseline) the ranks can exchange directly, as OpenDiLoCo's workers do::

    dist.init_process_group("gloo", ...)        # or "nccl"
    opt = DiLoCo(model, inner, transport=CollectiveTransport(spec), spec=spec)

Each round every rank all-gathers the others' compressed pseudo-gradients (the same bytes the relay
would carry, as uint8 tensors: no pickle), decodes them into the model's shapes, takes the
token-weighted mean in rank order and applies it to its ``GlobalReplica``. Every rank does the same
arithmetic on the same bytes, so the replicas stay equal bit for bit; the ranks compare state hashes
each round to prove it. There is no downlink compression: each rank receives the W−1 uplinks.

``ThrottledAllReduce`` is the same group's DDP communication hook on a simulated link (the baseline
of ``bench/diloco_vs_ddp.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpuflex.errors import ServiceError
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.outer import GlobalReplica, weighted_mean
from gpuflex.train.throttle import Link, LinkStats
from gpuflex.train.transport import Decoder, Outgoing


@dataclass
class LinkMeter:
    """One rank's link: collectives wait as long as it makes them, and what crossed it is counted."""

    link: Link
    stats: LinkStats = field(default_factory=LinkStats)

    def carry(self, sent: int, received: int) -> None:
        """Count a collective's bytes and wait as long as the link would (full duplex: the larger way)."""
        delay = self.link.delay_s(max(sent, received))
        if delay > 0:
            time.sleep(delay)
        self.stats.wait_s += delay
        self.stats.calls += 1
        self.stats.bytes_up += sent
        self.stats.bytes_down += received


class CollectiveTransport:
    """DiLoCo's exchange between the ranks of a ``torch.distributed`` process group."""

    def __init__(
        self, spec: TrainingSpec, *, group: dist.ProcessGroup | None = None, link: Link | None = None
    ):
        if not dist.is_initialized():
            raise ServiceError("CollectiveTransport needs torch.distributed.init_process_group first")
        self.spec = spec
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.meter = LinkMeter(link or Link())

    def join(self, replica: GlobalReplica, decode: Decoder) -> bool:
        """Make every rank's replica rank 0's, at round 0."""
        replica.round = 0
        state = self._gather(replica.to_bytes() if self.rank == 0 else b"")[0]
        if self.rank != 0:
            replica.load(state)
        self._check_agreement(replica)
        return True

    def exchange(self, replica: GlobalReplica, outgoing: Outgoing, decode: Decoder) -> tuple[bool, bool]:
        """Share this rank's compressed pseudo-gradient and apply the round's mean: every rank's is used."""
        blobs = self._gather(outgoing.blob)
        tokens = self._gather_ints(outgoing.tokens)
        replica.apply(weighted_mean([(t, decode(b)) for t, b in zip(tokens, blobs, strict=True)]))
        self._check_agreement(replica)
        return True, replica.round < self.spec.rounds

    def _gather_ints(self, value: int) -> list[int]:
        values = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(values, torch.tensor([value], dtype=torch.int64), group=self.group)
        return [int(v.item()) for v in values]

    def _gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order; this rank's goes to the W−1 others."""
        sizes = self._gather_ints(len(data))
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        chunks = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(chunks, padded, group=self.group)
        others = sum(s for r, s in enumerate(sizes) if r != self.rank)
        self.meter.carry(sent=len(data) * (self.world - 1), received=others)
        return [bytes(chunk[:size].numpy()) for chunk, size in zip(chunks, sizes, strict=True)]

    def _check_agreement(self, replica: GlobalReplica) -> None:
        ours = replica.state_hash()
        hashes = self._gather(bytes.fromhex(ours))
        if any(h.hex() != ours for h in hashes):
            raise ServiceError(f"round {replica.round}: the ranks' replicas disagree")


@dataclass
class ThrottledAllReduce:
    """A DDP communication hook's state: each bucket is all-reduced as a ring would over ``meter``'s link.

    A ring all-reduce of b bytes makes each rank send 2·(W−1)/W·b bytes and receive as many, at once
    (the link is full duplex). One latency per bucket: generous to DDP (a real ring pays 2·(W−1) hops).
    """

    world: int
    meter: LinkMeter

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _throttled_allreduce)


def _throttled_allreduce(state: ThrottledAllReduce, bucket):  # unannotated: DDP checks hook annotations
    """All-reduce one bucket (a ``dist.GradBucket``) as the link would carry it; a done Future of the mean."""
    tensor = bucket.buffer()
    wire = round(2 * (state.world - 1) / state.world * tensor.numel() * tensor.element_size())
    state.meter.carry(sent=wire, received=wire)
    dist.all_reduce(tensor)
    tensor.div_(state.world)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(tensor)
    return done
