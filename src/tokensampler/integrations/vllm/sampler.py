"""`TokenSamplerSampler`: vLLM's V1 `Sampler` whose `forward` samples with tokensampler.

A subclass of vLLM's `Sampler`, so the runner's other uses of it (prompt logprobs through
`compute_logprobs` / `gather_logprobs`, `logprobs_mode`) keep working. One call:

1. the runner's persistent batch (`runner.input_batch`) is followed by the `BatchState` (admissions,
   moves, releases: `batch.py`);
2. vLLM's custom logits processors (not its built-in min-tokens, logit-bias and min-p ones, which
   tokensampler implements itself) are applied to the logits; the structured-output bitmask was
   applied by the runner before the call;
3. every row is sampled by the `SamplingGenerator`; rows vLLM will discard (a prefill chunk that is
   not the last) are sampled but neither counted nor advanced; on the shard path (`shards.py`) the
   logits are this rank's columns and the generator is split over the tensor-parallel group;
4. the tokens, and the logprobs in vLLM's layout (`logprobs.py`), are returned as vLLM's
   `SamplerOutput`.

A call whose rows do not match the persistent batch (vLLM's dummy sampler run during profiling)
falls back to vLLM's own sampler: it samples nothing that is returned to a request.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler as VllmSampler

from ...backends.choice import resolve_names
from ...state.layout import VocabLayout
from .batch import LOG, BatchState
from .logprobs import to_vllm_logprobs
from .processors import apply_custom
from .ranks import agreed_seed_source, tensor_parallel
from .shards import LogitsPath, choose_path, shard_layout


class TokenSamplerSampler(VllmSampler):
    """vLLM's sampler, sampling with tokensampler; bound to one model runner (`bind`).

    backend, compile: the tokensampler backend and torch.compile choice of every batch's sampler,
    resolved here, once (None: TOKENSAMPLER_BACKEND / TOKENSAMPLER_COMPILE, read now)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs", use_fp64_gumbel: bool = False,
                 backend: str | None = None, compile: bool | None = None) -> None:
        self.backend, self.compile = resolve_names(backend, compile)  # before any state: a bad value raises
        super().__init__(logprobs_mode=logprobs_mode, use_fp64_gumbel=use_fp64_gumbel)
        self._runner: Any = None
        self._states: dict[int, BatchState] = {}  # id(input batch) -> its state
        self.steps = 0  # calls sampled by tokensampler (vLLM's dummy runs excluded)

    def bind(self, runner: Any) -> None:
        """Attach to the model runner whose persistent batch this sampler follows."""
        self._runner = weakref.ref(runner)

    def runner(self) -> Any:
        """The bound model runner (None before `bind`, or once the runner is gone)."""
        return None if self._runner is None else self._runner()

    def warmup(self) -> None:
        """Make the state of the runner's persistent batch now (its `SamplingGenerator` runs
        `Sampler.warmup`): a runner without a batch yet makes it on the first step."""
        runner = self.runner()
        if runner is not None and getattr(runner, "input_batch", None) is not None:
            self.state()

    def state(self) -> BatchState:
        """The state of the runner's current persistent batch (made when the runner makes a new one;
        collective with tensor parallelism: every rank of the group makes it at the same call)."""
        runner = self.runner()
        batch = runner.input_batch
        state = self._states.get(id(batch))
        if state is None:
            config = runner.model_config
            vocab = config.get_vocab_size()
            max_logprobs = config.max_logprobs if config.max_logprobs >= 0 else vocab
            tp = tensor_parallel()
            path, why = choose_path(runner, 1 if tp is None else tp.world_size)
            if path is LogitsPath.SHARDS:  # each rank samples its columns over the group: one split sampler
                group = tp.device_group if torch.device(runner.device).type == "cuda" else tp.cpu_group
                state = BatchState(runner.max_num_reqs, vocab, runner.device, logprobs_mode=self.logprobs_mode,
                                   max_logprobs=max_logprobs, shards=shard_layout(tp.rank, tp.world_size, vocab),
                                   group=group, backend=self.backend, compile=self.compile)
            else:  # the ranks of a tensor-parallel group draw the same seeds for unseeded requests
                state = BatchState(runner.max_num_reqs, vocab, runner.device, logprobs_mode=self.logprobs_mode,
                                   max_logprobs=max_logprobs, seed_source=agreed_seed_source(tp),
                                   backend=self.backend, compile=self.compile)
            LOG.info("sampling on %s logits: %s", path.value, why)
            self._states = {id(batch): state}  # an older batch is gone for good
        return state

    def sharded_columns(self) -> VocabLayout | None:
        """The columns this rank samples when its engine is on the shard path (None: whole rows)."""
        return self.state().shards if self.runner() is not None else None

    def forward(self, logits: torch.Tensor, sampling_metadata: Any, predict_bonus_token: bool = False,
                logprobs_mode_override: str | None = None) -> SamplerOutput:
        runner = self.runner()
        batch = None if runner is None else runner.input_batch
        if batch is None or batch.num_reqs != logits.shape[0] or predict_bonus_token or logprobs_mode_override:
            return super().forward(logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        state = self.state()
        rows = batch.num_reqs
        state.follow(batch.req_ids[:rows], runner.requests.__getitem__)
        logits = apply_custom(logits, sampling_metadata.logitsprocs)
        record = (~runner.discard_request_mask.np[:rows].astype(bool)).tolist()
        tokens, logprobs = state.sample(logits, record)
        self.steps += 1
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1),
                             logprobs_tensors=to_vllm_logprobs(tokens, logprobs))
