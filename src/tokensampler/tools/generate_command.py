"""`tokensampler generate`: the command line of the Hugging Face decode loop (`serving.generate`).

Prompts are plain text, or with `--chat` user messages rendered with the checkpoint's chat template.
`--json-schema PATH`, `--regex PATTERN` and `--grammar PATH` (EBNF) constrain every completion with
xgrammar (`pip install 'tokensampler[grammar]'`); the grammar is checked before the model is loaded.
`--stop` and `--ignore-eos` follow OpenAI. A progress line goes to stderr (`--quiet`: none); `--json`
prints one JSON object per completion per line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from ..core.checks import check_device, check_int, is_int
from ..core.errors import InvalidCheckpoint, InvalidEnvironment, InvalidSamplingParams, TokenSamplerError
from ..core.params import SamplingParams
from ..serving.constrained import GrammarSpec, parse_grammar, read_grammar
from ..serving.generate import DTYPES, Completion, generate, load_causal_lm, prompt_token_ids
from ..serving.generation_config import (
    MODEL_CONFIG_FILE,
    GenerationDefaults,
    load_generation_defaults,
    resolve_request,
)

REQUEST_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "max_tokens", "min_tokens", "n", "logprobs", "stop_token_ids", "stop",
                 "ignore_eos", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "dynatemp_range",
                 "dynatemp_exponent", "xtc_probability", "xtc_threshold", "mirostat_tau", "mirostat_eta")


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
                       ("seed", int), ("max-tokens", int), ("min-tokens", int), ("n", int),
                       ("typical-p", float), ("epsilon-cutoff", float), ("eta-cutoff", float), ("top-n-sigma", float),
                       ("dynatemp-range", float), ("dynatemp-exponent", float), ("xtc-probability", float),
                       ("xtc-threshold", float), ("mirostat-tau", float), ("mirostat-eta", float)):
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help="request field (default: the checkpoint's, else neutral)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="print each token's logprob, rank and the top N alternatives")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=None,
                        help="stop at this token id (repeatable)")
    parser.add_argument("--stop", dest="stop", action="append", default=None, metavar="STRING",
                        help="stop when the text contains STRING, which is cut from it (repeatable; OpenAI's stop)")
    parser.add_argument("--ignore-eos", dest="ignore_eos", action="store_const", const=True, default=None,
                        help="EOS is not a stop condition: generate until max_tokens (or a stop string / id)")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user message, rendered with the checkpoint's chat template")
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", default=None, metavar="PATH",
                         help="constrain every completion to JSON valid for this schema (needs xgrammar)")
    grammar.add_argument("--regex", default=None, metavar="PATTERN",
                         help="constrain every completion to this regular expression (needs xgrammar)")
    grammar.add_argument("--grammar", default=None, metavar="PATH",
                         help="constrain every completion to this EBNF grammar, root rule `root` (needs xgrammar)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype (default float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    return parser


def grammar_from_args(args: argparse.Namespace) -> GrammarSpec | None:
    """The checked grammar of --json-schema / --regex / --grammar, or None (no model needed)."""
    if args.json_schema is not None:
        return read_grammar("json_schema", args.json_schema, "--json-schema")
    if args.regex is not None:
        return parse_grammar("regex", args.regex, "--regex")
    if args.grammar is not None:
        return read_grammar("ebnf", args.grammar, "--grammar")
    return None


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The OpenAI completion body the command-line flags describe (only the flags given)."""
    return {name: getattr(args, name) for name in REQUEST_FLAGS if getattr(args, name) is not None}


