"""The hardware probe: real values on this machine, and the fallbacks and CUDA path through fakes."""

from types import SimpleNamespace

import pytest
import torch

from gpuflex.agent import hardware
from gpuflex.protocol.messages import HardwareProfile


def test_probe_describes_this_machine():
    profile = hardware.probe_hardware()

    assert profile.cpu_cores >= 1
    assert profile.ram_gb > 0
    assert profile.cpu_model.strip()
    assert profile.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert len(profile.gpus) == torch.cuda.device_count()
    assert HardwareProfile.model_validate(profile.model_dump()) == profile


def test_cpu_model_reads_model_name(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7763 64-Core\n")

    assert hardware.cpu_model(cpuinfo) == "AMD EPYC 7763 64-Core"


@pytest.mark.parametrize("content", [None, "processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n"])
def test_cpu_model_falls_back_to_platform(tmp_path, monkeypatch, content):
    cpuinfo = tmp_path / "cpuinfo"
    if content is not None:
        cpuinfo.write_text(content)
    monkeypatch.setattr(hardware.platform, "processor", lambda: "")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "aarch64")

    assert hardware.cpu_model(cpuinfo) == "aarch64"


def test_cpu_cores_respects_affinity(monkeypatch):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 64)

    assert hardware.cpu_cores() == 2


def test_ram_falls_back_to_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:         1000 kB\n")

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(hardware.os, "sysconf", no_sysconf)

    assert hardware.ram_gb(meminfo) == 16.0


def test_gpus_come_from_torch_cuda(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * hardware.GIB, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    profile = hardware.probe_hardware()

    assert profile.device == "cuda"
    assert [g.model_dump() for g in profile.gpus] == [
        {"name": "NVIDIA H100 80GB HBM3", "vram_gb": 80.0, "compute_capability": "9.0"}
    ] * 2
    assert hardware.pick_device().type == "cuda"


def test_pick_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    assert hardware.pick_device() == torch.device("cpu")
    assert hardware.probe_hardware().device == "cpu"
