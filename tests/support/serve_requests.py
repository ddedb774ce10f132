"""The seeded generator of OpenAI requests of the server-level fault campaign (benchmarks/serve_campaign.py).

`generate(count, seed, vocabulary)` draws `count` requests, a pure function of its arguments, valid
and invalid, over the kinds of `KINDS`: every sampling field at and beyond its bounds, invalid
types, huge `n`, `logprobs` 20 and -1, `prompt_logprobs`, `logit_bias` with out-of-range ids and
+-100, `allowed_token_ids` with `bad_words`, `min_tokens` > `max_tokens`, stop strings and stop ids,
structured outputs mixed with penalties and bias, streaming and not, chat and completions, and
streams the client closes after a few chunks. Every request asks for its token ids
(`return_token_ids`, and `return_tokens_as_token_ids` with logprobs), so each id returned can be
checked against the vocabulary.

A request says whether its replay alone must give the same text (`replay`: seeded, sampled, read to
the end) and, where vLLM with and without the plugin may disagree on accepting it, why (`explained`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

ALL_BANNED = ("every allowed id is banned by a one-token bad word: vLLM answers 200 with a token "
              "outside the allowed ids, the plugin refuses the request with 400 (docs/vllm.md)")


@dataclass(frozen=True)
class Vocabulary:
    """What the generator needs of the served model: its name, the logits width, one-token words."""

    model: str
    size: int
    words: tuple[tuple[str, tuple[int, ...]], ...]  # word -> the ids vLLM's bad_words bans for it
    max_model_len: int
    spaced: bool = True  # the tokens carry their spaces (a grammar can ask for "a b"); False: words only
    grammar_words: tuple[str, ...] = ()  # words no shorter token starts (what a grammar of words asks for)


@dataclass(frozen=True)
class CampaignRequest:
    """One request of the campaign: `POST /v1/{endpoint}` with `body`."""

    index: int
    kind: str
    endpoint: str  # "completions" or "chat/completions"
    body: dict[str, Any]
    cancel_after: int | None = None  # stream events read before the client closes the connection
    replay: bool = False
    explained: str | None = None


@dataclass
class Draft:
    """A request being drawn: its body and flags."""

    body: dict[str, Any]
    replay: bool = False
    cancel_after: int | None = None
    explained: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def vocabulary(model_dir: Path, model: str, *, max_model_len: int, words: int = 64) -> Vocabulary:
    """The `Vocabulary` of a checkpoint: up to `words` alphabetic words that are one token with and
    without a leading space (so a bad word bans exactly the ids listed)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    found: list[tuple[str, tuple[int, ...]]] = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token.lstrip("\u0120")
        if not word.isalnum() or len(word) < 2 or any(w == word for w, _ in found):
            continue
        ids = {tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (word, " " + word)}
        if all(len(i) == 1 for i in ids):
            found.append((word, tuple(sorted(i[0] for i in ids))))
        if len(found) == words:
            break
    spaced = any(len(ids) == 2 for _, ids in found)  # " word" is a token of its own
    tokens = set(tokenizer.get_vocab())
    # without one-character tokens, a grammar that lets "w1" start "w16" has no way on after it
    grammar = tuple(w for w, _ in found if not any(w[:k] in tokens for k in range(1, len(w))))
    return Vocabulary(model, size, tuple(found), max_model_len, spaced, grammar)


# ---------------------------------------------------------------- the parts of a request
def _text(rng: random.Random, vocab: Vocabulary, words: int) -> str:
    return " ".join(rng.choice(vocab.words)[0] for _ in range(words))


def _base(rng: random.Random, vocab: Vocabulary, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": vocab.model, "max_tokens": rng.randint(4, 16), "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng, vocab, rng.randint(2, 8))}]
    elif rng.random() < 0.5:
        body["prompt"] = [rng.randrange(4, vocab.size) for _ in range(rng.randint(3, 12))]
    else:
        body["prompt"] = _text(rng, vocab, rng.randint(2, 8))
    return body


