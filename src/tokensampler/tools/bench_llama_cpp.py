"""llama.cpp's own sampler chain as a benchmark peer of `tokensampler bench --against llama.cpp`.

llama.cpp is never a dependency: `why_unavailable()` names why its column is omitted when
`llama_cpp` (the `llama-cpp-python` bindings, built from the sdist of the package registry; the
command is in docs/llama-cpp.md) cannot be imported. Otherwise `llama_cpp_arms(case, logits)` builds
llama.cpp's chain for the case's parameters, in llama.cpp's default order (top-k, top-p, min-p,
temperature, then `dist`, which draws the token), and returns its timing arms. A step copies the
row's logits into llama.cpp's `llama_token_data_array` (ids, logits, `p = 0`: what llama.cpp's
`common_sampler` does for every token) and applies the chain: the copy is timed with it, as
llama.cpp pays it on every token (a second arm times the copy alone). One row at a time: llama.cpp
samples one sequence per call.

Its cases (`workloads.LLAMA_CPP_CASES`) are B=1 at three vocabulary sizes, with llama.cpp's default
chain and top-k 20 + top-p 0.95. llama.cpp filters the temperature-1 logits and divides by the temperature
last; tokensampler divides first (as vLLM): at temperature 0.8 the two keep different sets
(docs/llama-cpp.md), so the default-chain rows time the same parameters, not the same definition.

`TokenArray` (the candidate array over a numpy buffer) is shared with the tests' llama.cpp driver
(`tests/support/llama_cpp_samplers.py`).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .workloads import BenchCase

DIST_SEED = 1234  # llama.cpp's `dist` sampler runs seeded (a fixed mt19937 stream), like tokensampler

def bindings() -> Any:
    """The `llama_cpp` module (raises ImportError when it is not installed)."""
    import llama_cpp
    return llama_cpp


def llama_cpp_version() -> str | None:
    try:
        return getattr(bindings(), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - any import failure means: no peer
        return None


def why_unavailable() -> str | None:
    """None if llama.cpp's samplers can be called, else a one-line reason."""
    try:
        _ = bindings().llama_sampler_init_top_k  # the low-level C API is what the arm calls
    except Exception as exc:  # noqa: BLE001
        return (f"llama.cpp column omitted: llama_cpp is not importable here ({type(exc).__name__}: {exc}); "
                "docs/llama-cpp.md has its build command")[:240]
    return None


class TokenArray:
    """llama.cpp's `llama_token_data_array` over a numpy buffer of `llama_token_data` (id int32, logit
    float32, p float32: 12 bytes, no padding). Samplers may reorder, truncate (`size`) and even move
    the start (`data`: XTC does) of the array; `view()` is what is left, in llama.cpp's order."""

    DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def __init__(self, vocab: int) -> None:
        lib = bindings()
        if ctypes.sizeof(lib.llama_token_data) != self.DTYPE.itemsize:
            raise RuntimeError("llama_token_data is not (int32, float32, float32) in these bindings")
        self.lib = lib
        self.vocab = vocab
        self.buffer = np.zeros(vocab, dtype=self.DTYPE)
        self.ids = np.arange(vocab, dtype=np.int32)
        self.base = self.buffer.ctypes.data
        self.struct = lib.llama_token_data_array(
            data=ctypes.cast(self.base, ctypes.POINTER(lib.llama_token_data)), size=vocab, selected=-1, sorted=False)
        self.pointer = ctypes.pointer(self.struct)

    def fill(self, logits: np.ndarray) -> None:
        """Every id with its logit and p = 0, in id order, unsorted: llama.cpp's fresh candidates."""
        self.buffer["id"] = self.ids
        self.buffer["logit"] = logits
        self.buffer["p"] = 0.0
        self.struct.data = ctypes.cast(self.base, ctypes.POINTER(self.lib.llama_token_data))
        self.struct.size = self.vocab
        self.struct.selected = -1
        self.struct.sorted = False

    def view(self) -> np.ndarray:
        """The candidates left after the samplers applied (a view into the buffer)."""
        start = (ctypes.cast(self.struct.data, ctypes.c_void_p).value - self.base) // self.DTYPE.itemsize
        return self.buffer[start:start + self.struct.size]

    def selected_id(self) -> int | None:
        """The id a selecting sampler (dist, greedy, mirostat) chose, None if none selected."""
        if self.struct.selected < 0:
            return None
        return int(self.view()["id"][self.struct.selected])


