"""What a campaign counts and notes: `Tally` (per path), `Finding` (with its rerun line) and `Log`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokensampler import SamplingParams


@dataclass
class Tally:
    """What one path did. `failures` (invalid ids, mismatches, unexpected exceptions, valid input
    rejected, invalid input accepted, and the oracle's own checks) must stay 0; library errors
    are the rejections of invalid input; `topp_border` counts rows whose top-p kept set differs from
    reference.py only where a float64 mass lies within summation-order rounding of `top_p * total`
    and the library's row equals the definition with one of the kept sets that rounding allows."""

    cases: int = 0
    calls: int = 0  # `sample` / `Sampler.sample` calls (one per step)
    requests: int = 0  # rows admitted (a stateful path) or rows of a checked `sample` call
    draws: int = 0
    reference_rows: int = 0
    library_errors: int = 0
    invalid_ids: int = 0
    mismatches: int = 0
    other_exceptions: int = 0
    rejected_valid: int = 0
    accepted_invalid: int = 0
    oracle_disagreements: int = 0
    reference_invalid_ids: int = 0
    topp_border: int = 0  # rows whose top-p kept set differs only where float64 summation order decides
    seconds: float = 0.0  # wall time of the path
    cpu_seconds: float = 0.0  # the process's CPU time meanwhile (every thread; not counting time waiting for a core)
    library_seconds: float = 0.0  # inside the library's sample / add_request calls
    oracle_seconds: float = 0.0  # in the oracle and reference.py

    def add(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def failures(self) -> int:
        return (self.invalid_ids + self.mismatches + self.other_exceptions + self.rejected_valid
                + self.accepted_invalid + self.oracle_disagreements + self.reference_invalid_ids)


@dataclass
class Finding:
    path: str
    case: int
    step: int
    row: int
    kind: str
    detail: str

    def line(self, seed: int, step_scale: int = 1) -> str:
        scale = f" --step-scale {step_scale}" if step_scale != 1 else ""
        return (f"[{self.path} case {self.case} step {self.step} row {self.row}] {self.kind}: {self.detail}"
                f"  (rerun: python benchmarks/adversarial.py --seed {seed}{scale} --case {self.path}:{self.case})")


class Log:
    """Findings of a run: the first `keep` failures with their details, and the first few of each
    allowed kind (`info`)."""

    def __init__(self, keep: int = 50) -> None:
        self.keep = keep
        self.findings: list[Finding] = []
        self.info: list[Finding] = []

    def note(self, finding: Finding, info: bool = False) -> None:
        if info:
            if sum(f.path == finding.path for f in self.info) < 3:
                self.info.append(finding)
        elif len(self.findings) < self.keep:
            self.findings.append(finding)


def short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def params_text(params: SamplingParams | dict) -> str:
    if isinstance(params, SamplingParams):
        defaults = SamplingParams()
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                  if getattr(params, f.name) != getattr(defaults, f.name) or f.name == "seed"}
        if params.get("logit_bias") is not None:
            params["logit_bias"] = dict(params["logit_bias"])
    return short(params, 600)
