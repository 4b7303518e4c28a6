"""The README's GGUF tensor types beyond the packed ones: BF16 and the block types kiln keeps dequantized (Q5_0, Q5_1,
Q2_K, Q3_K, IQ4_NL, IQ4_XS, the i-quants IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S, the ternary TQ1_0/TQ2_0 and MXFP4). A tiny
llama file of each loads, its weights are the file's values (gguf-py's own dequantization of the same bytes), the
model generates, and with packed weights the log names the dequantized ones; TQ1_0, TQ2_0 and MXFP4 stay packed as
int8 codes. gguf-py quantizes those three (their files hold quantized random weights); it cannot quantize the
i-quants, whose files hold random codes with small scales (tests.engine.tiny_models.RANDOM_BLOCK_SCALES)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kiln import LLM, SamplingParams
from kiln.model.loader.gguf_loader import GGUFCheckpoint
from kiln.quant.linear import PackedLinear
from tests.engine.tiny_models import write_gguf_model

# type -> the hidden size its blocks need (K-quants and IQ4_XS hold 256 values a block)
TYPES = {"BF16": 64, "Q5_0": 64, "Q5_1": 64, "IQ4_NL": 64, "Q2_K": 256, "Q3_K": 256, "IQ4_XS": 256, "MXFP4": 64}
TYPES |= {t: 256 for t in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")}
PACKED = ("TQ1_0", "TQ2_0", "MXFP4")  # kept packed as int8 codes (kiln.quant.gguf_blocks)
UNPERMUTED = {  # GGUF name -> HF name, for the tensors whose rows llama.cpp did not interleave
    "attn_v.weight": "self_attn.v_proj",
    "attn_output.weight": "self_attn.o_proj",
    "ffn_gate.weight": "mlp.gate_proj",
    "ffn_up.weight": "mlp.up_proj",
    "ffn_down.weight": "mlp.down_proj",
}


@pytest.fixture(scope="module", params=list(TYPES))
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    kind = request.param
    path = tmp_path_factory.mktemp(kind) / f"tiny-{kind}.gguf"
    write_gguf_model(path, kind, hidden_size=TYPES[kind])
    return kind, path


def test_the_weights_are_the_files_values(model_file: tuple[str, Path]) -> None:
    kind, path = model_file
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert {t.tensor_type.name for t in stored.values() if len(t.shape) == 2} == {kind}
    weights = dict(GGUFCheckpoint(str(path)).weights())
    compared = 0
    for i in range(2):
        for part, hf_name in UNPERMUTED.items():
            t = stored[f"blk.{i}.{part}"]
            got = weights[f"model.layers.{i}.{hf_name}.weight"]
            want = dequantize(t.data, t.tensor_type).reshape(got.shape)
            assert np.array_equal(got.numpy(), want), (kind, t.name)
            assert torch.isfinite(got).all() and got.abs().max() > 0, (kind, t.name)
            compared += 1
    assert compared == 10


def test_the_model_generates_and_the_log_names_the_dequantized_type(
    model_file: tuple[str, Path], kiln_log: pytest.LogCaptureFixture
) -> None:
    kind, path = model_file
    llm = LLM(str(path), num_kv_blocks=16, graph_mode="eager", quantization="packed")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    dequantized = [r.getMessage() for r in kiln_log.records if "are not kept packed" in r.getMessage()]
    if kind == "BF16":  # a float type: nothing to say
        assert dequantized == []
    elif kind in PACKED:  # int8 codes with the block's scale
        assert dequantized == []
        assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj, PackedLinear)
    else:
        assert dequantized and f" {kind} tensors are not kept packed" in dequantized[0], dequantized
