"""End-to-end `LLM.generate` throughput of vLLM's CPU engine with and without the tokensampler plugin.

    python benchmarks/vllm_cpu.py [--rounds 3] [--repeats 3] [--json benchmarks/vllm_cpu.json]
    python benchmarks/vllm_cpu.py --tp 2 [...]     (two tensor-parallel ranks: benchmarks/vllm_cpu_tp.py)

The model is a locally built 2-layer Llama (hidden 128, head size 64) with a 151,936-token
vocabulary whose output layer is drawn with std 0.35, so its logits have an LLM-like spread (std
about 4: top-p 0.9 keeps tens of tokens). Each case generates 32 requests x 64 tokens (ignore_eos,
32-token prompts). Each arm (vLLM's own sampler, the plugin) runs in a process of its own; in each
round both arms' processes are alive side by side, and per case, after an untimed warm-up generate in
each, the timed generates alternate between the arms (`--repeats` per arm, 3x as many for greedy,
whose generate lasts about a second), the arm going first alternating too: a slower spell of the
shared machine then falls on both arms. Per arm and case: tokens per second (the median generate of
the round, then the median over rounds), the median over rounds and repeats of the ratio of
generates run next to each other, the wall time per engine step, and the per-step breakdown
measured inside the engine: the model forward, the sampler (vLLM's, or the plugin's whole
`forward`), and for the plugin the part of it outside tokensampler's step (following the persistent
batch, vLLM's output format)."""

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


GREEDY_REPEAT_FACTOR = 3  # a greedy generate lasts about a second: it is repeated 3x as often


