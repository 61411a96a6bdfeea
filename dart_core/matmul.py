"""A faster product for the few-row linear layers of a verify step on the CPU.

A tree verify step runs every linear layer of the target on a handful of rows (the tree's nodes), and so does the
head on its new rows and mask rows. For such inputs `F.linear` (x [M, K] @ W.T, MKL sgemm with a transposed B) is
slow on the CPU: on this project's 2-core AVX2 machine a SmolLM2 forward over 2-10 tokens took 55-70 ms with it,
against 36 ms for one token. Computing the same product as `W @ x.T` (W the left operand, then transposed back) took
24-58 ms for 2-10 tokens (BENCHMARKS.md, "Few-row matmul"). Both are fp32 products of the same numbers, summed in
another order: results agree to about 1e-5 relative, as any two BLAS kernels do; DART's losslessness does not rest
on bitwise equality with plain decoding's kernels (a one-token step already uses another kernel, a matrix-vector
product, than a tree forward).

`few_row_linears(*modules)` makes that product apply, within a `with` block and only in the calling thread's context,
to every `nn.Linear` of the modules whose weight is a float32 CPU tensor. Inputs with one row, or with more rows than
`max_rows()`, take `F.linear` as before, so a plain one-token step or a prefill is unchanged.

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
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

# The measured break-even: `W @ x.T` wins up to about 10 rows with 2 threads and 5 rows with 1 thread
# (BENCHMARKS.md, "Few-row matmul"), i.e. up to ROWS_PER_THREAD rows per thread; never above MAX_ROWS (not measured).
ROWS_PER_THREAD = 5
MAX_ROWS = 16


def max_rows() -> int:
    """The largest row count that takes the `W @ x.T` product with the current torch thread count."""
    return min(MAX_ROWS, ROWS_PER_THREAD * torch.get_num_threads())


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]: `F.linear` computed as `weight @ x.T`."""
    rows = x.numel() // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()  # [rows, N]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, as `transposed_linear` for 2..max_rows() rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= max_rows():
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
