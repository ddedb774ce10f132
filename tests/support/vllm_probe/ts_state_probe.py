"""A vLLM general plugin of the test suite: the sizes of the tokensampler plugin's per-request structures.

Found by vLLM through the entry point beside this file (the directory goes on PYTHONPATH and
`VLLM_PLUGINS` names `ts_state_probe` after `tokensampler`). After each call of the model runner's
`_sample` that tokensampler's sampler served, `$TS_STATE_PROBE_FILE` is replaced (atomically) by
one JSON object: the step count, the request ids the slots hold, and the size of every container
that grows with the requests admitted: the `BatchState`'s seeds and held slots, the
`SamplingGenerator`'s occupied slots, the seeded slots of its sampler (`seed_manager`, a view), the
`Sampler`'s row-key cache, the captured steps, and the batch states the sampler keeps; and the
bytes the engine process's C heap has handed out and not freed (`heap_in_use`: glibc's `mallinfo2`,
arena and mmapped blocks), read every `HEAP_EVERY` steps: what a leak grows, where the resident size
also grows with what the allocator keeps of freed blocks.
"""

from __future__ import annotations

import ctypes
import json
import os

_INSTALLED = False
HEAP_EVERY = 32


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_in_use() -> int | None:
    """Bytes allocated by malloc and not freed in this process (None without glibc's mallinfo2)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def sizes(sampler) -> dict:
    """The per-request structure sizes of one `TokenSamplerSampler` (its current batch state)."""
    state = sampler.state()
    generator = state.generator
    return {"steps": sampler.steps,
            "held_ids": [rid for rid in state.held if rid is not None],
            "seeds": len(state.seeds),
            "held": sum(rid is not None for rid in state.held),
            "occupied": sum(generator._occupied),
            "seed_slots": sum(s is not None for s in generator.seed_manager.seeds),
            "row_keys": len(generator.sampler._row_keys),
            "traces": len(generator.tracer.keys()),
            "batch_states": len(sampler._states),
            "lanes": state.lanes}


_HEAP: list[int | None] = [None]


def register() -> None:
    global _INSTALLED
    path = os.environ.get("TS_STATE_PROBE_FILE")
    if _INSTALLED or not path:
        return
    import vllm.v1.worker.gpu_model_runner as runner_module

    original = runner_module.GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        out = original(self, logits, spec_decode_metadata)
        state = getattr(self.sampler, "state", None)
        if callable(state) and getattr(self, "input_batch", None) is not None:
            report = sizes(self.sampler)
            if report["steps"] % HEAP_EVERY == 1 or _HEAP[0] is None:
                _HEAP[0] = heap_in_use()
            report["heap_in_use"] = _HEAP[0]
            with open(path + ".tmp", "w") as handle:
                json.dump(report, handle)
            os.replace(path + ".tmp", path)
        return out

    runner_module.GPUModelRunner._sample = _sample
    _INSTALLED = True
