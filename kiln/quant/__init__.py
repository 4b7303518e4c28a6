"""Quantized weights kept packed in memory (`--quantization packed`).

gguf_blocks.py  GGUF Q4_0 / Q4_1 / Q8_0 blocks -> int8 codes, a scale and an offset per group of 32 weights
linear.py       PackedLinear: a linear layer over packed weights, dequantized inside the product; PackedTensor
"""
