"""The batched oracle: reference.py's definition for a whole batch at once, with the rows' state across steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from tests.support.adversarial.cases import bitmask_bits
from tests.support.adversarial.compare import differing, put_row, take_row
from tests.support.adversarial.menus import NEG_INF, POS_INF
from tokensampler import SamplerOutput, SamplingParams
from tokensampler.core import rng
from tokensampler.core.order import saturate_posinf
from tokensampler.core.output import LogprobsOutput
from tokensampler.reference import (
    ReferenceRequest,
    apply_dry,
    bad_word_ids,
    bitmask_allowed_ids,
    reference_step_row,
)


@dataclass
class OracleRow:
    params: SamplingParams
    seed: int
    position: int
    stream: int
    prompt: list[int]
    outputs: list[int]
    mu: float | None = None  # Mirostat's mu before the row's next token (None: Mirostat off)


def logprob_rows(scores: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor,
                 width: int) -> LogprobsOutput:
    """reference_sample's logprobs fields for rows whose (scores, values) are given: ranks and the
    top-N on the scores (value, then lower id), rows with num -1 padded."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
    inside = torch.arange(width)[None, :] < num[:, None]
    top_ids = torch.where(inside, order, -1)
    top_lp = torch.where(inside, values.gather(1, order), NEG_INF)
    token_scores = scores.gather(1, tokens[:, None])
    asked = num >= 0
    ranks = torch.where(asked, (scores >= token_scores).sum(-1), 0)
    token_lp = torch.where(asked, values.gather(1, tokens[:, None]).squeeze(1), 0.0)
    return LogprobsOutput(token_lp, ranks, top_ids, top_lp)


def _log_softmax_rows(z: torch.Tensor) -> torch.Tensor:
    """reference._log_softmax per row: rows with every id at -inf are returned as they are."""
    out = torch.log_softmax(z, dim=-1)
    empty = torch.isneginf(z).all(dim=-1, keepdim=True)
    return torch.where(empty, z, out)


def _f32(xs: list[float]) -> torch.Tensor:
    """float32 of Python floats as the definition rounds them (through float64)."""
    return torch.tensor(xs, dtype=torch.float64).to(torch.float32)


