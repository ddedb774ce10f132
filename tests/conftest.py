"""Shared test settings: no network access; reproducible hypothesis examples under CI."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported: without CUDA the kernels run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# CI must be reproducible: a fixed example sequence there; random exploration on developer machines.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
