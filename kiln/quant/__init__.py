"""Quantized weights kept packed in memory (`--quantization packed | int8 | int4`).

gguf_blocks.py  GGUF Q4_0 / Q4_1 / Q8_0 blocks -> int8 codes, a scale and an offset per group of 32 weights
linear.py       PackedLinear: a linear layer over packed weights, dequantized inside the product; PackedTensor
quantize.py     int8 (symmetric) / int4 (asymmetric) group-wise quantization of float weights at load
pack.py         which of a model's linear layers are built packed
"""
