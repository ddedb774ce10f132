"""`BatchState`: tokensampler's per-slot state attached to vLLM's persistent batch.

Slot s of a `SamplingGenerator` is row s of vLLM's `InputBatch`. Before every step the rows' request
ids are compared with the ids the slots hold, and the difference becomes the decode contract's
commands, in this order:

1. `release_slots`: requests that left the batch (finished, preempted, not scheduled this step);
2. `apply_decode_state(slot_remap=...)`: requests that moved to another row (`condense`, `swap_states`);
   only the slots that change hands are copied;
3. `apply_prefill_state`: requests that entered the batch (new, or resumed after preemption with
   the outputs they already have: their history and position continue from those).

A request's seed, position and penalty counts stay on the device from step to step (O(B) updates by
the sampled tokens); nothing is rebuilt from token lists except at admission. Mirostat's mu cannot
be rebuilt from tokens: a request that leaves with Mirostat on parks its mu (`parked`, the latest
`PARKED_LIMIT` per lane, oldest dropped first) and a resumed one (with outputs) takes it back. The comparison is
O(rows) on the host. Every admission is logged at DEBUG (logger `tokensampler.integrations.vllm`):
request id, slot and the effective seed, drawn or given, so an unseeded request can be replayed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from ...core.output import LogprobsOutput
from ...engine.batch_params import BatchSamplingParams
from ...engine.generator import SamplingGenerator
from ...state.layout import VocabLayout
from .params import to_tokensampler
from .shards import local_columns

RequestLookup = Callable[[str], Any]  # request id -> vLLM's CachedRequestState
PARKED_LIMIT = 4  # Mirostat mus kept per lane for requests that left (preempted, or finished)
LOG = logging.getLogger("tokensampler.integrations.vllm")


class BatchState:
    """The tokensampler state of one vLLM persistent batch (`lanes` rows, `vocab_size` logits).

    seed_source: the seeds of unseeded requests (None: fresh ones); the ranks of a tensor-parallel
    group pass the same source (`ranks.agreed_seed_source`) and admit the same requests in the same
    order, so they draw the same seeds.
    shards: sample this rank's columns of the logits (`shards.shard_layout`) over `group`, the
    tensor-parallel group (the generator's vocabulary split: the same tokens on every rank, and
    rank 0's seeds for unseeded requests); None: the whole rows, on this rank alone.
    backend, compile: the generator's `Sampler` choice (the plugin's sampler resolves them once).
    """

    def __init__(self, lanes: int, vocab_size: int, device: torch.device | str, *, logprobs_mode: str,
                 max_logprobs: int, seed_source: Callable[[], int] | None = None,
                 shards: VocabLayout | None = None, group: Any = None, backend: str | None = None,
                 compile: bool | None = None) -> None:
        self.lanes = lanes
        self.vocab_size = vocab_size
        self.shards = shards
        self.generator = SamplingGenerator(vocab_size, max_batch_size=lanes, device=device,
                                           logprobs_mode=logprobs_mode, max_logprobs=max_logprobs,
                                           seed_source=seed_source, group=group,
                                           padded_vocab_size=None if shards is None else shards.padded_vocab_size,
                                           backend=backend, compile=compile)
        self.held: list[str | None] = [None] * lanes  # the request id each slot holds (its identity only:
        # the slot's state, seed included, is the generator's sampler's)
        self.parked: OrderedDict[str, float] = OrderedDict()  # request id -> Mirostat mu when it left

    @property
    def seeds(self) -> dict[str, int]:
        """request id -> effective seed (drawn for unseeded requests), of every request held now."""
        return {rid: self.generator.seed_of(slot) for slot, rid in enumerate(self.held) if rid is not None}

    def follow(self, req_ids: Sequence[str | None], lookup: RequestLookup) -> None:
        """Make slot i hold the request of row i, for every row of the persistent batch."""
        rows = list(req_ids) + [None] * (self.lanes - len(req_ids))
        if rows == self.held:  # the usual decode step: nothing moved
            return
        where = {rid: s for s, rid in enumerate(self.held) if rid is not None}
        present = set(rows)
        gone = [s for s, rid in enumerate(self.held) if rid is not None and rid not in present]
        if gone:
            self._park(gone)
            self.generator.release_slots(gone)
            for s in gone:
                self.held[s] = None
        remap = self._remap(rows, where)
        if remap is not None:
            self.generator.apply_decode_state(BatchSamplingParams(), reload_sampling_params=False,
                                              reset_sampling_state=False, slot_remap=remap)
            self.held = [self.held[j] for j in remap]
        new = [i for i, rid in enumerate(rows) if rid is not None and self.held[i] != rid]
        if new:
            self._admit(new, [rows[i] for i in new], lookup)

    def _remap(self, rows: list[str | None], where: dict[str, int]) -> list[int] | None:
        """new slot i <- old slot remap[i]: each staying request to its new row, the other slots in order."""
        remap: list[int | None] = [where.get(rid) if rid is not None else None for rid in rows]
        taken = {j for j in remap if j is not None}
        spare = iter(j for j in range(self.lanes) if j not in taken)
        full = [j if j is not None else next(spare) for j in remap]
        return None if full == list(range(self.lanes)) else full

    def _park(self, slots: list[int]) -> None:
        """Keep the Mirostat mu of the requests leaving `slots` (one device read, only if one has it)."""
        mirostat = [s for s in slots if self.generator.params_of(s).mirostat_tau is not None]
        for slot in mirostat:
            self.parked.pop(self.held[slot], None)
        for slot, mu in zip(mirostat, self.generator.sampler.mus_of(mirostat)):
            self.parked[self.held[slot]] = mu
        while len(self.parked) > PARKED_LIMIT * self.lanes:
            self.parked.popitem(last=False)

    def _admit(self, slots: list[int], req_ids: list[str], lookup: RequestLookup) -> None:
        requests = [lookup(rid) for rid in req_ids]
        params = [to_tokensampler(r.sampling_params, self.vocab_size) for r in requests]
        prompts = [list(r.prompt_token_ids or ()) for r in requests]
        outputs = [list(r.output_token_ids) for r in requests]
        mus = [self.parked.pop(rid, None) if out and p.mirostat_tau is not None else None
               for rid, out, p in zip(req_ids, outputs, params)]  # a resumed request continues its mu
        seeds = self.generator.apply_prefill_state(
            sampling_params=BatchSamplingParams.from_requests(params), prompt_tokens=_rows(prompts),
            empty_slots=slots, output_tokens=_rows(outputs) if any(outputs) else None, mirostat_mu=mus)
        for slot, rid, seed, p in zip(slots, req_ids, seeds, params):
            self.held[slot] = rid
            LOG.debug("admitted request %s to slot %d, seed %d (%s)", rid, slot, seed,
                      "given" if p.seed is not None else "drawn")

    def sample(self, logits: torch.Tensor, record: Sequence[bool]) -> tuple[torch.Tensor, LogprobsOutput | None]:
        """Sample row b of `logits` for slot b; only rows where `record` is True are counted and advanced.
        On shards, `logits` is this rank's `[B, Vp / tp]` slice, or whole rows it takes its columns of."""
        active = [b for b, keep in enumerate(record) if keep]
        if self.shards is not None:
            logits = local_columns(self.shards, logits)
        # every row recorded: the generator's default (every occupied slot below B) is exactly them
        return self.generator.sample(logits, active_slots=None if len(active) == len(record) else active)


def _rows(lists: list[list[int]]) -> torch.Tensor:
    """Token lists as one int64 [len(lists), max len] tensor, -1 = padding (at least one column)."""
    width = max([len(ids) for ids in lists] + [1])
    out = torch.full((len(lists), width), -1, dtype=torch.int64)
    for i, ids in enumerate(lists):
        if ids:
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out
