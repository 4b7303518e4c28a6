"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by llguidance, cached by bytes,
and held as a per-request grammar state that masks each step's logits.

constraint.py         a request's constraint (StructuredOutput): light, checked before any engine is built
grammar_build.py      a constraint's llguidance grammar, compiled and tried on its first tokens (no panics)
grammar_cache.py      compiled grammars bounded in bytes, and failed constraints remembered by key
reasoning_gate.py     where a reasoning model's answer starts: its grammar holds the output after the reasoning
structured_output.py  outputs held to a JSON schema, regex, choice or grammar (llguidance), masked per step
"""
