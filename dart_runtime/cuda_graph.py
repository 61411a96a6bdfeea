"""Replaying a fixed-shape part of a decoding step from a CUDA graph (`generate(..., dart_cuda_graph=True)`)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class CudaGraphed:
    """`fn(*args)` (tensors in nested tuples / lists) replayed from a CUDA graph captured at its first call for each
    input shape. `fn` must run the same operators for every input of a shape and read nothing back to the host.

    Runs `fn` eagerly when an input is not a CUDA tensor (another device, or a drafter whose inputs are not plain
    tensors) or the inputs span several devices, and, with one warning, for good after a failed capture. The
    returned tensors are the graph's own outputs: the next call overwrites them.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.graphs: dict = {}
        self.failed = False

    def __call__(self, *args):
        leaves, spec = tree_flatten(args)
        if (self.failed or not leaves or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
                or len({x.device for x in leaves}) > 1):
            return self.fn(*args)
        key = (str(spec), tuple((tuple(x.shape), x.dtype, x.device) for x in leaves))
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(leaves, spec)
            except RuntimeError as err:
                self.failed = True
                warnings.warn(f"dart_cuda_graph: capturing {getattr(self.fn, '__name__', 'the step')} failed "
                              f"({err}); it runs eagerly", stacklevel=2)
                return self.fn(*args)
        graph, inputs, output = entry
        with torch.cuda.device(leaves[0].device):
            for static, value in zip(inputs, leaves):
                static.copy_(value)
            graph.replay()
        return output

    def _capture(self, leaves: list[torch.Tensor], spec):
        with torch.cuda.device(leaves[0].device):  # streams and graph on the inputs' device, not the current one
            inputs = [x.clone() for x in leaves]
            args = tree_unflatten(inputs, spec)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture: lazy initialisation, cached constants
                self.fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = self.fn(*args)
        return graph, inputs, output


def cached_graph(graphs: dict, key, fn: Callable) -> CudaGraphed:
    """The `CudaGraphed` of `fn` kept in `graphs` under `key` (made on first use), so that later calls replay the
    graphs earlier ones captured."""
    if key not in graphs:
        graphs[key] = CudaGraphed(fn)
    return graphs[key]
