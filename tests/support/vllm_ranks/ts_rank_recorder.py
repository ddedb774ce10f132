"""A vLLM general plugin of the test suite: every worker rank records what its model runner sampled.

Found by vLLM through the entry point beside this file (the directory goes on PYTHONPATH and
`VLLM_PLUGINS` names `ts_rank_recorder`), so it runs in each worker process of a multi-process
engine, whatever the start method. Each call of the runner's `_sample` (the sampler or the
rejection sampler, with the plugin or with vLLM's own) appends one JSON line to
`$TS_RANK_RECORD_DIR/<tag>-tp<rank>-pp<rank>-<pid>.jsonl` (`TS_RANK_RECORD_TAG` names the engine):
the sampler classes, whether drafts were verified, the rows' request ids, the sampled ids, the
width of the logits the sampler got, and, with tokensampler's sampler, the seed of every request
it holds.
"""

from __future__ import annotations

import json
import os

_INSTALLED = False


def register() -> None:
    global _INSTALLED
    directory = os.environ.get("TS_RANK_RECORD_DIR")
    if _INSTALLED or not directory:
        return
    import vllm.v1.worker.gpu_model_runner as runner_module

    original = runner_module.GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        out = original(self, logits, spec_decode_metadata)
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tag = os.environ.get("TS_RANK_RECORD_TAG", "engine")
        tp, pp = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        rows = self.input_batch.num_reqs
        record = {"sampler": type(self.sampler).__name__,
                  "rejection_sampler": type(getattr(self, "rejection_sampler", None)).__name__,
                  "speculative": spec_decode_metadata is not None,
                  "req_ids": list(self.input_batch.req_ids[:rows]),
                  "sampled": out.sampled_token_ids.tolist(),
                  "logits_width": None if logits is None else int(logits.shape[-1]),
                  "seeds": None}
        state = getattr(self.sampler, "state", None)
        if callable(state):
            record["seeds"] = dict(state().seeds)
        path = os.path.join(directory, f"{tag}-tp{tp}-pp{pp}-{os.getpid()}.jsonl")
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return out

    runner_module.GPUModelRunner._sample = _sample
    _INSTALLED = True
