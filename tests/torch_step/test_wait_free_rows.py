"""The wait-free rows (`native_rows.h`): the C++ passes share a call's rows between the calling thread
and helper threads, and the caller never waits for a helper that lost its core: it takes the row over.
The tokens, general rows and statistics are the same on any number of helpers and on torch's threads;
a helper made late on purpose (the test hook) is not waited for, its result is dropped, and inputs
changed under it after the call change nothing; a forked child gets helpers of its own; a compiling
step uses them where the process owns torch's thread count, with torch on one thread meanwhile."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import fused, native, penalties
from tokensampler.backends.torch_step import step as step_module
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.torch_step.routes import Route
from tokensampler.tools.workloads import make_logits

from .test_fused import pack_bitmask, random_params, state_for

pytestmark = pytest.mark.skipif(native.sample_op() is None, reason="the C++ pass cannot be built here")

LATE_S = 1.5  # the hook's delay: a helper that lost its core for this long


def hook(delay_us: int) -> tuple[int, int]:
    """Set the helpers' delay; (rows callers took over, rows helpers published) so far."""
    taken, published = torch.ops.tokensampler_native.wait_free_hook(delay_us)
    return taken, published


def late_call(call, tries: int = 20):
    """(call's result, seconds it took, rows taken over) for a call whose helper sleeps LATE_S after
    claiming a row. A helper that wakes after the caller has drawn every row claims none (the call
    then takes nothing over and the helper is not delayed): the call is repeated, a helper woken just
    before it (`warm_helpers`), until one claimed a row; the delay is cleared on return."""
    for _ in range(tries):
        torch.ops.tokensampler_native.warm_helpers(1)
        time.sleep(0.001)  # awake and watching (for 2 ms) when the call starts
        taken_before, _ = hook(int(LATE_S * 1e6))
        try:
            start = time.perf_counter()
            result = call()
            elapsed = time.perf_counter() - start
        finally:
            taken_after, _ = hook(0)
        if taken_after > taken_before:
            return result, elapsed, taken_after - taken_before
    raise AssertionError(f"no helper claimed a row in {tries} calls")


def batch(rows: int, vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Peaked and flat rows, a NaN row and an all -inf row (general), mixed parameters."""
    logits = torch.cat([make_logits(rows // 2, vocab, seed=3), make_logits(rows - rows // 2, vocab, flat=True, seed=4)])
    logits[1, 17] = float("nan")
    logits[2] = float("-inf")
    return logits, random_params(rows, seed=11)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("masked", [False, True])
def test_the_same_rows_on_any_number_of_helpers_and_on_torch_threads(two_threads, masked):
    vocab = 20_000
    logits, params = batch(24, vocab)
    state = state_for(params, vocab)
    gen = torch.Generator().manual_seed(5)
    allowed = torch.rand(24, vocab, generator=gen) < 0.3
    allowed[1, 17] = True  # the NaN is read
    bitmask = pack_bitmask(allowed) if masked else None
    results = []
    for helpers in (-1, 0, 1, 3):
        stats = None if masked else (torch.full((24, -(-vocab // 64)), 7.0), torch.full((24,), 7.0), 16)
        tokens, general, count = fused.sample_rows(logits, torch.arange(24), state, bitmask, stats, helpers)
        results.append((tokens, general, count, stats))
    tokens, general, count, stats = results[0]
    assert general[1] and general[2] and count == int(general.sum())
    for other in results[1:]:
        assert torch.equal(other[0], tokens) and torch.equal(other[1], general) and other[2] == count
        if stats is not None:
            kept = ~general
            assert torch.equal(other[3][0][kept], stats[0][kept]) and torch.equal(other[3][1][kept], stats[1][kept])


def test_a_late_helper_is_not_waited_for_and_what_it_reads_late_changes_nothing(two_threads):
    """The helper sleeps LATE_S after claiming its first row; the call returns long before (the caller
    takes that row over); then the logits, the token bitmask and the state's parameters are changed in
    place (NaN, +inf, values above each row's max) while the helper reads them; its result is dropped."""
    rows, vocab = 32, 150_000  # a few milliseconds of rows: a helper woken just before claims one
    logits, params = batch(rows, vocab)
    bitmask = pack_bitmask(torch.rand(rows, vocab, generator=torch.Generator().manual_seed(1)) < 0.5)
    state = state_for(params, vocab)
    want = fused.sample_rows(logits, torch.arange(rows), state, bitmask, None, -1)
    (tokens, general, count), elapsed, taken = late_call(
        lambda: fused.sample_rows(logits, torch.arange(rows), state, bitmask, None, 1))
    kept = (tokens.clone(), general.clone())
    logits[:, ::3] = float("nan")
    logits[:, 1::3] = float("inf")
    logits[:, 2::3] = 1e30
    bitmask.fill_(-1)
    state.temperature.fill_(1e-30)
    state.top_k.fill_(1)
    time.sleep(LATE_S + 0.5)  # the helper wakes, reads the changed inputs, loses its row
    assert elapsed < LATE_S / 3, f"the call waited for its late helper ({elapsed:.3f} s)"
    assert taken == 1
    assert torch.equal(tokens, want[0]) and torch.equal(general, want[1]) and count == want[2]
    assert torch.equal(tokens, kept[0]) and torch.equal(general, kept[1])  # nothing written after the call


def test_late_penalty_rows_are_taken_over_too(two_threads):
    rows, vocab = 32, 150_000
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(rows, vocab, generator=gen)
    prompt = torch.rand(rows, vocab, generator=gen) < 0.02
    counts = (torch.rand(rows, vocab, generator=gen) < 0.02).to(torch.int32) * 3
    columns = [torch.full((rows,), value) for value in (1.3, 0.4, 0.2)]
    args = (z, list(range(rows)), list(reversed(range(rows))), prompt, counts, *columns)
    want = penalties.penalty_edits(*args, compiled=True, helpers=-1)
    got, elapsed, taken = late_call(lambda: penalties.penalty_edits(*args, compiled=True, helpers=1))
    kept = [t.clone() for t in got]
    counts.fill_(7)  # the history goes on while the helper reads it
    prompt.fill_(True)
    time.sleep(LATE_S + 0.5)
    assert elapsed < LATE_S / 3 and taken == 1
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, want, kept))


