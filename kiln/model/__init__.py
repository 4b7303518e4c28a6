"""Models: the Llama family on kiln's layers (llama.py, layers.py), the paged attention op and the KV cache
layout (attention.py), per-step batch state (forward_context.py), checkpoint loading (loader/), tokenizers,
dtype names, and model construction (build.py).

attention.py        `kiln::attention`: the paged-KV attention custom op and the graph's splitting point
build.py            model construction: checkpoint -> kiln model on the requested dtype and device, with load progress
causal_lm.py        what every kiln model class is: `forward`, `compute_logits`, weight loading by HF names
dtypes.py           dtype names (`float32`, `bf16`, ...) to torch dtypes, with a clear error
family_configs.py   config readers of the Llama-shaped families: each family's typed `ModelConfig` fields, read
                    through a config view (HF config.json and GGUF metadata alike)
forward_context.py  per-step state: the flattened batch (`ModelInputs`) and what the attention op reads
kv_format.py        how each KV cache dtype is stored: bf16/fp16 as they are, int8 and fp8_e4m3 codes with a float32
                    scale per token and head after them in the row
gemma.py            Gemma 2 and Gemma 3 (text) on kiln's layers and paged attention op
gemma_config.py     config readers of Gemma 2 and Gemma 3: soft-caps, query scale, layer kinds, rotary base per kind
graph_attention.py  decode attention the compiler can see: the attention of a full decode graph
layers.py           building blocks of the Llama family: RMSNorm, rotary embedding (with scaling), SiLU-gated MLP
llama.py            the Llama-shaped families (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) and the
                    mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE)
moe.py              `kiln::moe`: the mixture-of-experts custom op, the `FusedMoE` layer around it, its checkpoint names
prefill_attention.py
                    prompts and chunks of a step attend in a few padded, masked SDPA calls, not one per sequence
paths.py            how a model name becomes a path ("default": the bundled GGUF), without loading torch
parallel.py         tensor-parallel pieces of the forward: the all-reduce after a row-parallel layer, the
                    vocab-parallel embedding
tokenizer.py        tokenizer and chat template, from GGUF metadata or an HF directory, on the `tokenizers` library
tp_slots.py         which part of each checkpoint tensor a tensor-parallel rank of a Llama-shaped model loads
loader/             subpackage: checkpoint loading (HF directories, GGUF files), modules mapped in loader/__init__.py
"""
