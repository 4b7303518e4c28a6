"""Model construction: checkpoint -> kiln model on the requested dtype and device, with load progress.

Weights load in the plain (row-major) layout; the executor that runs the model owns any layout change. With
`quantization="packed"` a GGUF's block-quantized weights, or a quantized HF checkpoint's integer codes
(compressed-tensors, GPTQ, AWQ), stay packed (kiln.quant).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from kiln.errors import ConfigError, ModelLoadError
from kiln.model.causal_lm import CausalLM, WeightMismatch
from kiln.model.loader import Checkpoint, GGUFCheckpoint, HFCheckpoint
from kiln.model.loader.base import FileVersion, file_version
from kiln.model.loader.families import family_of
from kiln.model.tokenizer import KilnTokenizer
from kiln.quant.gguf_blocks import GROUP, PACKED_TYPES
from kiln.quant.linear import PackedEmbedding, PackedLinear
from kiln.quant.pack import pack_model
from kiln.quant.quantize import BITS

logger = logging.getLogger("kiln")
PACKED_NAMES = ", ".join(kind.name for kind in PACKED_TYPES)


class _NoRandomInit(TorchFunctionMode):
    """While a model for a checkpoint is built, its layers' random initial values are not drawn: `load_weights`
    overwrites every parameter and fails when one does not arrive (drawing them took 0.6 s of the default model's
    2.6 s build). A TorchFunctionMode is this thread's alone, so a model built elsewhere meanwhile is untouched."""

    DRAWS = frozenset(
        {nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_, torch.Tensor.uniform_, torch.Tensor.normal_}
    )

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in self.DRAWS:  # the tensor it would have filled, as it is
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    max_positions: int,
    device: str = "cpu",
    quantization: str = "none",
    group_size: int = GROUP,
) -> CausalLM:
    """Instantiate the model for `checkpoint` and load its weights in `dtype`: dequantized (`quantization`
    "none"), or, with "packed", a GGUF's block-quantized weights kept packed (kiln.quant).

    Tensor names and shapes are checked against the model from the headers first, so a checkpoint with missing,
    extra or misshapen tensors fails before any weight is read; every failure is a ModelLoadError naming the file.
    """
    config = checkpoint.config
    start = time.perf_counter()
    with _NoRandomInit():
        model = family_of(config.architecture).model_class()(config, max_positions, checkpoint.rope_freq_factors())
    held = checkpoint.quantization if isinstance(checkpoint, HFCheckpoint) else None
    if held is not None:
        logger.info("Checkpoint quantization: %s", held.describe())
        for note in held.notes():
            logger.info("%s", note)
    if quantization == "auto":  # NOTE: decided with the engine's config (kiln.engine.setup.resolve), not here
        raise ConfigError("quantization auto reached the model build undecided: resolve_for_model decides it")
    quantization = run_quantization(checkpoint, quantization)  # a decided value comes back as it is
    packed = quantization == "packed"
    if packed:
        if not isinstance(checkpoint, GGUFCheckpoint) and held is None:
            raise ConfigError(
                "--quantization packed keeps a quantized checkpoint's weights packed; "
                f"{checkpoint.path} holds float weights (no quantization_config in its config.json; use "
                "--quantization int8 or int4 to quantize it at load)"
            )
        packed_names = pack_model(model, checkpoint.packed_layout)
        logger.info("Keeping %d weights packed as the file stores them", len(packed_names))
        for kind, count in checkpoint.dequantized_types().items() if held is None else ():
            logger.info("%d %s tensors are not kept packed (kiln packs %s): dequantized", count, kind, PACKED_NAMES)
    elif quantization in ("int8", "int4"):
        if group_size < 2 or group_size % 2:
            raise ConfigError(f"--quantization-group-size {group_size}: expected an even number of values, such as 32")
        layout = (BITS[quantization], group_size)
        packed_names = pack_model(model, lambda _name: layout, quantization)
        logger.info("Quantizing %d of the decoder's linear weights to %s at load", len(packed_names), quantization)
    bar = tqdm(total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", leave=False, delay=0.5)
    try:
        model.check_tensors(checkpoint.weight_shapes())
        if isinstance(checkpoint, GGUFCheckpoint):
            weights = checkpoint.weights(packed=packed)
        else:  # read tensors as they load, a tensor-parallel rank only its part of each (and a stage only its layers)
            weights = checkpoint.weights(lazy=True)
        model.load_weights(weights, on_tensor=lambda _name: bar.update(1))
    except WeightMismatch as exc:
        label = checkpoint.tensor_label(exc.tensor)
        raise ModelLoadError(checkpoint.file_of(exc.tensor), f"tensor {label}: {exc.problem}") from None
    finally:
        bar.close()
    # NOTE: only parameters change dtype; rotary tables stay fp32 as in HF.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    for module in model.modules():
        if isinstance(module, (PackedLinear, PackedEmbedding)):
            module.to_dtype(dtype)
    model.to(device)
    model.eval().requires_grad_(False)
    size_gb = resident_weight_bytes(model) / 1e9
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


def run_quantization(checkpoint: Checkpoint, asked: str) -> str:
    """How `checkpoint` runs for `--quantization asked` (kiln.engine.setup.resolve writes it into the engine's
    config): a quantized HF checkpoint as its quantization_config allows (packed or none; ConfigError for another
    width), `auto` elsewhere packed for a GGUF holding blocks kiln keeps packed, else none; any other value as
    asked."""
    if isinstance(checkpoint, HFCheckpoint) and checkpoint.quantization is not None:
        return checkpoint.quantization.run_mode(asked, checkpoint.path)
    if asked == "auto":
        return "packed" if _has_blocks(checkpoint) else "none"
    return asked


def _has_blocks(checkpoint: Checkpoint) -> bool:
    """A GGUF holding weights kiln keeps packed."""
    if not isinstance(checkpoint, GGUFCheckpoint):
        return False
    return any(checkpoint.packed_layout(name) is not None for name in checkpoint.weight_shapes())


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the weights occupy in memory: parameters plus packed layers' codes, scales and offsets (a tied head's
    buffers are the embedding's, counted once)."""
    packed = [b for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding)) for b in m.buffers()]
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *packed]}
    return sum(tensors.values())


def load_tokenizer(checkpoint: Checkpoint) -> KilnTokenizer:
    """The checkpoint's tokenizer, shared within the process while the files it is read from are unchanged (a
    tokenizer is read-only once built; ~0.3 s a start for the default model's 49,152 tokens)."""
    gguf = isinstance(checkpoint, GGUFCheckpoint)
    files = [checkpoint.path] if gguf else [os.path.join(checkpoint.path, name) for name in TOKENIZER_FILES]
    return _tokenizer(checkpoint.path, gguf, tuple(_file_version(f) for f in files))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what an HF directory's tokenizer is read from
TOKENIZERS_KEPT = 4


@functools.lru_cache(maxsize=TOKENIZERS_KEPT)
def _tokenizer(path: str, gguf: bool, versions: tuple[FileVersion | None, ...]) -> KilnTokenizer:
    """A tokenizer per version of its files."""
    return KilnTokenizer.from_gguf(GGUFCheckpoint(path)) if gguf else KilnTokenizer.from_hf_dir(path)


def _file_version(path: str) -> FileVersion | None:
    try:
        return file_version(path)
    except OSError:
        return None  # missing: the tokenizer's own reading says so
