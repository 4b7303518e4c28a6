"""Model construction: checkpoint -> kiln model on the requested dtype, with load progress."""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from kiln.errors import ModelLoadError
from kiln.model.llama import LlamaForCausalLM
from kiln.model.loader import Checkpoint, GGUFCheckpoint
from kiln.model.tokenizer import KilnTokenizer

logger = logging.getLogger("kiln")

# architecture -> model class; every supported family shares the Llama implementation today.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def build_model(
    checkpoint: Checkpoint, dtype: torch.dtype, max_positions: int, device: str = "cpu"
) -> LlamaForCausalLM:
    """Instantiate the model for `checkpoint` and load its weights (dequantized) in `dtype`."""
    config = checkpoint.config
    start = time.perf_counter()
    model = MODEL_CLASSES[config.architecture](config, max_positions, checkpoint.rope_freq_factors())
    bar = tqdm(total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", leave=False, delay=0.5)
    try:
        model.load_weights(checkpoint.weights(), on_tensor=lambda _name: bar.update(1))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(checkpoint.path, str(exc)) from None
    finally:
        bar.close()
    # NOTE: only parameters change dtype; rotary tables stay fp32 as in HF.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.to(device)
    model.eval().requires_grad_(False)
    if dtype == torch.float32 and model.lm_head.weight.device.type == "cpu":
        set_layer_weight_layout(model, column_major=True)
        model.prepare_decode_head()
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    logger.info(
        "Loaded %s (%s, %d layers, %.2f GB %s) in %.2f s",
        config.name,
        config.architecture,
        config.num_layers,
        size_gb,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - start,
    )
    return model


def set_layer_weight_layout(model: LlamaForCausalLM, column_major: bool) -> bool:
    """Store each decoder layer's linear weights [out, in] column-major (a transposed view) or row-major
    (the plain layout); True when some weight changed.

    NOTE: measured on this CPU (MKL fp32): `linear(x, W)` for one row streams a row-major W at ~12 GB/s but
    the same W stored column-major at ~20 GB/s (the GEMV is then a plain NN product), while for 8-32 rows the
    two layouts are within noise inside the model. Batch-1 decode is weight-bandwidth bound, so this is the
    layout for eager CPU. Graph mode turns one- and two-row products into reductions that want the plain
    layout (kiln.compile.passes.DecodeGemv) and switches back. Shapes, names and values are unchanged; only
    strides differ. The embedding stays row-major (token lookups gather rows).
    """
    changed = False
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight.data
                is_column_major = weight.t().is_contiguous() and not weight.is_contiguous()
                if is_column_major != column_major:
                    module.weight.data = weight.t().contiguous().t() if column_major else weight.contiguous()
                    changed = True
    return changed


def load_tokenizer(checkpoint: Checkpoint) -> KilnTokenizer:
    if isinstance(checkpoint, GGUFCheckpoint):
        return KilnTokenizer.from_gguf(checkpoint)
    return KilnTokenizer.from_hf_dir(checkpoint.path)
