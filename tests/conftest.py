"""Session settings of the test suite, applied before collection (never by a test module):

- no network: Hugging Face runs offline;
- without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, which Triton
  reads when it is first imported, so it is set before anything imports it);
- samplers are eager by default (compiling costs minutes on a 2-core machine): TOKENSAMPLER_COMPILE
  defaults to 0 for the session (the default a `Sampler` reads when it is made with `compile=None`;
  a TOKENSAMPLER_COMPILE set by the caller is kept). A test that wants torch.compile passes
  `compile=True`, and a test picks a backend with `backend=...`: no test sets these variables;
- under CI the hypothesis examples are a fixed sequence.
"""

import os

import pytest
import torch
from hypothesis import settings


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TOKENSAMPLER_COMPILE", "0")
    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")

