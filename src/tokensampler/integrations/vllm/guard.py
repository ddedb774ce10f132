"""What the vLLM plugin refuses at start-up, as pure functions of the values they check (no vLLM
import here: the checks run on a version string and on config objects read by attribute).

- `check_vllm_version`: the installed vLLM's major.minor must be one of `SUPPORTED_VLLM_VERSIONS`;
  another version is refused unless `TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED=1` (then one warning line).
  The plugin hooks vLLM internals (the V1 model runner, its input batch and rejection sampler) whose
  interfaces change between minor versions.
- `check_speculative_config`: a speculative setting that changes how drafts are accepted and that
  the plugin does not implement (vLLM's synthetic acceptance, block verification) is refused rather
  than silently replaced by tokensampler's verification.

Each refusal is one `InvalidEnvironment` (a `ValueError`), whose message is one line naming the
setting, its value and what is supported.
"""

from __future__ import annotations

import re
from typing import Any

from ...core.errors import InvalidEnvironment

SUPPORTED_VLLM = "0.32"
SUPPORTED_VLLM_VERSIONS = (SUPPORTED_VLLM,)
ALLOW_UNSUPPORTED_ENV = "TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED"

# speculative_config fields that select how drafts are verified, and the values the plugin implements
REJECTION_SAMPLE_METHODS = ("standard",)  # match mode without draft probabilities, rejection mode with
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # no draft probabilities / the draft's probabilities

_MAJOR_MINOR = re.compile(r"^\s*(\d+)\.(\d+)(?:\D|$)")


def major_minor(version: str) -> str | None:
    """'0.32.0+cpu' -> '0.32' (None when `version` does not start with two numbers)."""
    match = _MAJOR_MINOR.match(str(version))
    return None if match is None else f"{int(match.group(1))}.{int(match.group(2))}"


def check_vllm_version(version: str, allow_unsupported: str | None,
                       supported: tuple[str, ...] = SUPPORTED_VLLM_VERSIONS) -> str | None:
    """Refuse a vLLM `version` whose major.minor is not in `supported`, unless `allow_unsupported`
    (the value of `TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED`: unset, '' or '0' off, '1' on) is '1'.

    Returns the warning line to log when an unsupported version is let through, else None. Raises
    `InvalidEnvironment` for an unsupported version without the override, and for an override value
    other than unset, '', '0' or '1' (whatever the version)."""
    if allow_unsupported not in (None, "", "0", "1"):
        raise InvalidEnvironment(ALLOW_UNSUPPORTED_ENV, allow_unsupported,
                                 f"0 or 1 (1: run the tokensampler plugin on a vLLM other than {_names(supported)})")
    if major_minor(version) in supported:
        return None
    if allow_unsupported != "1":
        raise InvalidEnvironment("vllm.__version__", version,
                                 f"vLLM {_names(supported)} for the tokensampler plugin "
                                 f"(set {ALLOW_UNSUPPORTED_ENV}=1 to run it on vLLM {version} anyway, untested)")
    return (f"tokensampler plugin: vLLM {version} is not a supported version ({_names(supported)}); "
            f"running anyway because {ALLOW_UNSUPPORTED_ENV}=1 (untested)")


def check_speculative_config(config: Any) -> None:
    """Refuse a vLLM `SpeculativeConfig` whose draft verification the plugin does not implement.

    The plugin's rejection sampler verifies every draft with tokensampler: match mode when the
    drafts come without probabilities (`draft_sample_method='greedy'`, n-gram, suffix and other
    proposers), rejection mode with the draft's probabilities (`'probabilistic'`). vLLM's
    `rejection_sample_method='synthetic'` (accepting drafts at fixed rates, a benchmarking mode that
    ignores the target's probabilities) and `'block'` (block verification) are other acceptance rules:
    refused. None (no speculative decoding) passes."""
    if config is None:
        return
    method = getattr(config, "rejection_sample_method", "standard")
    if method not in REJECTION_SAMPLE_METHODS:
        raise InvalidEnvironment(
            "speculative_config.rejection_sample_method", method,
            f"{_quoted(REJECTION_SAMPLE_METHODS)}: the tokensampler plugin verifies drafts with tokensampler "
            f"(match mode without draft probabilities, rejection mode with them) and does not implement {method!r}")
    draft = getattr(config, "draft_sample_method", "greedy")
    if draft not in DRAFT_SAMPLE_METHODS:
        raise InvalidEnvironment("speculative_config.draft_sample_method", draft,
                                 f"{_quoted(DRAFT_SAMPLE_METHODS)} with the tokensampler plugin")


def _names(versions: tuple[str, ...]) -> str:
    return " or ".join(versions)


def _quoted(values: tuple[str, ...]) -> str:
    return " or ".join(repr(v) for v in values)
