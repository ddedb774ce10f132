"""Straightforward numpy transcriptions of samplers tokensampler does not define yet, and the
reference's kept set for those it does: what tests/integrations/test_llama_cpp_samplers.py compares
llama.cpp's samplers with.

Every function takes one float32 logits row `z` (`-inf` = removed) at temperature 1 and returns a
boolean keep mask or the edited row (one function per sampler). reference.py now defines
top-n-sigma, typical-p, dynamic temperature and XTC (docs/semantics.md, steps 7 and 10.1-10.5): the
tests compare llama.cpp with reference.py there and check these transcriptions equal to it; Mirostat
v2 and DRY are compared with the transcriptions there, and reference.py with the transcriptions in
CI (tests/test_mirostat.py, tests/test_dry.py). The definitions:

- top-n-sigma: keep ids with `z >= max - n * sigma`, sigma the population std of the finite logits;
- typical-p: order the ids by `|-log q_i - H|` (q the softmax, H its entropy), keep the smallest
  prefix with mass `>= p`;
- dynamic temperature: `T = T_min + (T_max - T_min) * (H / H_max) ** exponent`, `H_max = log n` over
  the n candidates, then `z / T`;
- XTC: if at least 2 ids have `q >= threshold`, remove all but the least probable of them (the
  coin with probability `p` is the caller's: these functions are the removal);
- Mirostat v2: keep the ids with surprise `-log2 q <= mu` (at least the most probable), renormalise;
  then `mu -= eta * (surprise(chosen) - tau)`, the chosen id's surprise taken on the renormalised q;
- DRY: llama.cpp's (docs/llama-cpp.md), with single-token sequence breakers.

Probabilities are computed in float64 here; llama.cpp computes them in float32, so a test compares
kept sets away from exact borders and edited logits to a stated tolerance.
"""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np
import torch

from tokensampler.core.params import SamplingParams
from tokensampler.reference import ReferenceRequest, reference_sample_row


def softmax64(z: np.ndarray) -> np.ndarray:
    """float64 softmax of the finite ids (0 for -inf ids)."""
    z = np.asarray(z, dtype=np.float64)
    finite = z > -np.inf
    q = np.zeros_like(z)
    q[finite] = np.exp(z[finite] - z[finite].max())
    return q / q.sum()


# --- tokensampler's samplers: the reference's kept set ---------------------------------------------------

def reference_processed(z: np.ndarray, params: SamplingParams, prompt: Sequence[int] = (),
                        output: Sequence[int] = ()) -> np.ndarray:
    """reference.py's processed logits of one row ([V] float32): after penalties and temperature, `-inf`
    for every id the filters removed (docs/semantics.md, step 12, `logprobs_mode="processed_logits"`)."""
    row = torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32))
    request = ReferenceRequest(params, seed=0, position=len(prompt) + len(output),
                               prompt_token_ids=list(prompt), output_token_ids=list(output))
    _, _, (_, values) = reference_sample_row(row, request, row.numel(), "processed_logits")
    return values.numpy()


def reference_kept(z: np.ndarray, params: SamplingParams, prompt: Sequence[int] = (),
                   output: Sequence[int] = ()) -> set[int]:
    """The ids reference.py keeps for one row (those it may sample)."""
    return {int(i) for i in np.flatnonzero(reference_processed(z, params, prompt, output) > -np.inf)}


def reference_token(z: np.ndarray, params: SamplingParams) -> int:
    """The token reference.py returns for one row (seed 0, position 0)."""
    row = torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32))
    return reference_sample_row(row, ReferenceRequest(params, seed=0, position=0), row.numel())[0]


# --- samplers tokensampler does not define yet: the definitions ------------------------------

def top_n_sigma_keep(z: np.ndarray, n: float) -> np.ndarray:
    finite = z > -np.inf
    values = z[finite].astype(np.float64)
    return finite & (z >= values.max() - n * values.std())


