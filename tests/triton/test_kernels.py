"""The Triton step (`tokensampler.backends.triton`) against `reference.py`, token for token.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets for the session before anything imports Triton); with one they are
compiled and run on CUDA tensors, and the CUDA-graph test runs too (the one test skipped without
CUDA). Vocabularies are small (the interpreter is slow); block sizes are smaller still so every
multi-block and multi-split path runs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")
DEVICE = "cuda" if CUDA else "cpu"
# the interpreter evaluates both sides of every tl.where (log(0), inf - inf in discarded lanes)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tokensampler import InvalidEnvironment, InvalidSamplingParams, Sampler, SamplingParams  # noqa: E402
from tokensampler.backends.choice import BACKEND_ENV, BackendChoice  # noqa: E402
from tokensampler.backends.triton.config import KernelConfig  # noqa: E402
from tokensampler.backends.triton.noise import gumbel_table_kernel  # noqa: E402
from tokensampler.core import rng  # noqa: E402
from tokensampler.core.constants import LOGPROBS_MODES  # noqa: E402
from tokensampler.core.plan import plan_step  # noqa: E402
from tokensampler.reference import ReferenceRequest, reference_sample  # noqa: E402

NEG_INF = float("-inf")
# one block per row pass (fast under the interpreter) / many small blocks and 4 splits per row
WIDE = KernelConfig(prepare_block=128, select_block=512, logprobs_block=512, pivots=256, splits=2, num_warps=4,
                    window_cap=512, window_block=512)
NARROW = KernelConfig(prepare_block=16, select_block=32, logprobs_block=32, pivots=4, splits=4, num_warps=4,
                      window_cap=8, window_block=4)


def kernel_sampler(vocab: int, *, backend: str = "triton", **kw) -> Sampler:
    """A `Sampler` forced onto the kernels (`backend="triton"`) unless `backend` says otherwise."""
    return Sampler(vocab, backend=backend, **kw)


# ------------------------------------------------------------------------------ random cases
def random_params(rnd: random.Random, vocab: int) -> SamplingParams:
    """Mixed parameters: greedy or sampled, every filter, penalties, bias, allowed/stop ids, logprobs."""
    kw: dict = {"seed": rnd.choice([rnd.randrange(2**64), -rnd.randrange(2**63), 0])}
    kw["temperature"] = rnd.choice([0.0, 0.3, 0.7, 1.0, 1.0, 1.6])
    kw["top_k"] = rnd.choice([0, 0, 1, 3, 10, vocab // 2])
    kw["top_p"] = rnd.choice([1.0, 1.0, 0.2, 0.6, 0.9, 0.97])
    kw["min_p"] = rnd.choice([0.0, 0.0, 0.02, 0.2])
    if rnd.random() < 0.4:
        kw["repetition_penalty"] = rnd.choice([0.7, 1.3, 2.0])
        kw["frequency_penalty"] = rnd.choice([0.0, 0.5, -0.4])
        kw["presence_penalty"] = rnd.choice([0.0, 1.0, -1.5])
    if rnd.random() < 0.3:
        kw["logit_bias"] = {rnd.randrange(vocab): rnd.choice([-100.0, -2.5, 3.0, 100.0]) for _ in range(3)}
    if rnd.random() < 0.2:
        kw["allowed_token_ids"] = rnd.sample(range(vocab), rnd.randint(1, 6))
    if rnd.random() < 0.3:
        kw["min_tokens"] = rnd.choice([1, 5])
        kw["stop_token_ids"] = rnd.sample(range(vocab), 2)
    kw["logprobs"] = rnd.choice([None, None, 0, 1, 5, min(20, vocab)])
    return SamplingParams(**kw)


def random_logits(rnd: random.Random, gen: torch.Generator, batch: int, vocab: int, padded: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows of several kinds: gaussian, heavy ties, LLM-like, NaN/-inf/+inf holes, all removed.
    The padding columns hold huge values, so returning a padded id cannot go unnoticed."""
    rows = []
    for _ in range(batch):
        kind = rnd.choice(["gauss", "ties", "llm", "holes", "posinf", "removed"])
        row = torch.randn(vocab, generator=gen) * rnd.choice([0.5, 2.0, 6.0])
        if kind == "ties":
            row = torch.randint(0, 4, (vocab,), generator=gen).float() * 1.5
        elif kind == "llm":
            row = 12.0 - 2.0 * torch.log(torch.randperm(vocab, generator=gen).float() + 1.0)
        elif kind == "holes":
            holes = torch.randint(0, vocab, (vocab // 3,), generator=gen)
            row[holes[: vocab // 6]] = float("nan")
            row[holes[vocab // 6:]] = NEG_INF
        elif kind == "posinf":
            row[torch.randint(0, vocab, (rnd.choice([1, 3]),), generator=gen)] = float("inf")
        elif kind == "removed":
            row[:] = rnd.choice([NEG_INF, float("nan")])
        rows.append(torch.cat([row, torch.full((padded - vocab,), 1e4)]))
    return torch.stack(rows).to(dtype)


def random_history(rnd: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    prompt = [rnd.randrange(vocab) for _ in range(rnd.choice([0, 3, 20]))]
    output = [rnd.randrange(vocab) for _ in range(rnd.choice([0, 2, 10]))]
    return prompt, output


class Twin:
    """The same requests in a kernel-backed Sampler and as reference requests, stepped together."""

    def __init__(self, params, histories, *, vocab, padded, slots, max_slots, mode, eos, config,
                 positions=None, streams=None):
        self.vocab, self.mode, self.slots = vocab, mode, slots
        self.sampler = kernel_sampler(vocab, max_slots=max_slots, padded_vocab_size=padded, logprobs_mode=mode,
                               eos_token_ids=eos, device=DEVICE, kernel_config=config)
        self.requests = []
        for b, (p, (prompt, output)) in enumerate(zip(params, histories)):
            position = None if positions is None else positions[b]
            stream = 0 if streams is None else streams[b]
            seed = self.sampler.add_request(slots[b], p, prompt, output_token_ids=output, position=position,
                                            stream=stream)
            self.requests.append(ReferenceRequest(p, seed, len(prompt) + len(output) if position is None
                                                  else position, prompt, list(output), stream, eos))

    def step(self, logits: torch.Tensor):
        got = self.sampler.sample(logits.to(DEVICE), self.slots)
        want = reference_sample(logits, self.requests, vocab_size=self.vocab, logprobs_mode=self.mode)
        assert_same_output(got, want)
        for req, token in zip(self.requests, want.token_ids.tolist()):
            req.output_token_ids.append(token)
            req.position += 1
        return got


def assert_same_output(got, want) -> None:
    assert torch.equal(got.token_ids.cpu(), want.token_ids)
    assert torch.equal(got.valid.cpu(), want.valid)
    if want.logprobs is None:
        assert got.logprobs is None
        return
    g, w = got.logprobs, want.logprobs
    assert torch.equal(g.token_ranks.cpu(), w.token_ranks)
    assert torch.equal(g.top_token_ids.cpu(), w.top_token_ids)
    torch.testing.assert_close(g.token_logprobs.cpu(), w.token_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.top_logprobs.cpu(), w.top_logprobs, atol=1e-5, rtol=1e-5)


def run_random_case(case_seed: int, mode: str, config: KernelConfig, *, batch_range=(1, 8),
                    vocab_range=(50, 300), steps: int = 2) -> None:
    rnd = random.Random(case_seed)
    gen = torch.Generator().manual_seed(case_seed)
    batch = rnd.randint(*batch_range)
    vocab = rnd.randint(*vocab_range)
    padded = vocab + rnd.choice([0, 0, 3, 64])
    dtype = rnd.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    max_slots = batch + rnd.choice([0, 3])
    slots = rnd.sample(range(max_slots), batch)
    eos = tuple(rnd.sample(range(vocab), rnd.choice([0, 1])))
    params = [random_params(rnd, vocab) for _ in range(batch)]
    histories = [random_history(rnd, vocab) for _ in range(batch)]
    positions = [rnd.choice([None, 0, 2**32 - 3]) for _ in range(batch)]
    positions = [len(h[0]) + len(h[1]) if p is None else p for p, h in zip(positions, histories)]
    streams = [rnd.choice([0, 1, 2**32 - 1]) for _ in range(batch)]
    twin = Twin(params, histories, vocab=vocab, padded=padded, slots=slots, max_slots=max_slots, mode=mode,
                eos=eos, config=config, positions=positions, streams=streams)
    for _ in range(steps):
        twin.step(random_logits(rnd, gen, batch, vocab, padded, dtype))


# ------------------------------------------------------------------------------ tests
def test_gumbel_noise_is_bit_identical_to_rng():
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 5, 2**32 - 1, 17, 3, 100000], dtype=torch.int64)
    streams = torch.tensor([0, 1, 2, 0, 2**32 - 1, 7], dtype=torch.int64)
    vocab = 300
    out = torch.empty(6, vocab, device=DEVICE)
    gumbel_table_kernel[(6,)](seeds.to(DEVICE), positions.to(DEVICE), streams.to(DEVICE), out, vocab, BLOCK=128)
    want = rng.gumbel(seeds[:, None], positions[:, None], torch.arange(vocab)[None, :], streams[:, None])
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("case_seed", range(2))
def test_random_batches_match_reference(case_seed, mode):
    run_random_case(1000 * case_seed + LOGPROBS_MODES.index(mode), mode, WIDE)


@pytest.mark.parametrize("case_seed", range(2))
def test_many_blocks_and_splits_match_reference(case_seed):
    run_random_case(77 + case_seed, LOGPROBS_MODES[case_seed % 4], NARROW, batch_range=(3, 5),
                    vocab_range=(90, 200))


@pytest.mark.parametrize("mode", ["processed_logits", "processed_logprobs"])
def test_kept_sets_equal_reference_on_ties(mode):
    """V <= 20 and logprobs = V: the whole processed row is compared, so a top-k / top-p / min-p
    border off by one id (ties at the border, masses equal to the bound) fails."""
    rnd = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 8, rnd.randint(8, 20)
    logits = (torch.randint(0, 5, (batch, vocab), generator=gen).float() * 0.5 - 1.0)
    logits[0, :] = 0.0  # all tied
    params = []
    for b in range(batch):
        params.append(SamplingParams(temperature=rnd.choice([0.5, 1.0, 2.0]), seed=b,
                                     top_k=rnd.choice([0, 1, 2, 5]), top_p=rnd.choice([1.0, 0.25, 0.5, 0.75]),
                                     min_p=rnd.choice([0.0, 0.3]), logprobs=vocab))
    twin = Twin(params, [([], [])] * batch, vocab=vocab, padded=vocab, slots=list(range(batch)),
                max_slots=batch, mode=mode, eos=(), config=WIDE)
    twin.step(logits)


def test_greedy_and_invalid_rows():
    """Greedy takes the lowest id among the maxima; a row with nothing left returns the raw greedy id
    and is flagged invalid; the all-NaN row returns id 0; padding (huge values) is never chosen."""
    vocab, padded = 40, 48
    logits = torch.full((5, padded), 1e4)
    logits[:, :vocab] = torch.arange(vocab, dtype=torch.float32) % 7
    logits[1, :vocab] = float("nan")
    logits[2, 10] = float("inf")
    logits[2, 30] = float("inf")
    logits[3, 5] = -math.inf
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, seed=3, allowed_token_ids=[10, 30, 31], logprobs=2),
              SamplingParams(temperature=0.9, seed=4, allowed_token_ids=[5]),
              SamplingParams(temperature=0.0, logit_bias={13: 100.0})]
    twin = Twin(params, [([], [])] * 5, vocab=vocab, padded=padded, slots=[0, 1, 2, 3, 4], max_slots=5,
                mode="raw_logprobs", eos=(), config=WIDE)
    got = twin.step(logits)
    tokens = got.token_ids.tolist()
    assert tokens[:2] + tokens[3:] == [6, 0, 6, 13] and tokens[2] in (10, 30)
    assert got.valid.tolist() == [True, False, True, False, True]


def test_signed_zero_ties_and_overflowing_temperature():
    """-0.0 ties with +0.0 at the top-k border; z / T overflowing to +inf keeps only those ids (the +inf
    rule after temperature); the whole processed row is compared (logprobs = V)."""
    vocab = 16
    logits = torch.linspace(-3.0, -1.0, vocab).repeat(4, 1)
    logits[0, 3], logits[0, 9] = 0.0, -0.0
    logits[1, 2], logits[1, 5] = 0.0, -0.0
    logits[2, 4], logits[2, 11], logits[2, 12] = 3e38, 2e38, 1e38
    logits[3, 7] = 3e38
    params = [SamplingParams(temperature=1.0, top_k=1, seed=1, logprobs=vocab),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2, logprobs=vocab),
              SamplingParams(temperature=0.5, seed=3, logprobs=vocab),
              SamplingParams(temperature=1e-3, top_k=3, seed=4, logprobs=vocab)]
    twin = Twin(params, [([], [])] * 4, vocab=vocab, padded=vocab, slots=[0, 1, 2, 3], max_slots=4,
                mode="processed_logits", eos=(), config=WIDE)
    out = twin.step(logits)
    kept = [set(out.logprobs.top_token_ids[b][out.logprobs.top_logprobs[b] > NEG_INF].tolist()) for b in range(4)]
    assert kept[0] == {3, 9} and kept[2] == {4, 11} and kept[3] == {7}


def test_exact_min_p_and_top_p_borders():
    """p = exp(ln 0.5) is exactly 0.5 in float32: min_p = 0.5 keeps those ids (>=), and top_p = 0.5
    over masses 1 + 0.5 + 0.5 removes them (the mass above, 1.0, is not < 0.5 * 2.0)."""
    vocab = 12
    half = float(torch.tensor(math.log(0.5), dtype=torch.float32))
    logits = torch.full((3, vocab), NEG_INF)
    logits[:, 2] = 0.0
    logits[:, 5] = half
    logits[:, 8] = half
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=1, logprobs=vocab),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2, logprobs=vocab),
              SamplingParams(temperature=1.0, top_p=0.5 + 1e-9, seed=3, logprobs=vocab)]
    twin = Twin(params, [([], [])] * 3, vocab=vocab, padded=vocab, slots=[0, 1, 2], max_slots=3,
                mode="processed_logits", eos=(), config=WIDE)
    out = twin.step(logits)
    kept = [set(out.logprobs.top_token_ids[b][out.logprobs.top_logprobs[b] > NEG_INF].tolist()) for b in range(3)]
    assert kept == [{2, 5, 8}, {2}, {2, 5, 8}]


