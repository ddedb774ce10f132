"""The library's errors: one `ValueError` base that names the field, the value and what is allowed.

    TokenSamplerError                 every error the library raises for bad input
    ├── InvalidSamplingParams         a parameter, token id, shape, dtype or slot out of range
    │   ├── InvalidRequest            an OpenAI request body field (an HTTP layer's 400)
    │   ├── InvalidSlotRemap          a slot remap that is not a permutation of the slots
    │   ├── StaleSamplingState        device state out of date, and the call did not rebuild it
    │   ├── TraceMismatch             a captured step replayed with another logits tensor
    │   └── SplitMismatch             the ranks of a vocabulary split disagree on a call
    ├── InvalidCheckpoint             a checkpoint's files (generation config, tokenizer) unusable
    └── InvalidEnvironment            an environment variable, a missing optional package, or a
                                      process group that is not set up

Every error is raised before any state changes. `field`, `value` and `allowed` are attributes so an
HTTP layer can build its reply; `str(error)` is one line.
"""

from __future__ import annotations

from typing import Any


class TokenSamplerError(ValueError):
    """Bad input to tokensampler: `field` had `value`, and `allowed` says what is accepted."""

    def __init__(self, field_name: str, value: Any, allowed: str) -> None:
        self.field = field_name
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field_name}={value!r} is invalid: allowed {allowed}")


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


class InvalidCheckpoint(TokenSamplerError):
    """A checkpoint file that cannot be used; `source` names the file (or the override)."""

    def __init__(self, source: str, key: str, value: Any, allowed: str) -> None:
        self.source = source
        super().__init__(key, value, allowed)
        self.args = (f"{source}: {key}={value!r} is invalid: allowed {allowed}",)


class InvalidEnvironment(TokenSamplerError):
    """The environment cannot run what was asked: an environment variable's value, an optional
    package that is not installed, or a torch.distributed group that is not initialised."""
