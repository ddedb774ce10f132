"""A vLLM general plugin of the serving benchmark: where the engine's step time goes.

Found by vLLM through the entry point beside this file (`benchmarks/serve.py --breakdown` puts this
directory on PYTHONPATH and adds `ts_step_timer` to `VLLM_PLUGINS`, with the plugin or without it).
It wraps three methods of vLLM's model runner and keeps, per method, the number of calls and their
total wall time in seconds:

- `execute_model`: the forward pass up to the logits;
- `sample_tokens`: everything after the logits (sampling, bookkeeping of the output);
- `_sample`: the sampler itself (vLLM's or tokensampler's), inside `sample_tokens`.

After every step and at exit `$TS_STEP_TIMER_FILE` is replaced (atomically) by those totals as JSON;
the benchmark reads it before and after each timed run and takes the difference.
"""

from __future__ import annotations

import atexit
import json
import os
import time

_INSTALLED = False
METHODS = ("execute_model", "sample_tokens", "_sample")


def register() -> None:
    global _INSTALLED
    path = os.environ.get("TS_STEP_TIMER_FILE")
    if _INSTALLED or not path:
        return
    import vllm.v1.worker.gpu_model_runner as runner_module

    totals = {name: [0, 0.0] for name in METHODS}

    def dump() -> None:
        with open(path + ".tmp", "w") as handle:
            json.dump(totals, handle)
        os.replace(path + ".tmp", path)

    def timed(name, original):
        def wrapper(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                entry = totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - started
                if name == "sample_tokens":
                    dump()
        return wrapper

    for name in METHODS:
        setattr(runner_module.GPUModelRunner, name, timed(name, getattr(runner_module.GPUModelRunner, name)))
    atexit.register(dump)
    _INSTALLED = True
