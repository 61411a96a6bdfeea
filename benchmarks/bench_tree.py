"""Tree-search latency: vectorised `build_draft_trees` vs the straightforward reference, in the same run.

    python benchmarks/bench_tree.py --json benchmarks/results/tree_search.json

Settings follow the issue: K=25, W=20, R=60, 9 levels, an order-3 n-gram with >= 1e5 nodes; B=1 and B=32;
median of repeated runs with one torch thread (the decoding loop runs the search on one core).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from dart_core import NGramModel, TreeConfig, build_draft_trees, topk_draft_tokens
from dart_core.reference import DictTrie, reference_tree
from results_io import write_results


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--reference-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
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
               "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                           "torch": torch.__version__, "python": sys.version.split()[0]},
               "batches": {}}

    for batch in (1, 32):
        logits = torch.randn(batch, levels, vocab, generator=gen) * 3
        tokens, probs = topk_draft_tokens(logits, cfg.topk)
        contexts = corpus[:3 * batch].view(batch, 3)

        def vectorised():
            build_draft_trees(tokens, probs, contexts, ngram, cfg)

        for _ in range(10):
            vectorised()
        fast = timed(vectorised, args.repeats)
        results["batches"][str(batch)] = {"vectorised_ms_median": statistics.median(fast) * 1e3,
                                          "vectorised_ms_per_tree": statistics.median(fast) * 1e3 / batch}
        print(f"B={batch:2d}: vectorised {statistics.median(fast) * 1e3:7.3f} ms per call "
              f"({statistics.median(fast) * 1e3 / batch:.3f} ms per tree)")

    trie = DictTrie([corpus.tolist()], order=3)
    tokens, probs = topk_draft_tokens(torch.randn(levels, vocab, generator=gen) * 3, cfg.topk)
    context = corpus[:3].tolist()
    slow = timed(lambda: reference_tree(tokens, probs, context, trie, cfg), args.reference_repeats)
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
