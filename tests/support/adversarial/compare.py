"""Comparing two `SamplerOutput`s row by row: ids, ranks and validity exactly, logprob values within the tolerance."""

from __future__ import annotations

import torch

from tests.support.adversarial.findings import short
from tokensampler import SamplerOutput
from tokensampler.core.output import LogprobsOutput

# the logprob values' tolerance (docs/semantics.md): ids, ranks, tokens and validity are exact
LOGPROB_ATOL = LOGPROB_RTOL = 1e-6


def take_row(out: SamplerOutput, b: int) -> SamplerOutput:
    """Row b of `out` as a one-row output (views)."""
    lp = out.logprobs
    if lp is not None:
        lp = LogprobsOutput(lp.token_logprobs[b:b + 1], lp.token_ranks[b:b + 1], lp.top_token_ids[b:b + 1],
                            lp.top_logprobs[b:b + 1])
    return SamplerOutput(out.token_ids[b:b + 1], out.valid[b:b + 1], lp)


def put_row(out: SamplerOutput, b: int, row: SamplerOutput) -> None:
    """Write the one-row output `row` into row b of `out`."""
    out.token_ids[b] = row.token_ids[0]
    out.valid[b] = row.valid[0]
    if out.logprobs is not None and row.logprobs is not None:
        for name in ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
            getattr(out.logprobs, name)[b] = getattr(row.logprobs, name)[0]


def _values_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: infinities (and NaN) must be equal, finite values within the logprob tolerance."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    far = (a64 - b64).abs() > LOGPROB_ATOL + LOGPROB_RTOL * b64.abs()
    return torch.where(finite, far, ~(a64 == b64))


def differing(got: SamplerOutput, want: SamplerOutput) -> tuple[torch.Tensor, str]:
    """bool [B]: rows where `got` differs from `want` (tokens, validity, logprob ids and ranks exactly,
    logprob values within the tolerance), and what differs in the first of them."""
    tokens, valid = got.token_ids.cpu(), got.valid.cpu()
    bad = (tokens != want.token_ids) | (valid != want.valid)
    what = ["token/valid"]
    if (got.logprobs is None) != (want.logprobs is None):
        return torch.ones_like(bad), "logprobs present in one output only"
    if want.logprobs is not None:
        g, w = got.logprobs, want.logprobs
        if tuple(g.top_token_ids.shape) != tuple(w.top_token_ids.shape):
            return torch.ones_like(bad), f"top-N shape {tuple(g.top_token_ids.shape)} != {tuple(w.top_token_ids.shape)}"
        parts = {"token_ranks": g.token_ranks.cpu() != w.token_ranks,
                 "top_token_ids": (g.top_token_ids.cpu() != w.top_token_ids).any(-1),
                 "token_logprobs": _values_differ(g.token_logprobs.cpu(), w.token_logprobs),
                 "top_logprobs": _values_differ(g.top_logprobs.cpu(), w.top_logprobs).any(-1)}
        for name, rows in parts.items():
            bad |= rows
            if bool(rows.any()):
                what.append(name)
    return bad, ",".join(what)


def row_text(out: SamplerOutput, b: int) -> str:
    """Row b of `out` as text, for a finding."""
    text = f"token {int(out.token_ids[b])} valid {bool(out.valid[b])}"
    if out.logprobs is not None:
        lp = out.logprobs
        text += (f" lp {float(lp.token_logprobs[b]):.7g} rank {int(lp.token_ranks[b])} top "
                 f"{short(lp.top_token_ids[b].tolist(), 120)} {short(lp.top_logprobs[b].tolist(), 200)}")
    return text

