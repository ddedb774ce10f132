"""Running a case on one path (its sampler from tests/support/backends.py), every step checked with the oracle."""

from __future__ import annotations

import math
import random
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.adversarial.cases import Case
from tests.support.adversarial.compare import differing, row_text, take_row
from tests.support.adversarial.findings import Finding, Log, Tally, params_text, short
from tests.support.adversarial.menus import FIELD_NAMES, POSITION_LIMIT, RowSpec, fallback_spec, pick
from tests.support.adversarial.oracle import Oracle
from tests.support.backends import RanksDisagree, copy_output, make_sampler, on_every_rank
from tokensampler import Sampler, SamplerOutput, SamplingParams, TokenSamplerError, sample

COMPILE = {"compile": False}  # the samplers' torch.compile choice (--compile), passed to each of them
# the share of each path's rows also run through reference.py one by one (at least 2 per step)
REFERENCE_SHARE = {"sample": 0.05, "torch": 0.002, "kernels": 1.0, "split2": 0.05, "split3": 0.05}

# (slot, params, prompt, outputs, position, stream) of one add_request
Admission = tuple[int, SamplingParams, list[int], list[int], int | None, int]


class Engine:
    """One stateful path's sampler (`make_sampler(case.path)`; a split: every rank's): admit requests, sample steps."""

    def __init__(self, case: Case) -> None:
        self.sampler = make_sampler(case.path, case.vocab, step_config=case.step_config,
                                    kernel_config=case.kernel_config, max_slots=case.max_slots,
                                    padded_vocab_size=case.padded, logprobs_mode=case.mode,
                                    max_logprobs=case.max_logprobs, eos_token_ids=list(case.eos),
                                    compile=COMPILE["compile"])

    def admit_all(self, requests: list[Admission]) -> list[int | BaseException]:
        """Admit each request (on every rank); per request its seed or the exception it raised."""
        def admit(sampler: Sampler) -> list[int | BaseException]:
            outcomes: list[int | BaseException] = []
            for slot, params, prompt, outputs, position, stream in requests:
                try:
                    outcomes.append(sampler.add_request(slot, params, prompt, output_token_ids=outputs,
                                                        position=position, stream=stream))
                except Exception as exc:  # noqa: BLE001 - classified by the caller
                    outcomes.append(exc)
            return outcomes

        per_rank = on_every_rank(self.sampler, admit)
        for outcomes in per_rank[1:]:
            for a, b in zip(per_rank[0], outcomes):
                if type(a) is not type(b) or (isinstance(a, int) and a != b):
                    raise RanksDisagree(f"admission outcomes differ: {short(a)} vs {short(b)}")
        return per_rank[0]

    def mus(self, slots: list[int]) -> list[list[float | None]]:
        """Mirostat's mu of `slots`, per rank (`Sampler.mus_of`)."""
        return on_every_rank(self.sampler, lambda sampler: sampler.mus_of(slots))

    def sample(self, logits: torch.Tensor, slots: list[int], record: list[bool] | None,
               bitmask: torch.Tensor | None) -> SamplerOutput:
        """One step (a split: every rank on its slice of the logits, and the ranks must agree)."""
        mask = None if record is None else torch.tensor(record, dtype=torch.bool)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # Triton's interpreter: numpy overflow notes
            return copy_output(self.sampler.sample(logits, slots, record=mask, token_bitmask=bitmask))


@dataclass
class CheckedStep:
    """One step being checked: the library's output `out` and the oracle's `want` for oracle rows idx."""

    case: Case
    t: int
    oracle: Oracle
    idx: list[int]
    logits: torch.Tensor
    out: SamplerOutput
    want: SamplerOutput

    def describe(self, b: int) -> str:
        """Row b of the step as text: both outputs, the case, the request and its logits."""
        case, row = self.case, self.oracle.rows[self.idx[b]]
        return (f"got {row_text(self.out, b)}; reference {row_text(self.want, b)}; V={case.vocab} Vp={case.padded} "
                f"{case.dtype} {case.mode} eos={case.eos} params {params_text(row.params)} seed {row.seed} "
                f"position {int(self.oracle.position[self.idx[b]])} stream {row.stream} prompt {row.prompt} "
                f"outputs {short(row.outputs, 120)} logits {short(self.logits[b].tolist())}")


