"""The hooks the vLLM plugin installs (once per process, idempotent).

- Before anything is hooked, the installed vLLM's version (`vllm.__version__`, read at install
  time) is checked (`guard.check_vllm_version`): another major.minor than the supported ones is
  refused unless `TOKENSAMPLER_VLLM_ALLOW_UNSUPPORTED=1`, which logs one warning line.
- `GPUModelRunner.__init__` (the CPU runner inherits it): after vLLM builds the runner, its `sampler`
  is replaced by a `TokenSamplerSampler` bound to the runner, which warms up at once (the state of
  the persistent batch is made, and with it `Sampler.warmup` runs), so no request waits on a compile.
- `InputBatch.add_request`: the row's `torch.Generator` is dropped from the persistent batch. vLLM's
  per-request generators are not used (tokensampler's noise is a pure function of seed, position and
  token), and vLLM rewinds them for discarded prefill chunks with `set_offset`, which a CPU
  generator does not support.
- With speculative decoding, the runner's `rejection_sampler` becomes a `TokenSamplerRejectionSampler`
  around the same sampler: drafts are verified by tokensampler (match mode without draft
  probabilities, so speculation changes nothing but speed). A speculative config whose acceptance
  rule the plugin does not implement (`rejection_sample_method` 'synthetic' or 'block') is refused
  when the runner is built (`guard.check_speculative_config`).
- With tensor parallelism, on the shard path (`shards.py`): `GPUModelRunner.execute_model` runs
  inside `shards.sharding(...)`, during which `LogitsProcessor._get_logits` leaves the LM head's
  logits on their rank (no all-gather); the runner's `apply_grammar_bitmask` applies a
  structured-output bitmask to a rank's own columns when the logits are a shard.
- `SamplingParams.update_from_tokenizer` (in the API-server process, where vLLM tokenises the bad
  words of a request it admits): a request whose allowed ids are all banned by one-token bad words
  is refused with vLLM's validation error, a 400 (`admission.py`).
- On a GPU, vLLM 0.32 picks its Model Runner V2 when Triton is importable; the plugin asks for the
  V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0` unless set) and refuses a V2 runner.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from ...core.errors import InvalidEnvironment
from .guard import ALLOW_UNSUPPORTED_ENV, check_speculative_config, check_vllm_version

LOG = logging.getLogger("tokensampler.integrations.vllm")
_INSTALLED = False


def install() -> None:
    """Install the hooks in this process (a second call does nothing)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import vllm

    warning = check_vllm_version(vllm.__version__, os.environ.get(ALLOW_UNSUPPORTED_ENV))
    if warning is not None:
        LOG.warning(warning)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    import vllm.model_executor.layers.logits_processor as logits_module
    import vllm.sampling_params as sampling_module
    import vllm.v1.worker.gpu_input_batch as input_batch
    import vllm.v1.worker.gpu_model_runner as runner_module

    from .admission import check_allowed_against_bad_words, check_extra_args, tokenize_breakers
    from .ranks import tensor_parallel
    from .sampler import TokenSamplerSampler
    from .shards import apply_bitmask_to_shard, shard_layout, sharding, skip_gather
    from .speculative import TokenSamplerRejectionSampler

    runner_init = runner_module.GPUModelRunner.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        runner_init(self, *args, **kwargs)
        check_speculative_config(self.speculative_config)
        sampler = TokenSamplerSampler(logprobs_mode=self.model_config.logprobs_mode,
                                      use_fp64_gumbel=getattr(self.model_config, "use_fp64_gumbel", False))
        sampler.bind(self)
        self.sampler = sampler
        sampler.warmup()
        if self.speculative_config is not None:
            self.rejection_sampler = TokenSamplerRejectionSampler(sampler, self.speculative_config, self.device)

    add_request = input_batch.InputBatch.add_request

    def add(self: Any, request: Any) -> int:
        row = add_request(self, request)
        self.generators.pop(row, None)
        return row

    execute_model = runner_module.GPUModelRunner.execute_model

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        sampler = self.sampler
        layout = sampler.sharded_columns() if isinstance(sampler, TokenSamplerSampler) else None
        with sharding(layout):
            return execute_model(self, *args, **kwargs)

    get_logits = logits_module.LogitsProcessor._get_logits

    def logits(self: Any, hidden_states: Any, lm_head: Any, embedding_bias: Any, skip: bool = False) -> Any:
        return get_logits(self, hidden_states, lm_head, embedding_bias, skip or skip_gather(lm_head))

    apply_bitmask = runner_module.apply_grammar_bitmask

    def bitmask(scheduler_output: Any, grammar_output: Any, batch: Any, logits: Any) -> None:
        tp = tensor_parallel() if logits.shape[-1] != batch.vocab_size else None
        layout = None if tp is None else shard_layout(tp.rank, tp.world_size, batch.vocab_size)
        if layout is not None and logits.shape[-1] == layout.columns:
            apply_bitmask_to_shard(logits, batch.req_ids, grammar_output, layout)
        else:
            apply_bitmask(scheduler_output, grammar_output, batch, logits)

    update_from_tokenizer = sampling_module.SamplingParams.update_from_tokenizer

    def tokenised(self: Any, tokenizer: Any) -> None:
        update_from_tokenizer(self, tokenizer)
        check_allowed_against_bad_words(self)
        tokenize_breakers(self, tokenizer)
        check_extra_args(self)

    sampling_module.SamplingParams.update_from_tokenizer = tokenised
    runner_module.GPUModelRunner.__init__ = init
    runner_module.GPUModelRunner.execute_model = execute
    runner_module.apply_grammar_bitmask = bitmask
    logits_module.LogitsProcessor._get_logits = logits
    input_batch.InputBatch.add_request = add
    _refuse_runner_v2()
    _INSTALLED = True


def _refuse_runner_v2() -> None:
    """A V2 model runner (GPU) has another sampler interface: refuse it with a clear error."""
    if importlib.util.find_spec("triton") is None:  # vLLM uses the V2 runner only with Triton
        return
    import vllm.v1.worker.gpu.model_runner as v2
    original = v2.GPUModelRunner.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise InvalidEnvironment("VLLM_USE_V2_MODEL_RUNNER", os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                                 "0: the tokensampler plugin hooks vLLM's V1 model runner")

    init.__wrapped__ = original  # type: ignore[attr-defined]
    v2.GPUModelRunner.__init__ = init
