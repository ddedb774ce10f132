"""The server-level fault campaign of the vLLM plugin, and its soak (docs/reliability.md).

Campaign: every edge request of `tests/support/serve_requests.py` (each sampling field at each of
its bounds, the all-banned allow-list) and `--requests N` seeded random ones (every kind) are sent,
16 in flight, to `vllm serve` with the plugin and then to `vllm serve` without it (one server at a
time, the same flags). Per request: the HTTP status and whether the
server still answers `/health`. Then: the engine is alive (`/health` and a greedy request), the
plugin never answers 5xx where vLLM answers 2xx or 4xx, both arms accept and refuse the same
requests (or the request says why not), the seeded requests replayed alone give the texts they gave
under load, and every returned token id is in the vocabulary. Writes benchmarks/serve_campaign.json
(or `--json`) and prints a table; the exit status is 1 when a requirement fails.

Soak (`--soak MINUTES`): the generator's mixed load on the plugin's server for that long, the
server's resident memory and the plugin's per-request structure sizes every `--interval` seconds,
then one small request: only it is held. Writes benchmarks/serve_soak.json (or `--json`).

    python benchmarks/serve_campaign.py --requests 400 --seed 0 [--model smollm2]
    python benchmarks/serve_campaign.py --soak 20 --interval 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the test suite's support modules

from tests.support import serve_campaign as campaign  # noqa: E402
from tests.support.serve_campaign import MODELS, failures, run_campaign, run_soak  # noqa: E402
from tests.support.serve_requests import KINDS, vocabulary  # noqa: E402


def checkpoint(model: str, scratch: Path) -> Path:
    """The checkpoint of `model`: the tiny local Llama, or SmolLM2-135M-Instruct."""
    if model == "smollm2":
        from tests.support.models import smollm2_checkpoint

        return smollm2_checkpoint(scratch)
    from tokensampler.tools.tiny_models import build_llama

    return build_llama(scratch / "tiny", vocab_size=1000, head_std=0.5, seed=0)


def print_campaign(report: dict[str, Any]) -> None:
    print(f"{'kind':<16} {'sent':>5}  {'plugin':<28} vllm")
    for kind, row in report["by_kind"].items():
        print(f"{kind:<16} {row['sent']:>5}  {json.dumps(row['plugin']):<28} {json.dumps(row['vllm'])}")
    f = report["findings"]
    print(f"deaths {f['deaths']}, alive after {f['alive_after']}, invalid ids {f['invalid_ids']}")
    print(f"plugin 5xx where vLLM is not: {f['plugin_5xx_where_vllm_is_not']}")
    print(f"mismatched: {len(f['mismatched_explained'])} explained, {len(f['mismatched_unexplained'])} "
          f"unexplained {f['mismatched_unexplained']}")
    print(f"seeded replays: {f['replays']['identical']}/{f['replays']['replayed']} identical, "
          f"differ {f['replays']['differ']}")


def print_soak(report: dict[str, Any]) -> None:
    print(f"{'t (s)':>7} {'RSS (MiB)':>10}  " + " ".join(f"{name:>10}" for name in campaign.STRUCTURES))
    for sample in report["samples"]:
        sizes = sample["sizes"] or {}
        print(f"{sample['t']:>7} {sample['rss'] / 2**20:>10.1f}  "
              + " ".join(f"{sizes.get(name, '-'):>10}" for name in campaign.STRUCTURES))
    for name in ("rss", "heap"):
        growth = report.get(f"{name}_growth_per_request")
        if growth is not None:
            print(f"{name} growth over the second half of the load: {growth:.0f} bytes a request")
    print(f"requests {report['requests']} {report['statuses']}, deaths {report['deaths']}, "
          f"idle: only the last request held: {report['idle']['only_it_held']}")


def environment() -> dict[str, Any]:
    import torch
    import vllm

    return {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__, "machine": platform.machine(),
            "cpus": __import__("os").cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kind", action="append", choices=sorted(KINDS), default=[],
                        help="repeatable: only random requests of these kinds (no edge requests)")
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES", help="run the soak instead")
    parser.add_argument("--interval", type=float, default=30.0, help="soak: seconds between samples")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        path = checkpoint(args.model, scratch)
        vocab = vocabulary(path, args.model, max_model_len=MODELS[args.model])
        if args.soak is not None:
            report = run_soak(path, vocab, minutes=args.soak, interval=args.interval, seed=args.seed,
                              scratch=scratch, concurrency=args.concurrency)
            print_soak(report)
            bad = [] if report["deaths"] == 0 and report["idle"]["only_it_held"] else ["soak"]
            default = ROOT / "benchmarks" / "serve_soak.json"
        else:
            report = run_campaign(path, vocab, count=args.requests, seed=args.seed, scratch=scratch,
                                  concurrency=args.concurrency, kinds=args.kind)
            print_campaign(report)
            bad = failures(report)
            default = ROOT / "benchmarks" / "serve_campaign.json"
    report["environment"] = environment()
    (args.json or default).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if bad:
        print("FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
