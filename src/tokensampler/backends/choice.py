"""`BackendChoice`: which step a sampler runs and whether its torch step compiles, decided once.

A `Sampler` resolves its choice when it is made (`BackendChoice.resolve`) and keeps it; no call
after that reads the environment. An explicit argument wins; an argument left at None takes the
environment's default, read at that moment:

- `backend`: "auto" (CUDA logits run the Triton kernels when Triton is importable, everything
  else the torch step), "torch" (always the torch step), "triton" (always the kernels; CPU tensors
  need Triton's interpreter, TRITON_INTERPRET=1). None: TOKENSAMPLER_BACKEND, "auto" when unset or
  empty. Whatever the backend, a step whose batch asks more than `MAX_KERNEL_LOGPROBS` logprobs,
  and every step of a vocabulary split, runs the torch or split step.
- `compile`: True compiles the torch step's full-row reductions (`torch_step.compile_cache`), False
  keeps it eager (the same tokens). None: TOKENSAMPLER_COMPILE (0/false/no/off: False;
  1/true/yes/on or unset: True).

Bad values raise before any state is made: an argument `InvalidSamplingParams`, an environment
variable `InvalidEnvironment`, each naming the field, the value and what is allowed. Imports no Triton.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..core.errors import InvalidEnvironment, InvalidSamplingParams
from .triton.config import MAX_KERNEL_LOGPROBS, triton_available

BACKEND_ENV = "TOKENSAMPLER_BACKEND"
COMPILE_ENV = "TOKENSAMPLER_COMPILE"
INTERPRET_ENV = "TRITON_INTERPRET"
BACKENDS = ("auto", "torch", "triton")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _environ_backend(environ: Mapping[str, str]) -> str:
    name = environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise InvalidEnvironment(BACKEND_ENV, name, f"one of {BACKENDS} (or unset)")
    return name


def _environ_compile(environ: Mapping[str, str]) -> bool:
    value = environ.get(COMPILE_ENV, "").strip().lower()
    if value and value not in _TRUE + _FALSE:
        raise InvalidEnvironment(COMPILE_ENV, value, f"one of {_TRUE + _FALSE} (or unset: on)")
    return value not in _FALSE


def resolve_names(backend: str | None = None, compile: bool | None = None,
                  environ: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(backend, compile): the arguments, checked, and where one is None the environment's default
    (TOKENSAMPLER_BACKEND, TOKENSAMPLER_COMPILE in `environ`, default `os.environ`, read now). For
    a component that makes samplers later (the vLLM plugin): it resolves once and passes both on.
    Raises `InvalidSamplingParams` for a bad argument, `InvalidEnvironment` for a bad variable."""
    env = os.environ if environ is None else environ
    if backend is None:
        backend = _environ_backend(env)
    elif not isinstance(backend, str) or backend not in BACKENDS:
        raise InvalidSamplingParams("backend", backend, f"None (the {BACKEND_ENV} default) or one of {BACKENDS}")
    if compile is None:
        compile = _environ_compile(env)
    elif not isinstance(compile, bool):
        raise InvalidSamplingParams("compile", compile, f"None (the {COMPILE_ENV} default), True or False")
    return backend, compile


@dataclass(frozen=True)
class BackendChoice:
    """The resolved choice of one sampler (see the module docstring).

    backend: "auto" | "torch" | "triton", as asked.
    compile: the torch step's compiled reductions are on.
    kernels: whether a whole-vocabulary step runs the Triton kernels (when its batch asks at most
      `MAX_KERNEL_LOGPROBS` logprobs): what `backend` means on the sampler's device.
    """

    backend: str
    compile: bool
    kernels: bool

    @classmethod
    def resolve(cls, backend: str | None = None, compile: bool | None = None,
                device: torch.device | str = "cpu", environ: Mapping[str, str] | None = None) -> BackendChoice:
        """The choice for a sampler on `device`: the arguments, or where one is None the
        environment's default (`environ`, default `os.environ`, read now and never again).

        Raises `InvalidSamplingParams` for a bad argument, `InvalidEnvironment` for a bad
        environment variable or a forced "triton" this process cannot run (no Triton, or CPU
        tensors without TRITON_INTERPRET=1)."""
        env = os.environ if environ is None else environ
        field = BACKEND_ENV if backend is None else "backend"
        backend, compile = resolve_names(backend, compile, env)
        device = torch.device(device)
        if backend == "torch":
            kernels = False
        elif backend == "auto":
            kernels = device.type == "cuda" and triton_available()
        else:
            interpret = env.get(INTERPRET_ENV, "0") == "1"
            if not triton_available() or not (device.type == "cuda" or interpret):
                raise InvalidEnvironment(field, backend, "triton only with Triton installed and CUDA logits "
                                         f"(CPU logits need {INTERPRET_ENV}=1)")
            kernels = True
        return cls(backend, compile, kernels)

    def use_kernels(self, logprobs_width: int) -> bool:
        """Whether a whole-vocabulary step whose widest logprobs request is `logprobs_width` runs the kernels."""
        return self.kernels and logprobs_width <= MAX_KERNEL_LOGPROBS
