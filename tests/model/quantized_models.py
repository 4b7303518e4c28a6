"""Tiny quantized HF checkpoints written in the tests: compressed-tensors ones by the compressed-tensors package's
own lifecycle (apply a scheme, set data-free min/max scales, compress, save), GPTQ and AWQ ones in their documented
tensor layouts (no gptqmodel or autoawq here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.quant.gptq_awq import AWQ_ORDER
from tests.engine.tiny_models import rewrite_config, rewrite_safetensors, write_hf_model

# preset -> changes to its weights' args (tiny layers: groups and blocks of 32)
PRESETS = {
    "W4A16": {"group_size": 32},
    "W4A16_CHANNEL": {"strategy": "channel", "group_size": None},
    "W4A16_ASYM": {"group_size": 32},
    "W8A16": {"group_size": 32},
    "W8A8": {},
    "FP8": {},
    "FP8_DYNAMIC": {},
    "FP8_BLOCK": {"block_structure": [32, 32]},
}


def write_compressed_model(
    directory: Path, preset: str, perturb: float = 0.05, family: str = "llama", **overrides: object
) -> torch.nn.Module:
    """A tiny model of `family` (tests.engine.tiny_models) quantized under a compressed-tensors preset (PRESETS;
    `lm_head` and mixture-of-experts routers ignored), compressed and saved with its tokenizer; returns the
    compressed HF model."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = write_hf_model(directory, family, perturb=perturb, **overrides)
    scheme = preset_name_to_scheme(preset.removesuffix("_CHANNEL"), ["Linear"])
    for key, value in PRESETS[preset].items():
        setattr(scheme.weights, key, value)
    if scheme.input_activations is not None and scheme.input_activations.strategy == "group":
        scheme.input_activations.group_size = 32
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _set_minmax_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return model


def _set_minmax_qparams(module: torch.nn.Module) -> None:
    """Data-free scales and zero points: each group's (channel's, block's, the tensor's) min and max; a static
    activation scale of 1/64 where the scheme has one."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, w = module.quantization_scheme.weights, module.weight.data
    if args.strategy == "group":
        groups = w.reshape(w.shape[0], -1, args.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        blocks = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(1 / 64)


def edit_quantization_config(directory: Path, **changes: object) -> Path:
    """Change fields of config.json's quantization_config; returns config.json's path."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))
    return path


def gptq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """GPTQ's layout of `w = (q - zeros) * scales` (q [out, in], zeros and scales [out, groups]), `gptq` format
    (zeros stored minus one): qweight [in / p, out] packed along the input, qzeros [groups, out / p] along the
    output, scales [groups, out] float16."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    qt = q.T.to(torch.int32).reshape(-1, per_word, q.shape[0])  # [in / p, p, out]
    qweight = (qt << shifts.view(1, -1, 1)).sum(1, dtype=torch.int32)
    z = (zeros.T.to(torch.int32) - 1).reshape(zeros.shape[1], -1, per_word)  # [groups, out / p, p]
    qzeros = ((z & ((1 << bits) - 1)) << shifts).sum(-1, dtype=torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.T.contiguous().half()}


def awq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ's GEMM layout: qweight [in, out / 8] and qzeros [groups, out / 8], each word's slot i holding output
    column AWQ_ORDER[i] of its eight; scales [groups, out] float16."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def pack(values: torch.Tensor) -> torch.Tensor:  # [n, out] -> [n, out / 8]
        words = values.to(torch.int32).reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        return (words << shifts).sum(-1, dtype=torch.int32)

    return {"qweight": pack(q.T), "qzeros": pack(zeros.T), "scales": scales.T.contiguous().half()}


def formula(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_of: torch.Tensor) -> torch.Tensor:
    return (q.float() - zeros[:, group_of].float()) * scales[:, group_of]


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def minmax_codes(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric min/max codes of `weight` [out, in] per group of `group` columns: (q, zeros, scales) with
    float16-rounded scales, as GPTQ and AWQ store them. Zero points start at 1: GPTQ's `gptq` format stores
    zero - 1 in `bits` bits, where 0 does not fit."""
    top = (1 << bits) - 1
    groups = weight.reshape(weight.shape[0], -1, group)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((high - low) / top).clamp(min=1e-6).half().float()
    zeros = torch.round(-low / scales).clamp(1, top).long()
    q = torch.round(groups / scales[..., None] + zeros[..., None]).clamp(0, top).long().reshape(weight.shape)
    return q, zeros, scales


# layers that read the same input: GPTQ's act order (from that input's statistics) is the same for each
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj"}
SHARED_INPUT |= {"mlp.up_proj": "mlp.gate_proj"}


def write_gptq_awq_model(
    directory: Path, method: str, bits: int = 4, act_order: bool = False, shared_order: bool = True
) -> torch.nn.Module:
    """A tiny Llama whose decoder linear layers are stored as `method` ("gptq" or "awq") `bits`-bit codes in groups
    of 32 (GPTQ with `act_order`: each input's columns dealt to groups by a random permutation, as desc_act orders
    them, one per input as GPTQ's are unless not `shared_order`); returns the HF model holding the weights those
    codes dequantize to (the reference)."""
    model = write_hf_model(directory, "llama", perturb=0.05)
    stored: dict[str, dict[str, torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        orders: dict[str, torch.Tensor] = {}
        for name in LINEARS:
            linear = layer.get_submodule(name)
            cols = linear.in_features
            g_idx = torch.arange(cols) // 32
            if act_order:
                shared = SHARED_INPUT.get(name) if shared_order else None
                g_idx = orders[shared] if shared else torch.randperm(cols, generator=generator) // 32
                orders[name] = g_idx
            order = torch.argsort(g_idx, stable=True)  # columns of group 0, then 1, ...
            q_sorted, zeros, scales = minmax_codes(linear.weight.data[:, order], bits, 32)
            q = torch.empty_like(q_sorted)
            q[:, order] = q_sorted
            with torch.no_grad():
                linear.weight.copy_(formula(q, zeros, scales, g_idx))
            prefix = f"model.layers.{i}.{name}"
            if method == "gptq":
                stored[prefix] = gptq_tensors(q, zeros, scales, bits) | {"g_idx": g_idx.to(torch.int32)}
            else:
                stored[prefix] = awq_tensors(q, zeros, scales)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for prefix, parts in stored.items():
            del tensors[f"{prefix}.weight"]
            tensors.update({f"{prefix}.{local}": t for local, t in parts.items()})

    rewrite_safetensors(directory, edit)
    config = {"quant_method": method, "bits": bits, "group_size": 32}
    if method == "gptq":
        config |= {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"}
    else:
        config |= {"zero_point": True, "version": "gemm"}
    rewrite_config(directory, {"quantization_config": config})
    return model
