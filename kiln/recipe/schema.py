"""The recipe schema (version 1) as pydantic models: strict types, unknown keys forbidden, documented defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.config import (
    ACTIVATION_NAMES,
    DEFAULT_ACTIVATIONS,
    LORA_DTYPE_NAMES,
    SpeculativeConfig,
)
from kiln.graph_mode import DEFAULT_GRAPH_MODE, GRAPH_MODES
from kiln.lora.targets import TARGET_MODULES
from kiln.speculative_config import SPECULATIVE_METHODS, SPECULATIVE_POLICIES

DType = Literal["float32", "float16", "bfloat16"]
# kiln's KV cache dtypes (kiln.config.KV_CACHE_DTYPE_NAMES), and vLLM's fp8 spellings kiln refuses with a reason
# (kiln.recipe.contract.check_refused) rather than a bare "not one of"
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8", "fp8_e5m2"]
PositiveInt = Annotated[int, Field(gt=0)]
SPLITTING_OPS = ("kiln.attention", "kiln::attention")
GraphModeName = Literal[GRAPH_MODES]  # type: ignore[valid-type]  # NOTE: the names come from kiln.graph_mode alone
# keys kiln's schema had and no longer reads: each refused with what to do instead (kiln.recipe.schema_check)
RETIRED_KEYS = {
    ("graph", "piecewise"): "graph.piecewise was replaced by graph.mode: run `kiln recipe migrate {file} --out "
    "{file}` to rewrite it (true: full_and_piecewise, false: full; a graph.mode given is kept)",
}


class Section(BaseModel):
    """Base of every section. NOTE: strict, so `block_size: "16"` is an error rather than a silent conversion."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ModelSection(Section):
    name: str = Field(description="A name for people and logs.")
    path: str = Field(
        "default",
        description='Checkpoint: "default" (bundled SmolLM2-135M), a .gguf file or an HF '
        "directory; relative paths are relative to the recipe file.",
    )
    layer_type: Literal["decoder"] = "decoder"
    architecture: str | None = Field(
        None,
        description='Checked against the checkpoint\'s architecture ("llama", "LlamaForCausalLM"); null: not checked.',
    )
    num_experts: int | None = Field(
        None,
        ge=1,
        description="Mixture-of-experts: experts per layer, checked against the checkpoint; null: unchecked.",
    )
    top_k: int | None = Field(
        None, ge=1, description="Mixture-of-experts: experts each token is routed to, checked against the checkpoint."
    )


class TensorSpec(Section):
    shape: list[str | int] = Field(description="Each dimension is a symbol (num_tokens, hidden_size, ...) or a size.")
    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32"]


class InputConstraints(Section):
    input_ids: TensorSpec | None = None
    positions: TensorSpec | None = None
    hidden_states: TensorSpec | None = None
    constraints: list[str] = Field(
        default_factory=list,
        description="Python-syntax conditions over num_tokens, batch_size, seq_len and the model symbols "
        "(hidden_size, num_heads, ...): names, integers, + - * // %, comparisons, and/or/not, min/max.",
    )


# GGUF block types (kiln.model.loader.gguf_loader.SUPPORTED_TYPES, lower case), then what a quantized HF checkpoint
# holds (kiln.model.loader.hf_quant: CheckpointQuantization.weights)
GGUF_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q2_k", "q3_k")
GGUF_QUANTIZATIONS += ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0", "mxfp4")
HF_QUANTIZATIONS = ("int4", "int8", "fp8")
SOURCE_QUANTIZATIONS = ("none", *GGUF_QUANTIZATIONS, *HF_QUANTIZATIONS)


class Weights(Section):
    dtype: DType = Field("float32", description="The dtype weights are materialised in at run time.")
    source_quantization: Literal[SOURCE_QUANTIZATIONS] = Field(  # type: ignore[valid-type]
        "none",
        description="What the checkpoint really holds for its layer weights (none = float tensors): a GGUF block "
        "type, or int4 / int8 / fp8 for an HF checkpoint's quantization_config (compressed-tensors, GPTQ, AWQ).",
    )


