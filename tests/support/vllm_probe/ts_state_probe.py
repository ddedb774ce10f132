"""A vLLM general plugin of the test suite: the sizes of the tokensampler plugin's per-request structures.

Found by vLLM through the entry point beside this file (the directory goes on PYTHONPATH and
`VLLM_PLUGINS` names `ts_state_probe` after `tokensampler`). After each call of the model runner's
`_sample` that tokensampler's sampler served, `$TS_STATE_PROBE_FILE` is replaced (atomically) by
one JSON object: the step count, the request ids the slots hold, and the size of every container
that grows with the requests admitted: the `BatchState`'s seeds and held slots, the
`SamplingGenerator`'s occupied slots, the seeded slots of its sampler (`seed_manager`, a view), the
`Sampler`'s row-key cache, the captured steps, and the batch states the sampler keeps.
"""

from __future__ import annotations

import json
import os

_INSTALLED = False


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
            with open(path + ".tmp", "w") as handle:
                json.dump(sizes(self.sampler), handle)
            os.replace(path + ".tmp", path)
        return out

    runner_module.GPUModelRunner._sample = _sample
    _INSTALLED = True
