"""Frozen, layered configuration objects: the model's architecture, the KV cache, the scheduler, graph mode and
the engine that holds them all (resolved by `kiln.engine.setup.resolve` from flags, recipe and environment).

Only plain dataclasses cross module boundaries. Derived values are properties (`EngineConfig.sampled_rows`,
`executor`, `ParallelConfig.world_size`). Three fields are not yet resolved values and are marked where they stand:
`EngineConfig.max_model_len` (None) and `quantization` ("auto"), which the engine build resolves, and
`GraphConfig.max_model_len`, a copy of the engine's written by the build (`dataclasses.replace`). This module
does not import torch (so `kiln --help` stays fast); `kiln.model.dtypes` maps dtype names to torch dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kiln.env import read_env
from kiln.graph_mode import DEFAULT_GRAPH_MODE, GraphMode
from kiln.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

COMPILER_NAMES = ("inductor", "eager")  # piece compilers (kiln.compile.compiler.COMPILERS holds their classes)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# auto: packed for a GGUF with block-quantized weights, else none; none: dequantize every weight to the dtype (the
# reference); packed: keep a GGUF's blocks packed (kiln.quant); int8 / int4: quantize every decoder linear weight at
# load, group-wise (kiln.quant.quantize)
QUANTIZATION_NAMES = ("auto", "none", "packed", "int8", "int4")
# the activations of packed products: int8x2 (two int8 digits per value, about 15 bits) or int8 (one digit, llama.cpp's
# q8 arithmetic), quantized per weight group for integer dot products (kiln's native kernels join the timed
# candidates), or float32 (dequantize-then-fp32 arithmetic only). int8x2 is the default: the fastest setting that
# passes the accuracy bar on the default model (tests/quant/test_int8_accuracy.py: mean KL <= 1e-3, top-1 >= 99 %;
# one digit measured mean KL 0.014, top-1 92 %)
ACTIVATION_NAMES = ("int8x2", "int8", "float32")
DEFAULT_ACTIVATIONS = "int8x2"


DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
# the KV cache's dtypes, vLLM's names (kiln.model.kv_format: how each is stored). auto: AUTO_KV_CACHE_DTYPE for a
# float32 model, else the model's own dtype
KV_CACHE_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
# --lora-dtype (vLLM's): the LoRA adapters' buffers' dtype (kiln.lora.config); auto: the model's
LORA_DTYPE_NAMES = ("auto", "float32", "bfloat16")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
# how an embedding request's final hidden states become one vector (kiln.engine.running.pooling): the last prompt
# token's (vLLM's default for decoder models), the mean over the prompt's tokens, or the first token's
POOLING_NAMES = ("last", "mean", "cls")
# NOTE: float32, the model's own dtype. bfloat16 passes the KL bar at half the bytes and decodes 1.0-1.3x faster,
# but rounds float32's last-bit differences into 4e-3 ones: HF's logits, one process's against its ranks, and a
# seeded request's text with and without speculation move apart (docs/benchmarks.md, "Thirteenth session"). Opt-in.
AUTO_KV_CACHE_DTYPE = "float32"
# int8 and fp8_e4m3 rows carry their float32 scale after the head_dim codes (kiln.model.kv_format)
KV_SCALE_BYTES = 4


@dataclass(frozen=True)
class MoEConfig:
    """A family's mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): counts, widths and routing."""

    num_experts: int  # experts per sparse layer
    num_experts_per_tok: int  # experts each token is routed to (top-k)
    intermediate_size: int  # each expert's MLP width
    naming: str  # the experts' checkpoint names: a key of kiln.model.moe.CHECKPOINT_NAMES
    norm_topk_prob: bool  # the top-k routing weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    decoder_sparse_step: int = 1  # layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here (Qwen MoE keeps those dense)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a mixture-of-experts MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder, as read from a checkpoint header.

    Every setting is a typed field: the shared ones first, then those only some families have (each with a default
    that means "not this family's": no q/k norms, no experts, no soft-capping...). One reader fills them from HF
    config.json or GGUF metadata alike (kiln.model.loader.config_reader); a plugin family keeps its own settings,
    a frozen dataclass of its reader's, in `own` (kiln.models).
    """

    architecture: str  # a registered family: "llama", "qwen3", "gemma2", "mixtral", ... (kiln.model.loader.families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sliding_window: int = 0  # tokens a sliding-window layer looks back (0: none)
    # per layer "sliding_attention" | "full_attention"; empty: every layer slides when sliding_window is set
    layer_types: tuple[str, ...] = ()
    # what only some families have
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary embedding (Qwen3, Gemma 3)
    fused_checkpoint: bool = False  # the checkpoint stores q/k/v and gate/up already fused, as kiln does (Phi-3)
    moe: MoEConfig | None = None  # mixture-of-experts layers (None: dense MLPs)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -0.5 power (None: head_dim's; Gemma)
    attn_logit_softcapping: float = 0.0  # attention scores capped at tanh(s / cap) * cap (0: none; Gemma 2)
    final_logit_softcapping: float = 0.0  # the logits capped the same way (0: none; Gemma 2/3)
    rope_local_base_freq: float | None = None  # the sliding layers' own unscaled rotary base (None: rope_theta)
    own: object = None  # a plugin family's own settings: a frozen dataclass its config reader made (kiln.models)

    @property
    def num_experts(self) -> int:
        """Experts per sparse layer (0: dense MLPs)."""
        return self.moe.num_experts if self.moe is not None else 0

    @property
    def num_experts_per_tok(self) -> int:
        return self.moe.num_experts_per_tok if self.moe is not None else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder layer `layer` in tokens (0: global attention)."""
        if not self.sliding_window:
            return 0
        sliding = not self.layer_types or self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    @property
    def uniform_sliding_window(self) -> int:
        """The window W when every decoder layer slides with the same W > 0, else 0 (no window, or a global layer).

        Only then is a sequence's KV behind the window dead for every layer, so its blocks may be released
        (kiln.engine.scheduling.kv_window); a global layer (Gemma) still reads every block.
        """
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else 0

    @property
    def hybrid_sliding_window(self) -> int:
        """The window W when some decoder layers slide with W > 0 and the others attend globally (Gemma 2/3), else 0.

        The sliding layers' KV then lives in blocks of its own (kiln.engine.scheduling.kv_window), released behind the
        window while the global layers' blocks grow with the sequence.
        """
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return max(windows) if len(windows) == 2 and 0 in windows else 0

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied; per-head and extra norms not counted)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * h * i
        if self.moe is not None:
            shared, experts = self.moe.shared_expert_intermediate_size, self.moe.num_experts
            mlp = experts * (3 * h * self.moe.intermediate_size + h) + 3 * h * shared + (h if shared else 0)
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers, in a cache stored as `dtype`
        (kiln.model.kv_format: int8 and uint8, fp8_e4m3's bytes, carry a scale per head beside the codes)."""
        scale = KV_SCALE_BYTES if dtype.itemsize == 1 else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype.itemsize + scale)


