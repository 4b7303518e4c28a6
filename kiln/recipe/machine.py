"""What the machine running kiln offers, for `hardware.device` and `hardware.arch`: CPU ISA features and the
CUDA device's compute capability, detected once per process."""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from functools import lru_cache

from kiln.platforms import platform_of

# hardware.arch values for CPUs -> the /proc/cpuinfo flag (or machine name) that proves the feature
CPU_ARCHES: dict[str, str] = {
    "x86_64": "machine:x86_64",
    "avx2": "avx2",
    "avx512": "avx512f",
    "avx512_vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16",
    "amx": "amx_tile",
    "amx_bf16": "amx_bf16",
    "aarch64": "machine:aarch64",
    "neon": "asimd",
    "sve": "sve",
}
CUDA_ARCH = re.compile(r"^sm_(\d)(\d)a?$")


@dataclass(frozen=True)
class Machine:
    machine: str  # platform.machine(), normalised: x86_64 | aarch64 | ...
    cpu_flags: frozenset[str]
    cpu_model: str
    cuda: tuple[int, int] | None  # compute capability of device 0; None without a usable CUDA device
    cuda_name: str = ""

    def has_cpu_arch(self, arch: str) -> bool:
        need = CPU_ARCHES[arch]
        if need.startswith("machine:"):
            return self.machine == need.removeprefix("machine:")
        return need in self.cpu_flags or (need == "asimd" and self.machine == "aarch64")

    def cpu_summary(self) -> str:
        have = [a for a in CPU_ARCHES if self.has_cpu_arch(a)]
        return f"{self.cpu_model or self.machine} ({', '.join(have) or 'none of ' + ', '.join(CPU_ARCHES)})"


@lru_cache(maxsize=1)
def this_machine() -> Machine:
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    flags, model = _cpuinfo()
    return Machine(machine, flags, model, *platform_of("cuda").capability())


def _cpuinfo() -> tuple[frozenset[str], str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return frozenset(), platform.processor()
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return frozenset(flags.group(1).split() if flags else ()), model.group(1).strip() if model else ""
