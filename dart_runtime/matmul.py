"""A faster product for the few-row linear layers of a verify step on the CPU.

A tree verify step runs every linear layer of the target on a handful of rows (the tree's nodes), and so does the
head on its new rows and mask rows. For such inputs `F.linear` (x [M, K] @ W.T, a GEMM with a transposed B) can be
slow on the CPU, and computing the same product as `W @ x.T` (W the left operand, then transposed back) can be much
faster: on 2-core AMD EPYC machines a SmolLM2 forward over 2-4 tokens took less than a one-token forward with it; on a
2-core Intel Xeon `F.linear` was the faster one (BENCHMARKS.md, "Verify kernels"). So the choice is measured, per
machine, thread count, dtype and row bucket. Both are products of the same numbers, summed in another order: results
agree to rounding, as any two BLAS kernels do; DART's losslessness does not rest on bitwise equality with plain
decoding's kernels (a one-token step already uses another kernel, a matrix-vector product, than a tree forward).

The measurement streams the weights as the forward does: the layers a module registers (`install_few_row_forwards`)
form one group, and each product is timed over all of the group's weights in turn, interleaved, a few times. Timing
one small weight again and again would keep it in the cache and favour another kernel than a forward over hundreds
of megabytes of weights does.

`few_row_linears(*modules)` makes that product apply, within a `with` block and only in the calling thread's context,
to every `nn.Linear` of the modules whose weight is a CPU tensor, for the row counts at which it measures faster on
this machine (`transposed_is_faster`). Inputs with one row, or with more than `MAX_ROWS`, take `F.linear` as before,
so a plain one-token step or a prefill is unchanged. Packed-weight products (MKL's, oneDNN's) were measured too
(`benchmarks/bench_few_row_matmul.py`); each needs a copy of every weight, doubling the target's memory.

The model is never switched back and forth: the first use installs on each `nn.Linear` whose `forward` is the class's
own (modules wrapped by hooks that replace `forward`, e.g. accelerate's offloading, are left alone) a `FewRowForward`,
which computes `F.linear` (exactly `nn.Linear.forward`) unless the current context is inside `few_row_linears`. So
another thread, or code after an interrupted call, computes with the layers' own kernel; installing is idempotent and
locked, the same pattern transformers uses for its output-capturing hooks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import statistics
import threading
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dart_runtime.timing import interleaved_seconds

# `W @ x.T` is tried for 2..MAX_ROWS rows (one row is a matrix-vector product either way). Which of the two products is
# faster depends on the CPU, its BLAS, the dtype and the rows, so it is measured, once per group of weights, row
# bucket, thread count and dtype. The range covers what a verify step feeds a linear layer (a batch of B trees of
# R + 1 nodes: B x (R + 1) rows); past it a step is rare enough that `F.linear` is kept unmeasured.
MAX_ROWS = 64
ROW_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a row count is decided by the measurement at the first bound >= it
# Hysteresis, not a machine fact: the other product (or dtype) is taken only when it takes at most this fraction of
# the default's time, so that two kernels within timing noise (a few percent between interleaved passes) keep the
# default.
MARGIN = 0.9
REPEATS = 5  # timed passes of each product (after one warm-up pass), interleaved


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]: `F.linear` computed as `weight @ x.T`."""
    rows = x.numel() // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()  # [rows, N]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class LinearGroup:
    """The `nn.Linear` layers one module registered (a target, a head); `shapes`: their weights' shapes, which with
    the row bucket, threads and dtype key the kernel choice (`kernel_choices`)."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self._layers = [weakref.ref(layer) for layer in layers]
        self.shapes = "x".join(f"{n}:{k}" for n, k in (layer.weight.shape for layer in layers))

    def weights(self) -> list[torch.Tensor]:
        return [layer.weight for layer in (ref() for ref in self._layers) if layer is not None]


# "<group shapes or weight shape>|<bucket>|<threads>|<dtype>" -> whether `W @ x.T` is the faster product there: what
# this process measured or adopted (`adopt_kernel_choices`: a cache keeps them across processes on one machine)
_CHOICES: dict[str, bool] = {}
_CHOICES_LOCK = threading.Lock()


def kernel_choices() -> dict[str, bool]:
    """A copy of the kernel choices this process knows."""
    with _CHOICES_LOCK:
        return dict(_CHOICES)


def adopt_kernel_choices(choices: dict[str, bool]) -> None:
    """Take `choices` (from `kernel_choices` of an earlier process on this machine) as measured; keys this process
    measured itself keep their values. Entries that are not a string key and a bool are ValueError."""
    if not isinstance(choices, dict) or any(not isinstance(k, str) or not isinstance(v, bool)
                                            for k, v in choices.items()):
        raise ValueError("kernel choices are an object of string keys and true/false values")
    with _CHOICES_LOCK:
        for key, value in choices.items():
            _CHOICES.setdefault(key, value)


# id(weight) -> (a weak reference to the weight, its group); a tensor's `==` is elementwise, so no WeakKeyDictionary
_GROUPS: dict[int, tuple[weakref.ref, LinearGroup]] = {}


def _register(weight: torch.Tensor, group: LinearGroup) -> None:
    key = id(weight)

    def forget(ref: weakref.ref) -> None:  # the weight is gone; a newer entry under the same id stays
        if _GROUPS.get(key, (None,))[0] is ref:
            del _GROUPS[key]

    _GROUPS[key] = (weakref.ref(weight, forget), group)


def group_of(weight: torch.Tensor) -> Optional[LinearGroup]:
    """The group `weight` was registered in, or None."""
    entry = _GROUPS.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def _median_pass_seconds(products: list[Callable], weights: list[torch.Tensor], rows: int) -> list[float]:
    """Median seconds of one pass of each product over all `weights` with `rows` random rows, the products
    interleaved (so that a slow spell of the machine hits both alike), after a warm-up pass each."""
    inputs = {k: torch.randn(rows, k, dtype=weights[0].dtype) for k in {int(w.shape[1]) for w in weights}}

    def one_pass(product: Callable) -> None:
        for w in weights:
            product(inputs[int(w.shape[1])], w, None)

    with torch.no_grad():
        times = interleaved_seconds({i: functools.partial(one_pass, p) for i, p in enumerate(products)}, REPEATS)
    return [statistics.median(times[i]) for i in range(len(products))]


def transposed_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether `W @ x.T` beats `F.linear` for `rows` (2..MAX_ROWS) rows through `weight` on this machine with the
    current thread count and the weight's dtype: measured at the first call for the row bucket over all weights of
    the weight's group (`LinearGroup`; a weight outside one alone), then remembered (`kernel_choices`)."""
    bucket = next(b for b in ROW_BUCKETS if b >= rows)
    group = group_of(weight)
    shapes = group.shapes if group is not None else "{}:{}".format(*weight.shape)
    key = f"{shapes}|{bucket}|{torch.get_num_threads()}|{str(weight.dtype).replace('torch.', '')}"
    faster = _CHOICES.get(key)
    if faster is None:
        weights = group.weights() if group is not None else [weight]
        plain, transposed = _median_pass_seconds([F.linear, transposed_linear], weights, bucket)
        faster = transposed <= MARGIN * plain
        with _CHOICES_LOCK:
            faster = _CHOICES.setdefault(key, faster)
    return faster


