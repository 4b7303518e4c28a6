"""The systems `kiln bench --compare` runs beside kiln: a base class and one registry entry per system."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kiln.bench.hf_runner import auto_model_class, load_hf_model, run_hf, warm_up_hf
from kiln.bench.llamacpp_runner import check_llamacpp, run_llamacpp
from kiln.bench.metrics import RunResult
from kiln.bench.vllm_runner import check_vllm, hf_dir_for, run_vllm


@dataclass(frozen=True)
class AnchorSetup:
    """What kiln ran: the checkpoint it loaded, its dtype, device and thread count, and the prompts per batch size."""

    model_path: str
    dtype: str
    device: str
    num_threads: int
    batches: dict[int, list[list[int]]]
    output_len: int


class Anchor(ABC):
    """A system to compare kiln with. `check` runs as soon as kiln has loaded the model, before any timing, so a
    missing dependency or an unfit model fails in seconds; `run` returns one RunResult per batch size."""

    @abstractmethod
    def check(self, model_path: str) -> None: ...

    @abstractmethod
    def run(self, setup: AnchorSetup) -> list[RunResult]: ...


class HFAnchor(Anchor):
    """HF transformers `generate` (kiln.bench.hf_runner), in this process with the thread count the engine set."""

    def check(self, model_path: str) -> None:
        auto_model_class()

    def run(self, setup: AnchorSetup) -> list[RunResult]:
        model = load_hf_model(setup.model_path, setup.dtype, setup.device)
        warm_up_hf(model, next(iter(setup.batches.values()))[0])
        return [run_hf(model, prompts, setup.output_len, bs) for bs, prompts in setup.batches.items()]


class LlamaCppAnchor(Anchor):
    """llama.cpp through llama-cpp-python (kiln.bench.llamacpp_runner) on the same .gguf file, kiln's thread count."""

    def check(self, model_path: str) -> None:
        check_llamacpp(model_path)

    def run(self, setup: AnchorSetup) -> list[RunResult]:
        return run_llamacpp(setup.model_path, setup.batches, setup.output_len, setup.num_threads)


class VllmAnchor(Anchor):
    """vLLM's CPU build in its own environment (kiln.bench.vllm_runner) on the same weights in bf16, kiln's thread
    count."""

    def check(self, model_path: str) -> None:
        check_vllm()
        hf_dir_for(model_path)  # a .gguf converted here (once, cached), before kiln's timings

    def run(self, setup: AnchorSetup) -> list[RunResult]:
        return run_vllm(setup.model_path, setup.batches, setup.output_len, setup.num_threads)


ANCHORS: dict[str, Anchor] = {"hf": HFAnchor(), "llama.cpp": LlamaCppAnchor(), "vllm": VllmAnchor()}
