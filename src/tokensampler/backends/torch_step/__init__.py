"""The torch step (the CPU fast path, sort-free) and its building blocks, one job per module.

Each op works on a batch of rows `[B, V]` (float32 `z`, `-inf` = removed) with per-row parameter
columns and reproduces the float operations of `reference.py` exactly; `config.TorchStepConfig`
holds the routes and sizes, `compile_cache` the compiled functions (whether a sampler compiles is
its own choice, `backends.choice`), `torch_private` every private torch API they use.
"""
