"""`vllm serve` with and without the tokensampler plugin, measured by vLLM's own `vllm bench serve`.

    python benchmarks/serve.py [--rounds 2] [--part sampler --part generation-config --part synthetic]
                               [--json benchmarks/serve.json] [--plot benchmarks/serve.png]

Parts (all by default):

- `sampler`: SmolLM2-135M-Instruct (materialised offline by `tokensampler smollm2`), served with
  vLLM's sampler (`off`) and with the plugin (`on`), each driven by `vllm bench serve` (the random
  dataset, fixed seed, 128-token prompts, 128 output tokens, `--ignore-eos`) at concurrency 1, 8 and
  32 for the cases of `CASES`.
- `generation-config`: the same checkpoint with a `generation_config.json` that asks for sampling
  (`do_sample`, temperature 1.0, top_k 20, top_p 0.95, as many recent checkpoints ship), served with
  `--generation-config auto` (vLLM's default: the checkpoint's values are the requests' defaults) and
  `--generation-config vllm` (neutral defaults), plugin off and on: four arms. Each arm is timed on
  requests that set nothing, and answers seeded identity requests (`identity_checks`): with the
  plugin, the tokens are those tokensampler's definition gives on the model's logits (recomputed
  offline with transformers), and the checkpoint's defaults change them exactly where they change
  the distribution.
- `synthetic`: the 2-layer Llama of `benchmarks/vllm_cpu.py` with a 151,936-token vocabulary, where
  the sampler's share of a step is larger, through the same server path.

One server runs at a time; within a round every arm runs once, and the order of the arms alternates
from round to round, so a slower spell of the shared machine falls on both. Each server is first
warmed up on every case and concurrency (untimed), so that what either sampler compiles or caches
for a new batch shape is not timed. Per arm, case and concurrency the medians over rounds of output
tokens/s, TTFT and TPOT go to the JSON, the README table (`format_table`) and the plot (`plot`,
matplotlib, the `[plot]` extra). Every server also loads the `ts_step_timer` plugin of
`benchmarks/vllm_step_timer/`, which times the engine's step by part (the forward, the sampling
call, the sampler inside it): `format_breakdown` says where a difference between the arms comes from.

The bench client is vLLM's `vllm bench serve` itself (`vllm.benchmarks.serve`, the code behind the
command), called in this process so that its import (about 10 s) is paid once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.vllm_server import Server  # noqa: E402

CASES: dict[str, list[str]] = {
    "greedy": ["--temperature", "0"],
    "default": [],  # the server's defaults: temperature 1.0 unless the checkpoint says otherwise
    "topp0.95": ["--temperature", "1.0", "--top-p", "0.95"],
    "k20_p0.8": ["--temperature", "1.0", "--top-k", "20", "--top-p", "0.8"],
    "rep1.1_p0.95": ["--temperature", "1.0", "--repetition-penalty", "1.1", "--top-p", "0.95"],
}
CONCURRENCY = (1, 8, 32)
MIN_PROMPTS = 2  # a run sends max(concurrency, 2) prompts: one wave (they all start and end together)
INPUT_LEN = OUTPUT_LEN = 128
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
SERVE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-num-seqs", "32",
               "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--uvicorn-log-level", "warning"]
MAX_MODEL_LEN = 512
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
STEP_TIMER = Path(__file__).with_name("vllm_step_timer")  # the ts_step_timer plugin (its docstring)
WARMUP_TOKENS = 8


def bench_serve(url: str, tokenizer: Path, case: list[str], concurrency: int, prompts: int,
                output_len: int = OUTPUT_LEN) -> dict[str, Any]:
    """One `vllm bench serve` run (random dataset, seed 0, --ignore-eos); its result dictionary."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", url, "--model", "model", "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(output_len),
            "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", "0",
            "--disable-tqdm", *case]
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(parser.parse_args(argv))
    if result.get("failed"):
        raise RuntimeError(f"{result['failed']} of {prompts} requests failed: {result.get('errors')}")
    return {key: result[key] for key in (*METRICS, "completed", "duration", "total_output_tokens")}


