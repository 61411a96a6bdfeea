"""A faster product for the few-row linear layers of a verify step on the CPU.

A tree verify step runs every linear layer of the target on a handful of rows (the tree's nodes), and so does the
head on its new rows and mask rows. For such inputs `F.linear` (x [M, K] @ W.T, MKL sgemm with a transposed B) is
slow on the CPU: on this project's 2-core AVX2 machine a SmolLM2 forward over 2-10 tokens took 55-70 ms with it,
against 36 ms for one token. Computing the same product as `W @ x.T` (W the left operand, then transposed back) took
24-58 ms for 2-10 tokens (BENCHMARKS.md, "Few-row matmul"). Both are fp32 products of the same numbers, summed in
another order: results agree to about 1e-5 relative, as any two BLAS kernels do; DART's losslessness does not rest
on bitwise equality with plain decoding's kernels (a one-token step already uses another kernel, a matrix-vector
product, than a tree forward).

`few_row_linears(*modules)` swaps that product in for the duration of a `with` block, on every `nn.Linear` of the
modules whose weight is a float32 CPU tensor and whose `forward` is the class's own (modules wrapped by hooks that
replace `forward`, e.g. accelerate's offloading, are left alone). Inputs with one row, or with more rows than
`max_rows()`, take `F.linear` as before, so a plain one-token step or a prefill is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

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


def _eligible(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32)


@contextlib.contextmanager
def few_row_linears(*modules: nn.Module, product: Callable = few_row_linear) -> Iterator[None]:
    """Within the block, the eligible `nn.Linear` layers of `modules` compute few-row inputs as `W @ x.T`
    (`product(x, weight, bias)` replaces their `F.linear`; benchmarks pass other products). Not reentrant."""
    layers = [m for module in modules for m in module.modules() if _eligible(m)]

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight, self.bias)

    for layer in layers:
        layer.forward = forward.__get__(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
