"""The command line's user errors: exit status 2, exactly one non-empty line on stderr, no
traceback, nothing on stdout, and no work done.

Every case runs `python -m tokensampler ...` in a subprocess (a few at a time). "No work": the bench
cases name a valid case and a valid `--json` file besides the bad argument, so a bench that ran
would print its table and write the file; the generate cases use a checkpoint whose weights are
garbage, so a command that loaded the model would fail on the weights instead of naming the bad
argument. Each command must also end quickly (far below a bench round or a model load).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

QUICK_SECONDS = 90  # a generous bound for starting Python, importing torch and failing (2 loaded cores)
NO_CUDA = not torch.cuda.is_available()

# name -> (arguments, strings the one stderr line must contain); OUT is a writable JSON path that must
# stay absent, BAD a checkpoint with garbage weights, NOTOK one without a tokenizer (garbage weights too)
BENCH = {
    "unknown case": (["bench", "--case", "nonexistent", "--quick", "--json", "OUT"], ["--case", "nonexistent"]),
    "zero rounds": (["bench", "--rounds", "0", "--case", "greedy", "--quick", "--json", "OUT"], ["--rounds=0", ">= 1"]),
    "zero threads": (["bench", "--threads", "0", "--case", "greedy", "--quick", "--json", "OUT"], ["--threads=0"]),
    "negative contention": (["bench", "--contention", "-1", "--case", "greedy", "--quick", "--json", "OUT"],
                            ["--contention=-1", ">= 0"]),
    "contention with warmup": (["bench", "--contention", "1", "--warmup", "--quick", "--json", "OUT"],
                               ["--contention", "--warmup"]),
    "zero world": (["bench", "--world", "0", "--case", "greedy", "--quick", "--json", "OUT"], ["--world=0"]),
    "zero max slots": (["bench", "--warmup", "--max-slots", "0", "--quick", "--json", "OUT"], ["--max-slots=0"]),
    "json in a missing directory": (["bench", "--case", "greedy", "--quick", "--json", "/nonexistent-dir/x.json"],
                                    ["--json", "/nonexistent-dir"]),
    "json is a directory": (["bench", "--case", "greedy", "--quick", "--json", "DIR"], ["--json", "directory"]),
    "unknown device": (["bench", "--device", "nonsense", "--case", "greedy", "--quick", "--json", "OUT"],
                       ["--device", "nonsense"]),
    "speculative flag with a plain case": (["bench", "--speculative", "--case", "greedy", "--quick", "--json", "OUT"],
                                           ["--case", "speculative_match"]),
    "llama.cpp case without --against llama.cpp": (
        ["bench", "--case", "llama_default_V49k", "--quick", "--json", "OUT"], ["--case", "llama_default_V49k"]),
    "against llama.cpp with world": (["bench", "--against", "llama.cpp", "--world", "2", "--quick", "--json", "OUT"],
                                     ["--against", "llama.cpp"]),
    "rounds not an int": (["bench", "--rounds", "x", "--case", "greedy", "--json", "OUT"], ["--rounds", "'x'"]),
}
if NO_CUDA:
    BENCH["cuda without CUDA"] = (["bench", "--device", "cuda", "--case", "greedy", "--quick", "--json", "OUT"],
                                  ["--device", "CUDA"])
GENERATE = {
    "no tokenizer": (["--model", "NOTOK"], ["tokenizer"]),
    "min tokens above max tokens": (["--model", "BAD", "--min-tokens", "10", "--max-tokens", "3"],
                                    ["min_tokens=10", "max_tokens=3"]),
    "max tokens beyond the context": (["--model", "BAD", "--max-tokens", "100000"], ["--max-tokens=100000", "[1, "]),
    "max tokens beyond the given context": (["--model", "BAD", "--max-tokens", "30", "--max-model-len", "20"],
                                            ["--max-tokens=30", "[1, "]),
    "zero max model len": (["--model", "BAD", "--max-model-len", "0"], ["--max-model-len=0"]),
    "zero choices": (["--model", "BAD", "--n", "0"], ["n=0"]),
    "chat without a template": (["--model", "BAD", "--chat"], ["chat"]),
    "missing model directory": (["--model", "/nonexistent-model"], ["--model", "/nonexistent-model"]),
    "missing json schema": (["--model", "BAD", "--json-schema", "/nonexistent/schema.json"], ["--json-schema"]),
    "unknown device": (["--model", "BAD", "--device", "nonsense"], ["--device"]),
}
if NO_CUDA:
    GENERATE["cuda without CUDA"] = (["--model", "BAD", "--device", "cuda"], ["--device", "CUDA"])


def run_cli(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENSAMPLER_COMPILE": "0"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tokensampler", *argv], capture_output=True, text=True,
                          timeout=600, env=env)
    return done, time.perf_counter() - start


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path] | None:
    """BAD: the tiny checkpoint with garbage weights; NOTOK: the same without its tokenizer files."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from tests.support.hf_checkpoint import build_tiny_checkpoint

    full = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))
    bad = tmp_path_factory.mktemp("garbage_weights")
    notok = tmp_path_factory.mktemp("no_tokenizer")
    for path in full.iterdir():
        shutil.copy(path, bad / path.name)
        if not path.name.startswith("tokenizer"):
            shutil.copy(path, notok / path.name)
    for directory in (bad, notok):
        for weights in directory.glob("*.safetensors"):
            weights.write_bytes(b"not a safetensors file")
    return {"BAD": bad, "NOTOK": notok}