def _sampled(rng: random.Random) -> dict[str, Any]:
    """Valid sampling fields of a seeded, sampled request."""
    fields: dict[str, Any] = {"temperature": round(rng.uniform(0.3, 1.6), 3), "seed": rng.randrange(1 << 31)}
    if rng.random() < 0.5:
        fields["top_p"] = round(rng.uniform(0.5, 1.0), 3)
    if rng.random() < 0.5:
        fields["top_k"] = rng.choice([1, 5, 50, -1, 0])
    if rng.random() < 0.3:
        fields["min_p"] = round(rng.uniform(0.0, 0.2), 3)
    if rng.random() < 0.3:
        fields["repetition_penalty"] = round(rng.uniform(0.8, 1.5), 3)
    if rng.random() < 0.3:
        fields["presence_penalty"] = round(rng.uniform(-2, 2), 3)
        fields["frequency_penalty"] = round(rng.uniform(-2, 2), 3)
    return fields


def _logprobs(rng: random.Random, chat: bool, count: int) -> dict[str, Any]:
    if chat:
        return {"logprobs": True, "top_logprobs": count, "return_tokens_as_token_ids": True}
    return {"logprobs": count, "return_tokens_as_token_ids": True}


# ---------------------------------------------------------------- the kinds
def _plain(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    stream = rng.random() < 0.4
    body = {**_sampled(rng), "stream": stream}
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 4)
    return Draft(body, replay=True)


def bounds_table(vocab: Vocabulary) -> dict[str, list[Any]]:
    """Each sampling field's values at, inside and beyond its bounds."""
    v, long = vocab.size, vocab.max_model_len
    return {
        "temperature": [0, 0.0, 1e-6, 1e-5, 2.0, 2.0000001, -0.0001, 1e-45, 1e-300],
        "top_p": [1e-9, 1.0, 0.0, 1.0001, -0.5],
        "top_k": [-1, 0, 1, v - 1, v, v + 1, 2**31, 2**63, -2],
        "min_p": [0.0, 1.0, 1.0001, -0.1, 1e-300],
        "presence_penalty": [-2.0, 2.0, 2.0001, -2.0001],
        "frequency_penalty": [-2.0, 2.0, 2.0001, -2.0001],
        "repetition_penalty": [1e-30, 1e-300, 0.0, 2.0, 1e30, 1e300, -1.0, 1e-45, 3.5e38],
        "max_tokens": [0, 1, long, long + 1, 10**9, -1],
        "seed": [-1, 0, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64],
        "min_tokens": [-1, 0, 1],
        "n": [0, -1, 1],
    }


