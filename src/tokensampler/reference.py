"""The obviously-correct, slow implementation of docs/semantics.md: the oracle of the tests.

One row at a time, one step of the definition per block, sorting allowed. Every fast path
(`backends/torch_step`, `backends/triton`, `backends/split`) is tested token for token against
`reference_sample`. Imports only `core`; imported only by the tests and the tools (the bench).
Floating-point conventions that make "the same token" well defined are in docs/semantics.md:
z is float32 throughout, top-p masses are float64 sums of float32 `exp(z - z_max)`, the Gumbel
noise comes from `rng.gumbel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from .core import rng
from .core.constants import LOGPROBS_MODES, NEG_INF
from .core.dry import dry_penalty, dry_window, single_token_breakers
from .core.order import saturate_posinf
from .core.output import LogprobsOutput, SamplerOutput
from .core.params import SamplingParams


@dataclass
class ReferenceRequest:
    """One row's request as the reference sees it: params, history and noise coordinates."""

    params: SamplingParams
    seed: int
    position: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stream: int = 0
    eos_token_ids: Sequence[int] = field(default_factory=tuple)
    mirostat_mu: float | None = None  # Mirostat's mu before this token (None: 2 * tau, the admitted value)

    @property
    def mu(self) -> float | None:
        """The mu step 10.6 reads (None: Mirostat off)."""
        tau = self.params.mirostat_tau
        if tau is None:
            return None
        return 2.0 * tau if self.mirostat_mu is None else float(self.mirostat_mu)


