"""dart_runtime.matmul: the few-row product equals F.linear, applies only where it should, and undoes itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dart_runtime import matmul
from dart_runtime.matmul import MAX_ROWS, few_row_linear, few_row_linears


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


@pytest.mark.parametrize("faster", [True, False])
def test_few_row_linear_takes_the_product_measured_faster_for_few_rows(two_threads, monkeypatch, faster):
    asked = []
    monkeypatch.setattr(matmul, "transposed_is_faster", lambda weight, rows: asked.append(rows) or faster)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    for rows in (1, 2, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 32, generator=g)
        transposed = faster and 2 <= rows <= MAX_ROWS
        expected = (w @ x.T).T if transposed else F.linear(x, w)
        assert torch.equal(few_row_linear(x, w, None), expected), rows  # bitwise: this kernel, not the other
    assert asked == [2, MAX_ROWS]  # one row and more than MAX_ROWS are F.linear without asking


def test_the_measured_choice_is_made_once_per_group_row_bucket_threads_and_dtype(two_threads, monkeypatch):
    monkeypatch.setattr(matmul, "_CHOICES", {})
    timed = []
    timings = iter([(1.0, 0.5), (1.0, 0.95), (1.0, 0.5), (1.0, 0.5)])  # first 2x faster, then only 5% faster

    def passes(products, weights, rows):
        timed.append((len(weights), rows))
        return next(timings)

    monkeypatch.setattr(matmul, "_median_pass_seconds", passes)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    lone = torch.randn(8, 4)
    matmul.install_few_row_forwards(model)
    w = model[0].weight
    assert matmul.transposed_is_faster(w, 5) and matmul.transposed_is_faster(model[1].weight, 6)  # one group, once
    assert not matmul.transposed_is_faster(w, 7)  # the next bucket: inside the margin, F.linear stays
    assert timed == [(2, 6), (2, 8)]  # every weight of the group timed together, at the bucket's bound
    model.to(torch.bfloat16)  # another dtype is measured anew, for the same group
    assert matmul.transposed_is_faster(model[0].weight, 2) and timed[-1] == (2, 2)
    assert matmul.transposed_is_faster(lone, 2) and timed[-1] == (1, 2)  # a weight outside any group: alone
    assert [k for k in matmul.kernel_choices() if k.startswith("8:4|")] == ["8:4|2|2|float32"]  # the lone weight's
    model_copy = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))  # another module of the same shapes: same choices
    matmul.install_few_row_forwards(model_copy)
    assert matmul.transposed_is_faster(model_copy[0].weight, 5) and len(timed) == 4


def test_adopted_choices_are_not_measured_again_and_bad_ones_are_refused(two_threads, monkeypatch):
    monkeypatch.setattr(matmul, "_CHOICES", {})
    monkeypatch.setattr(matmul, "_median_pass_seconds", lambda *a: pytest.fail("measured an adopted choice"))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    matmul.install_few_row_forwards(model)
    matmul.adopt_kernel_choices({"8:4x4:8|6|2|float32": True, "8:4x4:8|8|2|float32": False})
    assert matmul.transposed_is_faster(model[0].weight, 5) and not matmul.transposed_is_faster(model[1].weight, 7)
    matmul.adopt_kernel_choices({"8:4x4:8|6|2|float32": False})  # what this process knows stays
    assert matmul.transposed_is_faster(model[0].weight, 6)
    for bad in ([1], {"k": 1}, {"k": "yes"}, {3: True}):
        with pytest.raises(ValueError):
            matmul.adopt_kernel_choices(bad)


def test_the_pass_timing_streams_every_weight_with_each_product():
    calls = []
    weights = [torch.randn(6, 4), torch.randn(3, 6)]
    product = lambda x, w, b: calls.append((tuple(x.shape), tuple(w.shape)))  # noqa: E731
    times = matmul._median_pass_seconds([product, product], weights, rows=2)
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert calls[:2] == [((2, 4), (6, 4)), ((2, 6), (3, 6))]
    assert len(calls) == 2 * 2 * (matmul.REPEATS + 1)


def test_few_row_linears_apply_inside_the_block_only():
    plain = nn.Linear(8, 4)
    half = nn.Linear(8, 4).to(torch.bfloat16)
    hooked = nn.Linear(8, 4)
    hooked.forward = lambda x: torch.zeros(x.shape[:-1] + (4,))  # e.g. an offloading hook's forward
    model = nn.Sequential(plain, nn.ReLU())
    calls = []

    def product(x, weight, bias):
        calls.append(x.shape)
        return F.linear(x, weight, bias)

    x = torch.randn(3, 8)
    with few_row_linears(model, half, hooked, product=product):
        assert hooked(torch.ones(2, 8)).abs().sum() == 0  # left alone
        torch.testing.assert_close(model(x), torch.relu(F.linear(x, plain.weight, plain.bias)))
        half(x.to(torch.bfloat16))  # a bfloat16 CPU weight: the block's product too
    assert calls == [(3, 8), (3, 8)]
    assert torch.equal(model(x), torch.relu(F.linear(x, plain.weight, plain.bias)))  # outside: F.linear exactly
    assert calls == [(3, 8), (3, 8)] and "forward" in hooked.__dict__


def test_few_row_linears_end_on_error_and_layers_stay_picklable():
    import copy
    import pickle

    layer = nn.Linear(4, 4)
    calls = []
    with pytest.raises(RuntimeError):
        with few_row_linears(layer, product=lambda *a: calls.append(1)):
            raise RuntimeError("boom")
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and not calls
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert torch.equal(clone(x), layer(x)) and clone.forward.layer is clone
