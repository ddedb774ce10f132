"""The shard path's arithmetic without an engine (`integrations/vllm/shards.py`): the columns of a
rank, its slice of whole rows, the structured-output bitmask on a rank's columns, the choice of the
environment variable. The engine tests are in test_vllm_tensor_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokensampler.core.errors import InvalidEnvironment
from tokensampler.integrations.vllm.shards import (
    LOGITS_ENV,
    LogitsPath,
    apply_bitmask_to_shard,
    local_columns,
    requested_path,
    shard_layout,
)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_ranks_columns_tile_the_padded_vocabulary(world):
    layouts = [shard_layout(r, world, 151_646) for r in range(world)]
    assert layouts[0].padded_vocab_size == 151_680  # a multiple of 64
    assert [layout.offset for layout in layouts] == [r * layouts[0].columns for r in range(world)]
    assert sum(layout.columns for layout in layouts) == 151_680


def test_local_takes_a_ranks_columns_of_whole_rows_with_the_padding_removed():
    rows = torch.arange(2 * 100, dtype=torch.float32).reshape(2, 100)  # V = 100 -> Vp = 128, width 64
    zero, one = shard_layout(0, 2, 100), shard_layout(1, 2, 100)
    assert torch.equal(local_columns(zero, rows), rows[:, :64])
    tail = local_columns(one, rows)
    assert tail.shape == (2, 64) and torch.equal(tail[:, :36], rows[:, 64:])
    assert torch.isneginf(tail[:, 36:]).all()
    shard = torch.randn(2, 64)
    assert local_columns(one, shard) is shard  # already the rank's slice


def bitmask_rows(allowed: list[set[int]], vocab: int) -> np.ndarray:
    words = -(-vocab // 32)
    mask = np.zeros((len(allowed), words), dtype=np.int32)
    for row, ids in enumerate(allowed):
        for i in ids:
            mask[row, i // 32] |= np.int32(np.uint32(1 << (i % 32)).view(np.int32))
    return mask


# vLLM needs the padded vocabulary divisible by the ranks; 8 ranks of 192 columns: slices of 24
# columns, most of which start inside a 32-bit word of the bitmask
@pytest.mark.parametrize("vocab, world", [(200, 2), (200, 4), (191, 8)])
def test_the_bitmask_on_each_ranks_columns_equals_the_bitmask_on_whole_rows(vocab, world):
    layouts = [shard_layout(r, world, vocab) for r in range(world)]
    width, padded = layouts[0].columns, layouts[0].padded_vocab_size
    logits = torch.randn(4, padded, generator=torch.Generator().manual_seed(world))
    # rows 0 and 2 have grammars (listed in another order than the batch), rows 1 and 3 none
    grammar = SimpleNamespace(structured_output_request_ids=["c", "a"],
                              grammar_bitmask=bitmask_rows([{5, 64, 190}, {0, 31, 32, 150, 190}], vocab))
    req_ids = ["a", "b", "c", "d"]
    want = logits.clone()
    allowed = {0: {0, 31, 32, 150, 190}, 2: {5, 64, 190}}
    for row, ids in allowed.items():
        keep = torch.zeros(padded, dtype=torch.bool)
        keep[list(ids)] = True
        want[row] = want[row].masked_fill(~keep, float("-inf"))
    parts = []
    for layout in layouts:
        shard = logits[:, layout.offset:layout.offset + width].clone()
        apply_bitmask_to_shard(shard, req_ids, grammar, layout)
        parts.append(shard)
    assert torch.equal(torch.cat(parts, dim=1), want)


def test_the_logits_path_is_read_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.delenv(LOGITS_ENV, raising=False)
    assert requested_path() is LogitsPath.GATHERED
    monkeypatch.setenv(LOGITS_ENV, "shards")
    assert requested_path() is LogitsPath.SHARDS
    monkeypatch.setenv(LOGITS_ENV, "shard")
    with pytest.raises(InvalidEnvironment) as error:
        requested_path()
    assert error.value.field == LOGITS_ENV and "gathered" in str(error.value)
