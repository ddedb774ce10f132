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
from round to round, so a slower spell of the shared machine falls on both. Per arm, case and
concurrency the medians over rounds of output tokens/s, TTFT and TPOT go to the JSON, the README
table (`format_table`) and the plot (`plot`, matplotlib, the `[plot]` extra).

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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

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
SERVE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "32",
               "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--uvicorn-log-level", "warning"]
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(model: Path, *, plugin: bool, log: Path, extra: list[str] = ()) -> Iterator[str]:
    """`vllm serve model` (plugin on or off) in its own process group; yields its URL once `/health`
    answers, and stops it (SIGINT, then SIGKILL) on exit."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_PLUGINS", None)
    if plugin:
        env["VLLM_PLUGINS"] = "tokensampler"
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--served-model-name", "model",
               "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS, *extra]
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start (see {log}):\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


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


def run_arm(model: Path, *, plugin: bool, cases: dict[str, list[str]], concurrency: tuple[int, ...],
            log: Path, extra: list[str] = (), identity: bool = False) -> dict[str, Any]:
    """Start one server, warm it up, run every case x concurrency once, optionally the identity
    requests; the results by case and concurrency."""
    started = time.monotonic()
    with served(model, plugin=plugin, log=log, extra=list(extra)) as url:
        startup = time.monotonic() - started
        bench_serve(url, model, CASES["topp0.95"], 8, 8, output_len=16)  # untimed warm-up
        runs = {name: {str(c): bench_serve(url, model, case, c, max(c, MIN_PROMPTS)) for c in concurrency}
                for name, case in cases.items()}
        ids = identity_requests(url, model) if identity else None
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
    """Per case and concurrency, the median over rounds of each metric of one arm."""
    first = rounds[0]["runs"]
    return {case: {c: {m: statistics.median(r["runs"][case][c][m] for r in rounds) for m in METRICS}
                   for c in first[case]} for case in first}


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
        print(format_table(summary["parts"]["sampler"]), flush=True)
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
        print(format_table(summary["parts"]["synthetic"]), flush=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if "sampler" in summary["parts"]:
        plot(summary, args.plot)
    if args.scratch is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
