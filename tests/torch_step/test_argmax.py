"""backends/torch_step/argmax.first_argmax equals torch.argmax (first maximum) on ties, NaN, -inf rows and tails."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokensampler.backends.torch_step.argmax import block_size, first_argmax


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 4), width=st.integers(1, 12_000),
       block=st.sampled_from([None, 1, 7, 64, 1024]),
       kind=st.sampled_from(["ties", "nan", "neginf", "posinf", "slice"]))
def test_first_argmax_is_the_first_maximum(seed, rows, width, block, kind):
    gen = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(rows, width, generator=gen) * 1.5)  # many ties
    if kind == "nan":
        x[0, int(torch.randint(0, width, (1,), generator=gen))] = float("nan")
    elif kind == "neginf":
        x[-1] = float("-inf")
    elif kind == "posinf":
        x[:, torch.randint(0, width, (3,), generator=gen)] = float("inf")
    elif kind == "slice":
        x = x[:, : max(1, width - 5)]  # a strided view, as logits[:, :V] of padded logits
    assert torch.equal(first_argmax(x, block=block), x.argmax(dim=-1))


def test_the_maximum_in_the_tail_block_and_at_block_borders():
    x = torch.zeros(3, 5000)
    x[0, 4999] = 1.0          # inside the partial tail block
    x[1, 1023] = x[1, 1024] = 2.0  # a tie across a block border: the first wins
    x[2, 3000] = x[2, 4990] = 3.0  # the tail window overlaps an earlier block holding the max
    assert first_argmax(x, block=1024).tolist() == [4999, 1023, 3000]


def test_rows_with_a_strided_last_dim_fall_back_to_argmax():
    x = torch.round(torch.randn(2, 3 * 6000, generator=torch.Generator().manual_seed(1)) * 1.5)
    for step in (2, 3):
        view = x[:, ::step]  # stride(-1) = step: no blocked view of the row
        assert torch.equal(first_argmax(view), view.argmax(dim=-1))


def test_the_block_divides_the_width_when_a_divisor_is_near():
    assert block_size(151_936) == 1187 and block_size(128_256) == 1002 and block_size(32_000) == 1000
    assert block_size(4096 * 3) == 1024 and block_size(50_257) == 1733  # 50,257 = 29 x 1733
    assert block_size(151_937) == 1024  # a prime: no divisor, a partial tail block


def test_whole_rows_of_blocks_find_the_first_maximum_in_any_block():
    width, block = 151_936, 1187
    x = torch.zeros(5, width)
    x[0, 0] = 1.0                             # the first id
    x[1, width - 1] = 1.0                     # the last id of the last block
    x[2, block - 1] = x[2, block] = 2.0       # a tie across a block border: the first wins
    x[3, 5 * block + 3] = x[3, 90 * block] = float("inf")
    x[4, 77 * block + 11] = float("nan")      # NaN is the maximum, as in torch.argmax
    padded = torch.zeros(5, width + 64)
    padded[:, :width] = x
    for rows in (x, padded[:, :width]):       # contiguous, and a view of padded logits
        assert first_argmax(rows).tolist() == [0, width - 1, block - 1, 5 * block + 3, 77 * block + 11]
        assert torch.equal(first_argmax(rows), rows.argmax(dim=-1))
