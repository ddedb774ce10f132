"""`Agreement`: how the ranks that share a sampler agree on a call before any state changes.

A vocabulary split runs the same sampler on every rank of a group, and every rank must take the
same decisions. Each public call first runs its checks locally, then takes part in one all-gather
of (error flag, a digest of the checked arguments): if any rank failed, or the ranks' arguments
differ, every rank raises (its own error on the rank that failed, `SplitMismatch` on the others)
before any state changes, and no rank is left waiting in a later collective. Without a group the
agreement is local: checks raise directly and nothing is gathered or hashed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..core.errors import SplitMismatch
from ..core.params import SamplingParams
from ..core.rng import fresh_seed
from .transport import Exchange, as_exchange

_T = TypeVar("_T")


def fingerprint(*parts: Any) -> int:
    """A 63-bit hash of a repr, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def params_key(params: SamplingParams) -> tuple:
    """The fields of `params` as a sorted tuple (logit_bias as sorted items): a stable repr."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = sorted(fields["logit_bias"].items())
    return tuple(sorted(fields.items()))


def call_key(value: Any) -> Any:
    """`value` with every tensor replaced by (dtype, shape, hash of its values), for `fingerprint`
    (the repr of a large tensor elides values). Reads tensors back to the host."""
    if isinstance(value, torch.Tensor):
        values = repr(value.detach().to("cpu").reshape(-1).tolist()).encode()
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.blake2b(values, digest_size=8).hexdigest())
    if isinstance(value, SamplingParams):
        return params_key(value)
    if isinstance(value, dict):
        return ("dict", tuple((call_key(k), call_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(call_key(v) for v in value))
    return value


class Agreement:
    """The agreement of the ranks of one group (or of one process alone, `exchange=None`)."""

    def __init__(self, exchange: Exchange | None = None, device: torch.device | str = "cpu") -> None:
        self.exchange = exchange
        self.device = torch.device(device)  # where the gathered payload lives (NCCL: a CUDA device)

    @classmethod
    def over(cls, group: Any, device: torch.device | str = "cpu") -> Agreement:
        """The agreement over a torch.distributed group or an `Exchange`; local for None."""
        return cls(None if group is None else as_exchange(group), device)

    @property
    def rank(self) -> int:
        return 0 if self.exchange is None else self.exchange.rank

    @property
    def world_size(self) -> int:
        return 1 if self.exchange is None else self.exchange.world_size

    @property
    def shared(self) -> bool:
        """True when calls are agreed with other ranks (a digest of the arguments is gathered)."""
        return self.exchange is not None

    def gather(self, error: BaseException | None, values: Sequence[int]) -> list[list[int]]:
        """All-gather (error flag, *values): one list of the values per rank (rank order); re-raise
        this rank's `error`, or raise `SplitMismatch` naming the first rank that failed."""
        if self.exchange is None:
            if error is not None:
                raise error
            return [list(values)]
        payload = torch.tensor([error is not None, *values], dtype=torch.int64, device=self.device)
        gathered = self.exchange.all_gather(payload).cpu().tolist()
        if error is not None:
            raise error
        failed = [r for r, row in enumerate(gathered) if row[0]]
        if failed:
            raise SplitMismatch("group", f"rank {failed[0]} rejected its input",
                                "valid input on every rank of the group")
        return [row[1:] for row in gathered]

    def agree(self, error: BaseException | None, what: str, key: Callable[[], Any] | Any,
              extra: Sequence[int] = ()) -> list[int]:
        """End a call's checks on every rank: re-raise this rank's `error`, name the rank that failed
        on the others, or raise `SplitMismatch(what)` when the ranks' keys (the call's checked
        arguments; a callable is evaluated only when there are other ranks) differ. Returns rank 0's
        `extra` integers (e.g. a seed drawn there). Call it before any state changes."""
        if self.exchange is None:
            if error is not None:
                raise error
            return list(extra)
        digest = 0
        if error is None:
            digest = fingerprint(call_key(key() if callable(key) else key))
        gathered = self.gather(error, [digest, *extra])
        if any(row[0] != gathered[0][0] for row in gathered):
            raise SplitMismatch(what, "different arguments across ranks",
                                "the same call, with the same arguments, on every rank of the group")
        return gathered[0][1:]

    def check(self, what: str, check: Callable[[], _T], key: Any = None) -> _T:
        """`check()` (a call's validation, no state change), agreed: every rank runs it, then one
        all-gather makes a failure on any rank, or checked results (and `key`) that differ, raise on
        every rank."""
        return self.check_sharing(what, check, (), key)[0]

    def check_sharing(self, what: str, check: Callable[[], _T], share: Sequence[int],
                      key: Any = None) -> tuple[_T, list[int]]:
        """`check` that also returns rank 0's `share` integers from the same all-gather."""
        if self.exchange is None:
            return check(), list(share)
        error, result = None, None
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - re-raised after the all-gather, so no rank is left waiting
            error = exc
        shared = self.agree(error, what, (result, key), extra=share)
        return result, shared  # type: ignore[return-value]

    def shared_random_bits(self) -> int:
        """63 random bits, the same on every rank (drawn on rank 0; one all-gather when shared)."""
        return self.agree(None, "random bits", None, extra=[fresh_seed()])[0]