class Quantization(Section):
    weights: Literal["none", "int8", "int4"] = Field("none", description="Weight-only quantization at run time.")
    group_size: PositiveInt = 32
    activations: Literal[ACTIVATION_NAMES] = Field(  # type: ignore[valid-type]
        DEFAULT_ACTIVATIONS,
        description="Activations of packed products: int8x2 (two int8 digits, about 15 bits) or int8 (one digit), "
        "quantized per weight group for integer dot products, or float32 (dequantize-then-fp32 arithmetic).",
    )


class FusionGroup(Section):
    name: str
    ops: list[str] = Field(min_length=1, description="Model modules (gate_proj, ...) and functional ops (silu, mul).")
    required: bool = Field(
        True, description="true: a compile that does not realise the group fails; false: it only warns."
    )
    all_ops_quantized: Literal["int4", "int8"] | None = Field(
        None,
        description="Every weight op of the group runs packed codes of at most this width; checked on the loaded "
        "model (an engine whose group runs float or wider weights fails to start).",
    )


class KVCache(Section):
    dtype: KVCacheDType = Field(
        "auto",
        description="What the cache stores (vLLM's names): auto (the weights' dtype), "
        "float32, bfloat16, float16, or int8 / fp8_e4m3 codes with a float32 scale per token and head.",
    )
    layout: Literal["paged", "contiguous"] = "paged"
    block_size: PositiveInt = Field(16, description="Tokens per page.")
    max_pages: PositiveInt = Field(1024, description="Pages in the pool; capacity = max_pages * block_size tokens.")
    prefix_caching: bool = Field(
        True, description="Keep full pages after their request and share them with prompts of the same prefix."
    )


class MemoryPlan(Section):
    kv_cache: KVCache = Field(default_factory=KVCache)
    activation_reuse: bool = True
    second_form_memory_gb: float | None = Field(
        None,
        ge=0,
        description="GB that second forms of packed weights (and of an unquantized logits head beside them) may "
        "take (a bf16 copy for the matrix unit, used by the row counts where it was timed fastest); default: half the "
        "memory free after the weights and the KV cache; 0: none.",
    )


class Graph(Section):
    mode: GraphModeName = Field(
        DEFAULT_GRAPH_MODE.value,
        description=(
            "Which graphs run (vLLM's cudagraph modes): full_and_piecewise replays a full graph, attention "
            "included, for decode-only steps and the pieces for mixed ones; piecewise only the pieces; "
            "full_decode_only the full graph for decode-only steps, the pieces uncaptured otherwise; full the "
            "whole forward as one graph; eager no graph at all."
        ),
    )
    splitting_ops: list[str] = Field(default_factory=lambda: ["kiln.attention"])
    capture_sizes: list[PositiveInt] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32],
        description="num_tokens buckets to capture; each must satisfy the num_tokens constraints.",
    )
    compile_sizes: list[PositiveInt] | None = Field(
        None,
        description=(
            "Capture sizes also compiled for their static num_tokens (inductor only); on CPU one- and two-row "
            "pieces then run weight products as GEMV reductions. null: automatic (CPU: the sizes <= 2)."
        ),
    )
    compiler: Literal["inductor", "eager"] = "inductor"


class Speculative(Section):
    """Speculative decoding (kiln.engine.speculation.speculation): a proposer's draft tokens, verified by the model in
    one step."""

    method: Literal[SPECULATIVE_METHODS] | None = Field(  # type: ignore[valid-type]
        None,
        description="ngram: propose the tokens that followed the latest earlier occurrence of the sequence's last n "
        "tokens in its prompt and output; draft: the draft_model proposes them. null: off.",
    )
    num_speculative_tokens: PositiveInt = Field(4, description="Most draft tokens a sequence verifies per step.")
    prompt_lookup_max: PositiveInt = Field(4, description="ngram: the longest suffix looked up.")
    prompt_lookup_min: PositiveInt = Field(2, description="ngram: the shortest suffix looked up.")
    policy: Literal[SPECULATIVE_POLICIES] = Field(  # type: ignore[valid-type]
        "measured",
        description="Which proposals a step verifies: measured (those that raise tokens per second by the step costs "
        "timed on the machine) or always.",
    )

    draft_model: str | None = Field(
        None, description="draft: the smaller model proposing the tokens (a .gguf file, an HF directory or 'default')."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        if problem := self.config().problem():
            raise ValueError(problem)
        return self

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            self.method,
            self.num_speculative_tokens,
            prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min,
            policy=self.policy,
            draft_model=self.draft_model,
        )


