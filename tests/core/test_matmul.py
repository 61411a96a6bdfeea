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
def test_few_row_linear_takes_the_product_decided_faster_for_few_rows(two_threads, monkeypatch, faster):
    asked = []
    monkeypatch.setattr(matmul, "kernel_choice", lambda weight, rows: asked.append(rows) or faster)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    for rows in (1, 2, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 32, generator=g)
        transposed = faster and 2 <= rows <= MAX_ROWS
        expected = (w @ x.T).T if transposed else F.linear(x, w)
        assert torch.equal(few_row_linear(x, w, None), expected), rows  # bitwise: this kernel, not the other
    assert asked == [2, MAX_ROWS]  # one row and more than MAX_ROWS are F.linear without asking


@pytest.fixture
def fake_kernels(monkeypatch):
    """Both kernels replaced by ones that advance a fake clock by the seconds `costs` gives for (kernel, weight
    shape); returns (costs, the kernel of each product in order: 0 F.linear, 1 W @ x.T)."""
    monkeypatch.setattr(matmul, "_CHOICES", {})
    monkeypatch.setattr(matmul, "_TRIALS", {})
    clock, ran, costs = [0.0], [], {}

    def kernel(index):
        def product(x, weight, bias):
            ran.append(index)
            clock[0] += costs[(index, tuple(weight.shape))]
            return F.linear(x, weight, bias)
        return product

    monkeypatch.setattr(matmul, "PRODUCTS", (kernel(0), kernel(1)))
    monkeypatch.setattr(matmul, "now", lambda: clock[0])
    return costs, ran


def test_the_choice_is_learned_from_the_products_a_forward_runs(two_threads, fake_kernels):
    costs, ran = fake_kernels
    w, other = torch.randn(8, 4), torch.randn(16, 4)
    costs.update({(0, (8, 4)): 1.0, (1, (8, 4)): 0.5, (0, (16, 4)): 1.0, (1, (16, 4)): 0.95})
    x = torch.randn(5, 4)
    for _ in range(2 * matmul.TRIAL_SAMPLES):
        torch.testing.assert_close(few_row_linear(x, w, None), F.linear(x, w))
    # the two kernels in turn, each product timed; twice as fast every time decides after EARLY_SAMPLES of each
    assert ran == [0, 1] * matmul.EARLY_SAMPLES
    assert matmul.kernel_choice(w, 5) is True and matmul.kernel_choice(w, 6) is True  # one row bucket
    assert matmul.kernel_choice(w, 7) is None and matmul.kernel_choice(other, 5) is None  # another bucket, shape
    ran.clear()
    for _ in range(2 * matmul.TRIAL_SAMPLES):
        few_row_linear(x, other, None)
    assert ran == [0, 1] * matmul.TRIAL_SAMPLES  # 5% apart: every product of the trial, then F.linear stays
    assert matmul.kernel_choice(other, 5) is False
    w_half = w.to(torch.bfloat16)
    assert matmul.kernel_choice(w_half, 5) is None  # another dtype is learned anew
    assert matmul.kernel_choices() == {"8:4|6|2|float32": True, "16:4|6|2|float32": False}


def test_one_slow_product_does_not_decide_the_choice(two_threads, fake_kernels):
    costs, ran = fake_kernels
    w = torch.randn(8, 4)
    costs.update({(0, (8, 4)): 1.0, (1, (8, 4)): 0.5})
    x = torch.randn(3, 4)
    few_row_linear(x, w, None)
    costs[(1, (8, 4))] = 50.0  # a one-off cost (a new shape's set-up, a slow spell of the machine)
    few_row_linear(x, w, None)
    costs[(1, (8, 4))] = 0.5
    for _ in range(2 * matmul.TRIAL_SAMPLES - 2):
        few_row_linear(x, w, None)
    assert matmul.kernel_choice(w, 3) is True  # the median of each kernel's products decides
    assert ran.count(1) == matmul.TRIAL_SAMPLES  # the slow product kept the trial from ending early


def test_the_products_of_a_trial_are_counted_until_the_choice_is_made(two_threads, fake_kernels):
    """`trial_products` grows with every product an undecided choice runs, and not once the choice is made (a forward
    that ran trials holds their one-off cost)."""
    costs, ran = fake_kernels
    w = torch.randn(8, 4)
    costs.update({(0, (8, 4)): 1.0, (1, (8, 4)): 0.5})
    x = torch.randn(3, 4)
    before = matmul.trial_products()
    while matmul.kernel_choice(w, 3) is None:
        few_row_linear(x, w, None)
    assert matmul.trial_products() - before == len(ran) == 2 * matmul.EARLY_SAMPLES
    few_row_linear(x, w, None)
    few_row_linear(torch.randn(1, 4), w, None)  # one row: F.linear, no choice
    assert matmul.trial_products() - before == 2 * matmul.EARLY_SAMPLES


def test_adopted_choices_are_not_tried_again_and_bad_ones_are_refused(two_threads, fake_kernels):
    costs, ran = fake_kernels
    w = torch.randn(8, 4)
    matmul.adopt_kernel_choices({"8:4|6|2|float32": True, "8:4|8|2|float32": False})
    x = torch.randn(5, 4)
    assert torch.equal(few_row_linear(x, w, None), (w @ x.T).T) and ran == []  # the adopted kernel, no trial
    matmul.adopt_kernel_choices({"8:4|6|2|float32": False})  # what this process knows stays
    assert matmul.kernel_choice(w, 6) is True and matmul.kernel_choice(w, 7) is False
    for bad in ([1], {"k": 1}, {"k": "yes"}, {3: True}):
        with pytest.raises(ValueError):
            matmul.adopt_kernel_choices(bad)


def test_settling_decides_every_weight_of_a_bucket(two_threads, monkeypatch):
    monkeypatch.setattr(matmul, "_CHOICES", {})
    monkeypatch.setattr(matmul, "_TRIALS", {})
    weights = [torch.randn(6, 4), torch.randn(3, 6)]
    matmul.settle_kernel_choices(weights, rows=4)
    assert all(matmul.kernel_choice(w, 4) is not None for w in weights)
    assert matmul.kernel_choice(weights[0], 5) is None


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


def test_few_row_linears_apply_to_the_blocks_own_modules_only():
    """A module used in an earlier block keeps its own kernel in a block of another module (a plain step of the target
    inside the head's block), and nested blocks apply to both."""
    target, head = nn.Linear(8, 4), nn.Linear(8, 4)
    calls = []

    def product(x, weight, bias):
        calls.append(weight is target.weight)
        return F.linear(x, weight, bias)

    x = torch.randn(3, 8)
    with few_row_linears(target, product=product):
        target(x)
    assert calls == [True]
    with few_row_linears(head, product=product):
        target(x)  # installed, but not this block's
        assert calls == [True]
        head(x)
        with few_row_linears(target, product=product):
            target(x), head(x)
    assert calls == [True, False, True, False]