def test_stop_and_eos_ids_removed_below_min_tokens():
    """Below min_tokens the stop ids and the sampler's EOS ids go (even when they are the maxima); at
    min_tokens they are back. Two steps: the output length counted by the kernel ends the ban."""
    vocab, eos = 30, (7,)
    logits = torch.linspace(0.0, 1.0, vocab).repeat(3, 1)
    logits[:, 4] = 40.0  # a stop id of rows 0 and 2
    logits[:, 7] = 50.0  # the EOS id
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]),
              SamplingParams(temperature=0.8, seed=5, min_tokens=3),
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[4])]
    histories = [([], []), ([1], [2, 3]), ([], [5])]
    twin = Twin(params, histories, vocab=vocab, padded=vocab, slots=[0, 1, 2], max_slots=3,
                mode="raw_logprobs", eos=eos, config=WIDE)
    assert twin.step(logits).token_ids.tolist() == [29, 4, 7]
    assert twin.step(logits).token_ids.tolist() == [29, 7, 7]
    assert twin.step(logits).token_ids.tolist() == [7, 7, 7]


def test_history_update_matches_record_tokens():
    """The kernel counts the token, advances position and output length, like SamplerState.record_tokens."""
    vocab = 64
    params = [SamplingParams(temperature=1.0, seed=s, frequency_penalty=0.5) for s in range(3)]
    sampler = kernel_sampler(vocab, max_slots=6, device=DEVICE, kernel_config=WIDE)
    for slot, p in zip([4, 1, 2], params):
        sampler.add_request(slot, p, [1, 2], output_token_ids=[3, 3])
    counts = sampler.state.output_counts.clone()
    position = sampler.state.position.clone()
    out_len = sampler.state.output_len.clone()
    tokens = sampler.sample(torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE),
                            [4, 1, 2]).token_ids.clone()
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    counts[slots, tokens] += 1
    position[slots] += 1
    out_len[slots] += 1
    assert torch.equal(sampler.state.output_counts, counts)
    assert torch.equal(sampler.state.position, position)
    assert torch.equal(sampler.state.output_len, out_len)


