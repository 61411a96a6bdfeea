"""The tree verify forward with transformers' sdpa attention vs `dart_hf.target.grouped_sdpa_attention`, by context.

    python benchmarks/bench_grouped_attention.py --json benchmarks/results/grouped_attention.json

SmolLM2-135M-Instruct (9 query heads on 3 key/value heads) fp32, the decoding loop's tree forward
(`dart_hf.target.tree_forward`: chain mask, explicit positions, tapped hidden states) over `--nodes` tokens on a
cache of each `--contexts` length. Both runs take the few-row linear product (`dart_runtime.matmul.few_row_linears`);
`repeat_kv` is transformers' sdpa, which copies each key/value head 3 times before attending with a 4D mask;
`grouped` runs inside `tree_forwards(model)`, whose attention stacks the 3 query heads of a key/value head instead.
The two alternate forward by forward (`--repeats` each after one warm-up pair; the cache is cut back after every
forward); medians in ms, and the largest difference between their logits. Also timed: entering and leaving each
block once (median of 100), the per-step cost the loop saves by entering them once per call.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

import dart_hf
from dart_bench import Clock, median_seconds, script_parser, write_results
from dart_hf.target import grouped_attention, keep_accepted_path, tree_attention_mask, tree_forward, tree_forwards
from dart_runtime.matmul import few_row_linears

TAPS = (2, 15, 27)


def measure(model, context: int, nodes: int, repeats: int) -> dict:
    """Median ms of the tree forward over `nodes` tokens after `context` cached ones, both ways, and the logits'
    largest absolute difference."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, 49152, (1, context), generator=gen).to(device)
    block = torch.randint(0, 49152, (1, nodes), generator=gen).to(device)
    mask = tree_attention_mask(torch.ones(1, nodes, nodes, dtype=torch.bool, device=device).tril(),
                               torch.ones(1, context, dtype=torch.bool, device=device), torch.float32)
    positions = torch.arange(context, context + nodes, device=device)[None]
    none = torch.zeros(1, 0, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    kernels = {"repeat_kv": lambda: few_row_linears(model), "grouped": lambda: tree_forwards(model)}
    clock = Clock(sync=device)
    logits = {}
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for i in range(repeats + 1):  # the two alternate forward by forward, after a warm-up pair
            for name, enter in kernels.items():
                with enter():  # entered outside the clock, as the loop enters it once per call
                    out = clock.run(name, tree_forward, model, block, positions, mask, cache, TAPS, keep=i > 0)
                keep_accepted_path(cache, context, none)
                logits[name] = out.logits
    row = clock.medians(scale=1e3)
    row["saved_fraction"] = 1 - row["grouped"] / row["repeat_kv"]
    row["max_abs_logit_diff"] = float((logits["grouped"] - logits["repeat_kv"]).abs().max())
    return row


def entry_ms(model, enter, repeats: int = 100) -> float:
    """Median ms to enter and leave the block `enter()`."""

    def enter_and_leave():
        with enter():
            pass

    return median_seconds(enter_and_leave, repeats, warmup=0) * 1e3


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[150, 600, 1500])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 61])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = dart_hf.load_smollm2()
    results = {"threads": args.threads, "repeats": args.repeats, "device": str(next(model.parameters()).device),
               "rows": []}
    results["enter_ms"] = {"few_row_linears": entry_ms(model, lambda: few_row_linears(model)),
                           "grouped_attention": entry_ms(model, lambda: grouped_attention())}
    print("entering each block once, ms:", {k: round(v, 3) for k, v in results["enter_ms"].items()})
    print("context  nodes  repeat_kv ms  grouped ms  saved  max |logit diff|")
    for context in args.contexts:
        for nodes in args.nodes:
            row = {"context": context, "nodes": nodes, **measure(model, context, nodes, args.repeats)}
            results["rows"].append(row)
            print(f"{context:7d} {nodes:6d} {row['repeat_kv']:13.1f} {row['grouped']:11.1f} "
                  f"{row['saved_fraction']:6.1%} {row['max_abs_logit_diff']:.1e}", flush=True)
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
