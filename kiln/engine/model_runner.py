"""Turns a SchedulerOutput into tensors, runs the model under a forward context, samples.

The model callable is swappable (`forward_fn`): eager by default, a piecewise graph executor in graph
mode. It always receives tensors padded to `pad_to(num_tokens)` and metadata for the real tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.compile.counters import CompileCounters
from kiln.engine.sampler import Sampler, SamplerOutput, SamplingRow
from kiln.engine.scheduler import SchedulerOutput
from kiln.model.attention import kv_cache_shape
from kiln.model.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from kiln.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kiln.compile.graph_runner import GraphRunner

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [padded_num_tokens]
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_indices: list[int]  # flattened index of the last token of each sequence that samples
    sample_request_ids: list[str]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, dict[int, float]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.device = next(model.parameters()).device
        c = model.config
        self.block_size = block_size
        shape = kv_cache_shape(num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(c.num_layers)]
        self.sampler = Sampler()
        self.forward_fn: ForwardFn = model
        self.pad_to: Callable[[int], int] = lambda n: n
        self.logits_fn: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits
        # graph mode (kiln.compile.enable_graph_mode) replaces forward_fn, pad_to and logits_fn and counts here
        self.counters = CompileCounters()
        self.graph_runner: GraphRunner | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def prepare(self, sched: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sample_ids: list[str] = []
        bs = self.block_size
        num_decodes = 0
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            tokens = req.all_token_ids[start:end]
            input_ids += tokens
            positions += range(start, end)
            blocks = req.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
            num_decodes += s.num_new_tokens == 1
            if s.completes_sequence:
                sample_indices.append(query_start_loc[-1] - 1)
                sample_ids.append(req.request_id)
        max_blocks = max(len(s.request.block_ids) for s in sched.scheduled)
        tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in sched.scheduled]
        n = len(input_ids)
        padded = self.pad_to(n)
        pad = padded - n
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=n,
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            block_size=bs,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids + [0] * pad, dtype=torch.long, device=dev),
            positions=torch.tensor(positions + [0] * pad, dtype=torch.long, device=dev),
            metadata=meta,
            sample_indices=sample_indices,
            sample_request_ids=sample_ids,
        )

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of the sampled tokens only: [num_samples, hidden]."""
        with set_forward_context(ForwardContext(inputs.metadata, self.kv_caches)):
            hidden = self.forward_fn(inputs.input_ids, inputs.positions)
        return hidden[inputs.sample_indices]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        inputs = self.prepare(sched)
        hidden = self.forward(inputs)
        if not inputs.sample_indices:
            return ModelRunnerOutput({}, {})
        # NOTE: sampling runs on the host: per-request torch.Generator objects are CPU generators.
        logits = self.logits_fn(hidden).cpu()
        by_id = {s.request.request_id: s.request for s in sched.scheduled}
        rows = []
        for rid in inputs.sample_request_ids:
            req = by_id[rid]
            p = req.params
            too_early = len(req.output_token_ids) < p.min_tokens
            block_eos = self.eos_token_ids + p.stop_token_ids if too_early else []
            rows.append(SamplingRow(p, req.prompt_token_ids, req.output_token_ids, req.generator, block_eos))
        out: SamplerOutput = self.sampler(logits, rows)
        sampled = dict(zip(inputs.sample_request_ids, out.token_ids, strict=True))
        logprobs = {rid: lp for rid, lp in zip(inputs.sample_request_ids, out.logprobs, strict=True) if lp}
        return ModelRunnerOutput(sampled, logprobs)