def test_record_mask_leaves_history_of_unrecorded_rows():
    """sample(record=mask): every row is sampled, only rows where the mask is True are counted and advanced."""
    vocab = 64
    sampler = kernel_sampler(vocab, max_slots=3, device=DEVICE, kernel_config=WIDE)
    for slot in range(3):
        sampler.add_request(slot, SamplingParams(temperature=1.0, seed=slot), [1], output_token_ids=[2])
    counts = sampler.state.output_counts.clone()
    position = sampler.state.position.clone()
    out_len = sampler.state.output_len.clone()
    mask = torch.tensor([True, False, True], device=DEVICE)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tokens = sampler.sample(logits, record=mask).token_ids.clone()
    rows = torch.tensor([0, 2], device=DEVICE)
    counts[rows, tokens[rows]] += 1
    position[rows] += 1
    out_len[rows] += 1
    assert torch.equal(sampler.state.output_counts, counts)
    assert torch.equal(sampler.state.position, position)
    assert torch.equal(sampler.state.output_len, out_len)


def test_search_window_goes_to_the_list():
    """With window_cap = 8 the top-k / top-p searches copy the last ids of their window to the row's
    list (and the tokens still equal the reference's)."""
    vocab = 200
    gen = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=1.0, top_k=20, seed=1), SamplingParams(temperature=0.7, top_p=0.8, seed=2)]
    twin = Twin(params, [([], [])] * 2, vocab=vocab, padded=vocab, slots=[0, 1], max_slots=2,
                mode="raw_logprobs", eos=(), config=NARROW)
    step = twin.sampler.backends.kernels
    step._reserve(2)
    step.window_keys.zero_()
    twin.step(torch.randn(2, vocab, generator=gen) * 3)
    lists = step.window_keys.view(-1, NARROW.window_cap)[:2]
    assert bool((lists != 0).any(dim=1).all())


