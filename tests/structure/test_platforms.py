"""Device differences live in kiln.platforms: other modules ask a device's platform, and what they ask follows it."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor import cpu_vec_isa

from kiln.compile.capture import CpuCapture, make_capture
from kiln.compile.decode_buffers import DecodeBuffers
from kiln.errors import ConfigError
from kiln.platforms import PLATFORMS, CpuPlatform, CudaPlatform, platform_of
from tests.structure.test_imports import KILN

# Modules that may name CUDA themselves, each with its reason.
CUDA_MODULES = {
    "kiln/platforms.py": "the CUDA platform itself",
    "kiln/compile/capture.py": "CudaGraphCapture records and replays torch.cuda.CUDAGraph (its streams and events)",
}
DEVICE_TEST = re.compile(r"""\.type\s*[!=]=\s*["']cuda["']|torch\.cuda\.\w+""")


def test_only_the_platforms_test_for_cuda() -> None:
    found = {}
    for path in KILN.rglob("*.py"):
        rel = str(path.relative_to(KILN.parent))
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1) if DEVICE_TEST.search(line)]
        if hits and rel not in CUDA_MODULES:
            found[rel] = hits
    assert found == {}, "ask kiln.platforms.platform_of(device) instead of testing the device type"


def test_platform_of_reads_devices_and_names() -> None:
    assert isinstance(platform_of(torch.device("cpu")), CpuPlatform)
    assert isinstance(platform_of("cuda:1"), CudaPlatform)  # the index does not matter, only the type
    assert platform_of("cuda") is PLATFORMS["cuda"]
    for bad in ("tpu", "not a device"):
        with pytest.raises(ConfigError, match=r"is not supported: expected one of cpu, cuda"):
            platform_of(bad)


def test_the_cpu_platform() -> None:
    cpu = torch.device("cpu")
    platform = platform_of(cpu)
    assert (platform.records_graphs, platform.separate_memory, platform.collective_backend) == (False, False, "gloo")
    assert platform.new_graph_pool() is None and not platform.is_capturing()
    # inductor's vector ISA and the threads it split loops for: code for one must not load under the other
    assert platform.cache_name(cpu) == f"cpu:{cpu_vec_isa.pick_vec_isa()}:{torch.get_num_threads()}-threads"
    assert platform.bind_rank(3) == cpu
    assert platform.capability() == (None, "")
    assert 0 < platform.available_memory_gb(cpu) < 1e6
    capture = make_capture(cpu, lambda x: (x * 2,), [torch.ones(4)], [0], set(), platform.new_graph_pool())
    assert isinstance(capture, CpuCapture) and torch.equal(capture([torch.full((4,), 3.0)])[0], torch.full((4,), 6.0))


def test_decode_buffers_follow_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the staging buffer is the input and the table takes the step's width; a platform that records graphs
    fixes the table to captured widths (the CUDA behaviour), with no other change than its answer."""
    cpu = torch.device("cpu")
    plain = DecodeBuffers(4, 64, (0, None), cpu)
    assert plain.buffer is plain.staging and not plain.fixed_width

    class Recording(CpuPlatform):
        records_graphs = True

    monkeypatch.setitem(PLATFORMS, "cpu", Recording())
    recorded = DecodeBuffers(4, 64, (0, None), cpu)
    assert recorded.fixed_width and recorded.buffer is recorded.staging  # still no memory of its own
