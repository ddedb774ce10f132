"""`tokensampler bench --speculative`: speculative verification, timed side by side.

Cases `speculative_match` and `speculative_rejection`: B=32 rows, K=4 drafts, V=151936, the
target at temperature 0.8 / top-p 0.9. The drafts come from a draft "model" (the target's logits
plus N(0, 0.7^2) noise) sampled by tokensampler at temperature 0.8 with the target's seeds and
positions (so match mode sees the Gumbel-max coupling); rejection mode also gets the draft's
distribution q (its softmax of z / 0.8, the exact distribution the drafts were sampled from).

Arms, in alternating rounds on the same inputs (state restored, untimed, before each call):
`Sampler.sample_speculative`; the plain step run K+1 times on the same positions (what a
verification without a speculative entry point costs); vLLM's `RejectionSampler.forward` (with
q in the rejection case, without in the match case: vLLM has no match mode) where it imports and
runs, else the column is omitted with a note. Match mode's tokens are checked against the plain
sampler stepped one position at a time (the definition); rejection mode reports its acceptance.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from ..core.output import SpeculativeOutput
from ..core.params import SamplingParams
from ..sampler import Sampler
from .bench import time_arms
from .machine import machine_info
from .workloads import make_logits


@dataclass(frozen=True)
class SpeculativeCase:
    """One speculative row of the bench: every row of the batch has `params`."""

    name: str
    batch: int
    drafts: int
    vocab: int
    mode: str
    params: dict = field(default_factory=dict)


TARGET = {"temperature": 0.8, "top_p": 0.9}
DRAFT_TEMPERATURE = 0.8
WARMUP = 2  # untimed calls per arm first (the compiled reductions specialise on their first shapes)
SPECULATIVE_CASES: tuple[SpeculativeCase, ...] = (
    SpeculativeCase("speculative_match", 32, 4, 151936, "match", TARGET),
    SpeculativeCase("speculative_rejection", 32, 4, 151936, "rejection", TARGET),
)


@dataclass
class Inputs:
    logits: torch.Tensor  # float32 [B, K+1, V]
    drafts: torch.Tensor  # int64 [B, K]
    probs: torch.Tensor | None  # float32 [B, K, V] (rejection)


def make_inputs(case: SpeculativeCase, device: torch.device) -> Inputs:
    """The target's logits, the draft model's tokens (sampled by tokensampler with the target's
    seeds and positions) and, in rejection mode, the draft's distribution."""
    k, batch, vocab = case.drafts, case.batch, case.vocab
    logits = make_logits(batch * (k + 1), vocab, device=device).view(batch, k + 1, vocab)
    gen = torch.Generator().manual_seed(7)
    draft_logits = logits[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen).to(device)
    draft = Sampler(vocab, max_slots=batch, device=device)
    for row in range(batch):
        draft.add_request(row, _params(case, row, temperature=DRAFT_TEMPERATURE, top_p=1.0), [])
    drafts = torch.stack([draft.sample(draft_logits[:, j].contiguous()).token_ids for j in range(k)], dim=1)
    probs = torch.softmax(draft_logits / DRAFT_TEMPERATURE, dim=-1) if case.mode == "rejection" else None
    return Inputs(logits, drafts, probs)


def _params(case: SpeculativeCase, row: int, **override) -> SamplingParams:
    return SamplingParams(seed=1000 + row, **{**case.params, **override})


def build_sampler(case: SpeculativeCase, device: torch.device) -> tuple[Sampler, Callable[[], None]]:
    """A sampler holding the case's rows, and the (untimed) reset to position 0, empty history."""
    sampler = Sampler(case.vocab, max_slots=case.batch, device=device)
    for row in range(case.batch):
        sampler.add_request(row, _params(case, row), [])
    slots = list(range(case.batch))
    seeds = [sampler.seed_of(s) for s in slots]

    def reset() -> None:
        sampler.set_noise(slots, seeds, [0] * case.batch, [0] * case.batch)
        sampler.reset_history(slots, None, None)

    return sampler, reset


