"""Tree-search latency: vectorised `build_draft_trees` vs the straightforward reference, in the same run.

    python benchmarks/bench_tree.py --json benchmarks/results/tree_search.json

Settings follow the issue: K=25, W=20, R=60, 9 levels, an order-3 n-gram with >= 1e5 nodes; B=1 and B=32;
median of repeated runs with one torch thread (the decoding loop runs the search on one core).
"""

from __future__ import annotations

import statistics
import sys

import torch

from dart_bench import machine_info, repeat_seconds, script_parser, write_results
from dart_core import NGramModel, TreeConfig, build_draft_trees, topk_draft_tokens
from dart_core.reference import DictTrie, reference_tree


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--reference-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    vocab, levels, cfg = 4096, 9, TreeConfig()
    corpus = torch.randint(0, vocab, (60_000,), generator=gen)
    corpus[::3] = corpus[::3] % 64  # some structure so contexts repeat
    ngram = NGramModel.build([corpus], order=3, vocab_size=vocab)
    results = {"settings": {"topk": cfg.topk, "beam_width": cfg.beam_width, "remain_total": cfg.remain_total,
                            "levels": levels, "ngram_order": ngram.order, "ngram_nodes": ngram.num_nodes,
                            "threads": args.threads, "repeats": args.repeats},
               "ngram_bytes_per_node": ngram.nbytes / ngram.num_nodes,
               "machine": machine_info(),
               "batches": {}}

    for batch in (1, 32):
        logits = torch.randn(batch, levels, vocab, generator=gen) * 3
        tokens, probs = topk_draft_tokens(logits, cfg.topk)
        contexts = corpus[:3 * batch].view(batch, 3)

        def vectorised():
            build_draft_trees(tokens, probs, contexts, ngram, cfg)

        fast = repeat_seconds(vectorised, args.repeats, warmup=10)
        results["batches"][str(batch)] = {"vectorised_ms_median": statistics.median(fast) * 1e3,
                                          "vectorised_ms_per_tree": statistics.median(fast) * 1e3 / batch}
        print(f"B={batch:2d}: vectorised {statistics.median(fast) * 1e3:7.3f} ms per call "
              f"({statistics.median(fast) * 1e3 / batch:.3f} ms per tree)")

    trie = DictTrie([corpus.tolist()], order=3)
    tokens, probs = topk_draft_tokens(torch.randn(levels, vocab, generator=gen) * 3, cfg.topk)
    context = corpus[:3].tolist()
    slow = repeat_seconds(lambda: reference_tree(tokens, probs, context, trie, cfg), args.reference_repeats)
    results["reference_ms_per_tree"] = statistics.median(slow) * 1e3
    results["speedup_b1_vs_reference"] = results["reference_ms_per_tree"] / \
        results["batches"]["1"]["vectorised_ms_median"]
    print(f"reference (python lists): {results['reference_ms_per_tree']:.1f} ms per tree; "
          f"vectorised B=1 is {results['speedup_b1_vs_reference']:.0f}x faster")
    print(f"n-gram: {ngram.num_nodes} nodes, {results['ngram_bytes_per_node']:.1f} bytes per node")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
