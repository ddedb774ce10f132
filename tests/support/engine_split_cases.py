"""Shared by tests/engine/test_generator_distributed.py: one engine schedule driven through a
vocabulary-split `SamplingGenerator` (each rank passes its logits slice) and through an unsplit one
(the concatenated logits), and the gloo worker that runs it in forked ranks.

The schedule reuses `support.engine.Engine`, which checks after every step that each live
request's token equals a fresh unsplit `Sampler`'s; here the split generator's tokens and log-probs
must also equal the unsplit generator's at every step. Kept out of the test module so forked
workers import it without pytest.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import torch

from tests.support.engine import EOS, Engine
from tests.support.split_cases import compare
from tokensampler import SamplerOutput, SamplingGenerator, SamplingParams, StaleSamplingState

# world -> (V, Vp, logprobs mode): a padded tail inside the last rank (61 of 64 over 2 ranks), and
# one spanning two ranks (30 of 48 over 3: rank 1 holds 14 ids + 2 padding, rank 2 only padding).
CONFIGS = {2: [(61, 64, "processed_logprobs")], 3: [(30, 48, "raw_logprobs")]}
MAX_BATCH_SIZE = 3
SAMPLING_DP = 2


class SliceView:
    """A split generator seen as a whole-vocabulary one: `sample` passes this rank's slice of the
    full logits; everything else is the generator's."""

    def __init__(self, gen: SamplingGenerator, rank: int, world: int) -> None:
        self.gen, self.rank, self.world = gen, rank, world

    def sample(self, logits: torch.Tensor, **kwargs: Any):
        width = logits.shape[1] // self.world
        return self.gen.sample(logits[:, self.rank * width:(self.rank + 1) * width], **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gen, name)


def random_params(r: random.Random, vocab: int, edges: list[int]) -> SamplingParams:
    """Random parameters; token-id fields use ids at rank edges (`edges`) and the last real id."""
    kwargs: dict[str, Any] = {
        "temperature": r.choice([0.0, 0.0, 0.5, 1.0, 1.7]), "top_k": r.choice([0, 0, 1, 3, 10]),
        "top_p": r.choice([1.0, 1.0, 0.5, 0.9]), "min_p": r.choice([0.0, 0.0, 0.1]),
        "presence_penalty": r.choice([0.0, 0.0, 1.5, -0.5]), "frequency_penalty": r.choice([0.0, 0.0, 0.8]),
        "repetition_penalty": r.choice([1.0, 1.0, 1.4, 0.7]),
        "seed": r.choice([None, r.randrange(-2**63, 2**64)]), "logprobs": r.choice([None, None, 0, 2, 5])}
    if r.random() < 0.35:
        kwargs.update(min_tokens=r.randint(1, 3), stop_token_ids=(r.choice(edges), vocab - 1))
    if r.random() < 0.25:
        kwargs["allowed_token_ids"] = tuple(sorted({*r.sample(range(vocab), 4), *edges, vocab - 1, *EOS}))
    if r.random() < 0.3:
        kwargs["logit_bias"] = {r.choice(edges): r.choice([-100.0, 4.0]), vocab - 1: 3.0,
                                r.randrange(vocab): r.uniform(-2, 2)}
    if r.random() < 0.3:  # DRY's penalised ids fall on every rank
        kwargs.update(dry_multiplier=r.choice([0.5, 2.0]), dry_allowed_length=r.choice([1, 2]),
                      dry_sequence_breakers=r.choice([(), ((r.choice(edges),),)]))
    if r.random() < 0.4:  # the full-row samplers (the split gathers these rows whole), Mirostat's mu carried
        kwargs.update(r.choice([{"dynatemp_range": 0.5, "dynatemp_exponent": r.choice([0.5, 1.0])},
                                {"top_n_sigma": r.choice([0.0, 1.0])}, {"typical_p": r.choice([0.5, 0.9])},
                                {"epsilon_cutoff": 0.02, "eta_cutoff": r.choice([0.0, 0.05])},
                                {"xtc_probability": r.choice([0.5, 1.0]), "xtc_threshold": 0.1},
                                {"mirostat_tau": r.choice([0.5, 3.0]), "mirostat_eta": r.choice([0.1, 1.0])}]))
    return SamplingParams(**kwargs)