def _child(queue) -> None:
    torch.set_num_threads(1)  # libgomp's threads are not in a forked child: torch on one thread there
    logits, params = batch(128, 100_000)  # about 10 ms of rows: a helper woken late still claims some
    state = state_for(params, 100_000)
    fused.sample_rows(logits, torch.arange(128), state, None, None, 1)  # starts the child's helper
    published = 0
    for _ in range(20):  # a helper that wakes after the caller drew every row publishes none: again
        _, published_before = hook(0)
        torch.ops.tokensampler_native.warm_helpers(1)
        time.sleep(0.001)  # awake and watching when the call starts
        tokens, _, _ = fused.sample_rows(logits, torch.arange(128), state, None, None, 1)
        _, published_after = hook(0)
        published = published_after - published_before
        if published > 0:
            break
    queue.put((tokens.tolist(), published))


def test_a_forked_child_starts_helpers_of_its_own(two_threads):
    """The parent's helper thread is not in the child (fork copies the calling thread only); the
    child starts its own: some of its rows are published by a helper."""
    logits, params = batch(128, 100_000)
    want, _, _ = fused.sample_rows(logits, torch.arange(128), state_for(params, 100_000), None, None, 1)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    tokens, published = queue.get(timeout=120)
    child.join(timeout=60)
    assert tokens == want.tolist() and published > 0


@pytest.mark.parametrize("wait_free, owned, want", [(True, True, (1, 1)), (False, True, (2, -1)),
                                                    (True, False, (2, -1))])
def test_a_compiling_step_uses_helpers_where_it_owns_the_thread_count(monkeypatch, two_threads, wait_free, owned,
                                                                       want):
    """(torch's thread count during the fused pass, the helpers it asks for): the caller's threads less
    one as helpers, torch on one thread; with `wait_free_rows=False`, or where an engine replaced
    `torch.set_num_threads` (vLLM's CPU worker), torch's own threads (-1)."""
    seen = []
    real = fused.sample_rows

    def recording(*args, **kwargs):
        seen.append((torch.get_num_threads(), args[5]))
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "sample_rows", recording)
    if not owned:
        monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    vocab = 50_000  # 8 rows: over `single_thread_elements`
    logits = make_logits(8, vocab, seed=2)
    sampler = Sampler(vocab, max_slots=8, compile=True, step_config=TorchStepConfig(wait_free_rows=wait_free))
    for slot in range(8):
        sampler.add_request(slot, SamplingParams(seed=slot, temperature=0.9, top_p=0.9, presence_penalty=0.5),
                            [1, 2, 3])
    tokens = sampler.sample(logits).token_ids
    assert seen == [want] and torch.get_num_threads() == 2
    assert sampler.backends.torch_step.routes_taken[Route.FUSED] == 1 and tokens.shape == (8,)


@pytest.mark.parametrize("rows, vocab, threads", [(5, 2000, 1), (8, 50_000, 2)])
def test_the_general_rows_run_on_the_callers_threads(monkeypatch, two_threads, rows, vocab, threads):
    """A row the fused pass marks general (a NaN) is drawn on the call's threads: one for a small
    call, the caller's two after a pass with helpers (torch on one thread only during the pass)."""
    seen = []
    real = step_module.TorchStep._sample

    def recording(self, *args, **kwargs):
        seen.append((kwargs.get("fused_first", True), torch.get_num_threads()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(step_module.TorchStep, "_sample", recording)
    logits = make_logits(rows, vocab, seed=1)
    logits[1, 5] = float("nan")
    sampler = Sampler(vocab, max_slots=rows, compile=True)
    for slot in range(rows):
        sampler.add_request(slot, SamplingParams(seed=slot, temperature=0.9, top_p=0.9), [1, 2])
    sampler.sample(logits)
    assert seen == [(True, threads), (False, threads)] and torch.get_num_threads() == 2


def test_the_setting_is_checked():
    from tokensampler import InvalidSamplingParams
    with pytest.raises(InvalidSamplingParams, match="wait_free_rows"):
        TorchStepConfig(wait_free_rows=1)