class Runner:
    """Runs cases of one path, counting into `tally` and noting findings in `log`."""

    def __init__(self, path: str, tally: Tally, log: Log) -> None:
        self.path, self.tally, self.log = path, tally, log

    def note(self, case: Case, step: int, row: int, kind: str, detail: str, info: bool = False) -> None:
        self.log.note(Finding(self.path, case.index, step, row, kind, detail), info)

    def params(self, case: Case, i: int, spec: RowSpec) -> SamplingParams | None:
        """SamplingParams of a row (None: rejected, as it should be, or with an unexpected error)."""
        try:
            return SamplingParams(**spec.kwargs)
        except TokenSamplerError as exc:
            self.rejected(case, i, spec, exc)
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, -1, i, exc, f"SamplingParams({params_text(spec.kwargs)})")
        return None

    def rejected(self, case: Case, i: int, spec: RowSpec, exc: TokenSamplerError) -> None:
        """Row i rejected with `exc`: a library error if it holds an invalid value of the field named."""
        if not spec.bad:
            self.tally.rejected_valid += 1
            self.note(case, -1, i, "valid input rejected", f"{type(exc).__name__}: {exc} for "
                      f"{params_text(spec.kwargs)}")
            return
        self.tally.library_errors += 1
        expected = tuple(n for name in spec.bad for n in FIELD_NAMES.get(name, (name,)))
        if not str(exc.field).startswith(expected):
            self.tally.rejected_valid += 1
            self.note(case, -1, i, "rejected for another field", f"expected {spec.bad}, got {exc.field}: {exc}")

    def other(self, case: Case, step: int, row: int, exc: BaseException, what: str) -> None:
        """An exception the library must not raise (not its own error type), with where it was raised."""
        self.tally.other_exceptions += 1
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{tb[-1].filename.rsplit('/', 2)[-1]}:{tb[-1].lineno}" if tb else "?"
        self.note(case, step, row, f"unexpected {type(exc).__name__}", f"{exc} at {where} in {what}")

    def run(self, case: Case) -> None:
        """Run `case` on this runner's path."""
        self.tally.cases += 1
        if self.path == "sample":
            self.run_stateless(case)
        else:
            self.run_stateful(case)

    # -------------------------------------------------------------- stateful paths
    def run_stateful(self, case: Case) -> None:
        """Admit the case's rows into its path's sampler, then sample and check its steps."""
        try:
            engine = Engine(case)
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, -1, -1, exc, "Sampler construction")
            return
        oracle = Oracle(case.vocab, case.mode, case.eos)
        admitted = self.admit(case, engine, oracle)
        if not any(admitted):
            return
        oracle.freeze(len(case.rows))
        check_rng = random.Random(f"check:{case.index}")
        for t in range(case.steps):
            step = case.step(t)
            keep = [b for b, i in enumerate(step.rows) if admitted[i]]
            if not keep:
                continue
            idx = [step.rows[b] for b in keep]
            logits = step.logits[keep] if len(keep) < len(step.rows) else step.logits
            bitmask = None if step.bitmask is None else step.bitmask[keep]
            record = None if step.record is None else [step.record[b] for b in keep]
            if not self.sample_and_check(case, t, engine, oracle, idx, logits, bitmask, record, check_rng):
                return
            if not self.check_mu(case, t, engine, oracle, idx):
                return

    def check_mu(self, case: Case, t: int, engine: Engine, oracle: Oracle, idx: list[int]) -> bool:
        """After a step: Mirostat's mu of its rows in the sampler (each rank's) equal to the oracle's,
        to the bit (docs/semantics.md 10.6). False: a mismatch (counted and noted), the case stops."""
        rows = [i for i in idx if oracle.rows[i].mu is not None]
        if not rows:
            return True
        want = [oracle.rows[i].mu for i in rows]
        try:
            per_rank = engine.mus([case.slots[i] for i in rows])
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, t, -1, exc, "mus_of")
            return False
        for rank, got in enumerate(per_rank):
            wrong = [j for j, (g, w) in enumerate(zip(got, want)) if g != w]
            if wrong:
                self.tally.mismatches += 1
                row = oracle.rows[rows[wrong[0]]]
                self.note(case, t, idx.index(rows[wrong[0]]), "Mirostat mu differs",
                          f"rank {rank}: sampler {got[wrong[0]]!r}, reference {want[wrong[0]]!r} for "
                          f"{params_text(row.params)} seed {row.seed} outputs {short(row.outputs, 120)}")
                return False
        return True

    def admit(self, case: Case, engine: Engine, oracle: Oracle) -> list[bool]:
        """Admit every row (a rejected row is replaced by `fallback_spec`); which rows are in."""
        specs = list(case.rows)
        params = [self.params(case, i, spec) for i, spec in enumerate(specs)]
        admitted = [False] * len(specs)
        for attempt in range(2):
            todo = [i for i in range(len(specs)) if not admitted[i] and params[i] is not None]
            requests = [(case.slots[i], params[i], specs[i].prompt, specs[i].outputs, specs[i].position,
                         specs[i].stream) for i in todo]
            start = time.perf_counter()
            try:
                outcomes = engine.admit_all(requests)
            except Exception as exc:  # noqa: BLE001 - counted
                self.other(case, -1, -1, exc, "admission")
                return admitted
            finally:
                self.tally.library_seconds += time.perf_counter() - start
            for i, outcome in zip(todo, outcomes):
                spec = specs[i]
                if isinstance(outcome, TokenSamplerError):
                    self.rejected(case, i, spec, outcome)
                elif isinstance(outcome, BaseException):
                    self.other(case, -1, i, outcome, f"add_request({params_text(params[i])})")
                else:
                    if spec.bad:
                        self.tally.accepted_invalid += 1
                        self.note(case, -1, i, "invalid input accepted", f"{spec.bad} in {params_text(spec.kwargs)} "
                                  f"prompt {spec.prompt} outputs {spec.outputs} position {spec.position} "
                                  f"stream {spec.stream}")
                    admitted[i] = True
                    self.tally.requests += 1
                    position = spec.position if spec.position is not None else len(spec.prompt) + len(spec.outputs)
                    oracle.admit(i, params[i], outcome, position, spec.stream, spec.prompt, spec.outputs)
            if attempt == 0:  # the rejected rows: their fallback requests
                for i in range(len(specs)):
                    if not admitted[i]:
                        specs[i] = fallback_spec(i)
                        params[i] = SamplingParams(**specs[i].kwargs)
        return admitted

    def sample_and_check(self, case: Case, t: int, engine: Engine, oracle: Oracle, idx: list[int],
                         logits: torch.Tensor, bitmask: torch.Tensor | None, record: list[bool] | None,
                         check_rng: random.Random) -> bool:
        """One step through the engine, checked against the oracle. False: the case stops."""
        slots = [case.slots[i] for i in idx]
        before = logits.clone()
        self.tally.calls += 1
        start = time.perf_counter()
        try:
            out = engine.sample(logits, slots, record, bitmask)
        except TokenSamplerError as exc:
            self.tally.rejected_valid += 1
            self.note(case, t, -1, "valid step rejected", f"{type(exc).__name__}: {exc}")
            return False
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, t, -1, exc, f"sample(B={len(idx)}, V={case.vocab}, Vp={case.padded}, {case.dtype})")
            return False
        finally:
            self.tally.library_seconds += time.perf_counter() - start
        return self.check(case, t, oracle, idx, logits, before, bitmask, out, record, check_rng)

    def check(self, case: Case, t: int, oracle: Oracle, idx: list[int], logits: torch.Tensor,
              before: torch.Tensor, bitmask: torch.Tensor | None, out: SamplerOutput, record: list[bool] | None,
              check_rng: random.Random) -> bool:
        """The library's output `out` for oracle rows idx checked against the oracle (which then records
        the step). False: something failed (counted and noted), the case stops."""
        batch = len(idx)
        share = REFERENCE_SHARE[self.path]
        count = min(batch, max(2, math.ceil(share * batch)))
        check = set(check_rng.sample(range(batch), count))
        start = time.perf_counter()
        want, removed, checked, disagree = oracle.step(logits, idx, bitmask, check)
        self.tally.oracle_seconds += time.perf_counter() - start
        self.tally.draws += batch
        self.tally.reference_rows += len(checked)
        ok = True
        if not torch.equal(before.view(torch.int16 if before.element_size() == 2 else torch.int32),
                           logits.view(torch.int16 if logits.element_size() == 2 else torch.int32)):
            self.tally.mismatches += 1
            self.note(case, t, -1, "logits changed by the call", "the caller's logits hold other values after it")
            ok = False
        for b in disagree:
            self.tally.oracle_disagreements += 1
            ref = oracle.reference_row(logits[b], idx[b], None if bitmask is None else bitmask[b:b + 1],
                                       None if want.logprobs is None else int(want.logprobs.top_token_ids.shape[1]))
            self.note(case, t, b, "batched oracle != reference.py", f"{row_text(want, b)} vs {row_text(ref, 0)}"
                      f" for {params_text(oracle.rows[idx[b]].params)} logits {short(logits[b].tolist())}")
        step = CheckedStep(case, t, oracle, idx, logits, out, want)
        ok = self.check_ids(step, removed) and ok
        border, matched = self.check_values(step)
        if ok and matched:  # a row at a top-p border goes on with the library's choice
            oracle.record(idx, torch.where(border, out.token_ids.cpu(), want.token_ids), record)
        return ok and matched

    def check_ids(self, step: CheckedStep, removed: torch.Tensor) -> bool:
        """No id out of range or removed (NaN, -inf, step 3) in a valid row, of the library or of the oracle."""
        out, want, vocab = step.out, step.want, step.case.vocab
        tokens = out.token_ids.cpu()
        out_of_range = (tokens < 0) | (tokens >= vocab)
        picked = removed.gather(1, tokens.clamp(0, vocab - 1)[:, None]).squeeze(1)
        invalid = out_of_range | (out.valid.cpu() & picked)
        ref_picked = removed.gather(1, want.token_ids[:, None]).squeeze(1) & want.valid
        ok = True
        if bool(ref_picked.any()):
            self.tally.reference_invalid_ids += int(ref_picked.sum())
            b = int(ref_picked.nonzero()[0])
            self.note(step.case, step.t, b, "reference returned a removed id", step.describe(b))
            ok = False
        if bool(invalid.any()):
            self.tally.invalid_ids += int(invalid.sum())
            b = int(invalid.nonzero()[0])
            self.note(step.case, step.t, b, "invalid id", step.describe(b))
            ok = False
        return ok

    def check_values(self, step: CheckedStep) -> tuple[torch.Tensor, bool]:
        """Every row equal to the oracle's, or (allowed) to one of its kept sets at a top-p border that
        float64 summation order decides. Returns (rows at such a border, no mismatch)."""
        out, want, oracle = step.out, step.want, step.oracle
        bad, what = differing(out, want)
        width = None if want.logprobs is None else int(want.logprobs.top_token_ids.shape[1])
        border = torch.zeros_like(bad)
        for b in bad.nonzero().squeeze(1).tolist():  # the float64 order at a top-p border: allowed
            if any(not bool(differing(take_row(out, b), alt)[0].any()) for alt in oracle.border_outputs(b, width)):
                border[b] = True
        if bool(border.any()):
            self.tally.topp_border += int(border.sum())
            b = int(border.nonzero()[0])
            self.note(step.case, step.t, b, "top-p border decided by float64 order (allowed)", step.describe(b),
                      info=True)
            bad &= ~border
        if bool(bad.any()):
            self.tally.mismatches += int(bad.sum())
            b = int(bad.nonzero()[0])
            self.note(step.case, step.t, b, f"mismatch ({what}; {int(bad.sum())} rows)", step.describe(b))
            return border, False
        return border, True

    # -------------------------------------------------------------- the stateless path
    def run_stateless(self, case: Case) -> None:
        """One `tokensampler.sample` call holding every row (histories and positions passed in)."""
        params = [self.params(case, i, spec) for i, spec in enumerate(case.rows)]
        if any(p is None for p in params):
            return  # `sample` takes the whole batch: a rejected row was counted above
        step = case.step(0)
        specs = case.rows
        positions = None if all(s.position is None for s in specs) else [
            s.position if s.position is not None else len(s.prompt) + len(s.outputs) for s in specs]
        vocab_size = case.vocab if case.padded > case.vocab or case.r.random() < 0.5 else None
        args: dict[str, Any] = dict(prompt_token_ids=[s.prompt for s in specs],
                                    output_token_ids=[s.outputs for s in specs], positions=positions,
                                    vocab_size=vocab_size, logprobs_mode=case.mode, eos_token_ids=list(case.eos),
                                    token_bitmask=step.bitmask)
        logits = step.logits
        rows: Any = params[0] if case.shared and all(s.kwargs == specs[0].kwargs for s in specs) else params
        if case.call_error is not None:
            logits, rows, args = self.spoil(case, case.call_error, logits, rows, args)
        before = logits.clone() if isinstance(logits, torch.Tensor) else None
        out = self.call_sample(case, logits, rows, args)
        if out is None:
            return
        oracle = Oracle(case.vocab, case.mode, case.eos)
        for i, (spec, p) in enumerate(zip(specs, params)):
            position = spec.position if spec.position is not None else len(spec.prompt) + len(spec.outputs)
            oracle.admit(i, p, p.seed, position, 0, spec.prompt, spec.outputs)
        oracle.freeze(len(specs))
        self.tally.requests += len(specs)
        self.check(case, 0, oracle, list(range(len(specs))), logits, before, step.bitmask, out, None,
                   random.Random(f"check:{case.index}"))

    def call_sample(self, case: Case, logits: Any, rows: Any, args: dict[str, Any]) -> SamplerOutput | None:
        """`sample(logits, rows, **args)`: its output, or None where it raised or (counted as a failure)
        accepted an invalid call."""
        expect, specs = case.call_error, case.rows
        bad_history = any(s.bad for s in specs)
        self.tally.calls += 1
        try:
            out = sample(logits, rows, **args, compile=COMPILE["compile"])
        except TokenSamplerError as exc:
            if expect is None and not bad_history:
                self.tally.rejected_valid += 1
                self.note(case, 0, -1, "valid call rejected", f"{type(exc).__name__}: {exc}")
            else:
                self.tally.library_errors += 1
            return None
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, 0, -1, exc, f"sample(B={len(specs)}, V={case.vocab}, Vp={case.padded}, {case.dtype},"
                       f" spoiled={expect})")
            return None
        if expect is not None or bad_history:
            self.tally.accepted_invalid += 1
            bad = {i: (s.bad, s.kwargs, s.prompt, s.outputs, s.position) for i, s in enumerate(specs) if s.bad}
            self.note(case, 0, -1, "invalid call accepted", f"{expect or short(bad)}")
            return None
        return out

    def spoil(self, case: Case, what: str, logits: torch.Tensor, rows: Any,
              args: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """One invalid argument of a `sample` call (the library must raise its own error)."""
        args = dict(args)
        if what == "params":
            rows = "not params"
        elif what == "dtype":
            logits = logits.to(pick(case.r, [torch.float64, torch.int32, torch.int64]))
        elif what == "shape":
            logits = logits.reshape(-1) if case.r.random() < 0.5 else logits[None]
        elif what == "rows":
            rows = (list(rows) if isinstance(rows, list) else [rows] * logits.shape[0]) + [SamplingParams()]
        elif what == "bitmask":
            words = -(-case.vocab // 32)
            args["token_bitmask"] = pick(case.r, [torch.zeros(logits.shape[0], words, dtype=torch.int64),
                                                   torch.zeros(logits.shape[0] + 1, words, dtype=torch.int32),
                                                   torch.zeros(logits.shape[0], max(0, words - 1), dtype=torch.int32)])
        elif what == "vocab_size":
            args["vocab_size"] = pick(case.r, [case.padded + 1, 0, -3])
        else:
            args["positions"] = [POSITION_LIMIT] * logits.shape[0]
        return logits, rows, args

