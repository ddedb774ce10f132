"""Sampling from a vocabulary split over a torch.distributed group (tensor-parallel LM head).

With `Sampler(..., group=G)` every rank of G passes its own logits slice `[B, Vp / W]`; rank r
owns the global ids `[r * Vp / W, (r + 1) * Vp / W)` and ids >= V (padding, possibly spanning
several ranks) are removed. Every rank returns the same `SamplerOutput`, equal to the unsplit
`Sampler` on the concatenated logits. A step moves a few numbers per row, never the slice:

    check       all-gather int64 [4]: error flag, batch, slice width, hash of slots and params
    summaries   all-gather [B, 5 (+3)]: raw and processed row max and first id (+ sum-exp, #+inf)
    top-k       all-gather [B, min(k_max, Vp/W)]: each rank's top-k candidates (rows with top-k)
    top-p       `bisection_rounds(P)` all-gathers [B, P (+1)]: float64 mass above P pivots
    winner      all-gather [B, 6]: (z + g, global id, ...) of each rank's Gumbel winner
    logprobs    all-gather [B, 1 + 2 N]: count of ids ranked above the token, local top-N

The per-rank penalty state holds only the rank's ids (prompt mask, output counts, bias, allowed
and stop ids translated to local ids). Admission all-gathers a hash of the request so ranks that
disagree raise `SplitMismatch` before any state changes; an unseeded request takes rank 0's seed.
The generator's slot-state updates (`set_params`, `set_noise`, `reset_history`, `record=`) agree
the same way (`VocabSplit.agree`), then translate global ids to the slice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .distributed_groups import Exchange, SamplingDP, TorchExchange, as_exchange, sampling_dp
from .ops import distributed_select as sel
from .output import SamplerOutput
from .params import InvalidSamplingParams, SamplingParams
from .state import SamplerState

if TYPE_CHECKING:
    from .sampler import Sampler

__all__ = ["Exchange", "SamplingDP", "SplitMismatch", "TorchExchange", "VocabSplit", "as_exchange", "call_key",
           "sampling_dp"]

NEG_INF = float("-inf")
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_TOP_P_PIVOTS = 255


class SplitMismatch(InvalidSamplingParams):
    """The ranks of a vocabulary-split group disagree (slice width, batch size, slots, parameters),
    or another rank rejected its input. Raised on every rank, before any state changes."""


# ================================================================== the split sampler
def _fingerprint(*parts: Any) -> int:
    """A 63-bit hash of a repr, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def call_key(value: Any) -> Any:
    """`value` with every tensor replaced by (dtype, shape, hash of its bytes), for `_fingerprint`
    (the repr of a large tensor elides values). Reads tensors back to the host."""
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.blake2b(data, digest_size=8).hexdigest())
    if isinstance(value, SamplingParams):
        return _params_key(value)
    if isinstance(value, dict):
        return ("dict", tuple((call_key(k), call_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(call_key(v) for v in value))
    return value


def _params_key(params: SamplingParams) -> tuple:
    fields = dataclasses.asdict(params) if params.logit_bias is None else {
        **{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
        "logit_bias": sorted(params.logit_bias.items())}
    return tuple(sorted(fields.items()))


class VocabSplit:
    """The split step behind `Sampler(..., group=...)`: state of this rank's slice and the
    pipeline of collectives. The `Sampler` keeps its public API and dispatches here."""

    def __init__(self, sampler: Sampler, group: Any, *, top_p_pivots: int = DEFAULT_TOP_P_PIVOTS) -> None:
        self.exchange = as_exchange(group)
        self.device = sampler.device
        world = self.exchange.world_size
        padded = sampler.padded_vocab_size
        error = None if padded % world == 0 else InvalidSamplingParams(
            "padded_vocab_size", padded, f"a multiple of the group size {world}")
        # every rank builds the same sampler, or every rank raises (one all-gather, before any state)
        self.agree(error, "Sampler", (sampler.vocab_size, padded, sampler.max_slots, sampler.logprobs_mode,
                                      sampler.max_logprobs, sampler.eos_token_ids, top_p_pivots))
        self.sampler = sampler
        self.vocab_size = sampler.vocab_size
        self.width = padded // world
        self.offset = self.exchange.rank * self.width
        self.real_width = max(0, min(self.width, self.vocab_size - self.offset))  # ids < V held here
        self.top_p_pivots = top_p_pivots
        self.top_p_rounds = sel.bisection_rounds(top_p_pivots)
        self.state = SamplerState(sampler.max_slots, self.width, self.device)
        self._row_keys: dict[int, tuple[SamplingParams, int]] = {}  # id(params) -> (params, hash)
        self.global_ids = torch.arange(self.offset, self.offset + self.width, device=self.device)
        self.padding = self.global_ids >= self.vocab_size

    # ------------------------------------------------------------ agreement
    def _agree(self, error: Exception | None, values: Sequence[int]) -> torch.Tensor:
        """All-gather (error flag, *values); re-raise a local error, or name the rank that failed."""
        payload = torch.tensor([error is not None, *values], dtype=torch.int64, device=self.device)
        gathered = self.exchange.all_gather(payload).cpu()
        if error is not None:
            raise error
        failed = [r for r in range(gathered.shape[0]) if gathered[r, 0]]
        if failed:
            raise SplitMismatch("group", f"rank {failed[0]} rejected its input",
                                "valid input on every rank of the group")
        return gathered[:, 1:]

    def agree(self, error: BaseException | None, what: str, key: Any) -> None:
        """One all-gather ending a call's checks on every rank: re-raise this rank's `error`, name
        the rank that failed on the others, or raise `SplitMismatch(what)` when the ranks' `key`s
        (the call's checked arguments, see `call_key`) differ. Call it before any state changes."""
        digest = 0 if error is not None else _fingerprint(call_key(key))
        gathered = self._agree(error, [digest])
        if bool((gathered[:, 0] != gathered[0, 0]).any()):
            raise SplitMismatch(what, "different arguments across ranks",
                                "the same call, with the same arguments, on every rank of the group")

    def shared_random_bits(self) -> int:
        """63 random bits drawn on rank 0, the same on every rank (one all-gather)."""
        return int(self._agree(None, [secrets.randbits(63)])[0, 0])

    def _local(self, ids: Sequence[int]) -> list[int]:
        return [t - self.offset for t in ids if self.offset <= t < self.offset + self.real_width]

    def _dense(self, name: str, dtype: torch.dtype, fill: float | bool) -> torch.Tensor:
        """The slice state's optional dense column (kept on the state so `SamplerState.move` moves it)."""
        tensor = getattr(self.state, name)
        if tensor is None:
            tensor = torch.full((self.state.max_slots, self.width), fill, dtype=dtype, device=self.device)
            setattr(self.state, name, tensor)
        return tensor

    def _row_key(self, slot: int) -> int:
        """Hash of the slot's params and seed, from the host mirror (follows `state.move`), memoised."""
        params = self.state.params[slot]
        cached = self._row_keys.get(id(params))
        if cached is None or cached[0] is not params:
            if len(self._row_keys) > 4 * self.state.max_slots:
                self._row_keys.clear()
            cached = (params, _fingerprint(_params_key(params)))
            self._row_keys[id(params)] = cached
        return _fingerprint(slot, cached[1], self.state.seeds[slot])

    # ------------------------------------------------------------ admission
    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], *,
                    output_token_ids: Sequence[int] = (), position: int | None = None,
                    stream: int = 0) -> int:
        """`Sampler.add_request` on every rank: one all-gather checks the ranks agree and shares
        rank 0's seed for an unseeded request. Nothing changes unless every rank accepted."""
        sampler = self.sampler
        error, fingerprint, drawn = None, 0, 0
        try:
            prompt, outputs, position = sampler._check_request(slot, params, prompt_token_ids, output_token_ids,
                                                               position, stream)
            fingerprint = _fingerprint(slot, _params_key(params), prompt, outputs, position, stream)
            drawn = secrets.randbits(63)
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather, so no rank is left waiting
            error = exc
        gathered = self._agree(error, [fingerprint, drawn])
        if bool((gathered[:, 0] != gathered[0, 0]).any()):
            raise SplitMismatch("params", params, "the same request (slot, params, prompt, outputs, "
                                "position, stream) on every rank of the group")
        seed = params.seed if params.seed is not None else int(gathered[0, 1])
        self._admit(slot, params, seed, position, stream, prompt, outputs)
        return seed

    def _admit(self, slot: int, params: SamplingParams, seed: int, position: int, stream: int,
               prompt: list[int], outputs: list[int]) -> None:
        self._write_params(slot, params)
        self.state.write_request(slot, seed, position, stream, self._local(prompt), self._local(outputs),
                                 output_len=len(outputs))

    def _write_params(self, slot: int, params: SamplingParams) -> None:
        """The parameter columns of `slot`, with bias, allowed and stop/EOS ids translated to local ids."""
        st = self.state
        bare = dataclasses.replace(params, logit_bias=None, allowed_token_ids=None, stop_token_ids=())
        st.write_params(slot, bare, ())
        st.params[slot] = params
        if params.logit_bias or st.logit_bias is not None:
            bias = self._dense("logit_bias", torch.float32, 0.0)
            bias[slot] = 0.0
            mine = {t - self.offset: v for t, v in (params.logit_bias or {}).items()
                    if self.offset <= t < self.offset + self.real_width}
            if mine:
                bias[slot, list(mine)] = torch.tensor(list(mine.values()), dtype=torch.float32, device=self.device)
        if params.allowed_token_ids is not None or st.allowed_mask is not None:
            allowed = self._dense("allowed_mask", torch.bool, True)
            allowed[slot] = params.allowed_token_ids is None
            if params.allowed_token_ids is not None:
                allowed[slot, self._local(params.allowed_token_ids)] = True
        stop_ids = list(params.stop_token_ids) + list(self.sampler.eos_token_ids)
        if (params.min_tokens > 0 and stop_ids) or st.stop_mask is not None:
            stop = self._dense("stop_mask", torch.bool, False)
            stop[slot] = False
            if params.min_tokens > 0:
                stop[slot, self._local(stop_ids)] = True

    def release(self, slot: int) -> None:
        self.state.release(slot)

    # ------------------------------------------------------------ slot-state updates (the generator's)
    def set_params(self, slot: int, params: SamplingParams) -> None:
        """`Sampler.set_params` on every rank: the ranks agree, then each writes its translation."""
        error = None
        try:
            self.sampler._check_set_params(slot, params)
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather, so no rank is left waiting
            error = exc
        self.agree(error, "params", (slot, params))
        self._write_params(slot, params)

    def set_noise(self, slots: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                  streams: Sequence[int]) -> None:
        """`Sampler.set_noise` on every rank (the noise columns are replicated)."""
        error, checked = None, None
        try:
            checked = self.sampler._check_noise(slots, seeds, positions, streams)
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather
            error = exc
        self.agree(error, "seeds/positions/streams", checked)
        self.sampler._write_noise(*checked)

    def reset_history(self, slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                      output_token_ids: torch.Tensor | None) -> None:
        """`Sampler.reset_history` from global ids: each rank keeps the ids of its slice; the
        output length (min_tokens) counts every output id."""
        error, checked = None, None
        try:
            checked = self.sampler._check_history(slots, prompt_token_ids, output_token_ids)
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather
            error = exc
        self.agree(error, "token histories", checked)
        index, prompt, output = checked
        self.state.rebuild_history(index, self._local_ids(prompt), self._local_ids(output))
        if output is not None:
            self.state.output_len[index] = (output >= 0).sum(dim=1)

    def _local_ids(self, ids: torch.Tensor | None) -> torch.Tensor | None:
        """Global ids [R, S] (-1 = padding) as this slice's local ids, other ranks' ids as -1."""
        if ids is None:
            return None
        local = ids - self.offset
        return torch.where((local >= 0) & (local < self.real_width), local, torch.full_like(ids, -1))

    # ------------------------------------------------------------ the step
    def _check_step(self, logits: Any, slots: Any, record: Any = None) -> list[int]:
        """Local checks, then one all-gather: every rank raises if any rank failed or disagrees.
        The record mask, when given, is part of what the ranks must agree on (a host read)."""
        error, slot_list, batch, width, recorded = None, [], -1, -1, None
        try:
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                            f"a 2-d tensor [B, {self.width}] (this rank's slice)")
            batch, width = logits.shape
            if width == self.width:
                slot_list = self._check_local_step(logits, slots)
                self.sampler._check_record(record, len(slot_list))
                recorded = None if record is None else record.tolist()
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather, so no rank is left waiting
            error = exc
            slot_list = []
        digest = _fingerprint([self._row_key(s) for s in slot_list], str(getattr(logits, "dtype", "")), recorded)
        payload = torch.tensor([error is not None, batch, width, digest], dtype=torch.int64, device=self.device)
        gathered = self.exchange.all_gather(payload).cpu()
        if error is not None:
            raise error
        widths, batches = gathered[:, 2].tolist(), gathered[:, 1].tolist()
        if any(w != self.width for w in widths):
            raise SplitMismatch("logits.shape[1]", widths, f"{self.width} on every rank (padded_vocab_size "
                                f"{self.sampler.padded_vocab_size} / world {self.exchange.world_size})")
        if any(b != batches[0] for b in batches):
            raise SplitMismatch("batch", batches, "the same number of logits rows on every rank")
        failed = [r for r in range(gathered.shape[0]) if gathered[r, 0]]
        if failed:
            raise SplitMismatch("group", f"rank {failed[0]} rejected its input",
                                "valid input on every rank of the group")
        if any(d != gathered[0, 3] for d in gathered[:, 3].tolist()):
            raise SplitMismatch("params", "different slots or requests across ranks",
                                "the same slots, requests, record mask and logits dtype on every rank of the group")
        return slot_list

    def _check_local_step(self, logits: torch.Tensor, slots: Any) -> list[int]:
        if logits.dtype not in LOGITS_DTYPES:
            raise InvalidSamplingParams("logits.dtype", logits.dtype, "float32, float16 or bfloat16")
        if logits.device != self.device and not (logits.device.type == self.device.type == "cuda"):
            raise InvalidSamplingParams("logits.device", logits.device, f"the sampler's device {self.device}")
        slot_list = list(range(logits.shape[0])) if slots is None else (
            slots.tolist() if isinstance(slots, torch.Tensor) else list(slots))
        if len(slot_list) != logits.shape[0]:
            raise InvalidSamplingParams("slots", slot_list, f"{logits.shape[0]} slots, one per logits row")
        if len(set(slot_list)) != len(slot_list):
            raise InvalidSamplingParams("slots", slot_list, "distinct slots")
        for slot in slot_list:
            self.sampler._check_occupied(slot)
        return slot_list

    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None, *,
               record: torch.Tensor | None = None) -> SamplerOutput:
        """`Sampler.sample` on this rank's slice [B, width]: the same output on every rank. Rows
        where `record` (bool [B]) is False are sampled but neither counted nor advanced."""
        from .distributed_step import record_split_tokens, run_split_step
        from .sampler import plan_step

        slot_list = self._check_step(logits, slots, record)
        if not slot_list:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=self.device),
                                 torch.empty(0, dtype=torch.bool, device=self.device), None)
        rows = [self.state.params[s] for s in slot_list]
        plan = plan_step(rows, self.vocab_size)
        index = torch.tensor(slot_list, dtype=torch.int64, device=self.device)
        out = run_split_step(self, logits, index, plan, rows)
        record_split_tokens(self, index, out.token_ids, record)
        return out
