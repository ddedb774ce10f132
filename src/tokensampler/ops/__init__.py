"""Pure torch building blocks of the batched sampling step, one job per module.

Each function works on a batch of rows `[B, V]` (float32 `z`, `-inf` = removed) with per-row
parameter columns, and reproduces the float operations of `reference.py` exactly.
"""