class LoRA(Section):
    """LoRA adapters (kiln.lora), vLLM's --enable-lora: the section's presence turns them on and sizes their static
    buffers (max_loras x max_rank per adapted layer), fixed when the engine starts."""

    max_loras: PositiveInt = Field(1, description="Adapters held at once, one buffer slot each (--max-loras).")
    max_rank: PositiveInt = Field(
        16, description="Highest adapter rank accepted: the buffers' width (--max-lora-rank)."
    )
    target_modules: list[Literal[TARGET_MODULES]] | None = Field(  # type: ignore[valid-type]
        None,
        description="The only layers adapters may adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj; qkv_proj, gate_up_proj where the checkpoint stores them fused); an adapter of another layer is "
        "refused. null: every layer kiln adapts.",
    )
    dtype: Literal[LORA_DTYPE_NAMES] = Field(  # type: ignore[valid-type]
        "auto",
        description="The buffers' dtype (--lora-dtype): auto is the weights' dtype; float32 keeps HF + PEFT's "
        "numbers; bfloat16 halves the buffers' bytes and what each step reads of them.",
    )


class Hardware(Section):
    device: Literal["cpu", "cuda"] = Field(description="The device the engine runs on; it must exist here.")
    arch: str | None = Field(
        None,
        description='What the device must have: a CPU ISA ("avx2", "avx512", "avx512_bf16", "amx", "neon", ...) or '
        'a CUDA arch ("sm_80": compute capability 8.0 or newer); null for any.',
    )
    memory_budget_gb: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="Weights plus KV cache must fit (1 GB = 1e9 bytes)."
    )


class Parallel(Section):
    """How the model is split over devices; world size = tensor * pipeline."""

    tensor: PositiveInt = Field(
        1, description="Tensor-parallel ranks per pipeline stage: each holds a slice of every layer's heads and MLP."
    )
    pipeline: PositiveInt | None = Field(
        None,
        description="Pipeline stages, each holding a contiguous group of layers. null: the number of "
        "device_affinity entries, or 1 without them.",
    )


class DeviceAffinity(Section):
    """One pipeline stage and the decoder layers it holds (with parallel.tensor N the stage spans N devices)."""

    device_id: int = Field(description="The pipeline stage, 0 .. pipeline - 1; stages run in device_id order.")
    kernel_groups: list[str] = Field(
        description='Its layers, "decoder_layer_<i>" (0-based): consecutive, and each layer in exactly one stage.'
    )


class Debug(Section):
    debug_mode: bool = False


class RecipeSpec(Section):
    """A kiln recipe: what the graph compiler may assume about a model, proven consistent before compiling."""

    recipe_version: Literal[1]
    model: ModelSection
    input_constraints: InputConstraints = Field(default_factory=InputConstraints)
    weights: Weights = Field(default_factory=Weights)
    quantization: Quantization = Field(default_factory=Quantization)
    fusion_groups: list[FusionGroup] = Field(default_factory=list)
    memory_plan: MemoryPlan = Field(default_factory=MemoryPlan)
    graph: Graph = Field(default_factory=Graph)
    speculative: Speculative = Field(default_factory=Speculative)
    lora: LoRA = Field(default_factory=LoRA)
    hardware: Hardware
    parallel: Parallel = Field(default_factory=Parallel)
    device_affinity: list[DeviceAffinity] | None = Field(
        None, description="Which decoder layers each pipeline stage holds; null: layers split evenly over the stages."
    )
    debug: Debug = Field(default_factory=Debug)


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe, for editors such as VS Code's YAML extension."""
    schema = RecipeSpec.model_json_schema()
    return {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "kiln recipe"}
