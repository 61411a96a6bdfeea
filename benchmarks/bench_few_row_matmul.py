"""The tree loop's target forward over k new tokens with each CPU product for its linear layers, per dtype.

    python benchmarks/bench_few_row_matmul.py --dtypes float32 bfloat16 --threads 2 \
        --json benchmarks/results/few_row_matmul.json

SmolLM2-135M-Instruct on a 256-token cache, the tree loop's forward (chain mask, tapped hidden states); median of
`--repeats` forwards per k after one warm-up, the cache cut back after each. Products: `f_linear` (the layers' own,
`F.linear`), `transposed` (`W @ x.T`), `mkl_packed` (MKL's packed weights for the row count, float32 only; a packed
copy of every weight), `onednn` (oneDNN with its own weight layout; a copy of every weight), `chosen` (what the loop
takes: `dart_runtime.matmul.few_row_linear`, measured per machine, row bucket and dtype). `one_row_as_two` is the
benchmarks' kernel control for plain decoding.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dart_hf
from dart_bench import interleave, script_parser, write_results
from dart_bench.kernel_control import one_row_as_two
from dart_hf.calibration import device_name
from dart_hf.target import keep_accepted_path, tree_attention_mask
from dart_runtime.matmul import few_row_linear, few_row_linears, transposed_linear

SIZES = (1, 2, 3, 4, 6, 8, 16, 32, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_copies(make):
    """A product that computes through `make(weight, rows)`'s copy of each weight, made once per weight and rows."""
    copies = {}

    def product(x, weight, bias):
        rows = x.numel() // x.shape[-1]
        key = (weight.data_ptr(), rows)
        if key not in copies:
            copies[key] = make(weight, rows)
        return copies[key](x.reshape(rows, x.shape[-1]), bias).view(*x.shape[:-1], weight.shape[0])

    return product


def mkl_packed(weight, rows):
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return lambda x, bias: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def onednn(weight, rows):
    blocked = weight.to_mkldnn()
    return lambda x, bias: torch._C._nn.mkldnn_linear(x.to_mkldnn(), blocked, bias).to_dense()


def products(dtype) -> dict:
    out = {"f_linear": F.linear, "transposed": transposed_linear, "onednn": weight_copies(onednn),
           "chosen": few_row_linear}
    if dtype == torch.float32 and torch._C.has_mkl:
        out["mkl_packed"] = weight_copies(mkl_packed)
    return out


def measure(model, sizes, repeats: int, named_products: dict) -> dict:
    """{product name: {k: median ms of the tree loop's target forward over k new tokens}} with each product for every
    linear layer; products and sizes round robin, so that a slow spell of the machine hits all alike."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    context = torch.randint(0, 49152, (1, 256), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 49152, (1, max(sizes)), generator=torch.Generator().manual_seed(1))
    none = torch.zeros(1, 0, dtype=torch.long)
    past = torch.ones(1, 256, dtype=torch.bool)
    masks = {k: tree_attention_mask(torch.ones(1, k, k, dtype=torch.bool).tril(), past, model.dtype).to(device)
             for k in sizes}
    positions = {k: torch.arange(256, 256 + k)[None] for k in sizes}

    def forward(product, k):
        with few_row_linears(model, product=product):  # the loop's tree forward, with `product`
            model(input_ids=block[:, :k], position_ids=positions[k], attention_mask=masks[k],
                  past_key_values=cache, use_cache=True, output_hidden_states=[2, 15, 27])

    runs = {(name, k): (lambda product=product, k=k: forward(product, k))
            for name, product in named_products.items() for k in sizes}
    with torch.no_grad():
        model(input_ids=context, past_key_values=cache, use_cache=True)
        clock = interleave(runs, repeats, warmup=1, after=lambda *_: keep_accepted_path(cache, 256, none))
    medians = clock.medians(scale=1e3)
    return {name: {k: medians[(name, k)] for k in sizes} for name in named_products}


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    model, _ = dart_hf.load_smollm2()
    results = {"sizes": list(SIZES), "repeats": args.repeats, "machine": device_name(torch.device("cpu")),
               "runs": {}}
    for dtype_name in args.dtypes:
        model.to(DTYPES[dtype_name])
        for threads in args.threads:
            torch.set_num_threads(threads)
            row = measure(model, SIZES, args.repeats, products(DTYPES[dtype_name]))
            row.update(measure(model, (1,), args.repeats, {"one_row_as_two": one_row_as_two, "f_linear_1": F.linear}))
            results["runs"][f"{dtype_name}/{threads}"] = row
            print(f"{dtype_name}, {threads} thread(s), ms per forward over k tokens:")
            print("  k           " + " ".join(f"{k:>6d}" for k in SIZES))
            for name in row:
                print(f"  {name:11s} " + " ".join(f"{row[name][k]:6.1f}" for k in row[name]))
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
