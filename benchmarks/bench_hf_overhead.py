"""Overhead of the dart_hf tree loop: time per decoding step vs one plain target forward over as many tokens.

    python benchmarks/bench_hf_overhead.py --json benchmarks/results/hf_overhead.json

SmolLM2-135M-Instruct (fp32, CPU, one thread) with a perfect head (`ReplayHead`: it drafts the target's own greedy
continuation, so every step accepts a full-depth path). For each tree size the loop's mean step time (head forward +
tree search + verify step) is compared, in the same run, with the median time of one plain target forward over the
same number of tokens on a cache of the same length (causal mask, no hidden states).
"""

from __future__ import annotations

import statistics
import sys

import torch
from transformers import DynamicCache

import dart_hf
from dart_bench import DEMO_PROMPT, Clock, chat_ids, script_parser, write_results
from dart_bench.replay import ReplayHead
from dart_core import DartConfig, DartHead, TreeConfig


def plain_forward_ms(model, prompt_ids, extra_tokens: int, repeats: int) -> float:
    """Median ms of one forward over `extra_tokens` new tokens after a cache holding the prompt."""
    clock = Clock()
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prompt_ids, past_key_values=cache, use_cache=True)
            block = prompt_ids[:, -extra_tokens:] if extra_tokens <= prompt_ids.shape[1] else \
                prompt_ids[:, :1].repeat(1, extra_tokens)
            clock.run("forward", model, block, past_key_values=cache, use_cache=True)
    return clock.median("forward") * 1e3


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--tree-sizes", default="8,24,60", help="remain_total values (draft nodes per tree)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size of the head")
    parser.add_argument("--draft-length", type=int, default=8, help="mask rows D of the head")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = dart_hf.load_smollm2()
    dart_hf.enable(model, False)
    ids = chat_ids(tokenizer, DEMO_PROMPT)
    mask = torch.ones_like(ids)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens + 16, do_sample=False,
                               eos_token_id=None)[0]
    cfg = model.config
    base = DartHead(DartConfig(hidden_size=cfg.hidden_size, intermediate_size=1536, num_attention_heads=9,
                               num_key_value_heads=3, vocab_size=cfg.vocab_size, draft_vocab_size=args.draft_vocab,
                               draft_length=args.draft_length, target_hidden_size=cfg.hidden_size,
                               num_target_layers=cfg.num_hidden_layers))
    # a draft vocabulary that holds the reference's tokens, filled up with the lowest other ids
    needed = sorted(set(reference.tolist()))
    rest = [t for t in range(cfg.vocab_size) if t not in set(needed)][: args.draft_vocab - len(needed)]
    targets = torch.tensor(sorted(needed + rest))
    base.d2t.copy_(targets - torch.arange(args.draft_vocab))
    head = ReplayHead.from_head(base, reference)
    results = {"model": "SmolLM2-135M-Instruct fp32", "threads": 1, "new_tokens": args.new_tokens,
               "draft_vocab": args.draft_vocab, "draft_length": args.draft_length, "rows": []}
    print(f"{'nodes':>5} {'steps':>5} {'tau':>5} {'step ms':>8} {'head ms':>7} {'tree ms':>7} {'target fwd ms':>13} "
          f"{'plain fwd ms':>12} {'overhead':>8} {'w/o head':>8}")
    for size in [int(s) for s in args.tree_sizes.split(",")]:
        tree = TreeConfig(remain_total=size)
        runs = []
        for _ in range(args.repeats):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                 eos_token_id=None, dart_head=head, dart_tree_config=tree)
            assert torch.equal(out[0], reference[: out.shape[1]]), "DART output differs from plain greedy"
            s = model.dart_stats
            runs.append(((s.head_time + s.tree_time + s.verify_time) / s.steps * 1e3, s.target_time / s.steps * 1e3,
                         s))
        step_ms = statistics.median(r[0] for r in runs)
        target_ms = statistics.median(r[1] for r in runs)
        stats = runs[-1][2]
        # same number of tokens, cache about as long as the mid-point of the generation
        context = reference[None, : ids.shape[1] + args.new_tokens // 2]
        plain_ms = plain_forward_ms(model, context, stats.tree_nodes, repeats=7)
        row = {"tree_nodes": stats.tree_nodes, "steps": stats.steps, "tau": stats.tau, "step_ms": step_ms,
               "target_forward_ms": target_ms, "plain_forward_ms": plain_ms,
               "head_ms": stats.head_time / stats.steps * 1e3, "tree_ms": stats.tree_time / stats.steps * 1e3,
               "overhead_vs_plain_forward": step_ms / plain_ms - 1.0}
        row["overhead_without_head"] = (step_ms - row["head_ms"]) / plain_ms - 1.0
        results["rows"].append(row)
        print(f"{row['tree_nodes']:5d} {row['steps']:5d} {row['tau']:5.2f} {step_ms:8.1f} {row['head_ms']:7.1f} "
              f"{row['tree_ms']:7.1f} {target_ms:13.1f} {plain_ms:12.1f} {row['overhead_vs_plain_forward']:8.1%} "
              f"{row['overhead_without_head']:8.1%}")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
