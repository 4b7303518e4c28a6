"""Multi-device execution on torch.distributed: tensor parallelism (kiln.distributed.sharding), the collectives as
custom ops (kiln.distributed.ops), process groups (kiln.distributed.state) and workers (kiln.distributed.workers)."""
