"""The shipped SmolLM2 head on the benchmark prompts: identity, tau, per-position acceptance and speedup vs plain.

    python benchmarks/bench_default_head.py --json benchmarks/results/default_head.json            # 80 + 40 prompts
    python benchmarks/bench_default_head.py --mt-bench 10 --humaneval 5 --json ...                 # a quick subset
    python benchmarks/bench_default_head.py --head runs/head --remain-total 8 ...                   # another head

Greedy, batch 1, `--max-new-tokens` (128) per prompt, MT-Bench first turns and the first HumanEval prompts (chat
template) from the sets shipped in dart_bench/data. For each prompt plain `generate()` and DART run back to back on
the same machine; tokens/s are summed per set and the speedup is the ratio of the two within this run. The tree size
is the one chosen by what calls measured (`dart_bench.decoding_tree`; else the head's own), or `--remain-total`.

`--kernel-control` adds a third run per prompt: plain `generate()` whose one-row linear products are computed as a
two-row `W @ x.T` product (the row twice, one result kept) - the few-row kernel DART's verify step uses
(`dart_runtime.matmul`), given to plain decoding too. It tells how much of the speedup is that kernel rather than
drafting: `speedup_vs_kernel_control` is DART over it.

`--head-dtype-control DTYPE` adds DART with a copy of the head in DTYPE (e.g. float32, when `load_default` gave the
head bfloat16: `dart_hf.default.default_head_dtype`): `head_dtype_control_tokens_per_s`, its tau and identity, and
`speedup_vs_head_dtype_control` (DART over it) tell what the head's dtype is worth.
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

import dart_hf
from dart_bench import chat_ids, decoding_tree, prompt_set, script_parser, timed_generate, write_results
from dart_bench.kernel_control import one_row_as_two
from dart_runtime.matmul import few_row_linears


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=1)
    parser.add_argument("--mt-bench", type=int, default=80, help="MT-Bench questions (first turn), default 80")
    parser.add_argument("--humaneval", type=int, default=40, help="first HumanEval prompts, default 40")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--head", metavar="DIR", help="another DART head for SmolLM2 (default: the shipped one)")
    parser.add_argument("--remain-total", type=int, help="draft nodes per tree (default: chosen for this machine)")
    parser.add_argument("--kernel-control", action="store_true",
                        help="also time plain decoding with the few-row kernel (see above)")
    parser.add_argument("--head-dtype-control", metavar="DTYPE",
                        help="also time DART with the head cast to DTYPE, e.g. float32 (see above)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default(args.head)
    tree = decoding_tree(model, head, args.remain_total)
    other_head = None
    if args.head_dtype_control:
        other_head = copy.deepcopy(head).to(getattr(torch, args.head_dtype_control))
        other_head.set_input_embeddings(model.get_input_embeddings())
    results = {"max_new_tokens": args.max_new_tokens, "threads": args.threads,
               "tree_nodes": tree.remain_total,
               "head_dtype": str(head.fc.weight.dtype).replace("torch.", ""),
               "head_dtype_control": args.head_dtype_control, "sets": {}}
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    for name, count in (("mt_bench", args.mt_bench), ("humaneval", args.humaneval)):
        prompts = prompt_set(name, count)
        plain_tokens = dart_tokens = control_tokens = 0
        plain_time = dart_time = control_time = 0.0
        accepted, identical, control_identical = [], 0, 0
        other = {"tokens": 0, "time": 0.0, "accepted": [], "identical": 0}
        for text in prompts:
            ids = chat_ids(tokenizer, text)
            plain, t_plain = timed_generate(model, ids, **greedy)
            dart, t_dart = timed_generate(model, ids, **greedy, dart_head=head, dart_tree_config=tree)
            identical += int(torch.equal(plain, dart))
            plain_tokens += plain.shape[1] - ids.shape[1]
            dart_tokens += dart.shape[1] - ids.shape[1]
            plain_time, dart_time = plain_time + t_plain, dart_time + t_dart
            accepted += model.dart_stats.accepted_lengths
            if args.kernel_control:
                with few_row_linears(model, product=one_row_as_two):
                    control, t_control = timed_generate(model, ids, **greedy)
                control_identical += int(torch.equal(plain, control))
                control_tokens += control.shape[1] - ids.shape[1]
                control_time += t_control
            if other_head is not None:
                out, t_other = timed_generate(model, ids, **greedy, dart_head=other_head, dart_tree_config=tree)
                other["identical"] += int(torch.equal(plain, out))
                other["tokens"] += out.shape[1] - ids.shape[1]
                other["time"] += t_other
                other["accepted"] += model.dart_stats.accepted_lengths
        pooled = dart_hf.DartStats(accepted_lengths=accepted)  # every verify step of the set
        row = {"prompts": len(prompts), "identical": identical,
               "plain_tokens_per_s": plain_tokens / plain_time, "dart_tokens_per_s": dart_tokens / dart_time,
               "tau": pooled.tau, "acceptance_by_position": pooled.acceptance_by_position(),
               "median_accepted": statistics.median(accepted) if accepted else 0}
        row["speedup"] = row["dart_tokens_per_s"] / row["plain_tokens_per_s"]
        control = ""
        if args.kernel_control:
            row.update(control_tokens_per_s=control_tokens / control_time, control_identical=control_identical)
            row["speedup_vs_kernel_control"] = row["dart_tokens_per_s"] / row["control_tokens_per_s"]
            control = (f", plain with the few-row kernel {row['control_tokens_per_s']:.1f} tok/s "
                       f"({control_identical}/{len(prompts)} identical to plain; "
                       f"DART {row['speedup_vs_kernel_control']:.2f}x of it)")
        if other_head is not None:
            row.update(head_dtype_control_tokens_per_s=other["tokens"] / other["time"],
                       head_dtype_control_identical=other["identical"],
                       head_dtype_control_tau=dart_hf.DartStats(accepted_lengths=other["accepted"]).tau)
            row["speedup_vs_head_dtype_control"] = row["dart_tokens_per_s"] / row["head_dtype_control_tokens_per_s"]
            control += (f", DART with a {args.head_dtype_control} head {row['head_dtype_control_tokens_per_s']:.1f} "
                        f"tok/s (tau {row['head_dtype_control_tau']:.2f}, {other['identical']}/{len(prompts)} "
                        f"identical; DART {row['speedup_vs_head_dtype_control']:.2f}x of it)")
        results["sets"][name] = row
        print(f"{name}: {identical}/{len(prompts)} identical, plain {row['plain_tokens_per_s']:.1f} tok/s, "
              f"DART {row['dart_tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f}x, tau {row['tau']:.2f}, "
              f"acceptance by position {[round(a, 2) for a in row['acceptance_by_position']]}{control}")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