def step_totals(path: Path) -> dict[str, list[float]]:
    """The step timer's totals so far: {method: [calls, seconds]} (empty before the first step)."""
    return json.loads(path.read_text()) if path.exists() else {}


def timed_run(url: str, model: Path, case: list[str], concurrency: int, timer: Path) -> dict[str, Any]:
    """One timed `bench_serve` run, with the engine's per-step breakdown over it (`step_ms`: ms per
    step of the forward, of sampling and bookkeeping, and of the sampler alone; `steps`)."""
    before = step_totals(timer)
    result = bench_serve(url, model, case, concurrency, max(concurrency, MIN_PROMPTS))
    time.sleep(0.2)  # the engine writes the totals after its step; the last one lands
    after = step_totals(timer)
    steps = after["sample_tokens"][0] - before.get("sample_tokens", [0, 0.0])[0]
    result["steps"] = steps
    result["step_ms"] = {name: 1000 * (after[name][1] - before.get(name, [0, 0.0])[1]) / max(steps, 1)
                         for name in after}
    return result


def run_arm(model: Path, *, plugin: bool, cases: dict[str, list[str]], concurrency: tuple[int, ...],
            log: Path, extra: list[str] = (), identity: bool = False) -> dict[str, Any]:
    """Start one server, warm it up on every case and concurrency (untimed, `WARMUP_TOKENS` output
    tokens: whatever either sampler compiles or caches for a batch shape happens there), run every
    case x concurrency once, optionally the identity requests; the results by case and concurrency."""
    started = time.monotonic()
    timer = log.with_suffix(".steps.json")
    timer.unlink(missing_ok=True)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STEP_TIMER), os.environ.get("PYTHONPATH")])),
           "TS_STEP_TIMER_FILE": str(timer)}
    server = Server(model, "model", max_model_len=MAX_MODEL_LEN, log=log, plugin=plugin, timeout=600,
                    flags=[*SERVE_FLAGS, *extra], plugins=["ts_step_timer"], env=env, test_defaults=False)
    try:
        startup = time.monotonic() - started
        for case in cases.values():
            for c in concurrency:
                bench_serve(server.url, model, case, c, max(c, MIN_PROMPTS), output_len=WARMUP_TOKENS)
        runs = {name: {str(c): timed_run(server.url, model, case, c, timer) for c in concurrency}
                for name, case in cases.items()}
        ids = identity_requests(server.url, model) if identity else None
    finally:
        server.stop()
    return {"startup_s": startup, "runs": runs, "identity": ids}


IDENTITY_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
IDENTITY_SEED, IDENTITY_TOKENS = 1234, 32


def identity_requests(url: str, model: Path) -> dict[str, list[list[int]]]:
    """Seeded completions of `IDENTITY_PROMPTS` (as token ids): with the server's defaults, with
    the checkpoint's sampling values set explicitly, and greedy; the emitted ids of each."""
    import openai
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    explicit = {"temperature": 1.0, "top_p": 0.95}
    kinds = {"defaults": ({}, {}), "explicit": (explicit, {"top_k": 20}), "greedy": ({"temperature": 0.0}, {})}
    out: dict[str, list[list[int]]] = {"prompts": [tokenizer(p).input_ids for p in IDENTITY_PROMPTS]}
    for kind, (fields, extra) in kinds.items():
        out[kind] = []
        for prompt in out["prompts"]:
            reply = client.completions.create(model="model", prompt=prompt, max_tokens=IDENTITY_TOKENS,
                                              seed=IDENTITY_SEED, logprobs=1, **fields,
                                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                          **extra})
            out[kind].append([int(t.split(":", 1)[1]) for t in reply.choices[0].logprobs.tokens])
    return out


