"""Shared fixtures: the default model loaded once per session (CPU, fp32); kernel choices made afresh; each test
file's memory handed back after it."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Iterator

import pytest
import torch

from kiln import LLM
from kiln.kernels.choices import forget_process_choices
from kiln.log import setup_logging


def share_cores_between_workers() -> None:
    """Under pytest-xdist each worker (and every server or rank it starts) gets its share of the cores: two
    workers each running torch on every core make both slower than one worker alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for var in ("KILN_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, threads)
        torch.set_num_threads(int(os.environ["KILN_NUM_THREADS"]))


share_cores_between_workers()


def _libc_trim() -> None:
    """Hand the heap's free pages back to the system (glibc keeps them for the next allocation otherwise)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@pytest.fixture(scope="module", autouse=True)
def free_each_files_memory() -> Iterator[None]:
    """A worker runs test files one after another: after each, what its fixtures held (engines in reference cycles
    wait for the collector) is collected and the freed heap returned, so the files' peaks do not add up (a worker
    grew past 11 GB and two of them past the machine's 24 GB; the debugger's file alone left 5.2 GB, 0.7 GB after)."""
    yield
    gc.collect()
    _libc_trim()


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM("default", dtype="float32", seed=0, quantization="none", graph_mode="eager")  # the dequantized reference


@pytest.fixture
def fresh_kernel_choices() -> Iterator[None]:
    """For tests of the timing itself (or that fake it): the process forgets the kernel choices it holds before
    the test, and forgets the test's after it, so no other test runs on them."""
    forget_process_choices()
    yield
    forget_process_choices()


@pytest.fixture
def kiln_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the "kiln" logger, which does not propagate to the root logger (caplog's) once `setup_logging`
    ran: it runs first here (it runs once per process), so the lines of engines the test builds are caught too."""
    setup_logging()
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is alive once the tests are imported (torch, transformers, kiln, the test modules) lives to the end:
    moved out of the collector's generations, so a full collection (each file's, the interpreter's own) walks only
    what the tests made since (about 1 s a file in a worker otherwise)."""
    gc.freeze()
