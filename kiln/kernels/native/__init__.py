"""kiln's own C++ kernels, built on the machine that runs them, one object per ISA tier, loaded only where the CPU
has the tier's instructions (never a SIGILL on an older CPU).

build.py           the tiers (avx512: F/BW/VL/DQ/VNNI; avx2: AVX2 + FMA; plain), the cpuid check, the JIT build
                   (torch cpp_extension, OpenMP) into a cache keyed by torch version, compiler, tier and source
                   hash, under a lock of kiln's own; `native_op`
packed_linear.cpp  `packed_linear(x, codes, scale, offset)` over kiln's packed layout, float32 activations: the
                   weight dequantized in registers, group by group (AVX2 + FMA path, scalar path)
packed_q8.cpp      `packed_linear_q8` / `packed_linear_q8x2`: x quantized per weight group to one or two int8 digits,
                   integer dot products (AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw, scalar path), one 128-bit lane per
                   output, the next outputs' rows prefetched at one or two rows
packed_q8_blocked.cpp
                   `packed_linear_q8_blocked` / `packed_linear_q8x2_blocked` (AVX-512 VNNI, AVX2 for 4-bit codes):
                   the same arithmetic with 16 (8) outputs' codes transposed per call into one word per lane, for
                   many rows; `_streamed` forms: transposed in registers as used, for one to a few rows
packed_q8_amx.cpp  `packed_linear_q8_amx` / `packed_linear_q8x2_amx` (avx512 tier, CPUs with AMX-INT8): the same
                   arithmetic, a group's integer sums of every row and digit by one tile multiply, for a few rows
                   (a speculative verification step); asks Linux for the tile state, probed in a child first
paged_attention.cpp
                   `paged_decode_attention` and `paged_prefill_attention`: decode rows' and a step's prompts'
                   attention over the paged KV cache where the blocks lie (a prompt causal from its cached
                   context), GQA heads and a block of a prompt's tokens together, keys split across threads and
                   merged (flash-decoding); every KV cache dtype
dense_brgemm.cpp   `brgemm_bf16_linear`: x times a bf16 copy of a weight in oneDNN's VNNI order on ATen's
                   `cpublas::brgemm` (oneDNN's ukernel: AMX tiles where the CPU has them), float32 sums and output
row_scores.cpp     `prompt_row_scores`: a row of float32 logits' logsumexp, its target's logit and rank, and its largest
                   logit with its index, in two vectorized passes (prompt logprobs, kiln.engine.running.prompt_logprobs)
head_scores.cpp    `head_row_scores`: the same numbers from a bf16 head's brgemm tiles folded as they are made (an
                   online softmax), the head read once a call and the logits never written
lora.cpp           `lora_delta`: each token's LoRA adapter product of its own slot (shrink, then expand; a fused
                   layer's parts in one call), nothing read for tokens without one; `lora_accumulate` (lora.h), the
                   same added into a product's output
dispatch.cpp       the C++ CPU kernels of `kiln::packed_linear` (native bindings and second forms called without
                   Python), `kiln::packed_linear_lora` (a packed product and its bound LoRA buffers' products) and
                   `kiln::dense_linear`
packed_operands.h  the operand checks every product shares, and the prefetch of the next outputs' rows
lora.h             `lora_accumulate`, for dispatch.cpp
lora_vectors.h     lora.cpp's per-tier vector arithmetic: the shrink's dot products and the expand's scaled rows
row_math.h         the vectorizable exp both row scorers share
kv_rows.h          paged_attention.cpp's row arithmetic: a cache row's stored forms widened, softmax's exp, the
                   per-tier products of a run of keys (q . k) and values (p v)
bf16_form.h        the layout and operand checks of a weight's bf16 VNNI copy (dense_brgemm.cpp, head_scores.cpp)
q8_activations.h   what the int8-activation products share: x quantized per group, the scalar (row, output) dot
reference.py       the int8 arithmetic in plain torch: what every tier must equal
"""
