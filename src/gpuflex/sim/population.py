"""The simulated nodes, column by column: what each one is (drawn once from the scenario) and how long
its sessions and absences last (drawn as it goes).

One numpy array per attribute instead of one object per node: a million nodes fit in some tens of
megabytes and are drawn in one vectorized call each. Nodes ``0 .. n_core - 1`` are core nodes.
A node's *profile* (kind, GPU, region, asking price in cents) is all the market's requirement checks
read, so eligibility is decided once per profile, by the market's own checks (``sim.index``).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

from gpuflex.market.matching import NodeOffer
from gpuflex.sim.scenario import Scenario


@dataclass
class Population:
    n: int
    n_core: int
    gpu: np.ndarray  # int, index into gpu_names
    region: np.ndarray  # int, index into region_names
    price: np.ndarray  # credits per hour, whole cents
    tflops: np.ndarray
    vram_gb: np.ndarray
    bandwidth: np.ndarray  # bytes per second
    latency_s: np.ndarray
    utc_offset_h: np.ndarray
    profile: np.ndarray  # int, index into profiles
    profiles: list[NodeOffer]  # one representative offer per profile (node_id of its first node)
    gpu_names: list[str]
    region_names: list[str]

    @classmethod
    def draw(cls, scenario: Scenario, n: int, rng: np.random.Generator) -> Population:
        n_core = min(n, round(scenario.core.share * n))
        gpus, regions = scenario.gpus, scenario.regions
        gpu = rng.choice(len(gpus), size=n, p=_normalized([g.share for g in gpus]))
        gpu[:n_core] = [g.name for g in gpus].index(scenario.core.gpu)
        region = rng.choice(len(regions), size=n, p=_normalized([r.share for r in regions]))
        low = np.array([g.price_per_hour.low for g in gpus])[gpu]
        high = np.array([g.price_per_hour.high for g in gpus])[gpu]
        price = np.round(rng.uniform(low, high), 2)
        price[:n_core] = round(scenario.core.price_per_hour, 2)
        bw = scenario.links.bandwidth_mbps
        mbps = np.exp(rng.uniform(math.log(max(bw.low, 1e-3)), math.log(max(bw.high, 1e-3)), size=n))
        mbps[:n_core] = scenario.core.bandwidth_mbps
        lat = scenario.links.latency_ms
        latency_s = rng.uniform(lat.low, lat.high, size=n) / 1000
        latency_s[:n_core] = scenario.core.latency_ms / 1000
        pop = cls(
            n=n,
            n_core=n_core,
            gpu=gpu,
            region=region,
            price=price,
            tflops=np.array([g.tflops for g in gpus])[gpu],
            vram_gb=np.array([g.vram_gb for g in gpus])[gpu],
            bandwidth=mbps * 1e6 / 8,
            latency_s=latency_s,
            utc_offset_h=np.array([r.utc_offset_hours for r in regions])[region],
            profile=np.zeros(n, dtype=np.int64),
            profiles=[],
            gpu_names=[g.name for g in gpus],
            region_names=[r.name for r in regions],
        )
        pop._offer_columns()
        pop._profile()
        return pop

    def _offer_columns(self) -> None:
        """What ``offer`` reads, as flat arrays (indexing numpy one element at a time is slow, and a
        million boxed floats in a list miss the cache), a GPU's attributes looked up once per GPU."""
        self._price = array("d", self.price.tolist())
        self._gpu = array("q", self.gpu.tolist())
        self._region = array("q", self.region.tolist())
        self._gpus = [(name,) for name in self.gpu_names]
        per_gpu = np.zeros((2, len(self.gpu_names)))
        per_gpu[:, self.gpu] = self.tflops, self.vram_gb
        self._gpu_tflops, self._gpu_vram = per_gpu.tolist()

    def _profile(self) -> None:
        core = np.arange(self.n) < self.n_core
        cents = np.round(self.price * 100).astype(np.int64)
        keys = np.stack([core.astype(np.int64), self.gpu, self.region, cents], axis=1)
        _, first, self.profile = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        self.profile = self.profile.reshape(-1)
        self.profiles = [self.offer(int(i), reliability=1.0) for i in first]

    def node_id(self, i: int) -> str:
        return f"n{i:08d}"  # zero-padded: string order is index order, as the market's ties need

    def offer(self, i: int, *, reliability: float) -> NodeOffer:
        """Node ``i`` as the market sees it (the same value ``services.market.offer_of`` builds)."""
        node_id, gpu = self.node_id(i), self._gpu[i]
        return NodeOffer(
            node_id,
            node_id,
            "core" if i < self.n_core else "community",
            self._price[i],
            self._gpu_tflops[gpu],
            self._gpu_vram[gpu],
            self._gpus[gpu],
            self.region_names[self._region[i]],
            reliability,
        )


def _normalized(shares: list[float]) -> np.ndarray:
    p = np.asarray(shares, dtype=float)
    return p / p.sum()


class Churn:
    """Session and absence lengths (seconds), log-normal, from a buffer of pre-drawn normals: drawing
    one number at a time from numpy costs more than the rest of an event."""

    def __init__(self, scenario: Scenario, rng: np.random.Generator, buffer: int = 1 << 16):
        a = scenario.availability
        self.session_mu, self.session_sigma = math.log(a.session_hours_median * 3600), a.session_sigma
        self.offline_mu, self.offline_sigma = math.log(a.offline_hours_median * 3600), a.offline_sigma
        self.crash_share = a.crash_share
        self.amplitude, self.peak_h = a.diurnal_amplitude, a.peak_local_hour
        self.rng, self.size = rng, buffer
        self._normal: list[float] = []
        self._uniform: list[float] = []

    def normal(self) -> float:
        if not self._normal:
            self._normal = self.rng.standard_normal(self.size).tolist()
        return self._normal.pop()

    def uniform(self) -> float:
        if not self._uniform:
            self._uniform = self.rng.random(self.size).tolist()
        return self._uniform.pop()

    def session_s(self) -> float:
        return math.exp(self.session_mu + self.session_sigma * self.normal())

    def crashes(self) -> bool:
        return self.uniform() < self.crash_share

    def offline_s(self, now: float, utc_offset_h: float) -> float:
        """How long a node that went away at ``now`` stays away: returns cluster around the local peak
        hour (thinning: a proposed return is kept with probability ~ 1 + amplitude x cos(hour - peak))."""
        for _ in range(8):
            away = math.exp(self.offline_mu + self.offline_sigma * self.normal())
            hour = ((now + away) / 3600 + utc_offset_h) % 24
            keep = (1 + self.amplitude * math.cos(2 * math.pi * (hour - self.peak_h) / 24)) / (
                1 + self.amplitude
            )
            if self.uniform() < keep:
                return away
        return away

    def mean_session_s(self) -> float:
        return math.exp(self.session_mu + self.session_sigma**2 / 2)

    def mean_offline_s(self) -> float:
        return math.exp(self.offline_mu + self.offline_sigma**2 / 2)
