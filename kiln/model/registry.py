"""Model construction: checkpoint -> kiln model on the requested dtype and device, with load progress.

Weights load in the plain (row-major) layout; the executor that runs the model owns any layout change.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from kiln.errors import ModelLoadError
from kiln.model.llama import LlamaForCausalLM, WeightMismatch
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
    """Instantiate the model for `checkpoint` and load its weights (dequantized) in `dtype`.

    Tensor names and shapes are checked against the model from the headers first, so a checkpoint with missing,
    extra or misshapen tensors fails before any weight is read; every failure is a ModelLoadError naming the file.
    """
    config = checkpoint.config
    start = time.perf_counter()
    model = MODEL_CLASSES[config.architecture](config, max_positions, checkpoint.rope_freq_factors())
    bar = tqdm(total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", leave=False, delay=0.5)
    try:
        model.check_tensors(checkpoint.weight_shapes())
        model.load_weights(checkpoint.weights(), on_tensor=lambda _name: bar.update(1))
    except WeightMismatch as exc:
        label = checkpoint.tensor_label(exc.tensor)
        raise ModelLoadError(checkpoint.file_of(exc.tensor), f"tensor {label}: {exc.problem}") from None
    finally:
        bar.close()
    # NOTE: only parameters change dtype; rotary tables stay fp32 as in HF.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.to(device)
    model.eval().requires_grad_(False)
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


def load_tokenizer(checkpoint: Checkpoint) -> KilnTokenizer:
    if isinstance(checkpoint, GGUFCheckpoint):
        return KilnTokenizer.from_gguf(checkpoint)
    return KilnTokenizer.from_hf_dir(checkpoint.path)
