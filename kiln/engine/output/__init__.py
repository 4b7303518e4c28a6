"""Output: the step's third verb: sampled tokens applied to their requests (stop rules, incremental
detokenization), and the outputs handed back to callers.

detokenizer.py  incremental detokenization with stop strings
outputs.py      the stop rules, and the `RequestOutput` handed to callers
updater.py      the update verb: a step's sampled tokens applied to its requests (stops, grammars, drafts, outputs)
"""