def _selected(session: pytest.Session) -> set[tuple[str, str]]:
    """(group, name) of the cases whose tests this session runs (so `-k` runs only those commands)."""
    groups = {"test_bench_user_error": "bench", "test_generate_user_error": "generate"}
    return {(groups[item.originalname], item.callspec.params["name"]) for item in session.items
            if getattr(item, "originalname", None) in groups and item.module.__name__ == __name__}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict:
    """Each selected case's (arguments, completed process, seconds, OUT path), run three at a time."""
    root = tmp_path_factory.mktemp("cli_errors")
    selected = _selected(request.session)
    checkpoints = request.getfixturevalue("checkpoints") if any(g == "generate" for g, _ in selected) else None
    jobs = {}
    for group, cases in (("bench", BENCH), ("generate", GENERATE)):
        for name, (argv, _) in cases.items():
            if (group, name) not in selected:
                continue
            if group == "generate":
                if checkpoints is None:
                    continue
                argv = ["generate", "--prompt", "the quick brown fox", *argv]
            out = root / f"{group}-{len(jobs)}.json"
            places = {"OUT": str(out), "DIR": str(root), **{k: str(v) for k, v in (checkpoints or {}).items()}}
            jobs[(group, name)] = ([places.get(a, a) for a in argv], out)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(run_cli, argv) for key, (argv, _) in jobs.items()}
        return {key: (jobs[key][0], *futures[key].result(), jobs[key][1]) for key in jobs}


def assert_user_error(result, needles: list[str]) -> None:
    argv, done, seconds, out = result
    what = f"tokensampler {' '.join(argv)}"
    assert "Traceback" not in done.stderr, f"{what}:\n{done.stderr[-3000:]}"
    assert done.returncode == 2, f"{what}: exit {done.returncode}\n{done.stderr[-3000:]}"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"{what}: stderr is not one line:\n{done.stderr[-3000:]}"
    assert lines[0].startswith(f"tokensampler {argv[0]}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{what}: {needle!r} not in {lines[0]!r}"
    assert done.stdout == "", f"{what}: work was done:\n{done.stdout[-2000:]}"
    assert not out.exists(), f"{what}: {out} was written"
    assert seconds < QUICK_SECONDS, f"{what}: took {seconds:.1f} s"


@pytest.mark.parametrize("name", sorted(BENCH))
def test_bench_user_error(results, name):
    assert_user_error(results[("bench", name)], BENCH[name][1])


@pytest.mark.parametrize("name", sorted(GENERATE))
def test_generate_user_error(results, checkpoints, name):
    if checkpoints is None:
        pytest.skip("the [hf] extra (transformers) is needed")
    assert_user_error(results[("generate", name)], GENERATE[name][1])


def test_the_library_error_of_a_subcommand_is_one_line(capsys, monkeypatch):
    """A `TokenSamplerError` whose message would span lines still prints one line (in process)."""
    from tokensampler import InvalidSamplingParams
    from tokensampler.tools import cli

    def fail(args):
        raise InvalidSamplingParams("field", "two\nlines", "one\nline")

    monkeypatch.setattr(cli, "SUBCOMMANDS", [(cli.add_bench_parser, fail), *cli.SUBCOMMANDS[1:]])
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokensampler bench: error: field=")
