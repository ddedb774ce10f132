"""`LLM.generate` on vLLM's CPU engine with two tensor-parallel ranks: vLLM's own sampler, the plugin
on the gathered logits, and the plugin on the logits shards.

    python benchmarks/vllm_cpu_tp.py [--rounds 3] [--repeats 2] [--json benchmarks/vllm_cpu_tp.json]
    python benchmarks/vllm_cpu.py --tp 2 ...            (the same)

The model is a locally built 2-layer Llama (hidden 256: 4 attention heads over 2 KV heads, head
size 64) with a 151,936-token vocabulary whose output layer is drawn with std 0.35 (logits std
about 4). Each case generates 32 requests x 64 tokens (ignore_eos, 32-token prompts, seeds 1000 +
i). Each engine runs vLLM's `mp` executor, one worker process per rank, one OMP thread each bound
to its own core. Arms run one engine at a time (three tensor-parallel engines would need six
cores); each round runs every arm once, the arm order rotating from round to round so that a slow
spell of the shared machine does not always fall on the same arm. Per arm and case: tokens per
second (the median generate of a round, then the median over rounds), and measured inside rank
0's worker, per decode step: the model forward, the LM head with vLLM's logits all-gather
(`compute_logits`; on the shard path the head alone), the sampler call (vLLM's, or the plugin's
whole `forward`), and the bytes the rank moves for sampling: the logits all-gather's payload (vLLM's
sampler and the gathered path: the rank's `[B, Vp / 2]` fp32 slice sent, the other slice
received) or, on the shard path, the collectives of tokensampler's vocabulary split (counted by
its `Exchange`). The tokens of the two plugin arms are compared.
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
    "penalties_topp": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.1),
}
ARMS = {"vllm": None, "gathered": "gathered", "shards": "shards"}  # arm -> TOKENSAMPLER_VLLM_LOGITS
REQUESTS, TOKENS, PROMPT_LEN, VOCAB, TP = 32, 64, 32, 151936, 2
PADDED = -(-VOCAB // 64) * 64


def _install_timers(worker) -> None:
    """(in each worker, by `collective_rpc`) time the model forward and the sampler call."""
    import time as clock

    runner = worker.model_runner
    runner.bench_timings = {"forward": [], "logits": [], "sampler": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = clock.perf_counter()
            result = fn(*args, **kwargs)
            runner.bench_timings[name].append(clock.perf_counter() - start)
            return result
        return wrapper

    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)  # LM head + all-gather
    runner.sampler.forward = timed("sampler", runner.sampler.forward)


def _read_timers(worker) -> dict:
    """(in each worker) the timings since the last read, and the split's exchange counters."""
    runner = worker.model_runner
    out = {name: list(values) for name, values in runner.bench_timings.items()}
    for values in runner.bench_timings.values():
        values.clear()
    out["exchange"] = None
    state = getattr(runner.sampler, "state", None)
    if callable(state) and state().shards is not None:
        exchange = state().generator.sampler.agreement.exchange
        out["exchange"] = {"calls": exchange.calls, "sent": exchange.bytes_sent, "received": exchange.bytes_received}
        exchange.reset_counters()
    return out


