"""A faster product for the few-row linear layers of a verify step on the CPU.

A tree verify step runs every linear layer of the target on a handful of rows (the tree's nodes), and so does the
head on its new rows and mask rows. For such inputs `F.linear` (x [M, K] @ W.T, MKL sgemm with a transposed B) can be
slow on the CPU: on a 2-core AMD EPYC machine a SmolLM2 forward over 2-10 tokens took 55-70 ms with it, against 36 ms
for one token, and computing the same product as `W @ x.T` (W the left operand, then transposed back) took 24-58 ms;
on a 2-core Intel Xeon `F.linear` was the faster one (BENCHMARKS.md, "Few-row matmul"), so the choice is measured. Both are fp32 products of the same numbers, summed in
another order: results agree to about 1e-5 relative, as any two BLAS kernels do; DART's losslessness does not rest
on bitwise equality with plain decoding's kernels (a one-token step already uses another kernel, a matrix-vector
product, than a tree forward).

`few_row_linears(*modules)` makes that product apply, within a `with` block and only in the calling thread's context,
to every `nn.Linear` of the modules whose weight is a float32 CPU tensor, for the row counts at which it measures
faster on this machine (`transposed_is_faster`). Inputs with one row, or with more than `MAX_ROWS`, take `F.linear`
as before, so a plain one-token step or a prefill is unchanged.

The model is never switched back and forth: the first use installs on each `nn.Linear` whose `forward` is the class's
own (modules wrapped by hooks that replace `forward`, e.g. accelerate's offloading, are left alone) a `FewRowForward`,
which computes `F.linear` (exactly `nn.Linear.forward`) unless the current context is inside `few_row_linears`. So
another thread, or code after an interrupted call, computes with the layers' own kernel; installing is idempotent and
locked, the same pattern transformers uses for its output-capturing hooks.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

# `W @ x.T` is tried for 2..MAX_ROWS rows only (one row is a matrix-vector product either way; beyond, sgemm's
# large-M path is fine). Which of the two products is faster depends on the CPU and its BLAS: on this project's AMD
# EPYC machines `W @ x.T` won up to about 5 rows per thread, on an Intel Xeon (AVX-512) `F.linear` won at 2-8 rows
# (BENCHMARKS.md, "Few-row matmul"). So it is measured, once per weight shape, row bucket and thread count.
MAX_ROWS = 16
ROW_BUCKETS = (2, 4, 8, 16)  # a row count is decided by the measurement at the first bucket bound >= it
MARGIN = 0.9  # `W @ x.T` is taken when it takes at most this fraction of `F.linear`'s time
_FASTER: dict[tuple, bool] = {}  # (N, K, bucket, threads, dtype) -> whether `W @ x.T` is the faster product


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]: `F.linear` computed as `weight @ x.T`."""
    rows = x.numel() // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()  # [rows, N]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _median_seconds(fn: Callable, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def transposed_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether `W @ x.T` beats `F.linear` for `rows` (2..MAX_ROWS) rows through `weight` on this machine with the
    current thread count: measured on random rows (the row bucket's bound) at the first call for each weight shape
    and bucket, then remembered for the process."""
    bucket = next(b for b in ROW_BUCKETS if b >= rows)
    key = (*weight.shape, bucket, torch.get_num_threads(), weight.dtype)
    faster = _FASTER.get(key)
    if faster is None:
        with torch.no_grad():
            x = torch.randn(bucket, weight.shape[1], dtype=weight.dtype)
            plain = _median_seconds(lambda: F.linear(x, weight))
            transposed = _median_seconds(lambda: transposed_linear(x, weight, None))
        faster = _FASTER[key] = transposed <= MARGIN * plain
    return faster


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
        if product is None or layer.weight.device.type != "cpu" or layer.weight.dtype != torch.float32:
            return F.linear(x, layer.weight, layer.bias)
        return product(x, layer.weight, layer.bias)


def install_few_row_forwards(*modules: nn.Module) -> None:
    """Give every `nn.Linear` of `modules` whose `forward` is the class's own a `FewRowForward` (the walk once per
    module; idempotent, safe to race)."""
    if all(module in _INSTALLED for module in modules):
        return
    with _INSTALL_LOCK:
        for module in modules:
            if module in _INSTALLED:
                continue
            for m in module.modules():
                if type(m) is nn.Linear and "forward" not in m.__dict__:
                    m.forward = FewRowForward(m)
            _INSTALLED.add(module)


@contextlib.contextmanager
def few_row_linears(*modules: nn.Module, product: Callable = few_row_linear) -> Iterator[None]:
    """Within the block, in this context only, the `nn.Linear` layers of `modules` with float32 CPU weights compute
    through `product(x, weight, bias)` (default: few-row inputs as `W @ x.T`; benchmarks pass other products)."""
    install_few_row_forwards(*modules)
    token = _PRODUCT.set(product)
    try:
        yield
    finally:
        _PRODUCT.reset(token)