def test_buffers_are_reused_between_steps():
    """No allocation per step: the second step of the same batch writes into the same buffers."""
    vocab = 50
    sampler = kernel_sampler(vocab, max_slots=2, device=DEVICE, kernel_config=WIDE)
    for slot in range(2):
        sampler.add_request(slot, SamplingParams(temperature=1.0, top_p=0.9, seed=slot, logprobs=2), [])
    first = sampler.sample(torch.randn(2, vocab).to(DEVICE))
    step = sampler.backends.kernels
    pointers = [t.data_ptr() for t in (step.z, step.index, step.tokens, step.top_ids, step.fstat)]
    second = sampler.sample(torch.randn(2, vocab).to(DEVICE))
    assert [t.data_ptr() for t in (step.z, step.index, step.tokens, step.top_ids, step.fstat)] == pointers
    assert second.token_ids.data_ptr() == first.token_ids.data_ptr()
    assert second.logprobs.top_token_ids.data_ptr() == first.logprobs.top_token_ids.data_ptr()


def test_backend_choice():
    """What each backend means on each device, decided when the sampler is made; bad values raise."""
    env: dict = {}
    for device in ("cpu", DEVICE):
        forced = BackendChoice.resolve("triton", device=device, environ={"TRITON_INTERPRET": "1"})
        assert forced.use_kernels(20) and not forced.use_kernels(21)  # N > 20: the torch step
        assert not BackendChoice.resolve("torch", device=device, environ=env).use_kernels(0)
        assert BackendChoice.resolve("auto", device=device, environ=env).use_kernels(0) == (device == "cuda")
        assert BackendChoice.resolve(None, device=device, environ=env).backend == "auto"  # unset: auto
        assert BackendChoice.resolve(None, device=device, environ={BACKEND_ENV: " Torch "}).backend == "torch"
    with pytest.raises(InvalidEnvironment) as err:
        BackendChoice.resolve(None, environ={BACKEND_ENV: "cuda"})
    assert err.value.field == BACKEND_ENV and err.value.value == "cuda"
    with pytest.raises(InvalidSamplingParams) as err:
        BackendChoice.resolve("cuda", environ={BACKEND_ENV: "torch"})
    assert err.value.field == "backend" and err.value.value == "cuda"
    with pytest.raises(InvalidEnvironment, match="TRITON_INTERPRET") as err:
        BackendChoice.resolve("triton", device="cpu", environ={"TRITON_INTERPRET": "0"})
    assert err.value.field == "backend"
    with pytest.raises(InvalidEnvironment, match="TRITON_INTERPRET") as err:
        BackendChoice.resolve(None, device="cpu", environ={BACKEND_ENV: "triton"})
    assert err.value.field == BACKEND_ENV


