"""A faster product for the few-row linear layers of a verify step on the CPU.

A tree verify step runs every linear layer of the target on a handful of rows (the tree's nodes), and so does the
head on its new rows and mask rows. For such inputs `F.linear` (x [M, K] @ W.T, a GEMM with a transposed B) can be
slow on the CPU, and computing the same product as `W @ x.T` (W the left operand, then transposed back) can be much
faster: on 2-core AMD EPYC machines a SmolLM2 forward over 2-4 tokens took less than a one-token forward with it; on a
2-core Intel Xeon `F.linear` was the faster one (docs/benchmark-history.md, "Verify kernels"). So the choice is made
per machine, weight shape, thread count, dtype and row bucket. Both are products of the same numbers, summed in another order:
results agree to rounding, as any two BLAS kernels do; DART's losslessness does not rest on bitwise equality with plain
decoding's kernels (a one-token step already uses another kernel, a matrix-vector product, than a tree forward).

The choice is learned from the forwards themselves, never from a timing run of its own: while a (weight shape, row
bucket, threads, dtype) is undecided, its products take the two kernels in turn, each product timed as the forward
runs it (so the weights stream through the caches as they do in a real forward), and after `TRIAL_SAMPLES` of each
the one with the lower median is kept (`W @ x.T` only at `MARGIN` or less of `F.linear`'s time), or after
`EARLY_SAMPLES` of each one whose every product beat all of the other's by that margin (`trial_verdict`). A SmolLM2
forward decides its layers' shapes at once (30 layers give each shape 30-60 products); a shape met once a forward
(the output projection) decides over its first `2 x EARLY_SAMPLES` forwards where one kernel is clearly faster, its
first `2 x TRIAL_SAMPLES` otherwise. What is decided is kept (`kernel_choices`;
`dart_hf.calibration` keeps it across processes on one machine).

`few_row_linears(*modules)` makes that product apply, within a `with` block and only in the calling thread's context,
to every `nn.Linear` of the modules whose weight is a CPU tensor, for 2..`MAX_ROWS` rows. Inputs with one row, or
with more, take `F.linear` as before, so a plain one-token step or a prefill is unchanged. Packed-weight products
(MKL's, oneDNN's) were measured too (`benchmarks/bench_few_row_matmul.py`); each needs a copy of every weight,
doubling the target's memory.

The model is never switched back and forth: the first use installs on each `nn.Linear` whose `forward` is the class's
own (modules wrapped by hooks that replace `forward`, e.g. accelerate's offloading, are left alone) a `FewRowForward`,
which computes `F.linear` (exactly `nn.Linear.forward`) unless the current context is inside `few_row_linears` of a
module that holds the layer. So another thread, another module, or code after an interrupted call, computes with the
layers' own kernel; installing is idempotent and locked, the same pattern transformers uses for its output-capturing
hooks.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import threading
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dart_runtime.timing import interleaved_seconds, now

# `W @ x.T` is tried for 2..MAX_ROWS rows (one row is a matrix-vector product either way). Which of the two products is
# faster depends on the CPU, its BLAS, the dtype and the rows, so it is learned per weight shape, row bucket, thread
# count and dtype. The range covers what a verify step feeds a linear layer (a batch of B trees of R + 1 nodes:
# B x (R + 1) rows); past it a step is rare enough that `F.linear` is kept.
MAX_ROWS = 64
ROW_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a row count is decided with the first bound >= it
# Hysteresis, not a machine fact: the other product (or dtype) is taken only when it takes at most this fraction of
# the default's time, so that two kernels within timing noise keep the default.
MARGIN = 0.9
REPEATS = 5  # timed passes of each dtype's products (after one warm-up pass), interleaved (`fastest_dtype`)
TRIAL_SAMPLES = 7  # products of each kernel timed (an odd count: a median is one of them) before a choice is made
# ... or only this many of each when every product of one kernel took at most `MARGIN` of the other's fastest: a
# kernel three times faster (a vocabulary projection over 2 rows) stops costing the slow one's time after 3 products
EARLY_SAMPLES = 3


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N]: `F.linear` computed as `weight @ x.T`."""
    rows = x.numel() // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T.contiguous()  # [rows, N]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


