"""Speculation: proposing draft tokens before the step is scheduled (n-gram prompt lookup or a draft model's
engine), choosing how many a step verifies, and learning from the verification.

draft.py        speculative decoding's draft model: a second engine proposing drafts, one round per step
ngram.py        the n-gram proposer's index: where each n-gram of a sequence last ended (prompt lookup)
speculation.py  speculative decoding's proposals: which drafts a step verifies, per-request back-off, the counters
"""