def bitmask_allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[set[int]]:
    """The ids each row of an xgrammar-layout bitmask allows, one Python test per id.

    Parameters
    ----------
    bitmask: int32 [B, W], W >= ceil(vocab_size / 32): bit j (least significant first) of word w
        allows id 32 w + j; the int32 holds the bit pattern (bit 31 is the sign bit).
    vocab_size: V; bits of ids >= V are ignored.

    Returns
    -------
    One set of allowed ids (each < V) per row."""
    rows = []
    for words in bitmask.detach().to("cpu").tolist():
        rows.append({i for i in range(vocab_size) if (words[i // 32] & 0xFFFFFFFF) >> (i % 32) & 1})
    return rows


def bad_word_ids(params: SamplingParams, output_token_ids: Sequence[int]) -> set[int]:
    """The ids the bad words remove after this output (vLLM's rule): a one-token word always; a
    longer word its last token when the output ends with its other tokens."""
    out = list(output_token_ids)
    removed = set()
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(out) and out[len(out) - len(prefix):] == prefix:
            removed.add(word[-1])
    return removed


def dry_repeat_lengths(params: SamplingParams, history: Sequence[int]) -> dict[int, int]:
    """Step 5.1's L per token (llama.cpp's DRY, written the obvious way): over the last N tokens of
    `history` (prompt + output), for each k in [1, N - 1] the length of the longest suffix that also
    ends k tokens before the end (inside the window), capped by the tokens after the latest breaker;
    the token after that earlier occurrence gets the largest such length. Only L >= allowed_length kept."""
    n = dry_window(params.dry_penalty_last_n, len(history))
    window = list(history)[len(history) - n:]
    rat = lambda i: window[n - 1 - i]  # noqa: E731  (i tokens back from the newest)
    rep_limit = n
    for i in range(n):  # the breaker whose head is nearest the end; the longest tail among those at i
        tails = [len(b) - 1 for b in params.dry_sequence_breakers
                 if b[0] == rat(i) and len(b) - 1 <= i and all(b[1 + o] == rat(i - o - 1) for o in range(len(b) - 1))]
        if tails:
            rep_limit = i - max(tails)
            break
    lengths: dict[int, int] = {}
    for k in range(1, n):
        match = 0
        while match + k < n and rat(match) == rat(match + k):
            match += 1
        match = min(match, rep_limit)
        if match >= params.dry_allowed_length:
            token = rat(k - 1)
            lengths[token] = max(lengths.get(token, 0), match)
    return lengths


def apply_dry(z: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """Step 5.1: z_t = z_t - float32(multiplier * base^min(L_t - allowed_length, cap)) in float32, the
    penalty in double from the float32 parameters and rounded to float32 (llama.cpp's), the cap
    `dry_max_exponent` (`core.dry.dry_penalty`); an id that is a one-token breaker keeps its value."""
    if not params.dry:
        return z
    z = z.clone()
    singles = single_token_breakers(params.dry_sequence_breakers)
    for token, length in dry_repeat_lengths(params, history).items():
        if token >= z.numel() or token in singles:  # a one-token breaker is never penalised
            continue
        penalty = dry_penalty(params.dry_multiplier, params.dry_base, params.dry_allowed_length, length)
        value = torch.tensor(float(z[token]) - penalty, dtype=torch.float64).to(torch.float32)
        z[token] = NEG_INF if math.isnan(value) else value  # +inf less an infinite penalty: removed
    return z


def _mass_and_count_above(z: torch.Tensor, p: torch.Tensor, kept: torch.Tensor):
    """For each id: float64 mass and number of kept ids with a strictly larger z."""
    values, inverse = torch.unique(z[kept], sorted=True, return_inverse=True)  # ascending
    mass_per_value = torch.zeros(values.numel(), dtype=torch.float64)
    mass_per_value.index_add_(0, inverse, p[kept].to(torch.float64))
    count_per_value = torch.bincount(inverse, minlength=values.numel())
    # strictly above value v: the sum over larger values, accumulated from the largest down
    mass_above_value = torch.flip(torch.cumsum(torch.flip(mass_per_value, [0]), 0), [0]) - mass_per_value
    count_above_value = torch.flip(torch.cumsum(torch.flip(count_per_value, [0]), 0), [0]) - count_per_value
    mass_above = torch.full(z.shape, float("inf"), dtype=torch.float64)
    count_above = torch.full(z.shape, z.numel(), dtype=torch.int64)
    mass_above[kept] = mass_above_value[inverse]
    count_above[kept] = count_above_value[inverse]
    return mass_above, count_above


def _top_n(order_key: torch.Tensor, n: int) -> torch.Tensor:
    """The ids of the n largest keys, ties broken by the lower id (a stable descending sort)."""
    return torch.sort(order_key, descending=True, stable=True).indices[:n]


# ------------------------------------------------------------------ steps 7 and 10.1-10.6
def canonical_ids(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The kept ids by z descending, the lower id first among equal z (the order every full-row
    quantity is summed in)."""
    ids = torch.nonzero(kept).squeeze(-1)
    return ids[torch.sort(z[ids], descending=True, stable=True).indices]


def _total(terms: torch.Tensor) -> torch.Tensor:
    """The float64 sum of `terms` added one after the other, in their order."""
    return torch.cumsum(terms, 0)[-1]


def _entropy(q: torch.Tensor) -> torch.Tensor:
    """-sum q log q over q > 0 (0 log 0 = 0), in q's order."""
    return -_total(torch.where(q > 0, q * torch.log(q), torch.zeros_like(q)))


def dynamic_temperature(z: torch.Tensor, kept: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Step 7's T_dyn (float32): T_min + (T_max - T_min) (H / log n)^exponent, H the entropy of
    softmax(z) over the n kept ids (float64); the request's T when n = 1."""
    ids = canonical_ids(z, kept)
    if ids.numel() == 1:
        return torch.tensor(params.temperature, dtype=torch.float32)
    x = z[ids].to(torch.float64)
    e = torch.exp(x - x[0])
    h = _entropy(e / _total(e))
    t_min = max(0.0, params.temperature - params.dynatemp_range)
    t_max = params.temperature + params.dynatemp_range
    return (t_min + (t_max - t_min) * (h / math.log(ids.numel())) ** params.dynatemp_exponent).to(torch.float32)


def full_row_filters(z: torch.Tensor, kept: torch.Tensor, request: ReferenceRequest) -> torch.Tensor:
    """Steps 10.1-10.6 on the kept ids of z (= z / T, float32): each filter on what the previous left,
    its probabilities q = e / S renormalised there (float64, summed in the canonical order); Mirostat
    (10.6) reads `request.mu`."""
    params = request.params
    ids = canonical_ids(z, kept)
    x = z[ids].to(torch.float64)  # descending: x[0] is the max
    if params.top_n_sigma is not None:  # 10.1: x >= max - n sigma, sigma the population std
        mean = _total(x) / x.numel()
        sigma = torch.sqrt(_total((x - mean) * (x - mean)) / x.numel())
        ids, x = ids[x >= x[0] - params.top_n_sigma * sigma], x[x >= x[0] - params.top_n_sigma * sigma]
    if params.typical_p < 1.0:  # 10.2: ids by |-log q - H| ascending; ties stay or go together
        e = torch.exp(x - x[0])
        total = _total(e)
        q = e / total
        score = torch.abs(-torch.log(q) - _entropy(q))
        order = torch.sort(score, stable=True).indices
        before = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(e[order], 0)[:-1]])
        first_of_tie = torch.searchsorted(score[order], score[order])  # ascending: the tie's first place
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[order] = before[first_of_tie] < params.typical_p * total
        ids, x = ids[keep], x[keep]
    for cutoff, is_eta in ((params.epsilon_cutoff, False), (params.eta_cutoff, True)):  # 10.3, 10.4
        if cutoff > 0:
            e = torch.exp(x - x[0])
            q = e / _total(e)
            bound = torch.minimum(torch.tensor(cutoff, dtype=torch.float64),
                                  math.sqrt(cutoff) * torch.exp(-_entropy(q))) if is_eta else cutoff
            keep = (q >= bound) | (x == x[0])
            ids, x = ids[keep], x[keep]
    if params.xtc_probability > 0 and \
            float(rng.xtc_coin(request.seed, request.position, request.stream)) < params.xtc_probability:
        e = torch.exp(x - x[0])  # 10.5: two or more ids with q >= threshold: all but the last go
        above = int((e / _total(e) >= params.xtc_threshold).sum())
        if above >= 2:
            ids, x = ids[above - 1:], x[above - 1:]
    if params.mirostat_tau is not None:  # 10.6: surprise -log2 q <= mu; none: the ids tied at the max
        e = torch.exp(x - x[0])
        keep = -torch.log2(e / _total(e)) <= request.mu
        if not bool(keep.any()):
            keep = x == x[0]
        ids, x = ids[keep], x[keep]
    out = torch.zeros_like(kept)
    out[ids] = True
    return out


def mirostat_mu_after(z: torch.Tensor, kept: torch.Tensor, token: int, request: ReferenceRequest) -> float:
    """Step 13's Mirostat update: mu - eta (-log2 q'_t - tau), q' the softmax of z (= z / T) over the
    kept ids (after 10.6; float64, summed in the canonical order), t the token drawn."""
    ids = canonical_ids(z, kept)
    x = z[ids].to(torch.float64)
    e = torch.exp(x - x[0])
    q = e / _total(e)
    surprise = float(-torch.log2(q[int((ids == token).nonzero())]))
    return request.mu - request.params.mirostat_eta * (surprise - request.params.mirostat_tau)


def _log_softmax(z: torch.Tensor) -> torch.Tensor:
    if bool(torch.isneginf(z).all()):
        return z.clone()
    return torch.log_softmax(z, dim=-1)


def reference_sample_row(logits_row: torch.Tensor, request: ReferenceRequest, vocab_size: int,
                         logprobs_mode: str = "raw_logprobs", step_allowed: Collection[int] | None = None):
    """`reference_step_row` without Mirostat's mu: (token, valid, (scores, values) or None)."""
    return reference_step_row(logits_row, request, vocab_size, logprobs_mode, step_allowed)[:3]


def reference_step_row(logits_row: torch.Tensor, request: ReferenceRequest, vocab_size: int,
                       logprobs_mode: str = "raw_logprobs", step_allowed: Collection[int] | None = None):
    """The definition for one row, one step per block.

    Parameters
    ----------
    logits_row: [Vp], any float dtype, any device. request: its parameters, history and noise
    coordinates. vocab_size: V (ids >= V are padding). logprobs_mode: which values step 2 / 12 return.
    step_allowed: this step's allowed ids (the call's token bitmask row), None = no such constraint.

    Returns
    -------
    (token int, valid bool, (scores, values) or None, mu): scores and values float32 [V], the values
    asked by `logprobs_mode` and the scores they were computed from, which order the ids for ranks
    and the top-N (so rounding to logprobs cannot create ties); mu: Mirostat's mu after this token
    (`request.mu` where 10.6 did not run: a greedy row, a row with no id left; None: Mirostat off)."""
    params = request.params
    # 1. float32, padding removed, NaN and -inf removed
    z = logits_row.detach().to("cpu", torch.float32)[:vocab_size].clone()
    z[torch.isnan(z)] = NEG_INF
    raw = saturate_posinf(z.clone())
    # 2. raw values for logprobs
    lp_values = None
    if logprobs_mode == "raw_logprobs":
        lp_values = (raw.clone(), _log_softmax(raw))
    elif logprobs_mode == "raw_logits":
        lp_values = (raw.clone(), raw.clone())
    # 3. allowed ids, the step's token bitmask, bad words; stop and EOS ids while fewer than
    # min_tokens were generated
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[list(params.allowed_token_ids)] = True
        z[~keep] = NEG_INF
    if step_allowed is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[[i for i in step_allowed if i < vocab_size]] = True
        z[~keep] = NEG_INF
    for token in bad_word_ids(params, request.output_token_ids):
        z[token] = NEG_INF
    if len(request.output_token_ids) < params.min_tokens:
        for token in (*params.stop_token_ids, *request.eos_token_ids):
            z[token] = NEG_INF
    # 4. logit bias
    if params.logit_bias:
        for token, bias in params.logit_bias.items():
            z[token] = z[token] + torch.tensor(bias, dtype=torch.float32)
    # 5. penalties: repetition (prompt and output), frequency, presence (output only)
    counts = torch.bincount(torch.tensor(list(request.output_token_ids), dtype=torch.int64),
                            minlength=vocab_size)[:vocab_size].to(torch.float32)
    seen = counts > 0
    if len(request.prompt_token_ids):
        seen[torch.tensor(list(request.prompt_token_ids), dtype=torch.int64)] = True
    r = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    z = z - torch.tensor(params.frequency_penalty, dtype=torch.float32) * counts
    z = z - torch.tensor(params.presence_penalty, dtype=torch.float32) * (counts > 0).to(torch.float32)
    # 5.1 DRY, on prompt + output
    z = apply_dry(z, params, [*request.prompt_token_ids, *request.output_token_ids])
    z = saturate_posinf(z)
    kept = ~torch.isneginf(z)
    valid = bool(kept.any())
    greedy = params.greedy
    mu = request.mu
    if valid and not greedy:
        # 7. temperature (an underflow to -inf removes the id; if none is left, the row is invalid)
        t = torch.tensor(params.temperature, dtype=torch.float32)
        if params.dynatemp_range > 0 and bool((~torch.isneginf(z / t)).any()):  # 7. dynamic temperature,
            t = dynamic_temperature(z, kept, params)  # after the test with the request's T
            greedy = bool(t == 0) or bool(torch.isneginf(z[kept] / t).all())  # T_dyn = 0: greedy on z
        if not greedy:
            z = saturate_posinf(z / t)
            kept = ~torch.isneginf(z)
            valid = bool(kept.any())
    if not valid:  # no id left: the greedy id of the raw logits, flagged invalid
        token = int(torch.argmax(raw))
        final = z
    elif greedy:  # 6. greedy: lowest id among the maxima
        token = int(torch.argmax(z))
        final = z
    else:
        z_max = z[kept].max()
        p = torch.exp(z - z_max)  # float32, the relative probabilities q_i / max(q)
        # 8. min-p
        if params.min_p > 0:
            kept &= p >= torch.tensor(params.min_p, dtype=torch.float32)
        # 9. top-k: fewer than k kept ids with a strictly larger z (ties at the border stay)
        if params.top_k > 0:
            _, count_above = _mass_and_count_above(z, p, kept)
            kept &= count_above < min(params.top_k, vocab_size)  # a k beyond int64 keeps every id too
        # 10. top-p: mass (renormalised over kept ids) of strictly larger z is < top_p
        if params.top_p < 1.0:
            mass_above, _ = _mass_and_count_above(z, p, kept)
            total = p[kept].to(torch.float64).sum()
            kept &= mass_above < params.top_p * total
        # 10.1-10.5. top-n-sigma, typical-p, epsilon, eta, XTC on the kept ids
        kept = full_row_filters(z, kept, request)
        z = torch.where(kept, z, torch.full_like(z, NEG_INF))
        # 11. Gumbel argmax, noise keyed by (seed, position, id, stream)
        g = rng.gumbel(request.seed, request.position, torch.arange(vocab_size), request.stream)
        score = torch.where(kept, z + g, torch.full_like(z, NEG_INF))
        token = int(torch.argmax(score))
        final = z
        if mu is not None:  # 13. Mirostat's mu, on the surprise of the token among the kept ids
            mu = mirostat_mu_after(z, kept, token, request)
    # 12. processed values
    if logprobs_mode == "processed_logprobs":
        lp_values = (final.clone(), _log_softmax(final))
    elif logprobs_mode == "processed_logits":
        lp_values = (final.clone(), final.clone())
    return token, valid, lp_values, mu


def reference_sample(logits: torch.Tensor, requests: Sequence[ReferenceRequest], *,
                     vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                     allowed: Sequence[Collection[int] | None] | None = None) -> SamplerOutput:
    """The definition (docs/semantics.md) for a batch: row b of `logits` ([B, Vp]) belongs to `requests[b]`.

    allowed: this step's allowed ids per row (a token bitmask as sets, `bitmask_allowed_ids`), or None.

    Returns a CPU `SamplerOutput`; logprobs follow the same conventions as `Sampler.sample`
    (ranks and the top-N order are taken on the values before rounding to logprobs: value, then id).
    """
    return reference_step(logits, requests, vocab_size=vocab_size, logprobs_mode=logprobs_mode, allowed=allowed)[0]


def reference_step(logits: torch.Tensor, requests: Sequence[ReferenceRequest], *,
                   vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                   allowed: Sequence[Collection[int] | None] | None = None) -> tuple[SamplerOutput, list]:
    """`reference_sample`, and each row's Mirostat mu after its token (None where Mirostat is off):
    the value the next step's `ReferenceRequest.mirostat_mu` takes."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} is invalid: allowed {LOGPROBS_MODES}")
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    step_allowed = [None] * len(requests) if allowed is None else list(allowed)
    rows = [reference_step_row(logits[b], req, vocab, logprobs_mode, step_allowed[b])
            for b, req in enumerate(requests)]
    mus = [row[3] for row in rows]
    tokens = torch.tensor([row[0] for row in rows], dtype=torch.int64)
    valid = torch.tensor([row[1] for row in rows], dtype=torch.bool)
    asked = [req.params.logprobs for req in requests if req.params.logprobs is not None]
    if not asked:
        return SamplerOutput(tokens, valid, None), mus
    width = max(vocab if n == -1 else min(n, vocab) for n in asked)
    batch = len(requests)
    token_lp = torch.zeros(batch, dtype=torch.float32)
    ranks = torch.zeros(batch, dtype=torch.int64)
    top_ids = torch.full((batch, width), -1, dtype=torch.int64)
    top_lp = torch.full((batch, width), NEG_INF, dtype=torch.float32)
    for b, (req, (token, _, (order_key, values), _)) in enumerate(zip(requests, rows)):
        if req.params.logprobs is None:
            continue
        token_lp[b] = values[token]
        ranks[b] = int((order_key >= order_key[token]).sum())
        n = vocab if req.params.logprobs == -1 else min(req.params.logprobs, vocab)
        ids = _top_n(order_key, n)
        top_ids[b, :n] = ids
        top_lp[b, :n] = values[ids]
    return SamplerOutput(tokens, valid, LogprobsOutput(token_lp, ranks, top_ids, top_lp)), mus
