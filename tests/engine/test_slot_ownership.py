"""One owner of slot state: the `Sampler`'s slot state holds every slot's parameters, seed, stream,
position and history; the generator, its `seed_manager` (a view) and the vLLM plugin ask it.

- positions never drift: through device steps (all rows, a record mask, a traced step), host
  sampling, device and host remaps, speculative verification with mixed acceptance, a rebuild and
  a preemption-resume, the Sampler's `position_of` is the definition's position of the next token
  (prompt + outputs) for every live request, and the generator's and the view's answers are it;
- the host record and the device columns agree after every step (`check_slot_state`);
- no module of src/ outside `state/` and `sampler/sampler.py` reads a Sampler's `.state`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.support.engine import Engine, Request
from tests.support.slot_state import check_slot_state
from tokensampler import SamplingParams, SeedManager
from tokensampler.engine.batch_params import BatchSamplingParams

SP = SamplingParams
SRC = Path(__file__).resolve().parents[2] / "src" / "tokensampler"


def assert_positions(engine: Engine) -> None:
    """Every live request's next position, as the definition counts it, from every API that tells it."""
    gen = engine.gen
    live = engine.live_slots() if engine.pending_remap is None else []
    for slot in live:
        want = engine.slots[slot].position
        assert gen.sampler.position_of(slot) == want, (slot, engine.slots[slot])
        assert gen.position_of(slot) == want and gen.seed_manager.positions[slot] == want
        assert gen.seed_of(slot) == engine.slots[slot].seed and gen.stream_of(slot) == engine.slots[slot].stream
    check_slot_state(gen.sampler)


def speculate(engine: Engine, drafts_by_slot: dict[int, str], k: int = 3) -> list[int]:
    """One match-mode verification over every lane: per live slot, drafts "all" (the canonical
    chain of a greedy request: every draft accepted), "first" (only the first correct), or "none"
    (-1: no draft). Records the emitted tokens into the requests; returns num_emitted by slot."""
    gen = engine.gen
    target = torch.randn((engine.n, k + 1, engine.padded), generator=engine.rng) * 3
    argmax = target[..., :engine.vocab_size].argmax(-1)
    drafts = torch.full((engine.n, k), -1, dtype=torch.int64)
    for slot, how in drafts_by_slot.items():
        if how == "all":
            drafts[slot] = argmax[slot, :k]
        elif how == "first":
            drafts[slot, 0] = argmax[slot, 0]
            drafts[slot, 1] = (argmax[slot, 1] + 1) % engine.vocab_size
    out = gen.sample_speculative(target, drafts, active_slots=engine.live_slots())
    emitted = out.num_emitted.tolist()
    for slot in engine.live_slots():
        engine.slots[slot].outputs.extend(out.token_ids[slot, :emitted[slot]].tolist())
    return emitted


def test_positions_follow_the_definition_through_every_kind_of_step():
    engine = Engine(vocab_size=40, max_batch_size=4, seed=3)
    gen = engine.gen
    engine.admit([(0, SP(temperature=0.0), [2, 3, 4]), (1, SP(temperature=0.9, seed=7, top_k=9), [5]),
                  (2, SP(temperature=0.0, presence_penalty=0.0), [6, 7])], streams=[0, 2, 0])
    assert_positions(engine)
    engine.decode()                                          # every row recorded
    assert_positions(engine)
    engine.prefill_sample([0, 2])                            # a record mask: slot 1 not advanced
    assert_positions(engine)
    engine.decode(enable_trace=True)                         # a traced step (eager off CUDA)
    assert_positions(engine)
    engine.remap([2, 0, 1, 3])                               # a device remap: the state moves with it
    engine.decode()
    assert_positions(engine)
    # speculative verification with mixed acceptance: 4, 1 and 2 tokens emitted
    greedy = [s for s in engine.live_slots() if engine.slots[s].params.greedy]
    sampled = [s for s in engine.live_slots() if not engine.slots[s].params.greedy]
    emitted = speculate(engine, {greedy[0]: "all", greedy[1]: "first", sampled[0]: "none"})
    assert (emitted[greedy[0]], emitted[greedy[1]], emitted[sampled[0]]) == (4, 2, 1)
    assert_positions(engine)
    engine.decode()                                          # the next token continues from there
    assert_positions(engine)
    engine.remap([1, 2, 0, 3])                               # a host-mode remap, then host sampling
    engine.decode("host")                                    # through gen.seed_manager.get_new_values
    assert_positions(engine)
    engine.decode("host")
    assert_positions(engine)
    engine.decode()                                          # the rebuild keeps every position
    assert_positions(engine)
    # preemption, then resume with the outputs the request already has (into another slot)
    slot = engine.live_slots()[1]
    request = engine.slots[slot]
    engine.finish(slot, release=True)
    assert_positions(engine)
    resumed = gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([request.params]),
                                      prompt_tokens=[request.prompt], output_tokens=[request.outputs],
                                      empty_slots=[3])
    assert resumed == [request.seed]
    engine.slots[3] = Request(request.rid, request.params, request.prompt, request.seed, 0, list(request.outputs))
    assert gen.position_of(3) == len(request.prompt) + len(request.outputs)
    assert_positions(engine)
    engine.decode()                                          # its token is the fresh sampler's at that position
    assert_positions(engine)
    assert engine.checked_tokens > 20


