"""End-to-end `LLM.generate` throughput of vLLM's CPU engine with and without the tokensampler plugin.

    python benchmarks/vllm_cpu.py [--rounds 3] [--repeats 3] [--json benchmarks/vllm_cpu.json]

The model is a locally built 2-layer Llama (hidden 128, head size 64) with a 151,936-token
vocabulary whose output layer is drawn with std 0.35, so its logits have an LLM-like spread (std
about 4: top-p 0.9 keeps tens of tokens). Each case generates 32 requests x 64 tokens (ignore_eos,
32-token prompts) after an untimed warm-up generate of the same case, `--repeats` times (3: the
median counts; one greedy generate lasts under a second). Each arm (vLLM's own sampler, the plugin)
runs in a process of its own; the arms alternate round by round. Per arm and case: tokens per
second, the wall time per engine step, and the per-step breakdown measured inside the engine: the
model forward, the sampler (vLLM's, or the plugin's whole `forward`), and for the plugin the part of
it outside tokensampler's step (following the persistent batch, vLLM's output format).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

CASES = {
    "greedy": dict(temperature=0.0),
    "topp0.9": dict(temperature=0.8, top_p=0.9),
    "k20_p0.95": dict(temperature=0.7, top_k=20, top_p=0.95),
    "penalties_topp": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.1),
    "logprobs5_topp": dict(temperature=0.8, top_p=0.9, logprobs=5),
}
REQUESTS, TOKENS, PROMPT_LEN, VOCAB = 32, 64, 32, 151936


def _arm(model: str, cases: list[str], out: str, repeats: int) -> None:
    """One arm in this process: every case, warm-up then `repeats` timed generates (the median's
    tokens per second), with step timings over all of them."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
              max_num_seqs=REQUESTS, kv_cache_memory_bytes=256 << 20, seed=0)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    timings = {"forward": [], "sampler": [], "tokensampler_step": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            timings[name].append(time.perf_counter() - start)
            return result
        return wrapper

    runner.model.forward = timed("forward", runner.model.forward)
    runner.sampler.forward = timed("sampler", runner.sampler.forward)
    state_sample = None
    if type(runner.sampler).__name__ == "TokenSamplerSampler":
        from tokensampler.integrations.vllm.batch import BatchState
        state_sample = BatchState.sample
        BatchState.sample = timed("tokensampler_step", BatchState.sample)
    gen = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, VOCAB, (PROMPT_LEN,), generator=gen).tolist())
               for _ in range(REQUESTS)]
    results = {"sampler_class": type(runner.sampler).__name__, "cases": {}}
    for case in cases:
        params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=1000 + i, **CASES[case])
                  for i in range(REQUESTS)]
        llm.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True, seed=7, **CASES[case])] * REQUESTS,
                     use_tqdm=False)  # warm-up: compiled reductions, allocator, caches
        for values in timings.values():
            values.clear()
        runs, decode_steps = [], {name: [] for name in timings}
        for _ in range(repeats):
            counts = {name: len(values) for name, values in timings.items()}
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
            for name, values in timings.items():  # the first call of a generate is its prefill step
                decode_steps[name] += values[counts[name] + 1:]
        seconds = statistics.median(runs)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        steps = len(timings["sampler"]) // repeats
        results["cases"][case] = {
            "seconds": seconds, "seconds_runs": runs, "tokens": generated, "tokens_per_s": generated / seconds,
            "steps": steps, "step_ms": 1e3 * seconds / steps,
            "forward_ms": 1e3 * statistics.median(decode_steps["forward"]),
            "sampler_ms": 1e3 * statistics.median(decode_steps["sampler"]),
            "tokensampler_step_ms": (1e3 * statistics.median(decode_steps["tokensampler_step"])
                                     if decode_steps["tokensampler_step"] else None),
        }
    if state_sample is not None:
        BatchState.sample = state_sample
    Path(out).write_text(json.dumps(results))


def _run_arm(model: Path, cases: list[str], plugin: bool, scratch: Path, tag: str, repeats: int) -> dict:
    out = scratch / f"{tag}.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugin:
        env["VLLM_PLUGINS"] = "tokensampler"
    done = subprocess.run([sys.executable, __file__, "--arm", str(model), ",".join(cases), str(out), str(repeats)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"arm {tag} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def format_table(summary: dict) -> str:
    lines = ["| case | vLLM tok/s | plugin tok/s | plugin / vLLM | vLLM step ms (forward + sampler) | "
             "plugin step ms (forward + sampler) | plugin sampler: tokensampler + conversion ms |",
             "|---|---|---|---|---|---|---|"]
    for case, row in summary.items():
        v, p = row["vllm"], row["plugin"]
        lines.append(f"| {case} | {v['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{p['tokens_per_s'] / v['tokens_per_s']:.2f}x | {v['forward_ms']:.1f} + {v['sampler_ms']:.1f} | "
                     f"{p['forward_ms']:.1f} + {p['sampler_ms']:.1f} | {p['tokensampler_step_ms']:.1f} + "
                     f"{p['sampler_ms'] - p['tokensampler_step_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", dest="cases", action="append", choices=sorted(CASES), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help="reuse this checkpoint directory (built if absent)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per case in each arm (median)")
    parser.add_argument("--arm", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        _arm(args.arm[0], args.arm[1].split(","), args.arm[2], int(args.arm[3]))
        return 0
    cases = args.cases or list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = Path(args.model) if args.model else scratch / "llama-v151936"
        if not (model / "config.json").is_file():
            from tokensampler.tools.tiny_models import build_llama
            build_llama(model, vocab_size=VOCAB, hidden_size=128, layers=2, head_std=0.35, seed=0)
        rounds = []
        for r in range(args.rounds):
            for plugin in (False, True):
                arm = "plugin" if plugin else "vllm"
                print(f"round {r + 1}/{args.rounds}: {arm} ...", file=sys.stderr, flush=True)
                rounds.append({"round": r, "arm": arm,
                               **_run_arm(model, cases, plugin, scratch, f"{arm}{r}", args.repeats)})
    summary = {}
    for case in cases:
        summary[case] = {}
        for arm in ("vllm", "plugin"):
            runs = [rd["cases"][case] for rd in rounds if rd["arm"] == arm]
            summary[case][arm] = {key: statistics.median(run[key] for run in runs)
                                  for key in ("tokens_per_s", "step_ms", "forward_ms", "sampler_ms")}
            if arm == "plugin":
                summary[case][arm]["tokensampler_step_ms"] = statistics.median(run["tokensampler_step_ms"]
                                                                               for run in runs)
    print(format_table(summary))
    if "greedy" in summary:
        greedy = summary["greedy"]["plugin"]["step_ms"]
        print("plugin step / plugin greedy step: " + ", ".join(
            f"{case} {row['plugin']['step_ms'] / greedy:.2f}x" for case, row in summary.items() if case != "greedy"))
    if args.json:
        import torch
        import vllm
        payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": {"platform": platform.platform(), "processor": platform.processor(),
                               "cpus": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__, "vllm": vllm.__version__},
                   "workload": {"requests": REQUESTS, "tokens": TOKENS, "prompt_len": PROMPT_LEN, "vocab": VOCAB,
                                "model": "Llama, 2 layers, hidden 128, head size 64, lm_head std 0.35"},
                   "repeats": args.repeats, "rounds": rounds, "summary": summary}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
