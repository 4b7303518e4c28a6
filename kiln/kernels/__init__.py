"""Kernel choices: which kernel or weight layout runs each product, timed on this machine, one plan per engine.

Both executors call `plan_kernels(model, ...)` (plan.py) at prepare and install the plan on the model's layers.
What the process holds belongs to a weight or to the machine, never to an engine: the kernels bound to each weight
(kiln.quant.ops `BoundKernels`, one table per op, mirrored by the native dispatch; a binding dies with its
weight, so engines over other models never see it), the memo of timed choices, which every engine shares on
purpose (two engines over one model make the same plan), and the native objects, loaded once. A new kernel is a
candidate class and one registry entry (candidates.py `CANDIDATES`), timed against the others where it runs.

plan.py          `KernelPlan` and `plan_kernels`: static compile sizes, decoder layout, one-row head, packed kernels
choices.py       the per-machine cache of timed choices (JSON on disk + the process memo), timing helpers
layout.py        row- or column-major decoder weights and the transposed one-row head copy, timed
static_sizes.py  which one- and two-row capture sizes compile statically (GEMV reductions), timed
candidates.py    the packed products' candidates (registry), float32 and int8 ones (`--activations`)
torch_kernels.py the kernels the torch candidates build: tiled dequantize-then-BLAS, torch's int4 kernel's copies
packed.py        the packed products' timing table, binding the winners to layers (second forms within a budget)
compute_forms.py second forms of packed weights for compute-bound rows: the bf16 copy on oneDNN's brgemm (AMX),
                 the matrix unit's probe in a child process
dense.py         bf16 decoder products: F.linear or oneDNN on prepacked weights (`kiln::dense_linear`), timed
race.py          a race of candidates at one row count: turns, floors (a candidate that cannot win is never built)
product.py       small functions traced and compiled for static shapes (the timed product, compiled candidates)
attention.py     decode attention's kernel (the torch form or the native paged one), timed; its graph op
lora.py          the LoRA products of few rows: the gathered torch form or the native kernel, timed per layer
                 geometry; over a packed base one op for the product and the adapters' (`kiln::packed_linear_lora`)
head.py          `LogitsHead`: one-row logits the fastest way the plan found
head_kernels.py  the ways to compute an unquantized float32 head's product: as loaded, a bf16 copy on oneDNN's
                 brgemm, an int8 Q8_0 copy on the packed int8 kernels
head_forms.py    those ways timed per row class against the head as loaded; the winners' copies within the budget
inductor_isa.py  inductor's vector-ISA probe, run at install and trusted at start-up where it still holds
native/          kiln's own C++ kernels, one object per ISA tier, built here and loaded where cpuid allows
cli.py           the `kiln kernels` parser; commands.py its handler: `kiln kernels build` (at install, make setup)
"""
