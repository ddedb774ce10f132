"""tokensampler inside vLLM (0.32, V1 model runner): a general plugin that makes the engine sample
every token with tokensampler.

Opt in: the plugin is installed with this package (entry point group `vllm.general_plugins`, name
`tokensampler`) but does nothing unless `VLLM_PLUGINS` (comma-separated) names `tokensampler`:

    VLLM_PLUGINS=tokensampler vllm serve MODEL ...

vLLM loads general plugins in every process it starts; `register` is idempotent. When active, the
model runner's `sampler` becomes `sampler.TokenSamplerSampler` (a subclass of vLLM's `Sampler`), whose
state (`batch.BatchState`: a `SamplingGenerator` over the persistent batch's rows) follows the
engine's batch. See docs/vllm.md. vLLM is never a requirement of tokensampler: nothing here imports
it before `register` runs.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "tokensampler"
SUPPORTED_VLLM = "0.32"


def requested() -> bool:
    """Whether `VLLM_PLUGINS` names this plugin (unset: vLLM loads every plugin, ours stays off)."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in [name.strip() for name in names.split(",")]


def register() -> None:
    """The entry point vLLM calls in each of its processes: install the hooks when requested."""
    if not requested():
        return
    from .patches import install

    install()


__all__ = ["PLUGIN_NAME", "SUPPORTED_VLLM", "register", "requested"]
