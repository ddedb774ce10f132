"""Helpers shared by the tests: reference/sampler runs, a tiny HF checkpoint, split and engine harnesses."""