PRODUCTS = (F.linear, transposed_linear)  # the two kernels a choice is between (False, True)

# "<N>:<K>|<row bucket>|<threads>|<dtype>" -> whether `W @ x.T` is the faster product there: what this process
# learned or adopted (`adopt_kernel_choices`: a cache keeps them across processes on one machine)
_CHOICES: dict[str, bool] = {}
_TRIALS: dict[str, tuple[list[float], list[float]]] = {}  # undecided key -> seconds of each kernel's products so far
_TRIAL_COUNT = 0  # products computed as trials in this process (`trial_products`)
_CHOICES_LOCK = threading.Lock()


_KEYS: dict[tuple, str] = {}  # (weight shape, rows, threads, dtype) -> its `choice_key`: a lookup per product


def choice_key(weight: torch.Tensor, rows: int) -> str:
    """The key of the kernel choice for `rows` (2..MAX_ROWS) rows through `weight` [N, K] here (`_CHOICES`)."""
    at = (weight.shape, rows, torch.get_num_threads(), weight.dtype)
    key = _KEYS.get(at)
    if key is None:
        bucket = next(b for b in ROW_BUCKETS if b >= rows)
        n, k = weight.shape
        key = _KEYS[at] = f"{n}:{k}|{bucket}|{at[2]}|{str(weight.dtype).replace('torch.', '')}"
    return key


def kernel_choice(weight: torch.Tensor, rows: int) -> Optional[bool]:
    """Whether `W @ x.T` is the faster product for `rows` rows through `weight` here; None while undecided."""
    return _CHOICES.get(choice_key(weight, rows))


def kernel_choices() -> dict[str, bool]:
    """A copy of the kernel choices this process knows."""
    with _CHOICES_LOCK:
        return dict(_CHOICES)


def adopt_kernel_choices(choices: dict[str, bool]) -> None:
    """Take `choices` (from `kernel_choices` of an earlier process on this machine) as decided; keys this process
    decided itself keep their values. Entries that are not a string key and a bool are ValueError."""
    if not isinstance(choices, dict) or any(not isinstance(k, str) or not isinstance(v, bool)
                                            for k, v in choices.items()):
        raise ValueError("kernel choices are an object of string keys and true/false values")
    with _CHOICES_LOCK:
        for key, value in choices.items():
            _CHOICES.setdefault(key, value)


def trial_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """The product through an undecided kernel choice: the kernel with fewer timed products so far, timed; the choice
    is made once `trial_verdict` gives one."""
    global _TRIAL_COUNT
    key = choice_key(weight, rows)
    with _CHOICES_LOCK:
        times = _TRIALS.setdefault(key, ([], []))
        kernel = int(len(times[1]) < len(times[0]))
        _TRIAL_COUNT += 1
    t0 = now()
    out = PRODUCTS[kernel](x, weight, bias)
    seconds = now() - t0
    with _CHOICES_LOCK:
        if key in _TRIALS and key not in _CHOICES:
            times[kernel].append(seconds)
            decided = trial_verdict(*times)
            if decided is not None:
                _CHOICES[key] = decided
                del _TRIALS[key]
    return out


def trial_products() -> int:
    """How many products this process has computed as kernel trials (`trial_product`): a forward during which it
    grows ran some products through the slower kernel, a one-off cost its time holds."""
    return _TRIAL_COUNT


def trial_verdict(linear: list[float], transposed: list[float]) -> Optional[bool]:
    """Whether `W @ x.T` is the faster product by the timed products of each kernel so far; None: not decided yet.
    After `TRIAL_SAMPLES` of each, the lower median (`W @ x.T` only within `MARGIN`); after `EARLY_SAMPLES`, a
    kernel all of whose products took at most `MARGIN` of the other's fastest."""
    done = min(len(linear), len(transposed))
    if done >= TRIAL_SAMPLES:
        return statistics.median(transposed) <= MARGIN * statistics.median(linear)
    if done >= EARLY_SAMPLES:
        if max(transposed) <= MARGIN * min(linear):
            return True
        if max(linear) <= MARGIN * min(transposed):
            return False
    return None