def plain_stepped(case: SpeculativeCase, inputs: Inputs, device: torch.device) -> torch.Tensor:
    """Match mode's expected tokens [B, K+1]: `Sampler.sample` one position at a time on the rows
    still matching their drafts."""
    sampler, _ = build_sampler(case, device)
    tokens = torch.full((case.batch, case.drafts + 1), -1, dtype=torch.int64)
    alive = list(range(case.batch))
    for j in range(case.drafts + 1):
        if not alive:
            break
        got = sampler.sample(inputs.logits[alive, j].contiguous(), alive).token_ids.cpu()
        tokens[alive, j] = got
        if j < case.drafts:
            alive = [b for i, b in enumerate(alive) if int(got[i]) == int(inputs.drafts[b, j])]
    return tokens


# ------------------------------------------------------------------ vLLM's RejectionSampler
def vllm_rejection_arm(case: SpeculativeCase, inputs: Inputs) -> tuple[tuple | None, str | None, list]:
    """((setup, step) timing vLLM's RejectionSampler on the same inputs, None, holder of its last
    output) or (None, a one-line reason, []) when vLLM does not import or its sampler does not run
    here (its rejection kernels are Triton kernels: a CPU-only install has none)."""
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.sample.sampler import Sampler as VllmSampler
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    except Exception as exc:  # noqa: BLE001 - any import failure: no peer
        return None, f"vLLM column omitted: vllm is not importable here ({type(exc).__name__}: {exc})"[:200], []
    if importlib.util.find_spec("triton") is None:
        return None, ("vLLM column omitted: vLLM's RejectionSampler runs Triton kernels and triton is not "
                      "installed here (a CPU-only vLLM)"), []
    batch, k, vocab = case.batch, case.drafts, case.vocab
    device = inputs.logits.device
    i32 = dict(dtype=torch.int32, device=device)
    metadata = SpecDecodeMetadata(
        draft_token_ids=inputs.drafts.to(torch.int32).flatten().contiguous(), num_draft_tokens=[k] * batch,
        cu_num_draft_tokens=torch.arange(1, batch + 1, **i32) * k,
        cu_num_sampled_tokens=torch.arange(1, batch + 1, **i32) * (k + 1),
        target_logits_indices=torch.tensor([b * (k + 1) + j for b in range(batch) for j in range(k)], **i32),
        bonus_logits_indices=torch.arange(batch, **i32) * (k + 1) + k,
        logits_indices=torch.arange(batch * (k + 1), **i32))
    sampling = SamplingMetadata(
        temperature=torch.full((batch,), case.params["temperature"], device=device), all_greedy=False,
        all_random=True, top_p=torch.full((batch,), case.params["top_p"], device=device), top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch, device=device), presence_penalties=torch.zeros(batch, device=device),
        repetition_penalties=torch.ones(batch, device=device), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors([]),
        spec_token_ids=inputs.drafts.tolist())
    flat = inputs.logits.reshape(batch * (k + 1), vocab)
    probs = None if inputs.probs is None else inputs.probs.reshape(batch * k, vocab).contiguous()
    buffer = torch.empty_like(flat)
    last: list = []

    def setup() -> None:
        buffer.copy_(flat)  # vLLM edits its logits in place

    def step():
        out = sampler(metadata, probs, buffer, sampling)
        last[:] = [out.sampled_token_ids]
        return out

    try:
        sampler = RejectionSampler(VllmSampler(logprobs_mode="raw_logprobs"))
        setup()
        step()  # first call: lazy initialisation inside vLLM
    except Exception as exc:  # noqa: BLE001 - vLLM's sampler does not run on this install
        return None, f"vLLM column omitted: its RejectionSampler does not run here ({type(exc).__name__}: {exc})"[
            :240], []
    return (setup, step), None, last


def _ids_valid(tokens: torch.Tensor, num_emitted: torch.Tensor, vocab: int) -> bool:
    """Real ids in every row's emitted prefix, -1 after it."""
    emitted = torch.arange(tokens.shape[1]) < num_emitted[:, None]
    real = (tokens >= 0) & (tokens < vocab)
    return bool(real[emitted].all()) and bool((tokens[~emitted] == -1).all())


def _mean_emitted(tokens: torch.Tensor) -> float:
    return float((tokens >= 0).sum(dim=1).to(torch.float64).mean())


