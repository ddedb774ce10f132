"""Grammar-constrained decoding with xgrammar: a JSON schema, a regular expression or an EBNF grammar.

`parse_grammar` checks a grammar without a tokenizer (so a bad schema fails before any model is
loaded); `GrammarConstraint` compiles it for one tokenizer and vocabulary and makes one
`xgrammar.GrammarMatcher` per completion. Each decode step, `fill_bitmask` writes every live
matcher's allowed tokens into an int32 bitmask in xgrammar's layout, which goes to
`Sampler.sample(..., token_bitmask=...)` unchanged; the sampled token is then given to its matcher
(`accept`). A completion ends when its matcher has terminated (the grammar is complete and the stop
token was accepted). xgrammar is the optional extra `tokensampler[grammar]`; it is imported here
only, on use. docs/constrained.md shows the same loop in a few lines.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..core.errors import InvalidEnvironment, InvalidSamplingParams

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def xgrammar_module() -> Any:
    """The `xgrammar` module, or `InvalidEnvironment` naming the extra to install."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidEnvironment("xgrammar", "not installed", "pip install 'tokensampler[grammar]' "
                                 "for --json-schema, --regex and --grammar") from None
    return xgrammar


def _one_line(error: BaseException) -> str:
    """xgrammar's C++ message on one line, without its '[time] file:line: ' prefix."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return _XGRAMMAR_PREFIX.sub("", text)


@dataclass(frozen=True)
class GrammarSpec:
    """A checked grammar: its kind, its text, where it came from, and the parsed `xgrammar.Grammar`."""

    kind: str
    text: str
    label: str
    grammar: Any


def parse_grammar(kind: str, text: str, label: str | None = None) -> GrammarSpec:
    """Parse a grammar with xgrammar (no tokenizer needed): a JSON schema (compact layout: no free
    whitespace, `any_whitespace=False`), a regular expression, or an EBNF grammar whose root rule is
    `root`. Raises `InvalidSamplingParams` (field = `label`) on a bad grammar, `InvalidEnvironment`
    without xgrammar."""
    if kind not in GRAMMAR_KINDS:
        raise InvalidSamplingParams("grammar kind", kind, f"one of {GRAMMAR_KINDS}")
    label = label or kind
    xgr = xgrammar_module()
    if kind == "json_schema":
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise InvalidSamplingParams(label, text[:60], f"a JSON schema (not valid JSON: {error})") from None
    try:
        if kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(text)
        else:
            grammar = xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as error:
        what = {"json_schema": "a JSON schema", "regex": "a regular expression", "ebnf": "an EBNF grammar"}[kind]
        raise InvalidSamplingParams(label, text[:60], f"{what} xgrammar accepts ({_one_line(error)})") from None
    return GrammarSpec(kind, text, label, grammar)


def read_grammar(kind: str, path: str | Path, label: str) -> GrammarSpec:
    """`parse_grammar` of the text of the file at `path` (a JSON schema or an EBNF grammar)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise InvalidSamplingParams(label, str(path), f"a readable file ({reason})") from None
    return parse_grammar(kind, text, f"{label} {path}")


class GrammarConstraint:
    """One grammar compiled for a tokenizer and a vocabulary of `vocab_size` ids (the logits' width).

    stop_token_ids: the ids that end the grammar (default: the tokenizer's EOS).
    """

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        xgr = xgrammar_module()
        self.xgr = xgr
        self.vocab_size = vocab_size
        stops = list(stop_token_ids) if stop_token_ids else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)))
        self.compiled = compiler.compile_grammar(spec.grammar)
        self.words = -(-vocab_size // 32)

    def matcher(self) -> Any:
        """A fresh `xgrammar.GrammarMatcher` (one per completion)."""
        return self.xgr.GrammarMatcher(self.compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        """An int32 [batch, ceil(V / 32)] CPU buffer for `fill_bitmask`, every id allowed."""
        return torch.full((batch, self.words), -1, dtype=torch.int32)

    @staticmethod
    def fill_bitmask(matchers: Sequence[Any], bitmask: torch.Tensor) -> torch.Tensor:
        """Row b of `bitmask` (int32 [>= len(matchers), W], CPU) gets matcher b's allowed tokens.

        Returns
        -------
        int32 [len(matchers), W], a view of `bitmask`. A terminated matcher has no next token: it
        is an error to fill it (check `is_terminated()` first, as the decode loop does)."""
        for b, matcher in enumerate(matchers):
            if matcher.is_terminated():
                raise InvalidSamplingParams("matcher", b, "a matcher that has not terminated")
            matcher.fill_next_token_bitmask(bitmask, b)
        return bitmask[:len(matchers)]

    @staticmethod
    def accept(matcher: Any, token: int) -> None:
        """Advance `matcher` by the sampled `token`; a token the mask allowed is always accepted."""
        if not matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar rejected token {int(token)}: the token bitmask was not applied")