def predicted_flips(model: Path, prompt: list[int], ids: list[int], params: dict[str, Any]) -> int:
    """At how many positions `ids` differ from `tokensampler.sample` of the model's own logits
    (transformers, float32) with `params`, the history being the emitted ids before each position."""
    import torch

    from tokensampler import SamplingParams, sample

    lm = _causal_lm(model)
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    p = SamplingParams(**params)
    vocab = lm.config.vocab_size
    return sum(int(sample(logits[t:t + 1], p, prompt_token_ids=[prompt], output_token_ids=[ids[:t]],
                          vocab_size=vocab).token_ids[0]) != ids[t] for t in range(len(ids)))


@functools.lru_cache(maxsize=1)
def _causal_lm(model: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def identity_checks(model: Path, arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the four generation-config arms' seeded tokens show (arm names `{auto|vllm}-{off|on}`)."""
    ident = {name: arm["identity"] for name, arm in arms.items()}
    prompts = ident["auto-on"]["prompts"]
    checkpoint = dict(temperature=1.0, top_k=20, top_p=0.95, seed=IDENTITY_SEED)
    neutral = dict(temperature=1.0, seed=IDENTITY_SEED)
    flips = {
        "auto-on defaults vs tokensampler(T=1, k=20, p=0.95)":
            [predicted_flips(model, p, ids, checkpoint) for p, ids in zip(prompts, ident["auto-on"]["defaults"])],
        "vllm-on defaults vs tokensampler(T=1)":
            [predicted_flips(model, p, ids, neutral) for p, ids in zip(prompts, ident["vllm-on"]["defaults"])],
        "vllm-on explicit vs tokensampler(T=1, k=20, p=0.95)":
            [predicted_flips(model, p, ids, checkpoint) for p, ids in zip(prompts, ident["vllm-on"]["explicit"])],
        # controls, which must be far from 0: the wrong parameters; vLLM's own sampler
        "control: auto-on defaults vs tokensampler(T=1)":
            [predicted_flips(model, p, ids, neutral) for p, ids in zip(prompts, ident["auto-on"]["defaults"])],
        "control: auto-off defaults vs tokensampler(T=1, k=20, p=0.95)":
            [predicted_flips(model, p, ids, checkpoint) for p, ids in zip(prompts, ident["auto-off"]["defaults"])],
    }
    same = {
        "auto-on defaults == vllm-on explicit (same distribution, same sampler)":
            ident["auto-on"]["defaults"] == ident["vllm-on"]["explicit"],
        "auto-off defaults == vllm-off explicit (same distribution, same sampler)":
            ident["auto-off"]["defaults"] == ident["vllm-off"]["explicit"],
        "auto-on defaults != vllm-on defaults (the checkpoint's defaults change the distribution)":
            ident["auto-on"]["defaults"] != ident["vllm-on"]["defaults"],
        "auto-off defaults != vllm-off defaults (the checkpoint's defaults change the distribution)":
            ident["auto-off"]["defaults"] != ident["vllm-off"]["defaults"],
        "greedy: all four arms emit the same ids":
            all(i["greedy"] == ident["auto-off"]["greedy"] for i in ident.values()),
    }
    return {"flips_of_32": flips, "checks": same, "tokens": ident}


def sampling_checkpoint(source: Path, target: Path) -> Path:
    """`source` with a generation_config.json that asks for sampling (`SAMPLING_DEFAULTS`); the
    weights are linked, not copied."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "generation_config.json" and not (target / item.name).exists():
            (target / item.name).symlink_to(item.resolve())
    config = json.loads((source / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, **SAMPLING_DEFAULTS}, indent=2))
    return target


def smollm2(scratch: Path) -> Path:
    out = scratch / "smollm2"
    if not (out / "config.json").exists():
        subprocess.run([str(Path(sys.executable).with_name("tokensampler")), "smollm2", "--out", str(out)], check=True)
    return out


def synthetic(scratch: Path) -> Path:
    from tokensampler.tools.tiny_models import build_llama

    return build_llama(scratch / "synthetic", vocab_size=151_936, hidden_size=128, layers=2, head_std=0.35, seed=0)


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and concurrency, the median over rounds of each metric of one arm, and of each part
    of the engine's step (`step_ms`)."""
    first = rounds[0]["runs"]
    out: dict[str, Any] = {}
    for case in first:
        out[case] = {}
        for c in first[case]:
            runs = [r["runs"][case][c] for r in rounds]
            entry = {m: statistics.median(run[m] for run in runs) for m in METRICS}
            if all("step_ms" in run for run in runs):
                entry["step_ms"] = {k: statistics.median(run["step_ms"][k] for run in runs) for k in runs[0]["step_ms"]}
            out[case][c] = entry
    return out


def run_part(name: str, model: Path, arms: dict[str, dict[str, Any]], cases: dict[str, list[str]],
             concurrency: tuple[int, ...], rounds: int, scratch: Path) -> dict[str, Any]:
    """Every arm once per round, the order reversed every other round; per-round results and medians."""
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    order = list(arms)
    for r in range(rounds):
        for arm in (order if r % 2 == 0 else order[::-1]):
            print(f"[{name}] round {r + 1}/{rounds}: {arm}", flush=True)
            log = scratch / f"{name}-{arm}-{r}.log"
            results[arm].append(run_arm(model, cases=cases, concurrency=concurrency, log=log,
                                        identity=(r == 0 and name == "generation-config"), **arms[arm]))
    return {"rounds": results, "medians": {arm: medians(rs) for arm, rs in results.items()}}


def format_table(part: dict[str, Any], base: str = "off", other: str = "on") -> str:
    """Markdown: per case and concurrency, output tok/s of both arms and their ratio, median TTFT and TPOT."""
    med = part["medians"]
    lines = [f"| case | conc | {base} tok/s | {other} tok/s | {other}/{base} | TTFT ms {base} / {other} "
             f"| TPOT ms {base} / {other} |", "|---|---|---|---|---|---|---|"]
    for case, by_c in med[base].items():
        for c, a in by_c.items():
            b = med[other][case][c]
            lines.append(f"| {case} | {c} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                         f"{b['output_throughput'] / a['output_throughput']:.2f} | {a['median_ttft_ms']:.0f} / "
                         f"{b['median_ttft_ms']:.0f} | {a['median_tpot_ms']:.1f} / {b['median_tpot_ms']:.1f} |")
    return "\n".join(lines)


def format_breakdown(part: dict[str, Any], base: str = "off", other: str = "on") -> str:
    """Markdown: per case and concurrency, the engine's step in ms (medians over rounds): the sampler
    alone (`_sample`), the rest of the sampling call (`sample_tokens` less the sampler), the forward
    (`execute_model`), for both arms."""
    med = part["medians"]
    lines = [f"| case | conc | sampler ms {base} / {other} | rest of sampling ms {base} / {other} "
             f"| forward ms {base} / {other} | step ms {base} / {other} |", "|---|---|---|---|---|---|"]
    for case, by_c in med[base].items():
        for c, a in by_c.items():
            b = med[other][case][c]
            if "step_ms" not in a or "step_ms" not in b:
                continue
            cells = []
            for part_of in (lambda s: s["_sample"], lambda s: s["sample_tokens"] - s["_sample"],
                            lambda s: s["execute_model"], lambda s: s["sample_tokens"] + s["execute_model"]):
                cells.append(f"{part_of(a['step_ms']):.2f} / {part_of(b['step_ms']):.2f}")
            lines.append(f"| {case} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_generation_config(part: dict[str, Any]) -> str:
    med = part["medians"]
    lines = ["| arm | conc | tok/s | TTFT ms | TPOT ms |", "|---|---|---|---|---|"]
    for arm, by_case in med.items():
        for c, m in by_case["default"].items():
            lines.append(f"| {arm} | {c} | {m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | "
                         f"{m['median_tpot_ms']:.1f} |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Output tok/s against concurrency, one panel per case of the `sampler` part, both arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = summary["parts"]["sampler"]["medians"]
    cases = list(med["off"])
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.2), sharey=True)
    for ax, case in zip(axes, cases):
        for arm, label in (("off", "vLLM sampler"), ("on", "tokensampler plugin")):
            cs = sorted(med[arm][case], key=int)
            ax.plot([int(c) for c in cs], [med[arm][case][c]["output_throughput"] for c in cs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(case)
        ax.set_xlabel("concurrency")
    axes[0].set_ylabel("output tokens/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"vllm serve, SmolLM2-135M-Instruct, {summary['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def versions() -> dict[str, str]:
    import torch
    import vllm

    import tokensampler

    return {"vllm": vllm.__version__, "torch": torch.__version__, "tokensampler": tokensampler.__version__,
            "python": platform.python_version()}


PARTS = ("sampler", "generation-config", "synthetic")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--part", action="append", choices=PARTS, help="repeatable; default: all")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("serve.json"))
    parser.add_argument("--plot", type=Path, default=Path(__file__).with_name("serve.png"))
    parser.add_argument("--case", action="append", choices=list(CASES), help="repeatable; default: all")
    parser.add_argument("--concurrency", type=int, action="append", help="repeatable; default: 1, 8, 32")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where checkpoints and logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    bad = [f"--rounds={args.rounds}"] * (args.rounds < 1)
    bad += [f"--concurrency={c}" for c in args.concurrency or () if c < 1]
    if bad:
        print(f"serve.py: {bad[0]} is invalid: allowed >= 1", file=sys.stderr)
        return 2
    cases = {k: CASES[k] for k in args.case} if args.case else CASES
    concurrency = tuple(args.concurrency or CONCURRENCY)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="ts-serve-"))
    scratch.mkdir(parents=True, exist_ok=True)
    parts = args.part or list(PARTS)
    summary: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "serve_flags": SERVE_FLAGS,
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "min_prompts": MIN_PROMPTS, "parts": {}}
    if args.json.exists():  # keep the parts not rerun
        summary["parts"] = json.loads(args.json.read_text()).get("parts", {})
    model = smollm2(scratch)
    onoff = {"off": {"plugin": False}, "on": {"plugin": True}}
    if "sampler" in parts:
        summary["parts"]["sampler"] = run_part("sampler", model, onoff, cases, concurrency, args.rounds, scratch)
        print(format_table(summary["parts"]["sampler"]), format_breakdown(summary["parts"]["sampler"]),
              sep="\n", flush=True)
    if "generation-config" in parts:
        sampling = sampling_checkpoint(model, scratch / "smollm2-sampling")
        arms = {f"{g}-{p}": {"plugin": p == "on", "extra": ["--generation-config", g]}
                for g in ("auto", "vllm") for p in ("off", "on")}
        part = run_part("generation-config", sampling, arms, {"default": []},
                        tuple(c for c in concurrency if c > 1) or concurrency, args.rounds, scratch)
        part["identity"] = identity_checks(model, {a: rs[0] for a, rs in part["rounds"].items()})
        summary["parts"]["generation-config"] = part
        print(format_generation_config(part), json.dumps(part["identity"]["checks"], indent=1),
              json.dumps(part["identity"]["flips_of_32"]), sep="\n", flush=True)
    if "synthetic" in parts:
        subset = {k: v for k, v in cases.items() if k != "default"}
        summary["parts"]["synthetic"] = run_part("synthetic", synthetic(scratch), onoff, subset,
                                                 tuple(c for c in concurrency if c > 1) or concurrency,
                                                 args.rounds, scratch)
        print(format_table(summary["parts"]["synthetic"]), format_breakdown(summary["parts"]["synthetic"]),
              sep="\n", flush=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if "sampler" in summary["parts"]:
        plot(summary, args.plot)
    if args.scratch is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