def run_case(case: SpeculativeCase, device: torch.device, rounds: int, against: str | None) -> dict:
    inputs = make_inputs(case, device)
    sampler, reset = build_sampler(case, device)
    plain, plain_reset = build_sampler(case, device)
    outputs: list[SpeculativeOutput] = []

    def speculative() -> None:
        outputs[:] = [sampler.sample_speculative(inputs.logits, inputs.drafts, draft_probs=inputs.probs,
                                                 mode=case.mode)]

    def plain_steps() -> None:
        for j in range(case.drafts + 1):
            plain.sample(inputs.logits[:, j])

    arms: dict = {"tokensampler": (reset, speculative), "plain_steps": (plain_reset, plain_steps)}
    note, peer_out = None, []
    if against == "vllm":
        peer, note, peer_out = vllm_rejection_arm(case, inputs)
        if peer is not None:
            arms["vllm"] = peer
    times = time_arms(arms, rounds, device, warmup=WARMUP)
    reset()
    speculative()
    got = outputs[0].token_ids.cpu()
    result = {
        "case": case.name, "mode": case.mode, "batch": case.batch, "drafts": case.drafts, "vocab": case.vocab,
        "params": case.params, "rounds": rounds, "median_ms": {n: statistics.median(v) for n, v in times.items()},
        "runs_ms": times, "mean_emitted": {"tokensampler": _mean_emitted(got)}, "peer_note": note,
        "ids_valid": _ids_valid(got, outputs[0].num_emitted.cpu(), case.vocab),
    }
    if peer_out:
        result["mean_emitted"]["vllm"] = _mean_emitted(peer_out[0].cpu().to(torch.int64))
    if case.mode == "match":
        want = plain_stepped(case, inputs, device)
        result["rows_equal"], result["rows"] = int((got == want).all(dim=1).sum()), case.batch
    return result


def format_table(results: list[dict]) -> str:
    peer = any("vllm" in r["median_ms"] for r in results)
    header = "| case | tokensampler ms | plain step x(K+1) ms | plain / ts | mean emitted |"
    header += " vLLM RejectionSampler ms | vLLM / ts | vLLM mean emitted |" if peer else ""
    header += " rows = plain stepping |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        m, e = r["median_ms"], r["mean_emitted"]
        line = (f"| {r['case']} (B={r['batch']}, K={r['drafts']}, V={r['vocab']}) | {m['tokensampler']:.1f} | "
                f"{m['plain_steps']:.1f} | {m['plain_steps'] / m['tokensampler']:.2f}x | {e['tokensampler']:.2f} |")
        if peer:
            line += (f" {m['vllm']:.1f} | {m['vllm'] / m['tokensampler']:.2f}x | {e['vllm']:.2f} |" if "vllm" in m
                     else " - | - | - |")
        rows = f"{r['rows_equal']}/{r['rows']}" if "rows" in r else "n/a (random)"
        lines.append(line + f" {rows} |")
    notes = sorted({r["peer_note"] for r in results if r.get("peer_note")})
    return "\n".join(lines + ([""] + notes if notes else []))


def run_bench(device: str = "cpu", quick: bool = False, json_path: str | None = None,
              cases: list[str] | None = None, rounds: int | None = None, log=sys.stderr,
              against: str | None = None, matrix: tuple[SpeculativeCase, ...] = SPECULATIVE_CASES) -> list[dict]:
    """Run the speculative cases (or the named ones); progress to `log`; per-case results."""
    dev = torch.device(device)
    unknown = set(cases or ()) - {c.name for c in matrix}
    if unknown:
        raise ValueError(f"cases={sorted(unknown)} are not speculative cases: {[c.name for c in matrix]}")
    selected = [c for c in matrix if cases is None or c.name in cases]
    n_rounds = rounds if rounds is not None else (3 if quick else 7)
    results = []
    for i, case in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {case.name} (B={case.batch}, K={case.drafts}, V={case.vocab}) ...", file=log,
              flush=True)
        results.append(run_case(case, dev, n_rounds, against))
        m = results[-1]["median_ms"]
        print(f"    tokensampler {m['tokensampler']:.1f} ms, plain step x{case.drafts + 1} {m['plain_steps']:.1f} ms",
              file=log, flush=True)
        if results[-1]["peer_note"]:
            print(f"    {results[-1]['peer_note']}", file=log, flush=True)
    if json_path:
        payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(dev),
                   "quick": quick, "results": results}
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=1)
    return results


def is_speculative_case(name: str) -> bool:
    return name in {c.name for c in SPECULATIVE_CASES}
