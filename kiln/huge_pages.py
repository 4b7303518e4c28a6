"""Large CPU buffers on transparent huge pages (Linux THP), so the TLB covers them.

A paged KV cache is read a block at a time, and a float32 block of one KV head is 4 KB of the default model: one
small page each, wherever the scheduler placed it. Decode attention over 32 sequences then misses the TLB at
nearly every block, and the hardware prefetchers stop at each page's end. On 2 MB pages one TLB entry covers 512
such blocks: the native decode attention took 9-24 % less time over the same cache (in-order to shuffled tables;
docs/benchmarks.md, "Seventeenth session"). Weights are not placed here: each is read front to back, where small
pages cost nothing measurable.

Linux gives huge pages to anonymous memory when /sys/kernel/mm/transparent_hugepage/enabled says `always`, or says
`madvise` and the range was advised MADV_HUGEPAGE (the usual default, which torch's allocator does not ask for). A
buffer here is its own anonymous mapping, advised on its 2 MB-aligned part before the first touch, then zeroed so
its memory is claimed at start as `torch.zeros` claims it. Where the kernel says `never`, has no THP, or Python's
mmap has no MADV_HUGEPAGE (not Linux), or the mapping or its advice is refused, the buffer is a plain `torch.zeros`.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps")


def thp_mode() -> str:
    """The kernel's THP mode (`always`, `madvise` or `never`: the bracketed word of THP_ENABLED), "" where there is
    none to read."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_pages_available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor whose memory starts on a 2 MB boundary, advised for huge pages (a plain
    `torch.zeros` where huge pages are unavailable or the tensor is under one)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a boundary
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, (size - start) // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a mapping limit, or a kernel that refuses the advice: torch's allocator, as before
        return torch.zeros(shape, dtype=dtype)
    # the storage holds `region` (frombuffer keeps its buffer alive), which unmaps when the last tensor on it goes;
    # the cache is a tensor of its own on that storage, not a view of a flat one (graph inputs that are views take
    # a view's path through the compiler)
    storage = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape).zero_()


def huge_page_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the kernel backs with huge pages now in the memory mappings that hold `tensors` (each mapping's
    AnonHugePages in /proc/self/smaps, counted once); 0 where that cannot be read."""
    addresses = [t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()]
    if not addresses:  # device caches, or no heads here: nothing to read smaps for
        return 0
    try:
        lines = SMAPS.read_text().splitlines()
    except OSError:
        return 0
    total, holds = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms offset ..."
            low, _, high = head.partition("-")
            try:
                holds = any(int(low, 16) <= a < int(high, 16) for a in addresses)
            except ValueError:  # not an address range after all
                holds = False
        elif holds and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
