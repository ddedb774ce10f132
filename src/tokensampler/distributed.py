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
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .ops import distributed_select as sel
from .output import SamplerOutput
from .params import InvalidSamplingParams, SamplingParams, check_params_for_vocab
from .state import SamplerState

if TYPE_CHECKING:
    from .sampler import Sampler

NEG_INF = float("-inf")
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_TOP_P_PIVOTS = 255


class SplitMismatch(InvalidSamplingParams):
    """The ranks of a vocabulary-split group disagree (slice width, batch size, slots, parameters),
    or another rank rejected its input. Raised on every rank, before any state changes."""


# ================================================================== collectives
class Exchange:
    """The one collective a split step needs (all-gather of a small tensor), with byte counters.

    `bytes_sent` counts what this rank contributes, `bytes_received` what it gets from the others
    (payload only, no transport overhead); `calls` counts collectives.
    """

    rank: int = 0
    world_size: int = 1

    def __init__(self) -> None:
        self.reset_counters()

    def reset_counters(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[*shape] on every rank -> [world_size, *shape], rank order, identical on every rank."""
        nbytes = tensor.numel() * tensor.element_size()
        self.calls += 1
        self.bytes_sent += nbytes
        self.bytes_received += nbytes * (self.world_size - 1)
        return self._all_gather(tensor.contiguous())

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchExchange(Exchange):
    """`Exchange` over a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidSamplingParams("group", group, "a group of an initialised torch.distributed")
        super().__init__()
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)


def as_exchange(group: Any) -> Exchange:
    """A process group, or an `Exchange` (custom transports, tests), as an `Exchange`."""
    return group if isinstance(group, Exchange) else TorchExchange(group)


# ================================================================== data-parallel groups
@dataclass(frozen=True)
class SamplingDP:
    """`dp` independent sampling groups of `tp` ranks each in a world of dp * tp ranks.

    Group g holds ranks [g * tp, (g + 1) * tp) (the usual TP-inner layout). Rows are split across
    groups by slot, round robin: global slot s lives in group s % dp, at local slot s // dp.
    """

    tp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSamplingParams(name, value, "an int >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def group_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise InvalidSamplingParams("rank", rank, f"an int in [0, {self.world_size})")
        return rank // self.tp

    def locate(self, global_slot: int) -> tuple[int, int]:
        """(group, local slot) of a global slot."""
        if isinstance(global_slot, bool) or not isinstance(global_slot, int) or global_slot < 0:
            raise InvalidSamplingParams("global_slot", global_slot, "an int >= 0")
        return global_slot % self.dp, global_slot // self.dp

    def global_slot(self, group: int, local_slot: int) -> int:
        return local_slot * self.dp + group

    def new_groups(self) -> list[Any]:
        """Create the dp process groups (every rank of the world must call this, in step)."""
        import torch.distributed as dist

        if dist.get_world_size() != self.world_size:
            raise InvalidSamplingParams("world_size", dist.get_world_size(), f"tp * dp = {self.world_size}")
        return [dist.new_group(self.ranks_of(g)) for g in range(self.dp)]


def sampling_dp(tp: int, dp: int) -> SamplingDP:
    """The layout of `dp` sampling groups of `tp` ranks (see `SamplingDP`)."""
    return SamplingDP(tp, dp)


# ================================================================== the split sampler
def _fingerprint(*parts: Any) -> int:
    """A 63-bit hash of a repr, the same in every process (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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
        world = self.exchange.world_size
        padded = sampler.padded_vocab_size
        if padded % world:
            raise InvalidSamplingParams("padded_vocab_size", padded, f"a multiple of the group size {world}")
        self.sampler = sampler
        self.vocab_size = sampler.vocab_size
        self.width = padded // world
        self.offset = self.exchange.rank * self.width
        self.real_width = max(0, min(self.width, self.vocab_size - self.offset))  # ids < V held here
        self.device = sampler.device
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
            sampler._check_slot(slot)
            if not isinstance(params, SamplingParams):
                raise InvalidSamplingParams("params", params, "a SamplingParams")
            check_params_for_vocab(params, self.vocab_size, sampler.max_logprobs)
            prompt = sampler._token_list("prompt_token_ids", prompt_token_ids)
            outputs = sampler._token_list("output_token_ids", output_token_ids)
            if position is None:
                position = len(prompt) + len(outputs)
            if not isinstance(position, int) or not 0 <= position < 2**32:
                raise InvalidSamplingParams("position", position, "an int in [0, 2^32)")
            if not isinstance(stream, int) or not 0 <= stream < 2**32:
                raise InvalidSamplingParams("stream", stream, "an int in [0, 2^32)")
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
        st = self.state
        bare = dataclasses.replace(params, logit_bias=None, allowed_token_ids=None, stop_token_ids=())
        st.admit(slot, bare, seed, position, stream, self._local(prompt), self._local(outputs), ())
        st.params[slot] = params
        st.output_len[slot] = len(outputs)
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

    # ------------------------------------------------------------ the step
    def _check_step(self, logits: Any, slots: Any) -> list[int]:
        """Local checks, then one all-gather: every rank raises if any rank failed or disagrees."""
        error, slot_list, batch, width = None, [], -1, -1
        try:
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                            f"a 2-d tensor [B, {self.width}] (this rank's slice)")
            batch, width = logits.shape
            if width == self.width:
                slot_list = self._check_local_step(logits, slots)
        except Exception as exc:  # noqa: BLE001 - raised after the all-gather, so no rank is left waiting
            error = exc
        digest = _fingerprint([self._row_key(s) for s in slot_list], str(getattr(logits, "dtype", "")))
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
                                "the same slots, requests and logits dtype on every rank of the group")
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

    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None) -> SamplerOutput:
        """`Sampler.sample` on this rank's slice [B, width]: the same output on every rank."""
        from .distributed_step import record_split_tokens, run_split_step
        from .sampler import plan_step

        slot_list = self._check_step(logits, slots)
        if not slot_list:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=self.device),
                                 torch.empty(0, dtype=torch.bool, device=self.device), None)
        rows = [self.state.params[s] for s in slot_list]
        plan = plan_step(rows, self.vocab_size)
        index = torch.tensor(slot_list, dtype=torch.int64, device=self.device)
        out = run_split_step(self, logits, index, plan, rows)
        record_split_tokens(self, index, out.token_ids)
        return out
