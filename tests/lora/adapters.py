"""A tiny random HF Llama on disk and PEFT LoRA adapters for it (peft's `get_peft_model` + `save_pretrained`), the
reference kiln's LoRA is tested against; nothing is downloaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from kiln.model.build import build_model
from kiln.model.causal_lm import CausalLM
from kiln.model.loader.hf_loader import HFCheckpoint

VOCAB = 128
MAX_POSITIONS = 256
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_base(
    directory: Path, num_layers: int = 2, family: str = "Llama", **overrides: object
) -> transformers.PreTrainedModel:
    """A tiny fp32 model of an HF `family` (`<family>Config`, `<family>ForCausalLM`) with random weights (norms too),
    saved as an HF directory."""
    torch.manual_seed(0)
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
    }
    config_cls = getattr(transformers, f"{family}TextConfig", None) or getattr(transformers, f"{family}Config")
    config = config_cls(**{**fields, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_adapter(
    base: transformers.PreTrainedModel, directory: Path, targets: list[str], rank: int, seed: int, **lora: object
) -> Path:
    """A PEFT adapter of `rank` on `targets` with random A and B (PEFT starts B at zero), saved to `directory`."""
    config = LoraConfig(r=rank, target_modules=targets, **{"lora_alpha": 2 * rank, **lora})
    peft_model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(directory)
    return directory


def reference(base: transformers.PreTrainedModel, adapter: Path | None) -> torch.nn.Module:
    """HF + PEFT with the adapter as saved (the base alone for None)."""
    model = copy.deepcopy(base)
    return (PeftModel.from_pretrained(model, str(adapter)) if adapter is not None else model).eval()


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for `prompt` and the logits [max_tokens, vocab] each was chosen from."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()


def kiln_model(directory: Path) -> CausalLM:
    return build_model(HFCheckpoint(str(directory)), torch.float32, MAX_POSITIONS)


def edit_config(adapter: Path, **changes: object) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