def settle_kernel_choices(weights: list[torch.Tensor], rows: int) -> None:
    """Decide now the kernel choices for `rows`-row products through `weights` (CPU tensors), by passes over all of
    them in turn on random rows (as forwards would decide them: `trial_product`)."""
    inputs = {int(w.shape[1]): torch.randn(rows, int(w.shape[1]), dtype=w.dtype) for w in weights}
    with torch.no_grad():
        while any(kernel_choice(w, rows) is None for w in weights):
            for w in weights:
                few_row_linear(inputs[int(w.shape[1])].to(w.dtype), w, None)


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
    """`F.linear`, as `transposed_linear` for 2..MAX_ROWS rows where that is faster here (`kernel_choice`; while
    undecided, `trial_product`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    faster = kernel_choice(weight, rows)
    if faster is None:
        return trial_product(x, weight, bias, rows)
    return transposed_linear(x, weight, bias) if faster else F.linear(x, weight, bias)


# in the current context: (the product of the few-row linear layers, the ids of the layers it applies to); None:
# every layer computes `F.linear`, its own
_PRODUCT: contextvars.ContextVar[Optional[tuple[Callable, frozenset]]] = contextvars.ContextVar(
    "dart_few_row_product", default=None)
_INSTALL_LOCK = threading.Lock()
# module -> the ids of its `nn.Linear` layers that compute through a `FewRowForward` (its walk is done)
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, frozenset]" = weakref.WeakKeyDictionary()


class FewRowForward:
    """The `forward` of an `nn.Linear` that DART has used: `F.linear(x, weight, bias)` (the layer's own), or inside
    `few_row_linears` of a module holding it, in this context, that block's product. Picklable and copyable with its
    layer."""

    __slots__ = ("layer",)

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        active = _PRODUCT.get()
        layer = self.layer
        if active is None or id(layer) not in active[1] or layer.weight.device.type != "cpu":
            return F.linear(x, layer.weight, layer.bias)
        return active[0](x, layer.weight, layer.bias)


def install_few_row_forwards(*modules: nn.Module) -> frozenset:
    """Give every `nn.Linear` of `modules` whose `forward` is the class's own a `FewRowForward` (the walk once per
    module; idempotent, safe to race) -> the ids of all of their layers that have one."""
    found = [_INSTALLED.get(module) for module in modules]
    if all(ids is not None for ids in found):
        return frozenset().union(*found)
    with _INSTALL_LOCK:
        for module in modules:
            if module in _INSTALLED:
                continue
            layers = [m for m in module.modules() if type(m) is nn.Linear
                      and ("forward" not in m.__dict__ or isinstance(m.__dict__["forward"], FewRowForward))]
            for m in layers:
                if "forward" not in m.__dict__:
                    m.forward = FewRowForward(m)
            _INSTALLED[module] = frozenset(id(m) for m in layers)
        return frozenset().union(*(_INSTALLED[module] for module in modules))


@contextlib.contextmanager
def few_row_linears(*modules: nn.Module, product: Callable = few_row_linear) -> Iterator[None]:
    """Within the block, in this context only, the `nn.Linear` layers of `modules` with CPU weights compute through
    `product(x, weight, bias)` (default: few-row inputs as `W @ x.T` where that is faster here; benchmarks pass
    other products)."""
    layers, outer = install_few_row_forwards(*modules), _PRODUCT.get()
    if outer is not None and outer[0] is product:  # nested in a block of the same product: both modules' layers
        layers |= outer[1]
    token = _PRODUCT.set((product, layers))
    try:
        yield
    finally:
        _PRODUCT.reset(token)