def _run_arm(model: str, logits: str | None, cases: list[str], repeats: int) -> dict:
    """One engine: per case a warm-up generate, then `repeats` timed generates."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    if logits is not None:
        os.environ["TOKENSAMPLER_VLLM_LOGITS"] = logits
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
              max_num_seqs=REQUESTS, kv_cache_memory_bytes=256 << 20, seed=0, tensor_parallel_size=TP,
              distributed_executor_backend="mp")
    llm.collective_rpc(_install_timers)
    gen = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, VOCAB, (PROMPT_LEN,), generator=gen).tolist())
               for _ in range(REQUESTS)]
    result = {"cases": {}}
    for name in cases:
        case = CASES[name]
        llm.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True, seed=7, **case)] * REQUESTS,
                     use_tqdm=False)
        llm.collective_rpc(_read_timers)
        runs = []
        for _ in range(repeats):
            params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=1000 + i, **case)
                      for i in range(REQUESTS)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            rank0 = llm.collective_rpc(_read_timers)[0]
            runs.append({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                         "token_ids": [list(o.outputs[0].token_ids) for o in outputs], **rank0})
        result["cases"][name] = runs
    llm.llm_engine.engine_core.shutdown()
    return result


def _arm_process(model: Path, arm: str, cases: list[str], repeats: int, out: Path, log: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "TOKENSAMPLER_VLLM_LOGITS")}
    if ARMS[arm] is not None:
        env["VLLM_PLUGINS"] = "tokensampler"
    command = [sys.executable, __file__, "--arm", str(model), arm, ",".join(cases), str(repeats), str(out)]
    done = subprocess.run(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def _trim(run: dict) -> None:
    """A run as recorded: its per-step timings replaced by their decode-step medians (ms)."""
    run.pop("token_ids", None)
    run["steps"] = len(run["sampler"])
    for name in ("forward", "logits", "sampler"):
        run[f"{name}_ms"] = 1e3 * statistics.median(_decode(run.pop(name)))


def _decode(values: list[float]) -> list[float]:
    return values[1:]  # the first sampler call of a generate is its prefill step


def summarise(rounds: list[dict], cases: list[str]) -> dict:
    summary: dict = {}
    for case in cases:
        summary[case] = {}
        for arm in ARMS:
            runs = [run for rd in rounds for run in rd[arm]["cases"][case]]
            per_round = [statistics.median(run["tokens"] / run["seconds"] for run in rd[arm]["cases"][case])
                         for rd in rounds]
            steps = [len(run["sampler"]) for run in runs]
            row = {"tokens_per_s": statistics.median(per_round),
                   "forward_ms": 1e3 * statistics.median(t for run in runs for t in _decode(run["forward"])),
                   "logits_ms": 1e3 * statistics.median(t for run in runs for t in _decode(run["logits"])),
                   "sampler_ms": 1e3 * statistics.median(t for run in runs for t in _decode(run["sampler"])),
                   "steps": statistics.median(steps)}
            if runs[0]["exchange"] is not None:
                row["bytes_per_step"] = statistics.median(
                    (run["exchange"]["sent"] + run["exchange"]["received"]) / len(run["sampler"]) for run in runs)
                row["collectives_per_step"] = statistics.median(run["exchange"]["calls"] / len(run["sampler"])
                                                                for run in runs)
            else:  # vLLM's logits all-gather: this rank's [B, Vp / TP] fp32 slice out, the other in
                row["bytes_per_step"] = REQUESTS * PADDED * 4 * (1 + (TP - 1)) / TP
                row["collectives_per_step"] = 1
            summary[case][arm] = row
        gathered = [run["token_ids"] for rd in rounds for run in rd["gathered"]["cases"][case]]
        shards = [run["token_ids"] for rd in rounds for run in rd["shards"]["cases"][case]]
        summary[case]["shards_equal_gathered"] = gathered == shards
    return summary


def format_table(summary: dict) -> str:
    lines = ["| case | arm | tok/s | / vLLM | forward ms | LM head + gather ms | sampler ms | bytes moved per step "
             "and rank | collectives per step | tokens = gathered |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case, rows in summary.items():
        base = rows["vllm"]
        for arm in ARMS:
            row = rows[arm]
            same = "" if arm == "vllm" else ("yes" if rows["shards_equal_gathered"] else "NO")
            lines.append(f"| {case} | {arm} | {row['tokens_per_s']:.0f} | "
                         f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {row['forward_ms']:.1f} | "
                         f"{row['logits_ms']:.1f} | {row['sampler_ms']:.1f} | "
                         f"{row['bytes_per_step'] / 1e3:,.1f} kB | {row['collectives_per_step']:.1f} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed generates per case, arm and round")
    parser.add_argument("--case", dest="cases", action="append", choices=sorted(CASES), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help="reuse this checkpoint directory (built if absent)")
    parser.add_argument("--arm", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        model, arm, cases, repeats, out = args.arm
        result = _run_arm(model, ARMS[arm], cases.split(","), int(repeats))
        Path(out).write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    cases = args.cases or list(CASES)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = Path(args.model) if args.model else scratch / "llama-v151936-tp"
        if not (model / "config.json").is_file():
            from tokensampler.tools.tiny_models import build_llama
            build_llama(model, vocab_size=VOCAB, hidden_size=256, kv_heads=2, layers=2, head_std=0.35, seed=0)
        names = list(ARMS)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)} ...", file=sys.stderr, flush=True)
            rounds.append({arm: _arm_process(model, arm, cases, args.repeats, scratch / f"{arm}{r}.json",
                                             scratch / f"{arm}{r}.log") for arm in order})
    summary = summarise(rounds, cases)
    print(format_table(summary))
    if args.json:
        import torch
        import vllm
        for rd in rounds:  # token ids are compared above; the file keeps each run's decode-step medians
            for arm in rd.values():
                for runs in arm["cases"].values():
                    for run in runs:
                        _trim(run)
        payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": {"platform": platform.platform(), "processor": platform.processor(),
                               "cpus": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__, "vllm": vllm.__version__},
                   "workload": {"requests": REQUESTS, "tokens": TOKENS, "prompt_len": PROMPT_LEN, "vocab": VOCAB,
                                "tensor_parallel_size": TP,
                                "model": "Llama, 2 layers, hidden 256 (4 heads, 2 KV heads), lm_head std 0.35"},
                   "repeats": args.repeats, "rounds": rounds, "summary": summary}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
