"""The kernel control of the benchmarks: plain decoding given the few-row product of DART's verify step
(`bench_default_head.py --kernel-control`, `bench_few_row_matmul.py`)."""

from __future__ import annotations

import torch

from dart_runtime.matmul import few_row_linear


def one_row_as_two(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`; a one-row x as a two-row `W @ x.T` product (the row twice, one result kept), which runs MKL's
    matrix product (both cores) instead of its one-thread matrix-vector product; few rows as the verify step does."""
    if x.numel() != x.shape[-1]:
        return few_row_linear(x, weight, bias)
    row = x.reshape(1, -1)
    out = (weight @ torch.cat((row, row)).T)[:, :1].T.contiguous()  # [1, N]
    return (out if bias is None else out + bias).view(*x.shape[:-1], weight.shape[0])

