"""The target forward over k new tokens with F.linear vs the few-row product (`dart_core.matmul`), and a one-token
forward with its product computed as two rows (what plain decoding would get from the same kernel).

    python benchmarks/bench_few_row_matmul.py --threads 1 2 --json benchmarks/results/few_row_matmul.json

SmolLM2-135M-Instruct fp32 on a 256-token cache, the tree loop's forward (`dart_hf.target.tree_forward`: chain
mask, tapped hidden states); median of `--repeats` forwards per k after one warm-up, the cache cut back after each.
`few_row` applies `W @ x.T` to every k (the loop takes it where `dart_core.matmul.transposed_is_faster` measures it faster),
so the table shows where the break-even lies; `one_row_as_two` is the benchmarks' kernel control for plain decoding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import dart_hf
from dart_core.matmul import few_row_linears, transposed_linear
from dart_hf.target import keep_accepted_path, tree_attention_mask
from kernel_control import one_row_as_two
from results_io import write_results

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16)


def measure(model, sizes, repeats: int, product) -> dict:
    """{k: median ms of the tree loop's target forward over k new tokens} with `product` for every linear layer."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    context = torch.randint(0, 49152, (1, 256), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 49152, (1, max(sizes)), generator=torch.Generator().manual_seed(1))
    none = torch.zeros(1, 0, dtype=torch.long)
    past = torch.ones(1, 256, dtype=torch.bool)
    with torch.no_grad():
        model(input_ids=context, past_key_values=cache, use_cache=True)
        out = {}
        for k in sizes:
            mask = tree_attention_mask(torch.ones(1, k, k, dtype=torch.bool).tril(), past, torch.float32).to(device)
            positions = torch.arange(256, 256 + k)[None]
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                with few_row_linears(model, product=product):  # the loop's tree forward, with `product`
                    model(input_ids=block[:, :k], position_ids=positions, attention_mask=mask, past_key_values=cache,
                          use_cache=True, output_hidden_states=[2, 15, 27])
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
        for name, product, sizes in (("f_linear", F.linear, SIZES), ("few_row", transposed_linear, SIZES),
                                     ("one_row_as_two", one_row_as_two, (1,))):
            row[name] = measure(model, sizes, args.repeats, product)
        results["runs"][str(threads)] = row
        print(f"{threads} thread(s), ms per forward over k tokens:")
        print("  k        " + " ".join(f"{k:>5d}" for k in SIZES))
        for name in ("f_linear", "few_row"):
            print(f"  {name:8s} " + " ".join(f"{row[name][k]:5.1f}" for k in SIZES))
        print(f"  one token as a two-row product: {row['one_row_as_two'][1]:.1f} ms "
              f"(F.linear {row['f_linear'][1]:.1f} ms)")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
