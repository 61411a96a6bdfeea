"""dart_core.matmul: the few-row product equals F.linear, applies only where it should, and undoes itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dart_core.matmul import few_row_linear, few_row_linears, max_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 10, 11, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(1, rows, 96, generator=g)
    got = few_row_linear(x, w, b)
    assert got.shape == (1, rows, 300) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_few_row_linear_takes_the_transposed_product_only_for_few_rows(two_threads):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    for rows in (1, 2, max_rows(), max_rows() + 1):
        x = torch.randn(rows, 32, generator=g)
        few = 2 <= rows <= max_rows()
        expected = (w @ x.T).T if few else F.linear(x, w)
        assert torch.equal(few_row_linear(x, w, None), expected), rows  # bitwise: this kernel, not the other
    assert max_rows() == 10


def test_few_row_linears_swaps_eligible_layers_and_restores_them():
    plain = nn.Linear(8, 4)
    half = nn.Linear(8, 4).to(torch.bfloat16)
    hooked = nn.Linear(8, 4)
    hooked.forward = lambda x: torch.zeros(x.shape[:-1] + (4,))  # e.g. an offloading hook's forward
    model = nn.Sequential(plain, nn.ReLU())
    with few_row_linears(model, half, hooked):
        assert "forward" in plain.__dict__
        assert "forward" not in half.__dict__
        assert hooked(torch.ones(2, 8)).abs().sum() == 0  # left alone
        x = torch.randn(3, 8)
        torch.testing.assert_close(model(x), torch.relu(F.linear(x, plain.weight, plain.bias)))
    assert "forward" not in plain.__dict__ and "forward" in hooked.__dict__


def test_few_row_linears_restores_on_error():
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError):
        with few_row_linears(layer):
            raise RuntimeError("boom")
    assert "forward" not in layer.__dict__
