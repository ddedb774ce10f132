"""Runs vLLM's real engine (in-process V1, CPU) in a process of its own and writes what it produced.

    python tests/support/vllm_driver.py SPEC.json OUT.json

SPEC: {"engines": [{"name", "llm": {LLM kwargs}, "env": {variables set before the engine is built},
"runs": [{"name", "prompts": [token id lists], "params": [vLLM SamplingParams kwargs, one per
prompt], "extend": optional name of an earlier run (each prompt continues with that run's first
completion of it), "reset_prefix_cache": optional, true to empty the prefix cache before the
run}]}]}. Each engine is built, runs its runs in order (one `LLM.generate` each) and is shut down.
OUT: per engine the sampler class the model runner holds (in-process engines), per run every
completion's token ids and logprobs ([[id, logprob, rank], ...] per position), the prompts it ran,
the request ids and the engine's counters after it (preemptions, speculative decoding, prefix
cache), and the same counters at the end. Plugins are loaded by vLLM from
the environment (VLLM_PLUGINS), once per process: a test that compares the plugin with vLLM's own
sampler runs two drivers. A tensor-parallel engine (`tensor_parallel_size` > 1) runs its workers
in processes of vLLM's `mp` executor; `TS_RANK_RECORD_TAG` is set to the engine's name, for the
test plugin that records each rank's samples and sampler classes (tests/support/vllm_ranks).
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINE_DEFAULTS = dict(dtype="float32", enforce_eager=True, block_size=32, max_model_len=256, max_num_seqs=8,
                       kv_cache_memory_bytes=4 << 20, disable_log_stats=False, seed=0)


def _runner(llm):
    """The model runner of an in-process engine (None when the workers are processes of their own)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(executor, "driver_worker", None)
    return None if worker is None else worker.worker.model_runner


def _metrics(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:num_preemptions", "vllm:spec_decode_num_drafts",
                           "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                           "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            out[metric.name] = getattr(metric, "value", None)
    return out


def _completion(output) -> dict:
    logprobs = None
    if output.logprobs is not None:
        logprobs = [[[int(i), float(lp.logprob), int(lp.rank)] for i, lp in position.items()]
                    for position in output.logprobs]
    return {"token_ids": list(output.token_ids), "logprobs": logprobs, "text": output.text}


def _params(kw: dict) -> dict:
    """SamplingParams kwargs from JSON (whose object keys are strings: logit_bias's ids; a
    `structured_outputs` object is `StructuredOutputsParams`' kwargs)."""
    if kw.get("logit_bias"):
        kw = {**kw, "logit_bias": {int(k): v for k, v in kw["logit_bias"].items()}}
    if kw.get("structured_outputs"):
        from vllm.sampling_params import StructuredOutputsParams

        kw = {**kw, "structured_outputs": StructuredOutputsParams(**kw["structured_outputs"])}
    return kw


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = {"engines": []}
    for engine in spec["engines"]:
        os.environ.update(engine.get("env", {}))
        os.environ["TS_RANK_RECORD_TAG"] = engine["name"]
        llm = LLM(model=spec["model"], **{**ENGINE_DEFAULTS, **engine.get("llm", {})})
        runner = _runner(llm)
        record = {"name": engine["name"], "runs": {}, "prompts": {}, "request_ids": {}, "run_metrics": {}}
        for run_spec in engine["runs"]:
            ids = run_spec["prompts"]
            if run_spec.get("extend"):
                earlier = record["runs"][run_spec["extend"]]
                ids = [p + earlier[i][0]["token_ids"] for i, p in enumerate(record["prompts"][run_spec["extend"]])]
            if run_spec.get("reset_prefix_cache"):
                assert llm.reset_prefix_cache()
            prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
            params = [SamplingParams(**_params(kw)) for kw in run_spec["params"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            record["runs"][run_spec["name"]] = [[_completion(c) for c in o.outputs] for o in outputs]
            record["prompts"][run_spec["name"]] = ids
            record["request_ids"][run_spec["name"]] = [o.request_id for o in outputs]
            record["run_metrics"][run_spec["name"]] = _metrics(llm)
        record["metrics"] = _metrics(llm)
        if runner is not None:
            record["sampler"] = type(runner.sampler).__name__
            record["rejection_sampler"] = type(getattr(runner, "rejection_sampler", None)).__name__
            record["steps"] = getattr(runner.sampler, "steps", None)
        results["engines"].append(record)
        del runner
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


if __name__ == "__main__":  # the guard vLLM's mp executor needs (its workers are spawned)
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    result = run(spec)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's interpreter teardown