class Oracle:
    """The definition (reference.py, step by step) for a batch at once, with the rows' state.

    Every elementwise float32 operation is reference_sample_row's, on the same values, so it gives
    the same bits; the float64 top-p masses are summed in reference.py's order only where that
    order cannot matter (every kept p is 0 or a float32 >= 2^(ceil(log2 V) - 30), so the sums are
    exact; or no id's mass lies within 8 (n + 2) 2^-53 total of the border `top_p * total`, more
    than the rounding of any summation order), and rows where it could, or where NaN arises, are
    given to `reference_sample_row` itself. Rows where a kept p below the max equals min_p or a mass equals
    `top_p * total` exactly (where a strict and a loose comparison differ) are also run through
    `reference_sample_row`, and the two must agree. The rows that turn a full-row sampler on
    (`SamplingParams.full_row_fields`: dynamic temperature, top-n-sigma, typical-p, epsilon, eta, XTC,
    Mirostat v2) are given to `reference_step_row` whole; a Mirostat row's mu is the row's state here
    (2 tau at admission, reference.py's update at each recorded token, reset by a re-admission)."""

    def __init__(self, vocab: int, mode: str, eos: Sequence[int]) -> None:
        self.vocab, self.mode, self.eos = vocab, mode, tuple(eos)
        self.rows: dict[int, OracleRow] = {}
        # Mirostat rows of the last step: (token, mu after it) as reference.py gave them, for `record`
        self.mu_after: dict[int, tuple[int, float]] = {}
        bits = max(0, math.ceil(math.log2(vocab)))
        self.exact_floor = 2.0 ** (bits - 30)

    def admit(self, i: int, params: SamplingParams, seed: int, position: int, stream: int, prompt: Sequence[int],
              outputs: Sequence[int]) -> None:
        """Row i's request (a re-admission replaces its state: history, position and Mirostat's mu = 2 tau)."""
        mu = None if params.mirostat_tau is None else 2.0 * params.mirostat_tau
        self.rows[i] = OracleRow(params, seed, position, stream, list(prompt), list(outputs), mu)
        self.mu_after.pop(i, None)

    def freeze(self, n: int) -> None:
        """Per-row tensors of the admitted rows (indices 0..n-1; others neutral)."""
        rows = [self.rows.get(i) for i in range(n)]
        default = SamplingParams()
        ps = [row.params if row is not None else default for row in rows]
        self._freeze_scalars(rows, ps)
        self._freeze_masks(rows, ps)

    def _freeze_scalars(self, rows: list[OracleRow | None], ps: list[SamplingParams]) -> None:
        """One value per row: the parameters (float32 as the definition rounds them) and the noise coordinates."""
        v = self.vocab
        self.temperature = _f32([p.temperature for p in ps])
        self.greedy = torch.tensor([p.greedy for p in ps], dtype=torch.bool)
        self.min_p, self.min_p_on = _f32([p.min_p for p in ps]), torch.tensor([p.min_p > 0 for p in ps])
        self.top_k = torch.tensor([min(p.top_k, v + 1) for p in ps], dtype=torch.int64)
        self.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64)
        self.top_p_on = torch.tensor([p.top_p < 1.0 for p in ps])
        self.repetition = _f32([p.repetition_penalty for p in ps])
        self.frequency = _f32([p.frequency_penalty for p in ps])
        self.presence = _f32([p.presence_penalty for p in ps])
        self.seed = torch.tensor([rng.seed_to_int64(row.seed) if row else 0 for row in rows], dtype=torch.int64)
        self.stream = torch.tensor([row.stream if row else 0 for row in rows], dtype=torch.int64)
        self.position = torch.tensor([row.position if row else 0 for row in rows], dtype=torch.int64)
        self.num_logprobs = torch.tensor([-1 if p.logprobs is None else v if p.logprobs == -1 else min(p.logprobs, v)
                                          for p in ps], dtype=torch.int64)
        self.full_row = torch.tensor([bool(p.full_row_fields) for p in ps], dtype=torch.bool)
        self.min_tokens = torch.tensor([min(p.min_tokens, 2**62) for p in ps], dtype=torch.int64)
        self.out_len = torch.tensor([len(row.outputs) if row else 0 for row in rows], dtype=torch.int64)

    def _freeze_masks(self, rows: list[OracleRow | None], ps: list[SamplingParams]) -> None:
        """[n, V] per row: allowed ids, logit bias, stop ids, prompt ids and output counts."""
        n, v = len(rows), self.vocab
        self.allowed = torch.ones(n, v, dtype=torch.bool)
        self.bias = torch.zeros(n, v, dtype=torch.float32)
        self.has_bias = torch.zeros(n, v, dtype=torch.bool)
        self.stop = torch.zeros(n, v, dtype=torch.bool)
        self.prompt_mask = torch.zeros(n, v, dtype=torch.bool)
        self.counts = torch.zeros(n, v, dtype=torch.float32)
        self.bad_words = {i for i, p in enumerate(ps) if p.bad_words_token_ids}
        self.any_allowed = any(p.allowed_token_ids is not None for p in ps)
        self.any_bias = any(bool(p.logit_bias) for p in ps)
        self.any_stop = any(p.min_tokens > 0 for p in ps)
        for i, (row, p) in enumerate(zip(rows, ps)):
            if row is None:
                continue
            if p.allowed_token_ids is not None:
                self.allowed[i] = False
                self.allowed[i, list(p.allowed_token_ids)] = True
            if p.logit_bias:
                ids = list(p.logit_bias)
                self.bias[i, ids] = _f32(list(p.logit_bias.values()))
                self.has_bias[i, ids] = True
            if p.min_tokens > 0:
                self.stop[i, list(p.stop_token_ids) + list(self.eos)] = True
            if row.prompt:
                self.prompt_mask[i, row.prompt] = True
            for token in row.outputs:
                self.counts[i, token] += 1

    def request(self, i: int) -> ReferenceRequest:
        row = self.rows[i]
        return ReferenceRequest(row.params, row.seed, int(self.position[i]), row.prompt, list(row.outputs),
                                row.stream, self.eos, row.mu)

    def step(self, logits: torch.Tensor, idx: list[int], bitmask: torch.Tensor | None,
             check: set[int]) -> tuple[SamplerOutput, torch.Tensor, set[int], list[int]]:
        """The definition for rows idx (logits [B, Vp]). Returns (output, removed [B, V] (NaN, -inf and
        step 3 removals: ids a valid row must never return), rows also run through reference.py (given
        to it, the share `check`, and those at a min-p or top-p bound), rows where reference.py and the
        batched form disagree)."""
        ix = torch.tensor(idx, dtype=torch.int64)
        z = logits[:, :self.vocab].to(torch.float32).clone()
        z[torch.isnan(z)] = NEG_INF
        raw = saturate_posinf(z.clone())
        self.raw = raw
        self.border: dict[int, tuple[torch.Tensor, ...]] = {}
        step_bits = None if bitmask is None else bitmask_bits(bitmask, self.vocab)
        removed = self._removed(z, idx, ix, step_bits)
        z, kept, valid, nan_rows = self._processed(z.masked_fill(removed, NEG_INF), ix, idx)
        tokens = torch.zeros(len(idx), dtype=torch.int64)
        self.edge = torch.zeros(len(idx), dtype=torch.bool)  # rows with a p or a mass exactly at a bound
        tokens[~valid] = raw[~valid].argmax(-1)
        greedy = self.greedy[ix]
        g = (valid & greedy).nonzero().squeeze(1)
        tokens[g] = z[g].argmax(-1)
        inexact = torch.zeros(len(idx), dtype=torch.bool)
        s = (valid & ~greedy & ~nan_rows).nonzero().squeeze(1)
        if s.numel():
            self._sample_rows(z, kept, tokens, inexact, ix, s)
        out = SamplerOutput(tokens, valid, self._logprobs(raw, z, tokens, ix))
        # the rows of a full-row sampler (steps 7, 10.1-10.6; Mirostat's mu): reference.py's, row by row
        full = self.full_row[ix]
        for b in full.nonzero().squeeze(1).tolist():
            self.border.pop(b, None)
        self.mu_after = {}
        given = set((nan_rows | inexact | full).nonzero().squeeze(1).tolist())
        edge = set(self.edge.nonzero().squeeze(1).tolist())
        disagree = []
        for b in sorted(given | check | edge):
            want = self.reference_row(logits[b], idx[b], None if step_bits is None else bitmask[b:b + 1],
                                      None if out.logprobs is None else int(out.logprobs.top_token_ids.shape[1]))
            if b in given:
                put_row(out, b, want)
            elif differing(take_row(out, b), want)[0].any():
                disagree.append(b)
        return out, removed, given | check | edge, disagree

    def _removed(self, z: torch.Tensor, idx: list[int], ix: torch.Tensor,
                 step_bits: torch.Tensor | None) -> torch.Tensor:
        """Steps 1 and 3: bool [B, V], the ids removed (NaN and -inf, not allowed, not in the step's
        bitmask, bad words, stop and EOS ids below min_tokens)."""
        removed = torch.isneginf(z) | ~self.allowed[ix] if self.any_allowed else torch.isneginf(z)
        if step_bits is not None:
            removed |= ~step_bits
        for b, i in enumerate(idx):
            if i in self.bad_words:
                banned = bad_word_ids(self.rows[i].params, self.rows[i].outputs)
                if banned:
                    removed[b, list(banned)] = True
        if self.any_stop:
            below = self.out_len[ix] < self.min_tokens[ix]
            removed |= self.stop[ix] & below[:, None]
        return removed

    def _processed(self, z: torch.Tensor, ix: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, ...]:
        """Steps 4-7 on z (removed ids at -inf): logit bias, penalties, DRY (reference.py's own, row
        by row: few rows have it), temperature. Returns (z, kept [B, V], valid [B], rows where NaN arose)."""
        if self.any_bias:
            z = torch.where(self.has_bias[ix], z + self.bias[ix], z)
        counts = self.counts[ix]
        seen = (counts > 0) | self.prompt_mask[ix]
        r = self.repetition[ix][:, None]
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
        z = z - self.frequency[ix][:, None] * counts
        z = z - self.presence[ix][:, None] * (counts > 0).to(torch.float32)
        for b, i in enumerate(idx):
            row = self.rows[i]
            if row.params.dry:
                z[b] = apply_dry(z[b], row.params, [*row.prompt, *row.outputs])
        nan_rows = torch.isnan(z).any(-1)
        z = saturate_posinf(z)
        kept = ~torch.isneginf(z)
        valid = kept.any(-1)
        s = (valid & ~self.greedy[ix]).nonzero().squeeze(1)
        if s.numel():
            zs = saturate_posinf(z[s] / self.temperature[ix[s]][:, None])
            nan_rows[s] |= torch.isnan(zs).any(-1)
            z[s] = zs
            kept[s] = ~torch.isneginf(zs)
            valid[s] = kept[s].any(-1)
        return z, kept, valid, nan_rows

    def _logprobs(self, raw: torch.Tensor, final: torch.Tensor, tokens: torch.Tensor,
                  ix: torch.Tensor) -> LogprobsOutput | None:
        """Steps 2 and 12: the logprobs fields of the batch (None: no row asks for them)."""
        num = self.num_logprobs[ix]
        if not bool((num >= 0).any()):
            return None
        scores = raw if self.mode.startswith("raw") else final
        values = _log_softmax_rows(scores) if self.mode.endswith("logprobs") else scores
        return logprob_rows(scores, values, tokens, num, int(num.max()))

    def _sample_rows(self, z: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor, inexact: torch.Tensor,
                     ix: torch.Tensor, s: torch.Tensor) -> None:
        """Steps 8-11 for the sampled rows s (z and kept are edited in place)."""
        v = self.vocab
        zs, ks = z[s], kept[s]
        rows = ix[s]
        edge = torch.zeros(len(s), dtype=torch.bool)
        p = torch.exp(zs - zs.amax(-1, keepdim=True))
        on = self.min_p_on[rows]
        if bool(on.any()):
            edge = on & (ks & (p == self.min_p[rows][:, None]) & (p < 1)).any(-1)  # below the max
            ks &= ~on[:, None] | (p >= self.min_p[rows][:, None])
        k = self.top_k[rows]
        if bool((k > 0).any()):  # kept ids with a strictly larger z: V - #(values <= z), exact
            ordered = torch.sort(torch.where(ks, zs, NEG_INF), dim=-1).values
            above = v - torch.searchsorted(ordered, zs.contiguous(), right=True)
            ks &= (k[:, None] <= 0) | (above < k[:, None])
        if bool(self.top_p_on[rows].any()):
            ks, at_border = self._top_p(zs, ks, p, rows, s, inexact)
            edge |= at_border
        zs = torch.where(ks, zs, NEG_INF)
        noise = rng.gumbel(self.seed[rows][:, None], self.position[rows][:, None], torch.arange(v)[None, :],
                           self.stream[rows][:, None])
        score = torch.where(ks, zs + noise, NEG_INF)
        tokens[s] = score.argmax(-1)
        z[s] = zs
        kept[s] = ks
        self.edge[s] = edge

    def _top_p(self, zs: torch.Tensor, ks: torch.Tensor, p: torch.Tensor, rows: torch.Tensor, s: torch.Tensor,
               inexact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 10 on the sampled rows s (oracle rows `rows`) with top-p < 1: the ids whose float64 mass
        above them reaches `top_p * total` are removed. Rows where summation order could decide are
        marked `inexact` (their candidates kept for `border_outputs`). Returns (kept ids, rows with a
        mass exactly at the border)."""
        on = self.top_p_on[rows]
        p64 = torch.where(ks, p, 0.0).to(torch.float64)
        # sums in any order are exact when every kept p is 0 or >= exact_floor; else the order
        # matters only for an id whose mass is within the rounding error bound of the border
        exact = ~(ks & (p > 0) & (p < self.exact_floor)).any(-1)
        n_kept = ks.sum(-1, keepdim=True).to(torch.float64)
        ordered, order = torch.sort(torch.where(ks, zs, NEG_INF), dim=-1)
        # the float64 mass of the ids above each sorted position, summed from the largest down
        suffix = torch.flip(torch.cumsum(torch.flip(p64.gather(1, order), [1]), dim=1), [1])
        suffix = torch.cat([suffix, torch.zeros(suffix.shape[0], 1, dtype=torch.float64)], dim=1)
        mass = suffix.gather(1, torch.searchsorted(ordered, zs.contiguous(), right=True))
        total = suffix[:, :1]
        border = self.top_p[rows][:, None] * total
        margin = 8 * (n_kept + 2) * 2.0**-53 * total
        near = ks & (mass != 0) & ((mass - border).abs() <= margin)
        ambiguous = on & ~exact & near.any(-1)
        inexact[s] = ambiguous
        for j in ambiguous.nonzero().squeeze(1).tolist():  # kept for `border_outputs`
            self.border[int(s[j])] = (zs[j].clone(), ks[j].clone(), near[j].clone(), (mass[j] < border[j]).clone(),
                                      int(rows[j]))
        return ks & (~on[:, None] | (mass < border)), on & (ks & (mass == border)).any(-1)

    def border_outputs(self, b: int, width: int | None) -> list[SamplerOutput]:
        """Row b of the last step with each kept set the definition allows where top-p masses lie
        within float64 rounding of the border (docs/cpu-fast-path.md, "Float64 sums"): the ids
        whose mass is that close may be kept or not, as a prefix in value order; [] if none."""
        if b not in self.border:
            return []
        zs, before, near, below, i = self.border[b]
        certain = before & ~near & below
        noise = rng.gumbel(self.seed[i], self.position[i], torch.arange(self.vocab), self.stream[i])
        outs = []
        for cut in [POS_INF] + sorted(set(zs[near].tolist()), reverse=True):
            kept = certain | (near & (zs >= cut))
            if not bool(kept.any()):
                continue
            token = torch.where(kept, zs + noise, NEG_INF).argmax()[None]
            final = torch.where(kept, zs, NEG_INF)[None]
            lp = None
            if width is not None:
                scores = self.raw[b:b + 1] if self.mode.startswith("raw") else final
                values = _log_softmax_rows(scores) if self.mode.endswith("logprobs") else scores
                lp = logprob_rows(scores, values, token, self.num_logprobs[i:i + 1], width)
            outs.append(SamplerOutput(token, torch.tensor([True]), lp))
        return outs

    def reference_row(self, logits_row: torch.Tensor, i: int, bitmask_row: torch.Tensor | None,
                      width: int | None) -> SamplerOutput:
        """reference_step_row for one row, as a one-row output with logprobs of width `width`
        (None: the batch has no logprobs); a Mirostat row's mu after its token is kept for `record`."""
        allowed = None if bitmask_row is None else bitmask_allowed_ids(bitmask_row, self.vocab)[0]
        token, valid, lp, mu = reference_step_row(logits_row, self.request(i), self.vocab, self.mode, allowed)
        if mu is not None:
            self.mu_after[i] = (token, mu)
        tokens = torch.tensor([token])
        out_lp = None
        if width is not None:
            scores, values = lp
            out_lp = logprob_rows(scores[None], values[None], tokens, self.num_logprobs[i:i + 1], width)
        return SamplerOutput(tokens, torch.tensor([valid]), out_lp)

    def record(self, idx: list[int], tokens: torch.Tensor, record: list[bool] | None) -> None:
        """Step 13: count the tokens of the recorded rows, advance their positions, update Mirostat's mu."""
        keep = range(len(idx)) if record is None else [b for b in range(len(idx)) if record[b]]
        rows = [idx[b] for b in keep]
        if not rows:
            return
        ix = torch.tensor(rows, dtype=torch.int64)
        tok = tokens[list(keep)]
        self.counts.index_put_((ix, tok), torch.ones(len(rows)), accumulate=True)
        self.out_len[ix] += 1
        self.position[ix] += 1
        for i, t in zip(rows, tok.tolist()):
            self.rows[i].outputs.append(t)
            if i in self.mu_after:
                token, mu = self.mu_after[i]
                if token != t:  # the rows of a full-row sampler keep reference.py's token (no top-p border)
                    raise AssertionError(f"row {i}: Mirostat's mu is that of token {token}, {t} recorded")
                self.rows[i].mu = mu

