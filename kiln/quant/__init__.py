"""Quantized weights kept packed in memory (`--quantization packed | int8 | int4`, a quantized checkpoint's codes).

gguf_blocks.py  GGUF Q4_0 / Q4_1 / Q8_0 / K-quant blocks -> codes, a scale and an offset per group
codes.py        integer codes with scales and zero points (quantized HF checkpoints) -> the same packed form
compressed.py   compressed-tensors layers -> packed codes or dequantized weights, through the compressed-tensors package
gptq_awq.py     GPTQ and AWQ layers (their int32 layouts) -> packed codes
linear.py       PackedLinear: a linear layer over packed weights, dequantized inside the product; PackedTensor
ops.py          `torch.ops.kiln.packed_linear`, the reference kernels and the kernels bound to each weight
quantize.py     int8 (symmetric) / int4 (asymmetric) group-wise quantization of float weights at load
pack.py         which of a model's linear layers are built packed
"""
