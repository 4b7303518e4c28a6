"""Greedy generation straight through an executor, steps built by hand (no engine): one prefill step of every
sequence, then decode-only steps, each token's LoRA slot set from its sequence's before the forward."""

from __future__ import annotations

import torch

from kiln.executor.base import Executor
from kiln.lora import LoRASlots, token_slots
from kiln.model.attention import allocate_kv_caches
from kiln.model.causal_lm import CausalLM
from kiln.model.forward_context import AttentionMetadata, ForwardContext, ModelInputs, set_forward_context

BLOCK_SIZE = 4
BLOCKS_PER_SEQUENCE = 16  # 64 tokens a sequence
NUM_BLOCKS = 8 * BLOCKS_PER_SEQUENCE  # 8 sequences


class Stepper:
    """`executor` prepared over `model` (with `slots` attached) and its own KV caches."""

    def __init__(self, model: CausalLM, executor: Executor, slots: LoRASlots) -> None:
        self.model, self.executor, self.slots = model, executor, slots
        self.kv_caches = allocate_kv_caches(
            model.config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu"
        )
        executor.prepare(model, self.kv_caches)

    def generate(
        self, prompts: list[list[int]], sequence_slots: list[int], max_tokens: int
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy tokens per prompt, and the logits [max_tokens, vocab] each was chosen from, all prompts batched."""
        tokens: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        new = [list(p) for p in prompts]
        lengths = [0] * len(prompts)
        for _ in range(max_tokens):
            step = self.step(new, lengths, sequence_slots)
            for i, row in enumerate(step):
                lengths[i] += len(new[i])
                tokens[i].append(int(row.argmax()))
                logits[i].append(row)
                new[i] = [tokens[i][-1]]
        return tokens, [torch.stack(rows) for rows in logits]

    def step(self, new: list[list[int]], lengths: list[int], sequence_slots: list[int]) -> torch.Tensor:
        """One forward of sequences fed `new[i]` after `lengths[i]` tokens: the logits of each one's last token."""
        ids, positions, slots, starts, tables = [], [], [], [0], []
        for i, (tokens, done) in enumerate(zip(new, lengths, strict=True)):
            blocks = list(range(i * BLOCKS_PER_SEQUENCE, (i + 1) * BLOCKS_PER_SEQUENCE))
            pos = list(range(done, done + len(tokens)))
            ids += tokens
            positions += pos
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            starts.append(len(ids))
            tables.append(blocks)
        n = len(ids)
        seq_lens = [done + len(tokens) for tokens, done in zip(new, lengths, strict=True)]
        meta = AttentionMetadata(
            num_actual_tokens=n,
            num_decodes=len(new) if all(len(t) == 1 for t in new) and any(lengths) else 0,
            slot_mapping=torch.tensor(slots),
            query_start_loc=starts,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens),
            block_tables=torch.tensor(tables),
            block_size=BLOCK_SIZE,
        )
        pad = self.executor.pad_to(n) - n
        inputs = ModelInputs(
            input_ids=torch.tensor(ids + [0] * pad),
            positions=torch.tensor(positions + [0] * pad),
            metadata=meta,
            sample_indices=[s - 1 for s in starts[1:]],
            sample_request_ids=[str(i) for i in range(len(new))],
        )
        self.slots.set_token_slots(token_slots(starts, sequence_slots))
        ctx = ForwardContext(meta, self.kv_caches, decode_kernel=self.executor.plan.decode_kernel)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden = self.executor.forward(inputs)
            return self.executor.compute_logits(hidden, inputs.sample_indices)
