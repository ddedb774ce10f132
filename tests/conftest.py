"""Session settings of the test suite, applied before collection (never by a test module):

- no network: Hugging Face runs offline;
- without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, which Triton
  reads when it is first imported, so it is set before anything imports it);
- each test runs the eager CPU path unless it asks for torch.compile itself
  (`monkeypatch.setenv("TOKENSAMPLER_COMPILE", "1")`) or the environment sets TOKENSAMPLER_COMPILE;
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
    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


@pytest.fixture(autouse=True)
def eager_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager path by default (compiling costs minutes on a 2-core machine)."""
    if "TOKENSAMPLER_COMPILE" not in os.environ:
        monkeypatch.setenv("TOKENSAMPLER_COMPILE", "0")