def _copy(out: SamplerOutput) -> SamplerOutput:
    return dataclasses.replace(out, token_ids=out.token_ids.clone(), valid=out.valid.clone(),
                               logprobs=None if out.logprobs is None else dataclasses.replace(
                                   out.logprobs, **{f.name: getattr(out.logprobs, f.name).clone()
                                                    for f in dataclasses.fields(out.logprobs)}))


def run_schedule(engine: Engine, seed: int, actions: int) -> tuple[list[SamplerOutput], dict[str, int]]:
    """A random engine schedule from `seed` (the same actions wherever the tokens are the same):
    admissions with and without a prefill sample (a partial prefill, also while other slots are
    stale), finishes with and without release, condensing and arbitrary remaps in device and host
    mode, host decodes, rebuilds, parameter changes and traced steps. Returns every device step's
    output and how often each action ran."""
    r = random.Random(seed)
    vocab, world_edges = engine.vocab_size, [0, engine.vocab_size - 1]
    for w in (2, 3):
        width = engine.padded // w
        world_edges += [min(width * k + d, vocab - 1) for k in range(1, w) for d in (-1, 0)]
    outputs: list[SamplerOutput] = []
    counts: dict[str, int] = {}
    buffer = engine.logits()  # the one logits tensor traced steps read
    state = {"dirty": False, "host_remap": False}

    def note(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    def admit(prefill: bool) -> None:
        free = engine.free_slots()
        if not free:  # every slot held: nothing to admit this time
            return
        slots = r.sample(free, r.randint(1, min(3, len(free))))
        entries = [(s, random_params(r, vocab, world_edges), [r.randrange(vocab) for _ in range(r.randint(0, 5))])
                   for s in slots]
        engine.admit(entries, streams=r.choice([None, [r.randint(0, 3) for _ in slots]]))
        note("admit")
        if prefill:
            engine.prefill_sample(slots)
            outputs.append(_copy(engine.gen.last_output))
            note("partial_prefill_while_stale" if engine.needs_rebuild else "partial_prefill")

    def decode(mode: str, reload: bool = False, reset: bool = False, send_prompts: bool = True,
               send_positions: bool = False, trace: bool = False) -> None:
        if mode == "host" and engine.pending_remap is not None:
            state["host_remap"] = True
            note("host_remap")
        elif engine.pending_remap is not None:
            note("device_remap")
        if mode == "device" and engine.needs_rebuild:
            send_prompts = send_prompts or state["host_remap"]
            note("rebuild")
        reload = reload or state["dirty"]
        logits = None
        if trace and mode == "device":
            buffer.copy_(engine.logits())
            logits = buffer
            note("traced")
        engine.decode(mode, reload=reload, reset=reset, send_prompts=send_prompts, send_positions=send_positions,
                      enable_trace=trace, logits=logits)
        note(f"{mode}_decode")
        state["dirty"] = False
        if mode == "device":
            state["host_remap"] = False
            outputs.append(_copy(engine.gen.last_output))

    def refuse() -> None:
        try:
            engine.gen.apply_decode_state(engine.chunks(), reload_sampling_params=True,
                                          reset_sampling_state=False, slot_remap=engine.pending_remap)
        except StaleSamplingState:
            note("refused")
        else:
            raise AssertionError("a stale device state was accepted without the full rebuild")

    # a fixed opening that covers every kind of step once, then random actions
    admit(prefill=True)
    admit(prefill=False)
    decode("device")
    engine.condense()
    decode("device")
    engine.remap(list(reversed(range(engine.n))))
    decode("host")
    refuse()
    admit(prefill=True)  # partial prefill while the rest is stale
    decode("device", send_positions=True)
    for _ in range(actions):
        action = r.choice(["admit", "finish", "remap", "retune", "decode", "steady", "steady", "refused"])
        if action == "admit" and engine.free_slots() and engine.pending_remap is None:
            admit(prefill=r.random() < 0.5)
        elif action == "finish" and engine.live_slots():
            engine.finish(r.choice(engine.live_slots()), release=r.random() < 0.5)
            note("finish")
        elif action == "remap" and engine.pending_remap is None:
            engine.condense() if r.random() < 0.5 else engine.remap(r.sample(range(engine.n), engine.n))
        elif action == "retune" and engine.live_slots():
            slot = r.choice(engine.live_slots())
            request = engine.slots[slot]
            new = dataclasses.replace(random_params(r, vocab, world_edges), seed=request.params.seed)
            engine.retune(slot, new)  # (Mirostat's mu restarts when the new params are sent)
            state["dirty"] = True
            note("retune")
        elif action == "decode":
            decode(r.choice(["device", "device", "host"]), r.random() < 0.5, r.random() < 0.5, r.random() < 0.5,
                   r.random() < 0.5, r.random() < 0.3)
        elif action == "refused" and engine.needs_rebuild:
            refuse()
        else:
            decode("device", trace=r.random() < 0.3)
    return outputs, counts


def make_generator(vocab: int, padded: int, mode: str, group: Any = None, seed_source: Any = None,
                   ) -> SamplingGenerator:
    return SamplingGenerator(vocab, max_batch_size=MAX_BATCH_SIZE, sampling_dp=SAMPLING_DP, padded_vocab_size=padded,
                             device="cpu", group=group, logprobs_mode=mode, eos_token_ids=EOS,
                             seed_source=seed_source)


def seeded_source(seed: int):
    return functools.partial(random.Random(seed).getrandbits, 63)


def check_schedule(group: Any, rank: int, world: int, vocab: int, padded: int, mode: str, seed: int,
                   actions: int) -> tuple[list[str], list[list[int]], dict[str, int]]:
    """The schedule on a split generator (this rank's view) and on an unsplit one, same seeds:
    (differences as text, the split run's tokens per step, action counts)."""
    split_gen = make_generator(vocab, padded, mode, group, seeded_source(seed))
    split_out, counts = run_schedule(Engine(vocab, padded_vocab_size=padded, seed=seed, batched_check=True,
                                            generator=SliceView(split_gen, rank, world)), seed, actions)
    whole_out, _ = run_schedule(Engine(vocab, padded_vocab_size=padded, seed=seed, batched_check=True,
                                       generator=make_generator(vocab, padded, mode, None, seeded_source(seed))),
                                seed, actions)
    bad = [] if len(split_out) == len(whole_out) else [f"{len(split_out)} device steps != {len(whole_out)}"]
    for t, (got, want) in enumerate(zip(split_out, whole_out)):
        bad += compare(f"world {world} V{vocab}/{padded} {mode} seed {seed} step {t}", got, want)
    return bad, [o.token_ids.tolist() for o in split_out], counts


def default_seed_schedule(group: Any, rank: int, world: int, vocab: int, padded: int, seed: int,
                          actions: int) -> tuple[list[list[int]], list[int]]:
    """The schedule with the default seed source (drawn on rank 0, shared): the engine's own checks
    hold on every rank; returns the tokens per step and the seeds drawn, to compare across ranks."""
    gen = make_generator(vocab, padded, "raw_logprobs", group)
    engine = Engine(vocab, padded_vocab_size=padded, seed=seed, batched_check=True,
                    generator=SliceView(gen, rank, world))
    outs, _ = run_schedule(engine, seed, actions)
    return [o.token_ids.tolist() for o in outs], [gen.seed_of(s) for s in gen.occupied_slots()]


# ------------------------------------------------------------------ a forked gloo rank
def gloo_worker(rank: int, world: int, init_file: str, out_dir: str, jobs: list[tuple]) -> None:
    """One rank of a forked gloo world; the groups of ranks [0, n) are real process groups of size n.
    Each job ("schedule" | "default_seeds", n, ...) runs on the ranks of its group, in list order.
    Writes {failures, tokens, counts, crash} as JSON, then leaves at once."""
    import datetime
    import json
    import os
    import traceback

    torch.set_num_threads(1)
    dist = torch.distributed
    report: dict[str, Any] = {"failures": [], "results": [], "crash": None}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}
        for job in jobs:
            kind, size = job[0], job[1]
            if rank >= size:
                continue
            if kind == "schedule":
                _, _, vocab, padded, mode, seed, actions = job
                bad, tokens, counts = check_schedule(groups[size], rank, size, vocab, padded, mode, seed, actions)
                report["failures"] += bad
                report["results"].append({"job": list(job), "tokens": tokens, "counts": counts})
            elif kind == "default_seeds":
                _, _, vocab, padded, seed, actions = job
                tokens, seeds = default_seed_schedule(groups[size], rank, size, vocab, padded, seed, actions)
                report["results"].append({"job": list(job), "tokens": tokens, "seeds": seeds})
    except Exception:  # noqa: BLE001 - reported to the parent
        report["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    os._exit(0)  # skip interpreter teardown