def chain_samplers(params: dict, vocab: int, seed: int = DIST_SEED) -> list:
    """llama.cpp sampler pointers for tokensampler-style parameters, in llama.cpp's default order
    (top-k, top-p, min-p, temperature), ending with `dist` (or `greedy` at temperature 0). Penalties
    need a history (`llama_sampler_accept`): not supported here."""
    lib = bindings()
    if any(params.get(k, d) != d for k, d in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                                ("presence_penalty", 0.0))):
        raise ValueError("the llama.cpp bench arm has no penalties (they need the history accepted token by token)")
    unsupported = set(params) - {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                 "frequency_penalty", "presence_penalty"}
    if unsupported:
        raise ValueError(f"the llama.cpp bench arm does not map {sorted(unsupported)}")
    temperature = params.get("temperature", 1.0)
    if temperature == 0.0:
        return [lib.llama_sampler_init_greedy()]
    samplers = []
    if params.get("top_k", 0) > 0:
        samplers.append(lib.llama_sampler_init_top_k(min(params["top_k"], vocab)))
    if params.get("top_p", 1.0) < 1.0:
        samplers.append(lib.llama_sampler_init_top_p(params["top_p"], 0))  # min_keep 0: llama.cpp's default
    if params.get("min_p", 0.0) > 0.0:
        samplers.append(lib.llama_sampler_init_min_p(params["min_p"], 0))
    if temperature != 1.0:
        samplers.append(lib.llama_sampler_init_temp_ext(temperature, 0.0, 1.0))  # what common_sampler adds
    samplers.append(lib.llama_sampler_init_dist(seed))
    return samplers


def make_chain(samplers: Sequence) -> Any:
    """A llama.cpp sampler chain owning `samplers` (freed with it by `llama_sampler_free`)."""
    lib = bindings()
    chain_params = lib.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = lib.llama_sampler_chain_init(chain_params)
    for sampler in samplers:
        lib.llama_sampler_chain_add(chain, sampler)
    return chain


class ChainArm:
    """One llama.cpp chain on one row of logits: `step()` copies the row in and samples one token."""

    def __init__(self, params: dict, logits_row: torch.Tensor, seed: int = DIST_SEED) -> None:
        row = logits_row.detach().to("cpu", torch.float32).contiguous()
        self.logits = row.numpy()
        self.array = TokenArray(row.numel())
        self.lib = self.array.lib
        self.chain = make_chain(chain_samplers(params, row.numel(), seed))

    def step(self) -> int:
        self.array.fill(self.logits)
        self.lib.llama_sampler_apply(self.chain, self.array.pointer)
        return self.array.selected_id()

    def __del__(self) -> None:
        chain, self.chain = getattr(self, "chain", None), None
        if chain is not None:
            self.lib.llama_sampler_free(chain)


def llama_cpp_arms(case: BenchCase, logits: torch.Tensor) -> dict[str, tuple[None, Callable[[], object]]] | None:
    """Timing arms on `logits`, or None if llama.cpp is unavailable: "llama.cpp", the chain's step
    (the copy into its array included; one row per call, rows sampled in turn), and "llama.cpp_copy",
    the copy alone (its share of the step)."""
    if why_unavailable() is not None:
        return None
    arms = [ChainArm(case.params, logits[row]) for row in range(logits.shape[0])]

    def step() -> list[int]:
        return [arm.step() for arm in arms]

    def copy() -> None:
        for arm in arms:
            arm.array.fill(arm.logits)

    step()
    return {"llama.cpp": (None, step), "llama.cpp_copy": (None, copy)}