def _serve_arm(model: str, reply_fd: int) -> None:
    """One arm, kept alive for a round: reads one JSON command per line on stdin (`warm` a case,
    `run` one timed generate of a case, `stop`) and answers each with one JSON line on `reply_fd`.
    Step timings are collected inside the engine for every timed generate."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reply = os.fdopen(reply_fd, "w")
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256,
              max_num_seqs=REQUESTS, kv_cache_memory_bytes=256 << 20, seed=0)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    timings: dict[str, list[float]] = {"forward": [], "sampler": [], "tokensampler_step": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            timings[name].append(time.perf_counter() - start)
            return result
        return wrapper

    runner.model.forward = timed("forward", runner.model.forward)
    runner.sampler.forward = timed("sampler", runner.sampler.forward)
    if type(runner.sampler).__name__ == "TokenSamplerSampler":
        from tokensampler.integrations.vllm.batch import BatchState
        BatchState.sample = timed("tokensampler_step", BatchState.sample)
    gen = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, VOCAB, (PROMPT_LEN,), generator=gen).tolist())
               for _ in range(REQUESTS)]

    def answer(payload: dict) -> None:
        reply.write(json.dumps(payload) + "\n")
        reply.flush()

    answer({"sampler_class": type(runner.sampler).__name__})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            break
        case = CASES[command["case"]]
        if command["op"] == "warm":  # untimed: compiled reductions, allocator, caches
            llm.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True, seed=7, **case)] * REQUESTS,
                         use_tqdm=False)
            answer({})
            continue
        params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=1000 + i, **case) for i in range(REQUESTS)]
        for values in timings.values():
            values.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        # the first call of a generate is its prefill step: the decode steps follow it
        answer({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                "steps": len(timings["sampler"]), **{name: values[1:] for name, values in timings.items()}})


class _Arm:
    """An arm's process (`_serve_arm`), driven one command at a time."""

    def __init__(self, model: Path, plugin: bool, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        if plugin:
            env["VLLM_PLUGINS"] = "tokensampler"
        read_fd, write_fd = os.pipe()
        self.log = log
        self.process = subprocess.Popen([sys.executable, __file__, "--serve-arm", str(model), str(write_fd)],
                                        env=env, stdin=subprocess.PIPE, stdout=log.open("w"),
                                        stderr=subprocess.STDOUT, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.sampler_class = self._reply()["sampler_class"]

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise SystemExit(f"arm failed:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def send(self, op: str, case: str | None = None) -> dict:
        self.process.stdin.write(json.dumps({"op": op, "case": case}) + "\n")
        self.process.stdin.flush()
        return {} if op == "stop" else self._reply()

    def stop(self) -> None:
        self.send("stop")
        self.process.wait()


def _round(model: Path, cases: list[str], repeats: int, scratch: Path, r: int) -> list[dict]:
    """One round: both arms alive in processes of their own; per case each is warmed up, then the
    timed generates alternate between the arms (vLLM first, then the plugin first, ...), so a
    slower spell of the machine falls on both. Returns the round's two arm records."""
    arms = {name: _Arm(model, name == "plugin", scratch / f"{name}{r}.log") for name in ("vllm", "plugin")}
    records = {name: {"round": r, "arm": name, "sampler_class": arm.sampler_class, "cases": {}}
               for name, arm in arms.items()}
    for case in cases:
        runs: dict[str, list[dict]] = {name: [] for name in arms}
        for arm in arms.values():
            arm.send("warm", case)
        count = repeats * (GREEDY_REPEAT_FACTOR if case == "greedy" else 1)
        for i in range(count):
            for name in (("vllm", "plugin") if (i + r) % 2 == 0 else ("plugin", "vllm")):
                runs[name].append(arms[name].send("run", case))
        for name, done in runs.items():
            seconds = [run["seconds"] for run in done]
            steps = {key: [t for run in done for t in run[key]] for key in ("forward", "sampler", "tokensampler_step")}
            median = statistics.median(seconds)
            records[name]["cases"][case] = {
                "seconds": median, "seconds_runs": seconds, "tokens": done[0]["tokens"],
                "tokens_per_s": done[0]["tokens"] / median, "steps": done[0]["steps"],
                "step_ms": 1e3 * median / done[0]["steps"],
                "forward_ms": 1e3 * statistics.median(steps["forward"]),
                "sampler_ms": 1e3 * statistics.median(steps["sampler"]),
                "tokensampler_step_ms": (1e3 * statistics.median(steps["tokensampler_step"])
                                         if steps["tokensampler_step"] else None),
            }
        # generate i of one arm ran next to generate i of the other: their ratio is one paired sample
        records["plugin"]["cases"][case]["paired_ratios"] = [
            v["seconds"] / p["seconds"] for v, p in zip(runs["vllm"], runs["plugin"])]
    for arm in arms.values():
        arm.stop()
    return [records["vllm"], records["plugin"]]


def format_table(summary: dict) -> str:
    lines = ["| case | vLLM tok/s | plugin tok/s | plugin / vLLM | paired generates: median ratio | "
             "vLLM step ms (forward + sampler) | plugin step ms (forward + sampler) | "
             "plugin sampler: tokensampler + conversion ms |",
             "|---|---|---|---|---|---|---|---|"]
    for case, row in summary.items():
        v, p = row["vllm"], row["plugin"]
        lines.append(f"| {case} | {v['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{p['tokens_per_s'] / v['tokens_per_s']:.2f}x | {p['paired_ratio']:.2f}x "
                     f"({p['paired_count']}) | {v['forward_ms']:.1f} + {v['sampler_ms']:.1f} | "
                     f"{p['forward_ms']:.1f} + {p['sampler_ms']:.1f} | {p['tokensampler_step_ms']:.1f} + "
                     f"{p['sampler_ms'] - p['tokensampler_step_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--tp" in argv:  # the tensor-parallel arms: vLLM's sampler, the plugin gathered and on shards
        sys.path.insert(0, str(Path(__file__).parent))
        import vllm_cpu_tp

        at = argv.index("--tp")
        if argv[at + 1:at + 2] != [str(vllm_cpu_tp.TP)]:
            print(f"--tp: only {vllm_cpu_tp.TP} ranks are benchmarked (two cores)", file=sys.stderr)
            return 2
        return vllm_cpu_tp.main(argv[:at] + argv[at + 2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", dest="cases", action="append", choices=sorted(CASES), default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help="reuse this checkpoint directory (built if absent)")
    parser.add_argument("--repeats", type=int, default=3,
                        help=f"timed generates per case and arm in each round (greedy: {GREEDY_REPEAT_FACTOR}x)")
    parser.add_argument("--serve-arm", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_arm:
        _serve_arm(args.serve_arm[0], int(args.serve_arm[1]))
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
            print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            rounds += _round(model, cases, args.repeats, scratch, r)
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
                paired = [ratio for run in runs for ratio in run["paired_ratios"]]
                summary[case][arm]["paired_ratio"] = statistics.median(paired)
                summary[case][arm]["paired_count"] = len(paired)
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
                   "repeats": args.repeats, "greedy_repeats": args.repeats * GREEDY_REPEAT_FACTOR,
                   "rounds": rounds, "summary": summary}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
