"""Tensor parallelism on torch.distributed: the split plan (plan.py), process groups and
collectives, per-rank shard loading, and rank 0's group of workers (launcher.py)."""