def completion_record(completion: Completion, tokenizer: Any, defaults: GenerationDefaults) -> dict[str, Any]:
    """A JSON-ready description of one completion."""
    params = {f.name: getattr(completion.params, f.name) for f in dataclasses.fields(SamplingParams)}
    params["logit_bias"] = dict(params["logit_bias"]) if params["logit_bias"] else None
    record: dict[str, Any] = {
        "prompt_index": completion.prompt_index, "choice": completion.choice, "prompt": completion.prompt,
        "seed": completion.seed, "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
        "text": completion.text,
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


def _described(error: BaseException) -> str:
    """`Type: message` of a third-party error, on one line (the library's error cuts it to length)."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def load_tokenizer(model_dir: str) -> Any:
    """The checkpoint's tokenizer alone, as `load_causal_lm` loads it, before any model is loaded: a
    checkpoint without a usable tokenizer is an `InvalidCheckpoint` (not a transformers traceback)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise InvalidEnvironment("transformers", "not installed", "pip install 'tokensampler[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(model_dir, padding_side="left", local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ... for these
        raise InvalidCheckpoint(model_dir, "tokenizer", _described(exc),
                                "a checkpoint directory whose tokenizer transformers' AutoTokenizer loads "
                                "(tokenizer.json, tokenizer_config.json, ...)") from exc


def context_length(model_dir: str) -> int | None:
    """The context length config.json declares (max_position_embeddings), read without loading the model;
    None when it declares none (or cannot be read: loading the model reports that)."""
    try:
        data = json.loads((Path(model_dir) / MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("max_position_embeddings") if isinstance(data, dict) else None
    return value if is_int(value) and value > 0 else None


def check_generate_args(args: argparse.Namespace) -> tuple[str, GrammarSpec | None, GenerationDefaults]:
    """Every argument checked before the model is loaded: (device, grammar, defaults).

    The device, the counts, the grammar, the model directory, the generation config, the request the flags describe
    (resolved once against the checkpoint's defaults), the tokenizer, and each prompt's length with
    --max-tokens against the context (--max-model-len, else the model's): a --max-tokens beyond the
    context is an error naming the allowed range, not silently capped. Raises a `TokenSamplerError`.
    """
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    check_device("--device", device)
    if args.max_model_len is not None:
        check_int("--max-model-len", args.max_model_len, 1, allowed="an int >= 1")
    grammar = grammar_from_args(args)  # a bad grammar fails at once, whatever the model
    if not Path(args.model).is_dir():
        raise InvalidSamplingParams("--model", args.model, "an existing checkpoint directory")
    defaults = load_generation_defaults(args.model, args.generation_config, args.override_generation_config)
    request = request_from_args(args)
    resolved = resolve_request(request, defaults)  # every flag's value, before any work
    tokenizer = load_tokenizer(args.model)
    limit = args.max_model_len if args.max_model_len is not None else context_length(args.model)
    if limit is None:
        if resolved.max_tokens is None:
            raise InvalidSamplingParams("--max-tokens", None, "an int >= 1: the model declares no context length "
                                        "to bound it")
        return device, grammar, defaults
    for prompt in args.prompts:
        length = len(prompt_token_ids(tokenizer, prompt, args.chat))
        if length >= limit:
            raise InvalidSamplingParams("--prompt", f"{length} tokens", f"at most {limit - 1} tokens (the context is "
                                        f"{limit}: --max-model-len, else the model's)")
        if args.max_tokens is not None and args.max_tokens > limit - length:
            raise InvalidSamplingParams("--max-tokens", args.max_tokens, f"an int in [1, {limit - length}]: the "
                                        f"context of {limit} tokens less the prompt's {length}")
    return device, grammar, defaults


def run_generate_command(args: argparse.Namespace) -> int:
    """Run `tokensampler generate`; 0 on success, 2 on a bad argument or request (one line on
    stderr, no traceback; every argument is checked before the model is loaded)."""
    try:
        device, grammar, defaults = check_generate_args(args)
        try:
            model, tokenizer = load_causal_lm(args.model, device=device, dtype=DTYPES[args.dtype])
        except TokenSamplerError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ... for a bad checkpoint
            raise InvalidCheckpoint(args.model, "model", _described(exc),
                                    "a checkpoint transformers' AutoModelForCausalLM loads") from exc
        completions = generate(model, tokenizer, args.prompts, request_from_args(args), defaults,
                               max_model_len=args.max_model_len, chat=args.chat, grammar=grammar,
                               progress=None if args.quiet else sys.stderr)
    except (TokenSamplerError, ImportError, OSError, RuntimeError) as exc:
        message = " ".join(str(exc).split())  # one line
        print(f"tokensampler generate: error: {message}", file=sys.stderr)
        return 2
    for completion in completions:
        record = completion_record(completion, tokenizer, defaults)
        print(json.dumps(record) if args.json else format_completion(record))
    return 0