DEFAULT_KV_CACHE_GB = 1.0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: size the pool from `kv_cache_memory_gb`, else `kv_cache_memory_fraction`, else DEFAULT_KV_CACHE_GB
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    dtype: str = "auto"  # KV_CACHE_DTYPE_NAMES; "auto": AUTO_KV_CACHE_DTYPE for a float32 model, else the model's
    # set: the pool is this fraction of the memory available after the weights, instead of `kv_cache_memory_gb`
    kv_cache_memory_fraction: float | None = None
    # automatic prefix caching (kiln.engine.scheduling.prefix_sharing): full blocks are kept after their request and
    # shared
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # the key of a block (kiln.engine.scheduling.prefix_cache.HASH_ALGOS)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # with chunked prefill, most prompt tokens one request prefills in a step while other requests run or wait
    # (vLLM's name): a long prompt then delays the others' next token by one chunk's step, not its whole prefill.
    # 0: no cap. A request alone prefills as much as the budget allows.
    long_prefill_token_threshold: int = 512
    # most sequences of one client request (its prompts x n) running at once; None: half of max_num_seqs. The rest
    # wait, so an n=64 request leaves batch slots to other requests instead of taking every one.
    max_running_per_request: int | None = None
    # with chunked prefill, a step holding a long prompt's chunk takes at most about this long, as measured: the
    # chunk shrinks as its context grows and as steps take longer (kiln.engine.scheduling.prefill_budget). 0: the
    # threshold's cost alone.
    long_prefill_step_seconds: float = 0.5
    # which waiting request is admitted first, and which running one is preempted when blocks run out (vLLM's
    # --scheduling-policy): fcfs, by arrival; priority, by each request's priority (lower first), then arrival
    policy: str = "fcfs"

    @property
    def running_per_request(self) -> int:
        cap = self.max_running_per_request
        return cap if cap is not None else max(1, self.max_num_seqs // 2)


@dataclass(frozen=True)
class PoolingConfig:
    """Embedding requests (`SamplingParams.embed`, /v1/embeddings): which of the prompt's final hidden states (after
    the model's final norm) make its vector, and whether it is L2-normalized (vLLM's defaults: last, normalized)."""

    mode: str = "last"  # one of POOLING_NAMES
    normalize: bool = True


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (kiln.lora), vLLM's flags: off unless `enabled`; `max_loras` adapters in one step (their slots),
    each of rank at most `max_lora_rank`; `max_cpu_loras` read adapters kept in host memory (None: max_loras);
    `modules`: (name, path) adapters registered at start (`--lora-modules name=path`); `target_modules`: the HF
    module names adapters may adapt (a recipe's lora.target_modules; None: any kiln adapts); `dtype`: the adapters'
    buffers' dtype (`--lora-dtype`, LORA_DTYPE_NAMES; auto: the model's)."""

    enabled: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()
    target_modules: tuple[str, ...] | None = None
    dtype: str = "auto"

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class FusionGroupConfig:
    """Ops a recipe expects in one kernel: module names (`gate_proj`) and functional ops (`silu`, `mul`)."""

    name: str
    ops: tuple[str, ...]
    required: bool = True  # not realised after compiling: True fails the compile, False logs a warning
    where: str = ""  # "recipe.yaml:18" when it came from a recipe, for messages
    all_ops_quantized: str | None = None  # "int4" | "int8": the group's weight ops must run packed at most this wide


def default_cache_dir() -> str:
    """The compile and kernel-choice cache when no flag names one: KILN_CACHE_DIR, else ~/.cache/kiln (kiln.env)."""
    return str(read_env().cache_dir)


class RecipeContract(Protocol):
    """What an engine reads of its validated recipe (a kiln.recipe.Recipe; named here so the config layer imports
    nothing above it): where it was read, its hash, its bounds by symbol (batch_size, num_tokens, seq_len) and the
    guards that check every request and step (kiln.recipe.guards.RecipeGuards)."""

    @property
    def path(self) -> str: ...

    @property
    def hash(self) -> str: ...

    @property
    def bounds(self) -> Mapping[str, int | None]: ...

    @property
    def guards(self) -> Any: ...


@dataclass(frozen=True)
class GraphConfig:
    """Graph-mode settings: from the recipe, else flags (built and validated by `kiln.compile.settings`)."""

    mode: GraphMode = DEFAULT_GRAPH_MODE
    splitting_ops: tuple[str, ...] = ("kiln.attention",)
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # capture sizes also compiled for their static num_tokens; None: automatic (CPU + inductor: sizes <= 2,
    # whose weight products become GEMV reductions, see kiln.compile.passes.DecodeGemv)
    compile_sizes: tuple[int, ...] | None = None
    compiler: str = "inductor"  # "inductor" | "eager" (run the traced graph, no codegen)
    # the compile and kernel-choice cache: resolved (kiln.engine.setup.resolve: --cache-dir, else KILN_CACHE_DIR,
    # else ~/.cache/kiln); a GraphConfig made without one takes the environment's at construction
    cache_dir: str = field(default_factory=lambda: default_cache_dir())
    dump_dir: str | None = None  # write the compile artifacts here when set
    piece_modes: tuple[tuple[int, str], ...] = ()  # (piece index, eager|compiled|captured); unset: the default
    default_piece_mode: str = "captured"  # pieces piece_modes does not name (the debugger starts them eager)
    recipe_hash: str = ""
    debug: int = 0  # trace level: the recipe's debug_mode raised by KILN_DEBUG, never lowered (resolved)
    fusion_groups: tuple[FusionGroupConfig, ...] = (
        # no recipe, no promise: the default group is reported (and warned about), never a failed compile
        FusionGroupConfig("mlp_fusion", ("gate_proj", "up_proj", "silu", "mul"), required=False),
    )
    # the engine's max_model_len, resolved once the checkpoint is open (kiln.engine.setup.resolve.resolve_for_model):
    # the table width of a CUDA full decode graph; None only in a GraphConfig no engine resolved (tests, tools)
    max_model_len: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices (kiln.distributed): `tensor` ranks share every layer (each holds a slice of
    its heads and MLP), `pipeline` stages hold contiguous groups of layers. `stage_layers`, when given (a recipe's
    `device_affinity`), lists the layers of each stage; None splits them evenly. World size = tensor * pipeline.

    `nnodes`/`node_rank`/`master_addr`/`master_port` place the ranks on machines (as torchrun does); one node starts
    its workers itself."""

    tensor: int = 1
    pipeline: int = 1
    stage_layers: tuple[tuple[int, ...], ...] | None = None
    micro_batches: int = 0  # parts each step is split into on a pipeline (0: one per stage, or 1 with steps in flight)
    steps_in_flight: int = 0  # steps rank 0 keeps in flight on a pipeline (0: one per stage; 1: one at a time)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node), 29500 (several)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (`kiln.engine.setup.build.build_engine`), after the recipe's overlay.

    Made by `kiln.engine.setup.resolve.resolve_engine_config`, the one place flags, a recipe and the environment
    meet (one precedence, written there), and resolved for its checkpoint by `resolve_for_model` before an engine is
    built: the engine's config holds max_model_len and quantization as decided, never None or "auto". `recipe` is the
    validated contract itself (its guards check every request), not a path to read again.
    """

    model: str = "default"
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" | "cuda"
    quantization: str = "auto"  # one of QUANTIZATION_NAMES (kiln.quant)
    quantization_group_size: int = 32  # values per scale/offset group when int8/int4 quantize at load
    activations: str = DEFAULT_ACTIVATIONS  # of packed products: one of ACTIVATION_NAMES
    # the memory second forms of packed weights may take (kiln.kernels.compute_forms); None: half the memory free
    # after the weights and the KV cache; 0: none
    second_form_memory_gb: float | None = None
    max_model_len: int | None = None  # None until resolved: min(model context, DEFAULT_MAX_MODEL_LEN)
    seed: int | None = None  # None: unseeded requests get fresh OS randomness
    num_threads: int | None = None  # --num-threads, else KILN_NUM_THREADS; None: torch's own (all cores)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    recipe: RecipeContract | None = field(default=None, compare=False)  # a validated kiln.recipe.Recipe
    graph: GraphConfig = field(default_factory=GraphConfig)  # graph.mode says which graphs run (eager: none)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    grammar_cache_bytes: int = 256 << 20  # structured outputs' compiled grammars (kiln.engine.structured.grammar_cache)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)  # embedding requests' vectors
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters (off by default)
    # the options the user gave (EngineArgs field names): each must act, which is checked again once the checkpoint
    # decides what its weights run with (kiln.engine.setup.inert_options); empty where a command derived them
    must_act: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def graph_mode(self) -> GraphMode:
        return self.graph.mode

    @property
    def sampled_rows(self) -> int:
        """The most rows a step samples (the logits head's): per running sequence 1, or k + 1 verifying k drafts."""
        drafts = self.speculative.num_speculative_tokens if self.speculative.is_enabled else 0
        return self.scheduler.max_num_seqs * (drafts + 1)

    @property
    def executor(self) -> str:
        """The executor registry entry (kiln.engine.setup.build.EXECUTORS) that runs this engine's forward."""
        return "graph" if self.graph.mode.is_graph else "eager"


DEFAULT_MAX_MODEL_LEN = 8192  # when neither flags nor the recipe bound it: min(model context, this)
