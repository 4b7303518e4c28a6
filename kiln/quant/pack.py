"""Which of a model's weights are built packed (before loading).

- `--quantization packed` (a GGUF): every decoder linear layer whose checkpoint parts (q, k and v of a fused
  qkv_proj) are all stored in a packed type, the embedding when it is, and the logits head: tied to the packed
  embedding, or packed itself when the file stores it so (a head that is more than a linear layer, and an
  embedding tied to it, stay unpacked). Parts of one fused layer in different formats share the
  widest layout: Q4_K q and k with a Q6_K v become 6-bit int8 codes in groups of 16.
- `--quantization int8|int4`: every decoder linear layer without a bias whose input size is a multiple of 32; the
  embedding and the head stay in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kiln.quant.linear import PackedEmbedding, PackedLinear

Layout = Callable[[str], tuple[int, int] | None]  # HF tensor name -> (bits, group) when stored packed
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def pack_model(model: nn.Module, layout: Layout, scheme: str = "gguf") -> list[str]:
    """Replace the modules described above by packed ones of the same shape; the replaced weight names."""
    replaced = _pack_linears(model, layout, scheme)
    if scheme != "gguf":
        return replaced
    embedding = layout(EMBEDDING)
    tied = model.config.tie_word_embeddings
    # NOTE: a head that is not a plain linear (Gemma's soft-capped head) computes more than a PackedLinear would,
    # so it stays as built, in the model dtype, and so does the embedding whose weight it shares
    # (a pipeline stage may hold no head, or no embedding: kiln.model.llama)
    plain_head = model.lm_head is None or isinstance(model.lm_head, nn.Linear)
    table = model.model.embed_tokens
    if embedding is not None and table is not None and (plain_head or not tied):
        bits, group = embedding
        model.model.embed_tokens = PackedEmbedding(table.num_embeddings, table.embedding_dim, bits, group)
        replaced.append(EMBEDDING)
        if tied and model.lm_head is not None:
            model.lm_head = PackedLinear.tied_to(model.model.embed_tokens)
    head = layout(HEAD)
    if head is not None and not tied and isinstance(model.lm_head, nn.Linear):
        model.lm_head = PackedLinear.like(model.lm_head, scheme, *head)
        replaced.append(HEAD)
    return replaced


# NOTE: mixture-of-experts routers stay in full precision: a rounded router logit picks other experts
ROUTERS = (".mlp.gate", ".mlp.shared_expert_gate")


def _pack_linears(model: nn.Module, layout: Layout, scheme: str) -> list[str]:
    parts: dict[str, list[str]] = {}
    for hf_name, slot in model.checkpoint_slots().items():
        parts.setdefault(slot.param, []).append(hf_name)
    replaced = []
    for name, module in list(model.model.layers.named_modules(prefix="model.layers")):
        if not isinstance(module, nn.Linear) or module.bias is not None or name.endswith(ROUTERS):
            continue
        weight = f"{name}.weight"
        layouts = [layout(p) for p in parts.get(weight, [])]
        if not layouts or None in layouts or any(module.in_features % g for _, g in layouts):
            continue
        bits = max(b for b, _ in layouts)
        group = min(g for _, g in layouts)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, PackedLinear.like(module, scheme, bits, group))
        replaced.append(weight)
    return replaced
