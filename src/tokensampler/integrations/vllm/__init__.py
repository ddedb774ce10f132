"""tokensampler inside vLLM (0.32, V1 model runner): a general plugin that makes the engine sample
every token with tokensampler.

Opt in: the plugin is installed with this package (entry point group `vllm.general_plugins`, name
`tokensampler`) but does nothing unless `VLLM_PLUGINS` (comma-separated) names `tokensampler`:

    VLLM_PLUGINS=tokensampler vllm serve MODEL ...

vLLM loads general plugins in every process it starts; `register` is idempotent. A requested plugin
first checks the installed vLLM: a major.minor other than `SUPPORTED_VLLM_VERSIONS` is refused with
one `InvalidEnvironment` line, unless `TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED=1` (one warning line, then
the hooks as usual). Speculative settings the plugin does not implement are refused when the model
runner is built (`guard.py`). When active, the model runner's `sampler` becomes
`sampler.TokenSamplerSampler` (a subclass of vLLM's `Sampler`), whose state (`batch.BatchState`: a
`SamplingGenerator` over the persistent batch's rows) follows the engine's batch. With tensor
parallelism the ranks draw the same seeds (`ranks.py`) and, opted in, sample their own logits
columns (`shards.py`). See docs/vllm.md. vLLM is never a requirement of tokensampler: nothing here imports
it before `register` runs.
"""

from __future__ import annotations

import os

from .guard import ALLOW_UNSUPPORTED_ENV, SUPPORTED_VLLM, SUPPORTED_VLLM_VERSIONS

PLUGIN_NAME = "tokensampler"


def requested() -> bool:
    """Whether `VLLM_PLUGINS` names this plugin (unset: vLLM loads every plugin, ours stays off)."""
    names = os.environ.get("VLLM_PLUGINS")
    return names is not None and PLUGIN_NAME in [name.strip() for name in names.split(",")]


def register() -> None:
    """The entry point vLLM calls in each of its processes: install the hooks when requested (after
    checking the installed vLLM's version, `guard.check_vllm_version`)."""
    if not requested():
        return
    from .patches import install

    install()


__all__ = ["ALLOW_UNSUPPORTED_ENV", "PLUGIN_NAME", "SUPPORTED_VLLM", "SUPPORTED_VLLM_VERSIONS", "register",
           "requested"]
