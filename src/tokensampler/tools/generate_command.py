"""`tokensampler generate`: the command line of the Hugging Face decode loop (`serving.generate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Mapping

import torch

from ..core.errors import InvalidSamplingParams, TokenSamplerError
from ..core.params import SamplingParams
from ..serving.generate import DTYPES, Completion, generate, load_causal_lm
from ..serving.generation_config import GenerationDefaults, load_generation_defaults

REQUEST_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "max_tokens", "min_tokens", "n", "logprobs", "stop_token_ids")


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `tokensampler generate` subcommand's parser."""
    parser = sub.add_parser("generate", help="complete prompts with a local Hugging Face causal LM")
    parser.add_argument("--model", required=True, help="local checkpoint directory")
    parser.add_argument("--prompt", dest="prompts", action="append", required=True,
                        help="prompt text (repeatable: the prompts are batched)")
    parser.add_argument("--generation-config", default="auto",
                        help="auto (the checkpoint's generation_config.json), vllm (neutral defaults) or a directory")
    parser.add_argument("--override-generation-config", default=None,
                        help='JSON applied over the generation config, e.g. \'{"temperature": 0.5}\'')
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("repetition-penalty", float), ("presence-penalty", float), ("frequency-penalty", float),
                       ("seed", int), ("max-tokens", int), ("min-tokens", int), ("n", int)):
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help="request field (default: the checkpoint's, else neutral)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="print each token's logprob, rank and the top N alternatives")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None,
                        help="stop at this token id (repeatable)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype (default float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    return parser


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The OpenAI completion body the command-line flags describe (only the flags given)."""
    return {name: getattr(args, name) for name in REQUEST_FLAGS if getattr(args, name) is not None}


def completion_record(completion: Completion, tokenizer: Any, defaults: GenerationDefaults) -> dict[str, Any]:
    """A JSON-ready description of one completion."""
    params = {f.name: getattr(completion.params, f.name) for f in dataclasses.fields(SamplingParams)}
    params["logit_bias"] = dict(params["logit_bias"]) if params["logit_bias"] else None
    record: dict[str, Any] = {
        "prompt_index": completion.prompt_index, "choice": completion.choice, "prompt": completion.prompt,
        "seed": completion.seed, "finish_reason": completion.finish_reason, "text": completion.text,
        "token_ids": completion.token_ids, "params": params,
        "defaults": {"mode": defaults.mode, "source": defaults.source, **defaults.sampling()},
    }
    if completion.logprobs is not None:
        record["logprobs"] = [{"token": tokenizer.decode([t.token_id]), "token_id": t.token_id, "logprob": t.logprob,
                               "rank": t.rank, "top": [[tokenizer.decode([i]), i, v] for i, v in t.top]}
                              for t in completion.logprobs]
    return record


def format_completion(record: Mapping[str, Any]) -> str:
    """The human-readable block printed for one completion."""
    p = record["params"]
    knobs = " ".join(f"{k}={p[k]}" for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                            "presence_penalty", "frequency_penalty", "max_tokens", "n"))
    source = record["defaults"]["source"] or "neutral defaults"
    lines = [f"=== prompt {record['prompt_index']} choice {record['choice']} | seed {record['seed']} "
             f"| finish {record['finish_reason']} | {len(record['token_ids'])} tokens",
             f"params: {knobs} (generation-config {record['defaults']['mode']}: {source})",
             f"prompt: {record['prompt']}", f"text: {record['text']}"]
    for k, t in enumerate(record.get("logprobs") or []):
        alts = ", ".join(f"{tok!r} {v:.4f}" for tok, _, v in t["top"])
        lines.append(f"  [{k}] {t['token']!r} id={t['token_id']} logprob={t['logprob']:.4f} rank={t['rank']}"
                     + (f" | top: {alts}" if alts else ""))
    return "\n".join(lines)


def run_generate_command(args: argparse.Namespace) -> int:
    """Run `tokensampler generate`; 0 on success, 2 on a bad argument or request."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise InvalidSamplingParams("--device", device, "cpu, auto, or cuda on a machine with a CUDA device")
        defaults = load_generation_defaults(args.model, args.generation_config, args.override_generation_config)
        model, tokenizer = load_causal_lm(args.model, device=device, dtype=DTYPES[args.dtype])
        completions = generate(model, tokenizer, args.prompts, request_from_args(args), defaults,
                               max_model_len=args.max_model_len)
    except (TokenSamplerError, ImportError, OSError, RuntimeError) as exc:
        print(f"tokensampler generate: error: {exc}", file=sys.stderr)
        return 2
    for completion in completions:
        record = completion_record(completion, tokenizer, defaults)
        print(json.dumps(record) if args.json else format_completion(record))
    return 0
