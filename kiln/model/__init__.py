"""Models: the Llama family on kiln's layers (llama.py, layers.py), the paged attention op and the KV cache
layout (attention.py), per-step batch state (forward_context.py), checkpoint loading (loader/), tokenizers,
dtype names, and model construction (registry.py)."""
