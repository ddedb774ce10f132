"""core/order.py: the order key of float32 values (one encoding for every path) and the +inf rule."""

import torch

from tokensampler.core.order import KEY_NEG_INF, key_to_float, order_key, saturate_posinf, value_id_keys

NEG_INF = float("-inf")
POS_INF = float("inf")


def test_order_key_is_the_float_order_and_inverts():
    values = torch.tensor([float("-inf"), -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1e-38, 1.0,
                           1.0000001, 3e38, float("inf")], dtype=torch.float32)
    keys = order_key(values)
    assert torch.all(keys[1:] >= keys[:-1])
    assert keys[4] == keys[5] == 0  # -0.0 == 0.0
    assert torch.all(keys[:4] < 0) and torch.all(keys[6:] > 0)
    assert int(keys[0]) == KEY_NEG_INF
    back = key_to_float(keys)
    assert torch.equal(back[values != 0], values[values != 0])
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2000, generator=gen) * torch.exp(torch.randn(2000, generator=gen) * 20)
    order = torch.argsort(z)
    assert torch.all(torch.diff(order_key(z[order])) >= 0)
    assert torch.equal(key_to_float(order_key(z)), z)


def test_value_id_keys_order_by_value_then_lower_id():
    values = torch.tensor([[1.0, 2.0, 2.0, -0.0, 0.0, NEG_INF]])
    ids = torch.arange(6)
    order = torch.argsort(value_id_keys(values, ids), dim=-1, descending=True)[0].tolist()
    assert order == [1, 2, 0, 3, 4, 5]  # 2.0 (ids 1, 2), 1.0, then -0.0 == 0.0 by id, -inf last


def test_saturate_posinf_keeps_only_the_posinf_ids_of_rows_that_hold_one():
    z = torch.tensor([[1.0, POS_INF, 3.0, POS_INF], [1.0, 2.0, NEG_INF, 0.5]])
    got = saturate_posinf(z)
    assert got.tolist() == [[NEG_INF, 0.0, NEG_INF, 0.0], [1.0, 2.0, NEG_INF, 0.5]]
    row = torch.tensor([2.0, POS_INF])
    assert saturate_posinf(row).tolist() == [NEG_INF, 0.0]  # one row (the reference's form)
    known = saturate_posinf(torch.tensor([[1.0, 2.0]]), torch.tensor([True]))  # +inf held on another rank
    assert known.tolist() == [[NEG_INF, NEG_INF]]
    inplace = z.clone()
    assert saturate_posinf(inplace, out=inplace) is inplace and torch.equal(inplace, got)
    plain = torch.tensor([[1.0, 2.0]])
    assert saturate_posinf(plain) is plain  # no +inf: no rewrite