def test_the_seed_manager_of_a_generator_is_a_view_of_its_sampler():
    """The view keeps nothing: what it writes is the sampler's, what the sampler steps it reads."""
    engine = Engine(vocab_size=40, max_batch_size=3, seed=1)
    gen, sm = engine.gen, engine.gen.seed_manager
    engine.admit([(1, SP(temperature=0.7, seed=5), [3, 4])])
    assert sm.seeds == [None, 5, None] and sm.positions == [0, 2, 0] and sm.drawn == [False] * 3
    engine.decode()
    assert sm.snapshot(1) == (5, 3, 0) == (gen.sampler.seed_of(1), gen.sampler.position_of(1), gen.sampler.stream_of(1))
    assert sm.get_new_values([1]) == ([5], [3], [0]) and gen.sampler.position_of(1) == 4
    sm.align_seed_counters_to_positions([1], [9])
    assert gen.sampler.position_of(1) == 9 and gen.position_of(1) == 9
    before = sm.positions
    before[1] = 100                                          # a fresh list: writing into it changes nothing
    assert sm.positions[1] == 9
    try:
        sm.apply_slot_remap([1, 0, 2])
    except ValueError as error:
        assert "move_slots" in str(error)
    else:
        raise AssertionError("a view's remap must be refused (the generator's slot_remap moves the slots)")
    assert sm.snapshot(1) == (5, 9, 0)
    sm.release_slots([1])
    assert sm.seeds == [None] * 3 and gen.sampler.seed_of(1) is None and gen.sampler.position_of(1) == 0


def test_a_seed_manager_of_its_own_keeps_its_lists():
    sm = SeedManager(3, seed_source=iter([100, 101]).__next__)
    assert sm.reset_seed([None, 4], [2, 0], streams=[1, 0], positions=[7, 3]) == [100, 4]
    assert (sm.seeds, sm.drawn) == ([4, None, 100], [False, False, True])
    assert (sm.positions, sm.streams) == ([3, 0, 7], [0, 0, 1])
    sm.release_slots([0, 2])
    assert sm.seeds == [None] * 3 and sm.positions == [0] * 3


def test_the_vllm_batch_state_seeds_are_the_generators():
    """The plugin's `BatchState.seeds` is read from its generator (no dict of its own to keep in step)."""
    pytest.importorskip("vllm")
    from tokensampler.integrations.vllm.batch import BatchState

    state = BatchState(3, 32, "cpu", logprobs_mode="raw_logprobs", max_logprobs=5)
    gen = state.generator
    gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([SP(seed=4), SP()]),
                            prompt_tokens=[[3], [5]], empty_slots=[0, 2])
    state.held[0], state.held[2] = "a", "b"
    assert state.seeds == {"a": 4, "b": gen.seed_of(2)} and "seeds" not in vars(state)


# ------------------------------------------------------------------ nobody else reaches into Sampler.state
def _sampler_state_reads(tree: ast.AST) -> list[int]:
    """Lines of `<x>.sampler.state` / `sampler.state` read as an attribute (not called: the vLLM
    plugin's `TokenSamplerSampler.state()` is its batch state, not a Sampler's)."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "state" and id(node) not in called:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if "sampler" in name.lower():
                lines.append(node.lineno)
    return lines


def test_no_module_outside_state_and_sampler_touches_the_sampler_state():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith("state/") or relative == "sampler/sampler.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        lines = _sampler_state_reads(tree)
        imports_state = any(isinstance(node, ast.ImportFrom) and any(a.name == "SamplerState" for a in node.names)
                            for node in ast.walk(tree))
        # the steps below the Sampler are given its state when it is made (backends/, speculative.py)
        if imports_state and not (relative.startswith("backends/") or relative == "speculative.py"):
            lines.append(0)
        if lines:
            offenders[relative] = lines
    assert not offenders, f"modules reaching into a Sampler's slot state (use the Sampler's API): {offenders}"


def test_the_ast_check_sees_a_reach_into_the_state():
    bad = ast.parse("def f(gen):\n    return gen.sampler.state.params[0]\n")
    fine = ast.parse("def f(sampler):\n    return sampler.state().generator, sampler.params_of(0)\n")
    assert _sampler_state_reads(bad) == [2] and _sampler_state_reads(fine) == []