_DTYPES: dict[tuple, torch.dtype] = {}  # (weight shapes, rows, threads, dtypes) -> the fastest dtype


def fastest_dtype(weights: list[torch.Tensor], rows: int, dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    """Of `dtypes`, the one in which `rows`-row products through all of `weights` (CPU tensors) run fastest on this
    machine with the current thread count, each product the faster of `F.linear` and `W @ x.T`: the first dtype
    unless another takes at most `MARGIN` of its time. Measured once per weight shapes, rows, threads and dtypes,
    over copies of the weights in each dtype, all passes interleaved."""
    key = (tuple(tuple(w.shape) for w in weights), rows, torch.get_num_threads(), dtypes)
    found = _DTYPES.get(key)
    if found is not None:
        return found
    runs = {}
    for dtype in dtypes:
        copies = [w.detach().to(dtype) for w in weights]
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {int(w.shape[1]) for w in copies}}
        for kernel in (F.linear, transposed_linear):
            def one_pass(kernel=kernel, copies=copies, inputs=inputs) -> None:
                for w in copies:
                    kernel(inputs[int(w.shape[1])], w, None)
            runs[(dtype, kernel)] = one_pass
    with torch.no_grad():
        times = interleaved_seconds(runs, REPEATS)
    best = {dtype: min(statistics.median(times[(dtype, k)]) for k in (F.linear, transposed_linear)) for dtype in dtypes}
    challenger = min(dtypes[1:], key=best.get, default=dtypes[0])
    found = _DTYPES[key] = challenger if best[challenger] <= MARGIN * best[dtypes[0]] else dtypes[0]
    return found


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, as `transposed_linear` for 2..MAX_ROWS rows where that is faster here (`transposed_is_faster`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= MAX_ROWS or not transposed_is_faster(weight, rows):
        return F.linear(x, weight, bias)
    return transposed_linear(x, weight, bias)


# the product of the few-row linear layers in the current context; None: `F.linear`, the layers' own
_PRODUCT: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("dart_few_row_product", default=None)
_INSTALL_LOCK = threading.Lock()
_INSTALLED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules whose walk is done


class FewRowForward:
    """The `forward` of an `nn.Linear` that DART has used: `F.linear(x, weight, bias)` (the layer's own), or inside
    `few_row_linears` in this context, that block's product. Picklable and copyable with its layer."""

    __slots__ = ("layer",)

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        product = _PRODUCT.get()
        layer = self.layer
        if product is None or layer.weight.device.type != "cpu":
            return F.linear(x, layer.weight, layer.bias)
        return product(x, layer.weight, layer.bias)


def install_few_row_forwards(*modules: nn.Module) -> None:
    """Give every `nn.Linear` of `modules` whose `forward` is the class's own a `FewRowForward`, and register each
    module's layers as one `LinearGroup` (the walk once per module; idempotent, safe to race)."""
    if all(module in _INSTALLED for module in modules):
        return
    with _INSTALL_LOCK:
        for module in modules:
            if module in _INSTALLED:
                continue
            layers = [m for m in module.modules() if type(m) is nn.Linear
                      and ("forward" not in m.__dict__ or isinstance(m.__dict__["forward"], FewRowForward))]
            for m in layers:
                if "forward" not in m.__dict__:
                    m.forward = FewRowForward(m)
            group = LinearGroup(layers)
            for m in layers:
                _register(m.weight, group)
            _INSTALLED.add(module)


@contextlib.contextmanager
def few_row_linears(*modules: nn.Module, product: Callable = few_row_linear) -> Iterator[None]:
    """Within the block, in this context only, the `nn.Linear` layers of `modules` with CPU weights compute through
    `product(x, weight, bias)` (default: few-row inputs as `W @ x.T` where that measures faster; benchmarks pass
    other products)."""
    install_few_row_forwards(*modules)
    token = _PRODUCT.set(product)
    try:
        yield
    finally:
        _PRODUCT.reset(token)
