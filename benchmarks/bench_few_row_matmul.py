"""The target forward over k new tokens with F.linear vs the few-row product (`dart_core.matmul`), and a one-token
forward with its product computed as two rows (what plain decoding would get from the same kernel).

    python benchmarks/bench_few_row_matmul.py --threads 1 2 --json benchmarks/results/few_row_matmul.json

SmolLM2-135M-Instruct fp32 on a 256-token cache, the tree loop's forward (`dart_hf.target.tree_forward`: chain
mask, tapped hidden states); median of `--repeats` forwards per k after one warm-up, the cache cut back after each.
`few_row` applies the product to every k (also above `dart_core.matmul.max_rows()`, where the loop keeps F.linear),
so the table shows where the break-even lies.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dart_hf
from dart_core import matmul
from dart_hf.target import keep_accepted_path, tree_attention_mask, tree_forward
from results_io import write_results

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16)


@contextlib.contextmanager
def every_row_count(few_rows: bool, pad_one_row: bool):
    """Let `dart_core.matmul` take the W @ x.T product for every row count (`few_rows`), and compute one-row inputs
    as a two-row product (`pad_one_row`); stock F.linear otherwise."""
    saved = matmul.few_row_linear

    def product(x, weight, bias):
        rows = x.numel() // x.shape[-1]
        if rows == 1 and pad_one_row:
            row = x.reshape(1, -1)
            out = (weight @ torch.cat((row, row)).T)[:, :1].T.contiguous()
            return (out if bias is None else out + bias).view(*x.shape[:-1], -1)
        if rows >= 2 and few_rows:
            out = (weight @ x.reshape(rows, -1).T).T.contiguous()
            return (out if bias is None else out + bias).view(*x.shape[:-1], -1)
        return F.linear(x, weight, bias)

    matmul.few_row_linear = product
    try:
        yield
    finally:
        matmul.few_row_linear = saved


def measure(model, sizes, repeats: int) -> dict:
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    context = torch.randint(0, 49152, (1, 256), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 49152, (1, max(sizes)), generator=torch.Generator().manual_seed(1))
    none = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=context, past_key_values=cache, use_cache=True)
        out = {}
        for k in sizes:
            mask = tree_attention_mask(torch.ones(k, k, dtype=torch.bool).tril(), 256, torch.float32).to(device)
            positions = torch.arange(256, 256 + k)[None]
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                tree_forward(model, block[:, :k], positions, mask, cache, (2, 15, 27))
                elapsed = time.perf_counter() - t0
                keep_accepted_path(cache, 256, none)
                if i:
                    times.append(elapsed)
            out[k] = statistics.median(times) * 1e3
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    model, _ = dart_hf.load_smollm2()
    results = {"sizes": list(SIZES), "repeats": args.repeats, "runs": {}}
    for threads in args.threads:
        torch.set_num_threads(threads)
        row = {}
        for name, few, pad in (("f_linear", False, False), ("few_row", True, False), ("one_row_as_two", False, True)):
            with every_row_count(few, pad):
                row[name] = measure(model, SIZES if name != "one_row_as_two" else (1,), args.repeats)
        results["runs"][str(threads)] = row
        print(f"{threads} thread(s), ms per forward over k tokens:")
        print("  k        " + " ".join(f"{k:>5d}" for k in SIZES))
        for name in ("f_linear", "few_row"):
            print(f"  {name:8s} " + " ".join(f"{row[name][k]:5.1f}" for k in SIZES))
        print(f"  one token as a two-row product: {row['one_row_as_two'][1]:.1f} ms "
              f"(F.linear {row['f_linear'][1]:.1f} ms); the loop uses the few-row product for 2..{matmul.max_rows()}")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
