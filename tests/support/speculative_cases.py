"""Shared by the speculative-verification tests (tests/test_speculative.py, tests/engine, tests/triton):
random mixed requests and logits, the plain sampler stepped one position at a time (the expected
output of match mode), and state snapshots."""

from __future__ import annotations

import random

import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.core.constants import NEG_INF


def random_params(rnd: random.Random, vocab: int, *, logprobs: bool = True, mirostat: bool = True) -> SamplingParams:
    """Greedy or sampled rows with every filter, penalties, DRY, Mirostat, bias, allowed ids, min_tokens
    and logprobs."""
    fields: dict = {"seed": rnd.choice([rnd.randrange(2**64), -rnd.randrange(2**63), 0, 7])}
    if rnd.random() < 0.25:
        fields["temperature"] = 0.0
    else:
        fields["temperature"] = rnd.choice([0.3, 0.7, 1.0, 1.5])
        if rnd.random() < 0.5:
            fields["top_k"] = rnd.choice([1, 2, 5, vocab // 2, vocab + 5])
        if rnd.random() < 0.5:
            fields["top_p"] = rnd.choice([0.05, 0.5, 0.9, 0.99])
        if rnd.random() < 0.3:
            fields["min_p"] = rnd.choice([0.01, 0.1, 0.5])
    if rnd.random() < 0.5:
        fields.update(repetition_penalty=rnd.choice([0.8, 1.2, 2.0]), frequency_penalty=rnd.choice([0.0, 0.7, -0.4]),
                      presence_penalty=rnd.choice([0.0, 1.0, -1.5]))
    if rnd.random() < 0.2:
        fields["logit_bias"] = {rnd.randrange(vocab): rnd.choice([-100.0, -2.5, 3.0]) for _ in range(3)}
    if rnd.random() < 0.15:
        fields["allowed_token_ids"] = tuple(rnd.sample(range(vocab), k=min(vocab, 5)))
    if rnd.random() < 0.2:
        fields.update(min_tokens=rnd.randint(1, 4), stop_token_ids=(rnd.randrange(vocab),))
    if logprobs and rnd.random() < 0.4:
        fields["logprobs"] = rnd.choice([0, 1, 3])
    if rnd.random() < 0.3:  # DRY: allowed length 1 fires on short random histories
        fields.update(dry_multiplier=rnd.choice([0.5, 2.0]), dry_base=rnd.choice([1.0, 1.75]),
                      dry_allowed_length=rnd.choice([1, 2]), dry_penalty_last_n=rnd.choice([-1, 6]),
                      dry_sequence_breakers=rnd.choice([(), ((rnd.randrange(vocab),),)]))
    if rnd.random() < 0.3 and mirostat:  # Mirostat: mu moves with every emitted token
        fields.update(mirostat_tau=rnd.choice([0.0, 1.0, 3.0]), mirostat_eta=rnd.choice([0.1, 1.0]))
    return SamplingParams(**fields)


def random_logits(rnd: random.Random, batch: int, positions: int, vocab: int, padded: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[batch, positions, padded]: gaussian or tied rows, some with -inf holes, NaN or +inf; the
    padding columns hold a huge value (a padded id returned cannot go unnoticed)."""
    gen = torch.Generator().manual_seed(rnd.randrange(2**31))
    logits = torch.randn(batch, positions, padded, generator=gen) * rnd.choice([0.5, 2.0, 5.0])
    if rnd.random() < 0.3:
        logits = torch.round(logits * 2) / 2
    for b in range(batch):
        for j in range(positions):
            r = rnd.random()
            if r < 0.05:
                logits[b, j, :vocab] = float("nan")
            elif r < 0.1:
                logits[b, j, rnd.randrange(vocab)] = float("inf")
            elif r < 0.25:
                logits[b, j, torch.randperm(vocab, generator=gen)[: vocab // 2]] = NEG_INF
    logits[:, :, vocab:] = 1e4
    return logits.to(dtype)


def make_sampler(vocab: int, padded: int, params: list[SamplingParams], prompts: list[list[int]],
                 outputs: list[list[int]], slots: list[int], *, max_slots: int, logprobs_mode: str = "raw_logprobs",
                 eos: tuple[int, ...] = (), **kwargs) -> Sampler:
    sampler = Sampler(vocab, max_slots=max_slots, padded_vocab_size=padded, logprobs_mode=logprobs_mode,
                      eos_token_ids=eos, **kwargs)
    for b, slot in enumerate(slots):
        sampler.add_request(slot, params[b], prompts[b], output_token_ids=outputs[b])
    return sampler


def step_plainly(sampler: Sampler, logits: torch.Tensor, slots: list[int], cuts: list[int], rnd: random.Random,
                 vocab: int, width: int) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """Match mode's expected output, by `Sampler.sample` one position at a time.

    Row b's drafts equal the sampled tokens up to `cuts[b]`, then one wrong draft (another id or
    -1), then random ids (never read). Returns (drafts int64 [B, K], tokens int64 [B, K+1] with -1
    after the last emitted token, logprobs as [B, K+1(, width)] tensors or None)."""
    batch, positions = logits.shape[:2]
    k = positions - 1
    drafts = torch.tensor([[rnd.randrange(vocab) for _ in range(k)] for _ in range(batch)], dtype=torch.int64)
    drafts = drafts.reshape(batch, k)
    tokens = torch.full((batch, positions), -1, dtype=torch.int64)
    lp = None
    alive = list(range(batch))
    for j in range(positions):
        if not alive:
            break
        out = sampler.sample(logits[alive, j].contiguous(), [slots[b] for b in alive])
        got = out.token_ids.tolist()
        if out.logprobs is not None:
            if lp is None:
                lp = {"token_logprobs": torch.zeros(batch, positions), "token_ranks": torch.zeros(batch, positions,
                                                                                                   dtype=torch.int64),
                      "top_token_ids": torch.full((batch, positions, width), -1, dtype=torch.int64),
                      "top_logprobs": torch.full((batch, positions, width), NEG_INF)}
            for i, b in enumerate(alive):
                n = out.logprobs.top_token_ids.shape[1]
                lp["token_logprobs"][b, j] = out.logprobs.token_logprobs[i]
                lp["token_ranks"][b, j] = out.logprobs.token_ranks[i]
                lp["top_token_ids"][b, j, :n] = out.logprobs.top_token_ids[i]
                lp["top_logprobs"][b, j, :n] = out.logprobs.top_logprobs[i]
        survivors = []
        for i, b in enumerate(alive):
            tokens[b, j] = got[i]
            if j == k:
                continue
            if j < cuts[b]:
                drafts[b, j] = got[i]
                survivors.append(b)
            else:
                wrong = (got[i] + 1 + rnd.randrange(vocab - 1)) % vocab if vocab > 1 else -1
                drafts[b, j] = rnd.choice([-1, wrong])
                if drafts[b, j] == -1 and rnd.random() < 0.5:
                    drafts[b, j:] = -1  # shorter rows pad with -1
        alive = survivors
    return drafts, tokens, lp


def snapshot(sampler: Sampler) -> list:
    """Every device tensor of the state (cloned: Mirostat's mu included) and the host mirror."""
    st = sampler.state
    return [t.detach().cpu().clone() for t in st.slot_tensors()] + [list(st.params), list(st.seeds)]


def assert_same_state(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), (x, y)
        else:
            assert x == y


def assert_logprobs_equal(got, want: dict | None) -> None:
    assert (got is None) == (want is None)
    if want is None:
        return
    assert torch.equal(got.token_ranks.cpu(), want["token_ranks"])
    assert torch.equal(got.top_token_ids.cpu(), want["top_token_ids"])
    assert torch.allclose(got.token_logprobs.cpu(), want["token_logprobs"], atol=1e-5, rtol=0, equal_nan=True)
    assert torch.allclose(got.top_logprobs.cpu(), want["top_logprobs"], atol=1e-5, rtol=0, equal_nan=True)
