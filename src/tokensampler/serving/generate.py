"""A real decode loop over a local Hugging Face causal LM, sampled with tokensampler.

The prompts are tokenized, left-padded into one batch and prefilled; then every decode step
feeds one token per row through the model's KV cache (`past_key_values`) and samples the next
token of every unfinished row with one `Sampler.sample` call. Each request's parameters come from
`resolve_request` against the checkpoint's `generation_config.json` (`load_generation_defaults`),
exactly as an OpenAI server would resolve them, and are reported with the seed, so a run can be
replayed. `transformers` is only imported here, on use (`pip install tokensampler[hf]`).

Options of the loop: chat prompts (each prompt a user message rendered with the checkpoint's chat
template), constrained generation (`constrained.GrammarSpec`: one xgrammar matcher per completion,
its bitmask passed to `Sampler.sample`, the completion ends when the grammar terminates), OpenAI
stop strings (not part of the returned text) and ignore_eos, and a progress line.
"""

from __future__ import annotations

import dataclasses
import inspect
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

import torch

from ..core.errors import InvalidSamplingParams
from ..core.output import SamplerOutput
from ..core.params import SamplingParams
from ..sampler import Sampler
from .constrained import GrammarConstraint, GrammarSpec
from .generation_config import GenerationDefaults, resolve_request

