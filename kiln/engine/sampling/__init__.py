"""Sampling: per-request sampling parameters and the batched sampler over a step's logits rows, with speculative
decoding's verification of draft tokens.

sampler.py          batched sampling: grammar masks, penalties, temperature, top-k, top-p, min-p, generators, logprobs
sampling_params.py  per-request sampling parameters, validated on construction with errors naming the field
spec_verify.py      speculative decoding's verification: greedy acceptance and rejection sampling of draft tokens
"""
