"""The library's errors: one `ValueError` base that names the field, the value and what is allowed.

    TokenSamplerError                 every error the library raises for bad input
    ├── InvalidSamplingParams         a parameter, token id, shape, dtype or slot out of range
    │   ├── InvalidRequest            an OpenAI request body field (an HTTP layer's 400)
    │   ├── InvalidSlotRemap          a slot remap that is not a permutation of the slots
    │   ├── StaleSamplingState        device state out of date, and the call did not rebuild it
    │   ├── TraceMismatch             a captured step replayed with another logits tensor
    │   ├── SplitMismatch             the ranks of a vocabulary split disagree on a call
    │   └── UnsupportedOnSplit        a feature a vocabulary split does not run (named in `field`)
    ├── InvalidCheckpoint             a checkpoint's files (generation config, tokenizer) unusable
    └── InvalidEnvironment            an environment variable, a missing optional package, or a
                                      process group that is not set up

One warning: `CompileFallbackWarning` (a `UserWarning`), once per process, when the torch in use
does not behave as the compile cache's private torch APIs expect and a function runs eagerly.

Every error is raised before any state changes. `field`, `value` and `allowed` are attributes so an
HTTP layer can build its reply; `str(error)` is one line.
"""

from __future__ import annotations

from typing import Any

MESSAGE_VALUE_CHARS = 200  # a value's repr in a message is cut to this many characters (`.value` keeps it whole)


def value_text(value: Any) -> str:
    """`repr(value)` on one line (runs of whitespace and newlines become one space), cut to
    `MESSAGE_VALUE_CHARS` characters: what a message shows of a value."""
    text = " ".join(repr(value).split())
    return text if len(text) <= MESSAGE_VALUE_CHARS else text[:MESSAGE_VALUE_CHARS - 3] + "..."


class TokenSamplerError(ValueError):
    """Bad input to tokensampler: `field` had `value`, and `allowed` says what is accepted."""

    def __init__(self, field_name: str, value: Any, allowed: str) -> None:
        self.field = field_name
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field_name}={value_text(value)} is invalid: allowed {' '.join(str(allowed).split())}")


class InvalidSamplingParams(TokenSamplerError):
    """A sampling parameter (or a token id, a shape, a dtype, a slot) outside its allowed range."""


class InvalidRequest(InvalidSamplingParams):
    """An OpenAI request body field that is unknown, unsupported or out of range (HTTP 400)."""


class InvalidSlotRemap(InvalidSamplingParams):
    """A slot remap of the wrong length, with an entry out of range, or not a permutation."""


class StaleSamplingState(InvalidSamplingParams):
    """The device buffers are stale (host sampling ran, or changed the layout) and this call did not
    command the full rebuild (`reload_sampling_params=True` and `reset_sampling_state=True`)."""


class TraceMismatch(InvalidSamplingParams):
    """A traced step was replayed with another logits tensor than the one it was captured with."""


class SplitMismatch(InvalidSamplingParams):
    """The ranks of a vocabulary-split group disagree (slice width, batch size, slots, parameters),
    or another rank rejected its input. Raised on every rank, before any state changes."""


class UnsupportedOnSplit(InvalidSamplingParams):
    """A call a vocabulary-split sampler does not run (e.g. rejection-mode speculative
    verification, which needs each row's whole filtered distribution on one rank). Raised on every
    rank, before any state changes; `field` and `value` name the feature, `allowed` what runs."""


class InvalidCheckpoint(TokenSamplerError):
    """A checkpoint file that cannot be used; `source` names the file (or the override)."""

    def __init__(self, source: str, key: str, value: Any, allowed: str) -> None:
        self.source = source
        super().__init__(key, value, allowed)
        self.args = (f"{' '.join(str(source).split())}: {self.args[0]}",)


class InvalidEnvironment(TokenSamplerError):
    """The environment cannot run what was asked: an environment variable's value, an optional
    package that is not installed, or a torch.distributed group that is not initialised."""


class CompileFallbackWarning(UserWarning):
    """The torch in use differs from what the compile cache's private torch APIs expect (an
    attribute missing, an internal raising): the function runs eagerly, with the same tokens.
    Emitted once per process (`backends.torch_step.torch_private`)."""