StepObserver = Callable[[Sampler, list[int], torch.Tensor, SamplerOutput], None]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TokenLogprob:
    """One generated token's log-probability, its 1-based rank and the top alternatives (id, value)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class Completion:
    """One choice of one prompt: the tokens, the text, and the exact parameters and seed sampled with."""

    prompt_index: int
    choice: int
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop token id, a stop string, the grammar's end) or "length" (max_tokens)
    params: SamplingParams  # as held by the Sampler for this row (seed filled in)
    seed: int
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's), if any


def load_causal_lm(model_dir: str | Path, *, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from a local checkpoint directory, offline; needs `transformers`."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - exercised only without the [hf] extra
        raise ImportError("tokensampler generate needs transformers: pip install 'tokensampler[hf]'") from exc
    if not Path(model_dir).is_dir():
        raise InvalidSamplingParams("model", str(model_dir), "a local checkpoint directory")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer


def max_model_len_of(model: Any) -> int | None:
    """The context length of the model (config.max_position_embeddings), if it declares one."""
    value = getattr(model.config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _eos_ids(defaults: GenerationDefaults, tokenizer: Any) -> tuple[int, ...]:
    ids = list(defaults.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row, dtype=torch.int64)
        mask[b, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def _token_logprob(out: SamplerOutput, b: int, asked: int) -> TokenLogprob:
    lp = out.logprobs
    count = lp.top_token_ids.shape[1] if asked == -1 else asked
    top_ids = lp.top_token_ids[b, :count].tolist()
    top_values = lp.top_logprobs[b, :count].tolist()
    return TokenLogprob(int(out.token_ids[b]), float(lp.token_logprobs[b]), int(lp.token_ranks[b]),
                        [(i, v) for i, v in zip(top_ids, top_values, strict=True) if i >= 0])


class _Forward:
    """One model call with a KV cache, whatever the transformers version names the cache argument.

    transformers 5.x calls it `cache` (and deprecates `past_key_values`); 4.x `past_key_values`.
    """

    def __init__(self, model: Any) -> None:
        names = inspect.signature(model.forward).parameters
        self.model = model
        self.cache_name = "cache" if "cache" in names else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in names else {}

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        kwargs = dict(self.extra)
        if cache is not None:
            kwargs[self.cache_name] = cache
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)

    def cache_of(self, out: Any) -> Any:
        cache = getattr(out, self.cache_name, None)
        return cache if cache is not None else getattr(out, "past_key_values", None)


def render_chat(tokenizer: Any, prompt: str) -> str:
    """`prompt` as the one user message of a chat, rendered with the tokenizer's chat template
    (add_generation_prompt=True: the text ends where the assistant's reply starts)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidSamplingParams("chat", True, "a checkpoint whose tokenizer has a chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's token ids: the text tokenized as is, or (chat) the rendered chat tokenized
    without adding special tokens (the template writes them)."""
    if chat:
        return list(tokenizer(render_chat(tokenizer, prompt), add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _resolve_requests(tokenizer: Any, prompts: Sequence[str],
                      requests: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                      defaults: GenerationDefaults, limit: int | None,
                      chat: bool = False) -> tuple[list[list[int]], list[SamplingParams]]:
    """Tokenize the prompts and resolve one SamplingParams per prompt, seeds drawn; all checks first."""
    if not prompts:
        raise InvalidSamplingParams("prompts", list(prompts), "at least one prompt")
    bodies = [requests or {}] * len(prompts) if requests is None or isinstance(requests, Mapping) else list(requests)
    if len(bodies) != len(prompts):
        raise InvalidSamplingParams("requests", f"{len(bodies)} bodies", f"one, or one per prompt ({len(prompts)})")
    prompt_ids = [prompt_token_ids(tokenizer, p, chat) for p in prompts]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise InvalidSamplingParams(f"prompts[{i}]", prompts[i], "a prompt of at least one token")
    resolved = [resolve_request(body, defaults, max_model_len=limit or None, prompt_len=len(ids) if limit else None)
                for body, ids in zip(bodies, prompt_ids, strict=True)]
    for i, params in enumerate(resolved):
        if params.max_tokens is None:
            raise InvalidSamplingParams(f"requests[{i}].max_tokens", None,
                                        "an int >= 1: the model declares no context length to bound it")
    # One seed per request, shared by its n choices; choice c uses noise stream c.
    return prompt_ids, [p if p.seed is not None else dataclasses.replace(p, seed=secrets.randbits(63))
                        for p in resolved]


class _Progress:
    """The progress line: tokens so far and tokens per second, redrawn with a carriage return."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.start = time.perf_counter()
        self.tokens = 0

    def step(self, tokens: int) -> None:
        self.tokens += tokens
        if self.stream is not None:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.stream.write(f"\rgenerate: {self.tokens} tokens, {rate:.1f} tokens/s")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.tokens:
            self.stream.write("\n")
            self.stream.flush()


def _stop_string_at(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """(index, string) of the stop string that ends first in `text[start:]` (ties: list order)."""
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or index + len(stop) < best[0] + len(best[1])):
            best = (index, stop)
    return best


@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompts: Sequence[str],
             requests: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
             defaults: GenerationDefaults | None = None, *, max_model_len: int | None = None,
             observer: StepObserver | None = None, chat: bool = False, grammar: GrammarSpec | None = None,
             progress: TextIO | None = None) -> list[Completion]:
    """Complete every prompt (each `n` times) with tokensampler; returns the completions in order.

    requests: one OpenAI completion body for all prompts, or one per prompt (its `prompt` field is
    ignored: the text comes from `prompts`). defaults: the checkpoint's sampling defaults.
    max_model_len: caps max_tokens at max_model_len - prompt_len (default: the model's).
    observer: called after every step with (sampler, slots sampled, their logits, output).
    chat: each prompt is a user message, rendered with the checkpoint's chat template.
    grammar: every completion follows it (`constrained.parse_grammar`): one xgrammar matcher per
      completion, advanced by each sampled token; its bitmask goes to `Sampler.sample`; the
      completion ends ("stop") when the grammar has terminated (its stop token, EOS, accepted).
    progress: a stream (e.g. sys.stderr) for a progress line redrawn after every step.
    Stop strings (`stop` in the request) end a completion and are cut from its text (finish_reason
    "stop"); `ignore_eos` makes EOS no stop condition (the sampler still samples it like any id).
    """
    defaults = defaults if defaults is not None else GenerationDefaults(mode="vllm")
    limit = max_model_len if max_model_len is not None else max_model_len_of(model)
    prompt_ids, resolved = _resolve_requests(tokenizer, prompts, requests, defaults, limit, chat)
    rows = [(i, c) for i, p in enumerate(resolved) for c in range(p.n)]

    device = next(model.parameters()).device
    logits_width = model.get_output_embeddings().weight.shape[0]
    eos = _eos_ids(defaults, tokenizer)
    max_logprobs = max([20] + [p.logprobs or 0 for p in resolved])
    sampler = Sampler(logits_width, max_slots=len(rows), device=device, max_logprobs=max_logprobs,
                      eos_token_ids=[t for t in eos if t < logits_width])
    seeds = [sampler.add_request(slot, resolved[i], prompt_ids[i], stream=c) for slot, (i, c) in enumerate(rows)]

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    input_ids, mask = _left_pad([prompt_ids[i] for i, _ in rows], pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    forward = _Forward(model)
    out = forward(input_ids, mask, positions, None)
    next_position = positions[:, -1:] + 1

    outputs: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[TokenLogprob] | None] = [[] if resolved[i].logprobs is not None else None for i, _ in rows]
    finish: list[str | None] = [None] * len(rows)
    reasons: list[str | int | None] = [None] * len(rows)
    texts: list[str | None] = [None] * len(rows)  # set when a stop string cut the text
    stops = [set(resolved[i].stop_token_ids) | (set() if resolved[i].ignore_eos else set(eos)) for i, _ in rows]
    constraint = (GrammarConstraint(grammar, tokenizer, logits_width, [t for t in eos if t < logits_width])
                  if grammar is not None else None)
    matchers = [constraint.matcher() for _ in rows] if constraint is not None else None
    bitmask = constraint.bitmask(len(rows)) if constraint is not None else None
    meter = _Progress(progress)
    while True:
        active = [slot for slot in range(len(rows)) if finish[slot] is None]
        logits = out.logits[:, -1, :].float()[active]
        token_bitmask = None
        if matchers is not None:  # every active matcher is live: a terminated one finished its row
            token_bitmask = constraint.fill_bitmask([matchers[s] for s in active], bitmask).to(device)
        step = sampler.sample(logits, slots=active, token_bitmask=token_bitmask)
        if observer is not None:
            observer(sampler, active, logits, step)
        tokens = step.token_ids.tolist()
        meter.step(len(active))
        for b, slot in enumerate(active):
            params = resolved[rows[slot][0]]
            outputs[slot].append(tokens[b])
            if logprobs[slot] is not None:
                logprobs[slot].append(_token_logprob(step, b, params.logprobs))
            if matchers is not None:
                constraint.accept(matchers[slot], tokens[b])
            if matchers is not None and matchers[slot].is_terminated():
                finish[slot] = "stop"
                reasons[slot] = tokens[b] if tokens[b] in eos else None
            elif tokens[b] in stops[slot]:
                finish[slot], reasons[slot] = "stop", tokens[b]
            elif params.stop and len(outputs[slot]) > params.min_tokens:
                text = tokenizer.decode(outputs[slot], skip_special_tokens=True)
                start = len(tokenizer.decode(outputs[slot][:params.min_tokens], skip_special_tokens=True))
                found = _stop_string_at(text, params.stop, start)
                if found is not None:
                    finish[slot], reasons[slot], texts[slot] = "stop", found[1], text[:found[0]]
            if finish[slot] is None and len(outputs[slot]) >= params.max_tokens:
                finish[slot] = "length"
        if all(f is not None for f in finish):
            break
        fed = torch.full((len(rows), 1), pad_id, dtype=torch.int64, device=device)
        fed[active, 0] = step.token_ids.to(device)
        mask = torch.cat([mask, torch.ones_like(fed)], dim=1)
        out = forward(fed, mask, next_position, forward.cache_of(out))
        next_position = next_position + 1

    meter.close()
    return [Completion(prompt_index=i, choice=c, prompt=prompts[i], prompt_token_ids=prompt_ids[i],
                       token_ids=outputs[slot],
                       text=texts[slot] if texts[slot] is not None else tokenizer.decode(outputs[slot],
                                                                                        skip_special_tokens=True),
                       finish_reason=finish[slot], params=sampler.params_of(slot), seed=seeds[slot],
                       logprobs=logprobs[slot], stop_reason=reasons[slot])
            for slot, (i, c) in enumerate(rows)]