def step_kind(sampler, logits):
    """The class name of the step `sampler` runs for `logits` (row b = slot b)."""
    plan = plan_step([sampler.params_of(s) for s in range(logits.shape[0])], sampler.vocab_size)
    return type(sampler.backends.choose(logits, plan)).__name__


def test_sampler_dispatch():
    """The Sampler runs the kernels when asked, the torch step otherwise, with the same tokens."""
    vocab = 80
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9, logprobs=25)
    tokens = {}
    for backend in ("torch", "triton"):
        sampler = kernel_sampler(vocab, max_slots=3, max_logprobs=25, device=DEVICE, backend=backend)
        for slot in range(3):
            sampler.add_request(slot, params, [])
        sampler.sample(logits)
        assert step_kind(sampler, logits) == "TorchStep"  # logprobs=25 > 20: the torch step even when forced
        for slot in range(3):
            sampler.add_request(slot, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9 + slot), [])
        tokens[backend] = sampler.sample(logits).token_ids.clone()
        assert (step_kind(sampler, logits) == "KernelStep") == (backend == "triton")
    assert torch.equal(tokens["torch"], tokens["triton"])


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="prepare_block"):
        KernelConfig(prepare_block=100)
    with pytest.raises(ValueError, match="splits"):
        KernelConfig(splits=3)


