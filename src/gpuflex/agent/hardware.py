"""What this machine is: the hardware profile a provider registers with.

Owns the probe of CPU model, usable cores, RAM and CUDA GPUs, and the choice of the torch device tasks
run on. It only reads: /proc, sysconf and ``torch.cuda``. Sizes are in GiB (2**30 bytes), the unit GPU
vendors mean by "24 GB", so VRAM and RAM compare the way people expect. torch is imported lazily, so
importing this module stays cheap.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflex.protocol.messages import GpuInfo, HardwareProfile, Kernel

if TYPE_CHECKING:
    import torch

GIB = 2**30
BITSANDBYTES_CPU = (0, 50)  # the first release seen to run all of its kernels on a CPU
CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")


def probe_hardware() -> HardwareProfile:
    """The profile of this machine; device is "cuda" when torch sees at least one GPU."""
    gpus = probe_gpus()
    device = "cuda" if gpus else "cpu"
    return HardwareProfile(
        cpu_model=cpu_model(),
        cpu_cores=cpu_cores(),
        ram_gb=ram_gb(),
        device=device,
        gpus=gpus,
        kernels=probe_kernels(device),
    )


def probe_kernels(device: str) -> list[Kernel]:
    """bitsandbytes' kernels tasks can run on ``device``: all of them where it is installed, on CUDA, and on
    a CPU from the release whose CPU backend runs them (0.50: NF4 and int8 weights, 8-bit AdamW). Read from
    the package's metadata: importing it takes seconds, which an agent's start should not pay."""
    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return []
    release = re.match(r"(\d+)\.(\d+)", version)
    if device == "cuda" or (release is not None and tuple(map(int, release.groups())) >= BITSANDBYTES_CPU):
        return ["nf4", "int8", "adamw8bit"]
    return []


def pick_device() -> torch.device:
    """The device tasks run on: the first CUDA GPU when there is one, else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's marketing name; ARM kernels often omit "model name", hence the fallbacks."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_cores() -> int:
    """Logical cores this process may run on (a pinned container sees fewer than the host has)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def ram_gb(meminfo: Path = MEMINFO) -> float:
    """Physical RAM in GiB, from sysconf, or /proc/meminfo where sysconf lacks the names."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = _meminfo_total_bytes(meminfo)
    return round(max(total, 0) / GIB, 1)


def _meminfo_total_bytes(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def probe_gpus() -> list[GpuInfo]:
    """Every CUDA device torch sees, with its VRAM in GiB and compute capability "major.minor"."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            GpuInfo(
                name=props.name,
                vram_gb=round(props.total_memory / GIB, 1),
                compute_capability=f"{props.major}.{props.minor}",
            )
        )
    return gpus
