"""Turns a SchedulerOutput into tensors, runs the executor under a forward context, samples.

The runner owns the KV caches (their geometry is exposed as named properties) and the batch layout; the
executor it is given owns how the forward and the logits run (kiln.executor.base). Inputs are padded to the
step's shape (kiln.engine.scheduling.step_shape: the recipe's allowed shapes, through the executor's `pad_to`), which
the recipe's guards check on every step; the metadata describes the real tokens only.

An optional `StepObserver` sees every executed step's batch and logits (the debugger's taps record through it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from kiln.compile.counters import CompileCounters
from kiln.config import PoolingConfig
from kiln.distributed.ops import local_collectives
from kiln.engine.request import PooledSum
from kiln.engine.running.pooling import pool_rows_of, pool_step_rows
from kiln.engine.running.prompt_logprobs import SLICE_ROWS, PromptScores, prompt_rows_of, score_prompt_rows
from kiln.engine.running.rank_role import SINGLE_DEVICE, RankRole
from kiln.engine.running.step_plan import PoolRows, PromptRows, StepPlan, kv_slots, padded_tables, split_plan
from kiln.engine.running.step_sample import DraftProbs, ModelRunnerOutput, sample_step
from kiln.engine.sampling.sampler import Sampler
from kiln.engine.scheduling.scheduler_output import SchedulerOutput
from kiln.engine.scheduling.step_shape import StepShaper
from kiln.executor.base import Executor
from kiln.huge_pages import huge_page_bytes
from kiln.kernels.head import RowScores
from kiln.lora.manager import LoRAManager
from kiln.model.attention import allocate_kv_caches, kv_cache_block_size
from kiln.model.forward_context import AttentionMetadata, ForwardContext, ModelInputs, set_forward_context
from kiln.model.parallel import held_layers, local_kv_heads


class StepPeers(Protocol):
    def send(self, plan: StepPlan) -> None:
        """Hand the step to the other ranks before this one runs it."""


class StepObserver(Protocol):
    def begin_step(self, batch: ModelInputs) -> None:
        """Called before the forward of a step."""

    def end_step(self, logits: torch.Tensor | None) -> None:
        """Called with the step's logits (one row per sampled sequence; None when no sequence samples)."""


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        executor: Executor,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        eos_token_ids: tuple[int, ...],
        observer: StepObserver | None = None,
        shaper: StepShaper | None = None,
        window_blocks: int = 0,
        role: RankRole = SINGLE_DEVICE,
        head_rows: int = SLICE_ROWS,
        pooling: PoolingConfig | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        """`window_blocks` > 0: a hybrid model's sliding layers keep that many blocks of their own (their block table
        is each request's second, kiln.engine.scheduling.kv_window). `head_rows`: the most rows the logits head's
        kernels were timed for (EngineConfig.sampled_rows), the size of the slices prompt rows are scored in; `pooling`:
        which rows embedding requests pool; `lora`: the adapters' slots (kiln.lora), set per step from each request's
        adapter (None: the engine serves the base model alone)."""
        self.lora = lora
        self.model = model
        self.head_rows = head_rows
        self.num_blocks, self.window_blocks = num_blocks, window_blocks
        self.executor = executor
        self.shaper = shaper or StepShaper(None, executor.pad_to, 0, 0)
        self.eos_token_ids = list(eos_token_ids)
        self.observer = observer
        self.device = next(model.parameters()).device
        kv_heads, layers = local_kv_heads(model), held_layers(model)
        self.kv_caches = allocate_kv_caches(
            config=model.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=kv_dtype,
            device=self.device,
            num_kv_heads=kv_heads,
            layers=layers,
            window_blocks=window_blocks,
        )
        self.sampler = Sampler()
        # the logits of the sampled rows (a multi-device engine's head gathers them across ranks and stages), and
        # the other ranks, which rank 0 sends each step's plan
        self.head: Callable[[torch.Tensor, list[int]], torch.Tensor | None] = role.head or executor.compute_logits
        self.whole_head = role.head is None  # this rank's head gives the whole vocabulary's logits
        self.peers: StepPeers | None = role.workers.channel if role.workers is not None else None
        # a pipeline stage splits each step into this many parts (kiln.engine.running.step_plan), and the last stage
        # runs each part's head right after its forward
        self.micro_batches, self.head_each_part = role.micro_batches, role.head_each_part
        # rank 0 of a pipeline with steps in flight: heads run when a step completes
        self.defer_heads = role.defers_heads
        self.pooling_mode = (pooling or PoolingConfig()).mode
        self.is_prepared = False

    def prepare_executor(self) -> None:
        """The executor's prepare phase over this runner's KV caches (kernel plan; in graph mode trace, compile,
        capture): once, before the first step."""
        with local_collectives():  # each rank prepares on its own (kiln.distributed.ops)
            self.executor.prepare(self.model, self.kv_caches)
        self.is_prepared = True

    @property
    def counters(self) -> CompileCounters:
        return self.executor.counters

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of every layer's pool (a hybrid model's global layers')."""
        return self.num_blocks

    @property
    def block_size(self) -> int:
        return kv_cache_block_size(self.kv_caches[0])

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    @property
    def kv_cache_huge_bytes(self) -> int:
        """Bytes of the caches' mappings on huge pages now (kiln.huge_pages; 0 on CUDA)."""
        return huge_page_bytes(self.kv_caches)

    def plan(self, sched: SchedulerOutput) -> StepPlan:
        """The step's inputs as plain lists: what a tensor- or pipeline-parallel driver sends its peers."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        window_slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sample_ids: list[str] = []
        bs = self.block_size
        num_decodes = 0
        requests = []  # per sequence of the step: a verification's rows are one each
        token_counts: list[int] = []  # per scheduled request: its tokens in the step
        prompt_rows: list[PromptRows] = []
        pool_rows: list[PoolRows] = []
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            if req.needs_prompt_logprobs and (scored := prompt_rows_of(req, start, end, len(input_ids))) is not None:
                prompt_rows.append(scored)
            if req.params.embed and (
                pooled := pool_rows_of(req=req, start=start, end=end, first_row=len(input_ids), mode=self.pooling_mode)
            ):
                pool_rows.append(pooled)
            new_tokens = req.all_token_ids[start:end] + s.spec_token_ids
            input_ids += new_tokens
            token_counts.append(len(new_tokens))
            positions += range(start, end)
            slots += kv_slots(req.block_ids, start, end, bs)
            if self.window_blocks:
                window_slots += kv_slots(req.block_tables[1], start, end, bs)
            # NOTE: a verification's tokens are decode rows, each seeing the keys up to its own position (the step
            # writes every row's K/V before attention reads), so the full decode graph runs it as it runs decodes
            rows = s.num_rows
            for row_end in range(end - rows + 1, end + 1):
                query_start_loc.append(query_start_loc[-1] + s.num_new_tokens // rows)
                seq_lens.append(row_end)
                requests.append(req)
                if s.completes_sequence and not req.params.embed:  # an embedding samples nothing
                    sample_indices.append(query_start_loc[-1] - 1)
                    sample_ids.append(req.request_id)
            num_decodes += rows if s.spec_token_ids else s.num_new_tokens == 1
        tables = padded_tables([r.block_ids for r in requests])
        window_tables = padded_tables([r.block_tables[1] for r in requests]) if self.window_blocks else []
        padded, batch_size = self.shaper.check(len(input_ids), len(requests), seq_lens)
        return StepPlan(
            input_ids=input_ids,
            positions=positions,
            slots=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables,
            num_decodes=num_decodes,
            padded=padded,
            batch_size=batch_size,
            sample_indices=sample_indices,
            sample_request_ids=sample_ids,
            window_slots=window_slots,
            window_tables=window_tables,
            block_copies=sched.block_copies,
            num_draft_tokens=sum(len(s.spec_token_ids) for s in sched.scheduled),
            prompt_rows=prompt_rows,
            pool_rows=pool_rows,
            lora_slots=self._lora_slots(sched, token_counts),
            lora_loads=self.lora.take_loads() if self.lora is not None else [],
        )

    def _lora_slots(self, sched: SchedulerOutput, token_counts: list[int]) -> list[int]:
        """Each token's adapter slot (its request's adapter copied into one now if it holds none); [] without LoRA."""
        if self.lora is None:
            return []
        slots = self.lora.step_slots([s.request.lora_id for s in sched.scheduled])
        return [slot for slot, count in zip(slots, token_counts, strict=True) for _ in range(count)]

    def prepare(self, sched: SchedulerOutput) -> ModelInputs:
        return self.inputs(self.plan(sched))

    def inputs(self, plan: StepPlan) -> ModelInputs:
        """The step's tensors on the model's device, padded to the step's shape; the metadata covers real tokens."""
        n = len(plan.input_ids)
        pad = plan.padded - n
        dev = self.device
        # NOTE: built on the host first: a full decode graph uploads these in one copy (kiln.compile.decode_buffers)
        host_ids = torch.tensor(plan.input_ids + [0] * pad, dtype=torch.long)
        host_lens = torch.tensor(plan.seq_lens, dtype=torch.long)
        host_tables = torch.tensor(plan.block_tables, dtype=torch.long)
        window_tables = torch.tensor(plan.window_tables, dtype=torch.long) if plan.window_tables else None
        meta = AttentionMetadata(
            num_actual_tokens=n,
            num_decodes=plan.num_decodes,
            slot_mapping=torch.tensor(plan.slots, dtype=torch.long, device=dev),
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            seq_lens_tensor=host_lens.to(dev),
            block_tables=host_tables.to(dev),
            block_size=self.block_size,
            window_slot_mapping=torch.tensor(plan.window_slots, dtype=torch.long, device=dev)
            if plan.window_slots
            else None,
            window_block_tables=window_tables.to(dev) if window_tables is not None else None,
        )
        return ModelInputs(
            input_ids=host_ids.to(dev),
            positions=torch.tensor(plan.positions + [0] * pad, dtype=torch.long, device=dev),
            metadata=meta,
            sample_indices=plan.sample_indices,
            sample_request_ids=plan.sample_request_ids,
            num_draft_tokens=plan.num_draft_tokens,
            batch_size=plan.batch_size,
            host=(host_ids, host_lens, host_tables, window_tables),
        )

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """fp32 logits of `hidden[rows]` over the whole vocabulary (None on a rank that does not sample)."""
        return self.head(hidden, rows)

    def fused_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> RowScores | None:
        """Prompt logprobs' numbers of these hidden rows from the executor's head without their logits, where it can
        (None: `logits` then `row_scores`; always on a multi-device engine, whose ranks hold vocabulary slices)."""
        return self.executor.score_rows(hidden, targets, self.head_rows) if self.whole_head else None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, copy) pair of KV blocks in every layer's cache (copy on write of a shared block)."""
        if not copies:
            return
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for cache in self.kv_caches:
            cache.index_copy_(2, dst, cache.index_select(2, src))

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of every fed token (padding included): [padded_num_tokens, hidden]."""
        plan = self.executor.plan
        ctx = ForwardContext(
            inputs.metadata, self.kv_caches, decode_kernel=plan.decode_kernel, prefill_kernel=plan.prefill_kernel
        )
        with set_forward_context(ctx):
            return self.executor.forward(inputs)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepLogits:
        """Run one step's forward and its logits head: the sampled rows' fp32 logits on the host (None on a rank
        that does not sample, or when no row samples), and the scores of the prompt rows the plan lists. Every rank
        of a multi-device engine runs each plan."""
        if self.lora is not None:
            self.lora.follow(plan.lora_loads)  # the adapters rank 0 copied into slots planning this step
        if self.micro_batches > 1 and len(plan.seq_lens) > 1:
            return StepLogits(self._heads(self._forwards(plan)))
        self.copy_blocks(plan.block_copies)
        inputs = self.inputs(plan)
        self._set_lora_slots(plan)
        if self.observer is not None:
            self.observer.begin_step(inputs)
        hidden = self.forward(inputs)
        # NOTE: sampling runs on the host: per-request torch.Generator objects are CPU generators.
        logits = self.logits(hidden, inputs.sample_indices) if inputs.sample_indices else None
        logits = logits.cpu() if logits is not None else None
        if self.observer is not None:
            self.observer.end_step(logits)
        prompt = (
            score_prompt_rows(self.logits, hidden, plan.prompt_rows, self.head_rows, fused=self.fused_scores)
            if plan.prompt_rows
            else {}
        )
        pooled = pool_step_rows(hidden, plan.pool_rows) if plan.pool_rows else {}
        return StepLogits(logits, prompt, pooled)

    def _forwards(self, plan: StepPlan) -> list[tuple[StepPlan, torch.Tensor | None]]:
        """A pipeline stage runs the step as `micro_batches` parts, so the stages work on different parts at once.
        The last stage computes each part's logits as soon as its forward ends (its outputs are reused by the next
        part); the others run every forward here and their heads later (`_heads`: rank 0 receives the logits)."""
        # NOTE: a multi-device engine refuses prompt logprobs (kiln.engine.scheduling.admission): no part scores prompt
        # rows
        assert not plan.prompt_rows, "prompt logprobs are scored on a single device"
        assert not plan.pool_rows, "embeddings are pooled on a single device"
        done: list[tuple[StepPlan, torch.Tensor | None]] = []
        self.copy_blocks(plan.block_copies)
        split = self.micro_batches > 1 and len(plan.seq_lens) > 1
        for part in split_plan(plan, self.micro_batches, self.executor.pad_to) if split else [plan]:
            self._set_lora_slots(part)
            hidden = self.forward(self.inputs(part))
            if self.head_each_part:
                hidden = self.logits(hidden, part.sample_indices) if part.sample_indices else None
            done.append((part, hidden))
        return done

    def _set_lora_slots(self, plan: StepPlan) -> None:
        if self.lora is not None:
            self.lora.slots.set_token_slots(plan.lora_slots)

    def _heads(self, parts: list[tuple[StepPlan, torch.Tensor | None]]) -> torch.Tensor | None:
        """The step's logits from `_forwards`' parts: their hidden states through the head (or, on the last stage,
        the logits already computed)."""
        logits = []
        for part, out in parts:
            if not part.sample_indices or out is None:
                continue
            logits.append(out if self.head_each_part else self.logits(out, part.sample_indices))
        rows = [t for t in logits if t is not None]
        return torch.cat(rows).cpu() if rows else None

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, draft_probs: DraftProbs | None = None) -> Launched:
        """Start a step: hand its plan to the other ranks and run this rank's forward. With `defer_heads` (rank 0 of
        a pipeline keeping steps in flight) its logits are left to `complete`, so rank 0 can launch the next step
        while the later stages still run this one. `draft_probs`: the sampled drafts' distributions (the
        proposer's), for their verification."""
        plan = self.plan(sched)
        if self.peers is not None:
            self.peers.send(plan)  # the other ranks run the same step
        probs = draft_probs or {}
        if self.defer_heads:
            return Launched(sched, plan, probs, parts=self._forwards(plan))
        return Launched(sched, plan, probs, computed=self.run(plan))

    @torch.inference_mode()
    def complete(self, step: Launched) -> ModelRunnerOutput:
        """Finish a launched step: its logits (received now, when deferred) sampled."""
        computed = StepLogits(self._heads(step.parts)) if step.parts is not None else step.computed
        assert computed is not None, "a launched step has its parts or its logits"
        out = self.sample(step, computed.logits)
        out.prompt_logprobs, out.pooled = computed.prompt, computed.pooled
        return out

    def execute(self, sched: SchedulerOutput, draft_probs: DraftProbs | None = None) -> ModelRunnerOutput:
        return self.complete(self.launch(sched, draft_probs))

    def sample(self, step: Launched, logits: torch.Tensor | None) -> ModelRunnerOutput:
        if logits is None:
            return ModelRunnerOutput({}, {})
        return sample_step(
            self.sampler,
            step.sched,
            step.plan,
            logits,
            eos_token_ids=self.eos_token_ids,
            draft_probs=step.draft_probs,
        )


@dataclass
class StepLogits:
    """What a step's heads computed on this rank: the sampled rows' fp32 logits on the host (None: none sampled,
    or not this rank's), the prompt positions its prefill chunks scored and the rows its embedding requests' chunks
    pooled, by request id."""

    logits: torch.Tensor | None
    prompt: dict[str, PromptScores] = field(default_factory=dict)
    pooled: dict[str, PooledSum] = field(default_factory=dict)


@dataclass
class Launched:
    """A step whose forward has run on this rank (`ModelRunner.launch`) and whose output is still to come."""

    sched: SchedulerOutput
    plan: StepPlan
    draft_probs: DraftProbs  # the sampled drafts' distributions, for their verification
    parts: list[tuple[StepPlan, torch.Tensor | None]] | None = None  # deferred heads: the parts' hidden states
    computed: StepLogits | None = None  # computed already: the sampled rows' logits and the prompt scores