def typical_keep(z: np.ndarray, p: float) -> np.ndarray:
    q = softmax64(z)
    finite = q > 0
    entropy = -(q[finite] * np.log(q[finite])).sum()
    score = np.full(z.shape, np.inf)
    score[finite] = np.abs(-np.log(q[finite]) - entropy)
    order = np.argsort(score, kind="stable")
    mass = np.cumsum(q[order])
    count = min(int(np.searchsorted(mass, p, side="left")) + 1, int(finite.sum()))  # first prefix with mass >= p
    keep = np.zeros(z.shape, dtype=bool)
    keep[order[:count]] = True
    return keep


def dynamic_temperature(z: np.ndarray, temperature: float, delta: float, exponent: float) -> tuple[float, np.ndarray]:
    """(T, z / T) with T = T_min + (T_max - T_min) (H / log n)^exponent over the n finite ids."""
    q = softmax64(z)
    finite = q > 0
    entropy = -(q[finite] * np.log(q[finite])).sum()
    t_min, t_max = max(0.0, temperature - delta), temperature + delta
    t = t_min + (t_max - t_min) * (entropy / np.log(finite.sum())) ** exponent
    return t, (z / np.float32(t)).astype(np.float32)


def xtc_keep(z: np.ndarray, threshold: float) -> np.ndarray:
    q = softmax64(z)
    keep = q > 0
    above = np.flatnonzero(q >= threshold)
    if above.size >= 2:
        least = above[np.argmin(q[above])]
        keep[above[above != least]] = False
    return keep


def mirostat_v2_keep(z: np.ndarray, mu: float) -> np.ndarray:
    q = softmax64(z)
    keep = (q > 0) & (-np.log2(np.where(q > 0, q, 1.0)) <= mu)
    if not keep.any():
        keep[int(np.argmax(q))] = True
    return keep


def mirostat_v2_mu(z: np.ndarray, mu: float, tau: float, eta: float, chosen: int) -> float:
    """mu after choosing `chosen`: its surprise taken on q renormalised over the kept ids."""
    keep = mirostat_v2_keep(z, mu)
    q = softmax64(np.where(keep, z, -np.inf))
    return mu - eta * (-np.log2(q[chosen]) - tau)


def dry_penalised(z: np.ndarray, history: Sequence[int], multiplier: float, base: float, allowed_length: int,
                  last_n: int, breakers: Collection[int]) -> np.ndarray:
    """DRY (llama.cpp's, from koboldcpp): an id that would extend a repetition of the context's
    suffix of length n >= allowed_length loses multiplier * base^(n - allowed_length), n the longest
    such repetition; a sequence breaker (single token) ends every repetition and is never penalised.
    Quadratic, one suffix at a time: the definition, not llama.cpp's Z-algorithm."""
    tokens = list(history)[-last_n:]
    size = len(tokens)
    out = np.asarray(z, dtype=np.float32).copy()
    if size <= allowed_length:
        return out
    # the most recent breaker limits how far back a repetition may reach
    rep_limit = next((i for i in range(size) if tokens[size - 1 - i] in breakers), size)
    if rep_limit < allowed_length:
        return out
    longest: dict[int, int] = {}
    for end in range(size - 1):  # tokens[..end] ends like the whole context; tokens[end + 1] would extend it
        n = 0
        while n <= end and tokens[end - n] == tokens[size - 1 - n]:
            n += 1
        n = min(n, rep_limit)
        if n >= allowed_length:
            following = tokens[end + 1]
            longest[following] = max(longest.get(following, 0), n)
    base32, multiplier32 = np.float32(base), np.float32(multiplier)
    max_exponent = int(np.float32(88.7228391) / np.log(base32)) if base32 > np.float32(1.000001) else 0
    for token, n in longest.items():
        if token in breakers:
            continue
        exponent = n - allowed_length
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        penalty = np.float32(float(multiplier32) * float(base32) ** exponent)
        out[token] = np.float32(out[token] - penalty)
    return out
