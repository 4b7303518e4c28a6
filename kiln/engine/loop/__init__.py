"""The step loop: a step's verbs in order, propose -> schedule -> execute -> update, over the parts the engine
built (`StepParts`), never the engine itself. Chosen once, when the engine is built: one step at a time, or steps
in flight on a pipeline.

parts.py      `StepParts`: what a step loop runs (scheduler, runner, updater, proposer, the other ranks), and the
              proposing verb
plain.py      one step at a time, a batch that raises run again one request at a time to isolate the failure
pipelined.py  steps in flight on a pipeline: rank 0 launches the next step while later stages run the last one
"""
