"""Multi-device execution on torch.distributed: tensor parallelism (kiln.distributed.sharding), the collectives as
custom ops (kiln.distributed.ops), process groups (kiln.distributed.state) and workers (kiln.distributed.workers).

control.py   rank 0 to the other ranks, outside the forward: each step's plan and start-up agreements
ops.py       the forward's collectives as custom ops (`kiln::all_reduce`, `kiln::all_gather`, `kiln::send_next` /
             `kiln::recv_prev`), kept by dynamo as single nodes inside the compiled pieces
sharding.py  how one tensor-parallel rank's slice of a layer is chosen: heads, MLP columns, vocabulary rows
spmd.py      one program on every rank: how the debugger runs a multi-device engine
state.py     this process's place in a multi-device run: its ranks and process groups, set once per process
workers.py   starting the ranks of a multi-device engine, following rank 0's steps, and noticing a rank that dies
"""
