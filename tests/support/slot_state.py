"""`check_slot_state`: the invariant of a `Sampler`'s slot state (its one owner, `SamplerState`).

The host record (params, seed, stream) and the device columns are written together by the state's
own methods; this reads the device (a host sync, for tests) and checks they agree for every slot
that holds a request: seed and stream, and the parameter columns the record's params give.
"""

from __future__ import annotations

import torch

from tokensampler import Sampler
from tokensampler.core import rng


def check_slot_state(sampler: Sampler) -> None:
    """Raise AssertionError where a slot's host record and device columns disagree."""
    st = sampler.state
    seeds, streams = st.seed.tolist(), st.stream.tolist()
    temperature, top_k, top_p = st.temperature.tolist(), st.top_k.tolist(), st.top_p.tolist()
    for slot in range(sampler.max_slots):
        record = st.record(slot)
        if record.params is None:
            continue
        want_seed = 0 if record.seed is None else rng.seed_to_int64(record.seed)
        assert (seeds[slot], streams[slot]) == (want_seed, record.stream), (slot, record, seeds[slot], streams[slot])
        p = record.params
        assert temperature[slot] == torch.tensor(p.temperature, dtype=torch.float32).item(), (slot, p)
        assert top_k[slot] == min(p.top_k, 2**63 - 1) and top_p[slot] == p.top_p, (slot, p)
