"""Batched DART vs plain batched generate() on SmolLM2: tokens/s, identity and tau per row, by batch size.

    python benchmarks/bench_batch.py --json benchmarks/results/batch.json                 # batch 1/2/4/8, 8 prompts
    python benchmarks/bench_batch.py --batch-sizes 1,2 --prompts 2 --max-new-tokens 8     # a quick check

Greedy, the first `--prompts` MT-Bench first turns (chat template, left-padded as a tokenizer pads a decoder-only
batch) from the shipped MT-Bench set, the shipped head (tree size: `dart_bench.decoding_tree`, the best by what calls
measured, else the head's own). For each batch size B the prompts are split into consecutive groups of B; each group
runs plain `generate()` and `generate(dart_head=...)` back to back, `--repeats` times alternating. tokens/s counts
every row's new tokens up to its stop (padding excluded) over the call's wall time; the speedup is the median over
repeats of DART's tokens/s over plain's, in this run. Identity compares the whole padded output tensors.
"""

from __future__ import annotations

import statistics
import sys

import torch

import dart_hf
from dart_bench import chat_batch, decoding_tree, prompt_set, script_parser, timed, write_results


def new_tokens(out: torch.Tensor, prompt_width: int, pad: int) -> int:
    """Generated tokens of every row, the right padding of finished rows excluded."""
    tail = out[:, prompt_width:]
    return int((tail != pad).sum())


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench questions (first turn), default 8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default()
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenizer.pad_token_id = pad
    texts = prompt_set("mt_bench", args.prompts)
    results = {"max_new_tokens": args.max_new_tokens, "threads": args.threads, "prompts": len(texts),
               "tree_nodes": decoding_tree(model, head).remain_total, "batch_sizes": {}}
    for size in (int(s) for s in args.batch_sizes.split(",")):
        groups = [texts[i: i + size] for i in range(0, len(texts) - size + 1, size)]
        ratios, plain_rates, dart_rates, identical, taus, forwards = [], [], [], 0, [], 0
        for _ in range(args.repeats):
            plain_tokens = dart_tokens = 0
            plain_time = dart_time = 0.0
            for group in groups:
                batch = chat_batch(tokenizer, group)
                width = batch["input_ids"].shape[1]
                common = dict(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
                plain, t_plain = timed(model.generate, **common)
                dart, t_dart = timed(model.generate, **common, dart_head=head)
                identical += int(torch.equal(plain, dart))
                plain_tokens += new_tokens(plain, width, pad)
                dart_tokens += new_tokens(dart, width, pad)
                plain_time, dart_time = plain_time + t_plain, dart_time + t_dart
                taus += list(model.dart_stats.tau_by_row().values())
                forwards += model.dart_stats.forwards
            plain_rates.append(plain_tokens / plain_time)
            dart_rates.append(dart_tokens / dart_time)
            ratios.append(dart_rates[-1] / plain_rates[-1])
        row = {"groups": len(groups), "identical": identical, "runs": len(groups) * args.repeats,
               "plain_tokens_per_s": statistics.median(plain_rates), "dart_tokens_per_s": statistics.median(dart_rates),
               "speedup": statistics.median(ratios), "speedups": ratios,
               "tau_by_row_median": statistics.median(taus), "tau_by_row_min": min(taus), "tau_by_row_max": max(taus),
               "verify_forwards_per_group": forwards / (len(groups) * args.repeats)}
        results["batch_sizes"][size] = row
        print(f"batch {size}: {identical}/{row['runs']} identical, plain {row['plain_tokens_per_s']:.1f} tok/s, "
              f"DART {row['dart_tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x "
              f"(runs {', '.join(f'{r:.2f}' for r in ratios)}), tau per row median {row['tau_by_row_median']:.2f} "
              f"[{row['tau_by_row_min']:.2f}, {row['tau_by_row_max']:.2f}]", flush=True)
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
