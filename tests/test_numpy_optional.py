"""numpy is optional: with numpy unimportable, the CPU passes that use it when present (a token
bitmask's unpacking and table lookup, the dense route's short sorts) take their torch routes and
give the same tokens, the vocabulary split runs, and importing tokensampler prints nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.parallel import ThreadExchange, ThreadHub

PROGRAM = r"""
import json, sys, threading
import torch
from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step.host import numpy_module
from tokensampler.parallel import ThreadExchange, ThreadHub
from tokensampler.tools.workloads import make_logits

def case():
    gen = torch.Generator().manual_seed(5)
    vocab, padded = 3000, 3008
    peaked = torch.randn(4, padded, generator=gen) * 4
    flat = make_logits(4, padded, flat=True, seed=1)  # flat rows: the dense route and its short sorts
    mask = torch.randint(-(2**31), 2**31, (4, padded // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    return vocab, padded, peaked, flat, mask

def tokens():
    vocab, padded, peaked, flat, mask = case()
    out = {}
    sampler = Sampler(vocab, max_slots=4, padded_vocab_size=padded)
    for name, logits, bitmask in (("peaked_mask", peaked, mask), ("flat", flat, None), ("flat_mask", flat, mask)):
        for slot in range(4):
            sampler.add_request(slot, SamplingParams(temperature=1.0, top_p=0.95, seed=slot), [slot, 7])
        out[name] = sampler.sample(logits.clone(), token_bitmask=bitmask).token_ids.tolist()
    hub, split = ThreadHub(2), [None, None]
    def rank(r):
        s = Sampler(vocab, max_slots=4, padded_vocab_size=padded, group=ThreadExchange(hub, r))
        for slot in range(4):
            s.add_request(slot, SamplingParams(temperature=0.9, top_k=50, seed=slot), [slot, 7])
        half = padded // 2
        split[r] = s.sample(peaked[:, r * half:(r + 1) * half].clone()).token_ids.tolist()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    out["split"] = split
    return out

print(json.dumps({"numpy": numpy_module() is not None, "tokens": tokens()}))
"""


def _run(block_numpy: bool) -> tuple[dict, str]:
    prelude = "import sys; sys.modules['numpy'] = None\n" if block_numpy else ""
    done = subprocess.run([sys.executable, "-c", prelude + PROGRAM], capture_output=True, text=True, timeout=300,
                          check=True, env={"TOKENSAMPLER_COMPILE": "0", "PATH": "", "HOME": "/tmp"})
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_without_numpy_the_same_tokens_and_a_working_split():
    with_numpy, _ = _run(False)
    without, stderr = _run(True)
    assert with_numpy["numpy"] and not without["numpy"]
    assert without["tokens"] == with_numpy["tokens"]
    assert without["tokens"]["split"][0] == without["tokens"]["split"][1]
    assert "Traceback" not in stderr


def test_importing_tokensampler_without_numpy_prints_nothing():
    done = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numpy'] = None; import tokensampler"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stderr == "" and done.stdout == ""


def test_the_split_in_this_process_equals_the_unsplit_sampler():
    """(The program's split is compared with its own ranks above; here with the unsplit sampler.)"""
    vocab, padded = 3000, 3008
    logits = torch.randn(4, padded, generator=torch.Generator().manual_seed(5)) * 4
    whole = Sampler(vocab, max_slots=4, padded_vocab_size=padded)
    for slot in range(4):
        whole.add_request(slot, SamplingParams(temperature=0.9, top_k=50, seed=slot), [slot, 7])
    want = whole.sample(logits.clone()).token_ids.tolist()
    import threading
    hub, got = ThreadHub(2), [None, None]

    def rank(r: int) -> None:
        s = Sampler(vocab, max_slots=4, padded_vocab_size=padded, group=ThreadExchange(hub, r))
        for slot in range(4):
            s.add_request(slot, SamplingParams(temperature=0.9, top_k=50, seed=slot), [slot, 7])
        half = padded // 2
        got[r] = s.sample(logits[:, r * half:(r + 1) * half].clone()).token_ids.tolist()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want, want]
