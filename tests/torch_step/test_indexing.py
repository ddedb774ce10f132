"""backends/torch_step/indexing.py: nonzero_ids equals torch.nonzero on 1-D tensors of any length;
read_at/write_at equal advanced indexing on contiguous and strided rows."""

import pytest
import torch

from tokensampler.backends.torch_step.indexing import nonzero_ids, read_at, write_at


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 63, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_equals_torch_nonzero(dtype, length, density):
    gen = torch.Generator().manual_seed(length)
    row = (torch.rand(length + 3, generator=gen) < density).to(dtype)
    for view in (row[:length], row[1:length + 1], row[3:]):  # aligned and unaligned starts
        want = torch.nonzero(view).squeeze(-1)
        assert torch.equal(nonzero_ids(view), want)
        assert torch.equal(nonzero_ids(view, want.numel()), want)  # the route chosen by the count


def test_hits_in_every_lane_and_the_tail():
    row = torch.zeros(8 * 5 + 3, dtype=torch.bool)
    row[[0, 9, 18, 27, 36, 7, 15, 40, 42]] = True
    assert nonzero_ids(row).tolist() == [0, 7, 9, 15, 18, 27, 36, 40, 42]


@pytest.mark.parametrize("padded", [0, 5])
def test_read_and_write_at_equal_advanced_indexing(padded):
    gen = torch.Generator().manual_seed(padded)
    base = torch.randn(6, 50 + padded, generator=gen)
    z = base[:, :50]  # a strided view when padded
    rows = torch.tensor([0, 0, 3, 5, 2])
    ids = torch.tensor([1, 49, 0, 17, 17])
    assert torch.equal(read_at(z, rows, ids), z[rows, ids])
    values = torch.arange(5, dtype=torch.float32)
    want = z.clone()
    want[rows, ids] = values
    write_at(z, rows, ids, values)
    assert torch.equal(z, want)
    untouched = torch.randn(6, 50 + padded, generator=torch.Generator().manual_seed(padded))[:, 50:]
    assert torch.equal(base[:, 50:], untouched)


def test_word_scan_on_a_long_sparse_row():
    row = torch.zeros(1000, dtype=torch.bool)
    row[[3, 500, 999]] = True
    assert nonzero_ids(row, 3, word_scan_min=64).tolist() == [3, 500, 999]  # the word scan on a short row too