def _bounds(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    table = bounds_table(vocab)
    name = rng.choice(sorted(table))
    body = {"temperature": 1.0, "seed": rng.randrange(1 << 31), "stream": rng.random() < 0.25,
            name: rng.choice(table[name])}
    return Draft(body)


def _types(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    cases: list[tuple[str, Any]] = [
        ("temperature", "hot"), ("temperature", [1.0]), ("top_k", 1.5), ("top_k", "5"), ("top_p", "x"),
        ("max_tokens", "ten"), ("max_tokens", 2.5), ("seed", 1.5), ("seed", "s"), ("logit_bias", {"x": 1}),
        ("logit_bias", [1, 2]), ("logit_bias", {"5": "high"}), ("n", "two"), ("stop", 5), ("stop", [1, 2]),
        ("allowed_token_ids", ["a"]), ("allowed_token_ids", 5), ("bad_words", 7), ("min_tokens", "1"),
        ("repetition_penalty", None), ("presence_penalty", {}), ("stream", "yes"), ("logprobs", "many"),
        ("structured_outputs", {"choice": 5}), ("stop_token_ids", ["a"]), ("return_token_ids", 3),
    ]
    name, value = rng.choice(cases)
    return Draft({"temperature": 0.8, "seed": rng.randrange(1 << 31), name: value})


def _huge_n(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    return Draft({"n": rng.choice([16, 64, 256]), "max_tokens": rng.randint(1, 3), "temperature": 1.0,
                  "seed": rng.randrange(1 << 31)})


def _logprobs_kind(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    count = rng.choice([0, 1, 5, 20, 21, -1])
    body = {**_sampled(rng), **_logprobs(rng, chat, count), "stream": rng.random() < 0.3}
    return Draft(body, replay=True)


def _prompt_logprobs(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    body = {**_sampled(rng), "prompt_logprobs": rng.choice([0, 1, 5, 20, 21, -1])}
    return Draft(body, replay=True)


def _logit_bias(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    v = vocab.size
    ids = [rng.randrange(v) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.4:
        ids.append(rng.choice([v, v + 5, -1, 10**12]))
    bias = {str(i): rng.choice([100, -100, 100.0, -100.0, 1000, -1000, 5.5, -0.5]) for i in ids}
    return Draft({**_sampled(rng), "logit_bias": bias, "stream": rng.random() < 0.3}, replay=True)


def _allowed_bad(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    chosen = rng.sample(vocab.words, rng.randint(1, 4))
    allowed = sorted({i for _, ids in chosen for i in ids})
    body: dict[str, Any] = {**_sampled(rng), "allowed_token_ids": allowed}
    explained = None
    shape = rng.choice(["all banned", "some banned", "allowed only", "bad only"])
    if shape == "all banned":
        body["bad_words"] = [w for w, _ in chosen]
        explained = ALL_BANNED
    elif shape == "some banned" and len(chosen) > 1:
        body["bad_words"] = [w for w, _ in chosen[1:]]
    elif shape == "bad only":
        del body["allowed_token_ids"]
        body["bad_words"] = [w for w, _ in chosen]
    return Draft(body, replay=True, explained=explained)


def _min_max(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    maximum = rng.randint(2, 12)
    minimum = rng.choice([maximum + 1, maximum, maximum - 1, 0, 10**6])
    body: dict[str, Any] = {**_sampled(rng), "max_tokens": maximum, "min_tokens": minimum}
    if rng.random() < 0.4:
        body["ignore_eos"] = True
    if rng.random() < 0.4:
        body["stop_token_ids"] = [rng.choice([2, rng.randrange(vocab.size), vocab.size, -1])]
    return Draft(body, replay=True)


def _stop(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    stop = [rng.choice(vocab.words)[0] for _ in range(rng.randint(1, 3))]
    body: dict[str, Any] = {**_sampled(rng), "stop": stop if rng.random() < 0.7 else stop[0],
                            "max_tokens": rng.randint(8, 24), "stream": rng.random() < 0.4}
    if rng.random() < 0.3:
        body["include_stop_str_in_output"] = True
    if rng.random() < 0.2:
        body["stop"] = [""]
    return Draft(body, replay=True)


def _structured(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    words = [w for w, _ in rng.sample(vocab.words, 4)]
    if vocab.spaced:
        choices = [{"choice": [words[0], f"{words[1]} {words[2]}", words[3]]},
                   {"regex": f"({words[0]}|{words[1]})( {words[2]}){{1,3}}"}]
    else:  # no token holds a space: a grammar asking for one has no way through
        words = rng.sample(vocab.grammar_words, 3)
        choices = [{"choice": words}, {"regex": f"({words[0]}|{words[1]}|{words[2]})"}]
    constraint = rng.choice(choices)
    body: dict[str, Any] = {**_sampled(rng), "structured_outputs": constraint, "stream": rng.random() < 0.3}
    body["repetition_penalty"] = rng.choice([1.0, 1.3, 2.0])
    body["presence_penalty"] = rng.choice([0.0, 1.5, -1.0])
    ids = [i for _, group in vocab.words[:8] for i in group]
    body["logit_bias"] = {str(rng.choice(ids)): rng.choice([100, -100, 7.0])}
    return Draft(body, replay=True)


def _stream_full(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    body = {**_sampled(rng), "stream": True, "max_tokens": rng.randint(8, 32)}
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return Draft(body, replay=True)


def _cancel(rng: random.Random, vocab: Vocabulary, chat: bool) -> Draft:
    body = {**_sampled(rng), "stream": True, "max_tokens": rng.randint(32, 96), "ignore_eos": True}
    if rng.random() < 0.3:
        body["n"] = 2
    return Draft(body, cancel_after=rng.randint(1, 4))


KINDS: dict[str, Callable[[random.Random, Vocabulary, bool], Draft]] = {
    "plain": _plain, "bounds": _bounds, "types": _types, "huge_n": _huge_n, "logprobs": _logprobs_kind,
    "prompt_logprobs": _prompt_logprobs, "logit_bias": _logit_bias, "allowed_bad": _allowed_bad,
    "min_max": _min_max, "stop": _stop, "structured": _structured, "stream": _stream_full, "cancel": _cancel,
}
WEIGHTS = {"plain": 3, "bounds": 4, "types": 2, "huge_n": 1, "logprobs": 2, "prompt_logprobs": 1,
           "logit_bias": 2, "allowed_bad": 2, "min_max": 2, "stop": 2, "structured": 2, "stream": 2, "cancel": 2}


def draw(index: int, rng: random.Random, vocab: Vocabulary, kind: str | None = None) -> CampaignRequest:
    """One request of kind `kind` (None: drawn by `WEIGHTS`), on a chat or completions endpoint."""
    kind = kind or rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    chat = rng.random() < 0.4
    draft = KINDS[kind](rng, vocab, chat)
    body = {**_base(rng, vocab, chat), **draft.body}
    replay = draft.replay and body.get("temperature", 1.0) not in (0, 0.0) and "seed" in body
    return CampaignRequest(index, kind, "chat/completions" if chat else "completions", body,
                           cancel_after=draft.cancel_after, replay=replay, explained=draft.explained)


def generate(count: int, seed: int, vocab: Vocabulary, kinds: Sequence[str] = ()) -> list[CampaignRequest]:
    """`count` requests, a pure function of (count, seed, vocab, kinds); every kind at least once when
    count allows; `kinds`: only those kinds, in turn."""
    rng = random.Random(seed)
    if kinds:
        requests = [draw(i, rng, vocab, kinds[i % len(kinds)]) for i in range(count)]
    else:
        forced = list(KINDS) if count >= len(KINDS) else [None] * count
        requests = [draw(i, rng, vocab, kind) for i, kind in enumerate(forced)]
        requests += [draw(i, rng, vocab) for i in range(len(requests), count)]
    rng.shuffle(requests)  # the forced kinds spread over the run
    return [replace(r, index=i) for i, r in enumerate(requests)]


def edge_requests(vocab: Vocabulary, start: int = 0) -> list[CampaignRequest]:
    """One completions request per value of `bounds_table` (temperature 1, seeded), and one whose
    allowed ids are all banned by bad words; indices from `start`."""
    out: list[CampaignRequest] = []
    for name, values in sorted(bounds_table(vocab).items()):
        for value in values:
            body = {"model": vocab.model, "prompt": [1, 5, 6, 7], "max_tokens": 4, "return_token_ids": True,
                    "temperature": 1.0, "seed": 7, name: value}
            out.append(CampaignRequest(start + len(out), "bounds", "completions", body))
    word, ids = vocab.words[0]
    body = {"model": vocab.model, "prompt": [1, 5, 6, 7], "max_tokens": 4, "return_token_ids": True,
            "temperature": 1.0, "seed": 7, "allowed_token_ids": list(ids), "bad_words": [word]}
    out.append(CampaignRequest(start + len(out), "allowed_bad", "completions", body, explained=ALL_BANNED))
    return out


def campaign_requests(count: int, seed: int, vocab: Vocabulary, kinds: Sequence[str] = ()) -> list[CampaignRequest]:
    """The campaign: `count` random requests (`generate`) and every edge request, shuffled together
    (seeded); `index` is the position in the list. With `kinds`, only random requests of those kinds."""
    requests = generate(count, seed, vocab, kinds) + ([] if kinds else edge_requests(vocab))
    random.Random(seed + 1).shuffle(requests)
    return [replace(r, index=i) for i, r in enumerate(requests)]