def test_kernels_compile_for_sm90_without_a_gpu():
    """The compiler (not the interpreter) accepts every kernel; the PTX divides correctly rounded,
    contracts no float32 multiply-add and spills nothing (runs in a process without the interpreter)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-m", "tokensampler.backends.triton.compile_check", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report) == {"prepare", "select", "logprobs"}
    assert report["prepare"]["div_rn_f32"] > 0 and report["select"]["div_rn_f32"] > 0
    for name, counts in report.items():
        assert counts["div_inexact_f32"] == 0 and counts["fma_f32"] == 0 and counts["local_memory"] == 0, name


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device")
def test_cuda_graph_capture_and_replay():
    """Capture one step after an eager step with the same slots, replay it on new logits: every replay
    equals the reference with the history advanced (so the in-graph state update happened)."""
    vocab, batch = 1000, 4
    rnd = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1, logprobs=5),
              SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, seed=2),
              SamplingParams(temperature=1.2, top_p=0.5, frequency_penalty=0.4, seed=3, logprobs=0)]
    histories = [random_history(rnd, vocab) for _ in range(batch)]
    twin = Twin(params, histories, vocab=vocab, padded=vocab, slots=[2, 0, 3, 1], max_slots=4,
                mode="raw_logprobs", eos=(), config=KernelConfig())
    static_logits = torch.zeros(batch, vocab, device="cuda")
    first = torch.randn(batch, vocab, generator=gen)
    static_logits.copy_(first)
    twin.step(first)  # eager: compiles, sizes the buffers, uploads the slot index
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = twin.sampler.sample(static_logits, twin.slots)
    for _ in range(3):
        logits = torch.randn(batch, vocab, generator=gen)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        want = reference_sample(logits, twin.requests, vocab_size=vocab, logprobs_mode=twin.mode)
        assert_same_output(out, want)
        for req, token in zip(twin.requests, want.token_ids.tolist()):
            req.output_token_ids.append(token)
            req.position += 1


def test_gpu_benchmark_script_needs_cuda(monkeypatch, capsys):
    """benchmarks/gpu.py imports anywhere and stops with a clear message when CUDA is absent."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("tokensampler_gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--json", os.devnull])
    assert exit_info.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
