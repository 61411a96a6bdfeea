"""Official `.trie` -> n-gram conversion: throughput, peak memory and output size on a synthetic trie.

    python benchmarks/bench_convert_trie.py --json benchmarks/results/convert_trie.json

A Zipf-distributed random corpus with copied segments (so n-grams recur) is counted with `NGramModel.build` (order
3, >= 5 M trie nodes) and written with `write_official_trie` in two layouts: "dfs" (parents first, like the
reference's creation order) and "random" (node ids permuted: children often precede parents, the reader needs extra
passes). Each conversion runs in a fresh child process; its peak memory is that process's peak RSS
(VmHWM from /proc/self/status; `ru_maxrss` is recorded too but under subprocess it can include the parent's peak),
reported next to the peak of a child that only imports the same modules. The converted
model is checked key for key and count for count against the directly built one. A plain Python
`struct.unpack_from` loop over the first records gives the per-node-loop parse rate for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile

import numpy as np

from dart_bench import machine_info, script_parser, timed, write_results
from dart_bench.memory import peak_rss_mib, run_child


def synthetic_corpus(tokens: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Zipf(1.05) token ids folded into the vocab, 200 copied 5000-token segments, split into ~500-token sequences."""
    rng = np.random.default_rng(seed)
    corpus = (rng.zipf(1.05, size=tokens) - 1) % vocab
    for _ in range(200):
        a, b = rng.integers(0, tokens - 5000, size=2)
        corpus[b:b + 5000] = corpus[a:a + 5000]
    return np.split(corpus, np.sort(rng.integers(0, tokens, size=tokens // 500)))


def python_loop_rate(path: str, nbytes: int = 64 << 20) -> float:
    """Nodes/s of a plain per-node struct.unpack_from loop (fields only, no processing) over the file's start."""
    with open(path, "rb") as fh:
        buf = fh.read(nbytes)
    node, child = struct.Struct("<iQiQ").unpack_from, struct.Struct("<iQ").unpack_from

    def parse() -> int:
        off, n, end = 16, 0, len(buf) - (1 << 20)
        while off < end:
            _, _, _, nch = node(buf, off)
            off += 24
            for _ in range(nch):
                child(buf, off)
                off += 12
            n += 1
        return n

    n, seconds = timed(parse)
    return n / seconds


def child_convert(src: str, dst: str) -> None:
    """Child process: convert, then print stats + peak memory as one JSON line."""
    from dart_converters import convert_trie

    stats = convert_trie(src, dst, force=True, progress=False)
    print(json.dumps({**stats, **peak_rss_mib()}))


def child_baseline() -> None:
    """Child process: only the imports the converter needs."""
    import dart_converters  # noqa: F401
    import torch  # noqa: F401

    print(json.dumps(peak_rss_mib()))


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=3_500_000, help="corpus tokens (default ~5 M trie nodes)")
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--layouts", default="dfs,random", help="node orders to write (comma separated)")
    parser.add_argument("--scale-tokens", type=int, default=7_000_000,
                        help="a second, larger dfs run (0: none): the memory slope per extra node")
    parser.add_argument("--workdir", help="where the .trie files go (default: a temp dir, removed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-convert", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--child-baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_convert:
        child_convert(*args.child_convert)
        return 0
    if args.child_baseline:
        child_baseline()
        return 0

    import torch

    from dart_converters import write_official_trie
    from dart_core import NGramModel

    work = args.workdir or tempfile.mkdtemp(prefix="bench-trie-")
    os.makedirs(work, exist_ok=True)
    baseline = run_child(__file__, "--child-baseline")["peak_mib"]
    results = {"settings": {"tokens": args.tokens, "vocab": args.vocab, "order": 3, "seed": args.seed,
                            "memory_measure": "peak RSS (VmHWM) of a fresh child process, MiB"},
               "machine": machine_info(numpy=np.__version__),
               "baseline_peak_mib": baseline, "runs": []}
    plan = [(args.tokens, layout) for layout in args.layouts.split(",") if layout]
    if args.scale_tokens:
        plan.append((args.scale_tokens, "dfs"))
    try:
        model, model_tokens = None, None
        for tokens, layout in plan:
            if tokens != model_tokens:
                model = None
                model, build_s = timed(lambda: NGramModel.build(synthetic_corpus(tokens, args.vocab, args.seed),
                                                                order=3, vocab_size=args.vocab))
                model_tokens = tokens
                print(f"corpus: {tokens:,} tokens, vocab {args.vocab:,} -> {model.num_nodes:,} trie nodes "
                      f"(NGramModel.build {build_s:.1f} s)")
            src, dst = os.path.join(work, f"{layout}.trie"), os.path.join(work, f"{layout}.safetensors")
            _, write_s = timed(write_official_trie, src, model, node_order=layout, seed=args.seed)
            stats = run_child(__file__, "--child-convert", src, dst)
            converted = NGramModel.load(dst)
            identical = (torch.equal(converted.keys, model.keys) and torch.equal(converted.counts, model.counts)
                         and converted.vocab_bound == model.vocab_bound)
            run = {"layout": layout, "tokens": tokens, "write_s": write_s, "identical_to_build": bool(identical),
                   "python_struct_loop_nodes_per_s": python_loop_rate(src) if not results["runs"] else None,
                   "peak_delta_mib": stats["peak_mib"] - baseline,
                   "output_mib": stats["output_bytes"] / 2**20,
                   "shrink": stats["input_bytes"] / stats["output_bytes"], **stats}
            results["runs"].append(run)
            del converted
            os.remove(dst)
            os.remove(src)
    finally:
        if not args.workdir:
            for f in os.listdir(work):
                os.remove(os.path.join(work, f))
            os.rmdir(work)
    dfs = [r for r in results["runs"] if r["layout"] == "dfs"]
    if len(dfs) >= 2 and dfs[-1]["nodes"] != dfs[0]["nodes"]:
        slope = (dfs[-1]["peak_mib"] - dfs[0]["peak_mib"]) * 2**20 / (dfs[-1]["nodes"] - dfs[0]["nodes"])
        results["peak_bytes_per_extra_node"] = slope

    head = (f"{'layout':8} {'nodes':>10} {'passes':>6} {'seconds':>8} {'M nodes/s':>9} {'in B/node':>9} "
            f"{'out B/node':>10} {'shrink':>6} {'peak MiB':>8} {'(-base)':>8} {'same':>5}")
    print(head)
    print("-" * len(head))
    for r in results["runs"]:
        print(f"{r['layout']:8} {r['nodes']:>10,} {r['passes']:>6} {r['seconds']:>8.2f} {r['nodes_per_s'] / 1e6:>9.2f} "
              f"{r['input_bytes_per_node']:>9.1f} {r['bytes_per_node']:>10.2f} {r['shrink']:>5.1f}x "
              f"{r['peak_mib']:>8.0f} {r['peak_delta_mib']:>8.0f} {str(r['identical_to_build']):>5}")
    print(f"baseline child (imports only): {baseline:.0f} MiB")
    if "peak_bytes_per_extra_node" in results:
        print(f"peak memory slope between the dfs runs: {results['peak_bytes_per_extra_node']:.1f} bytes per extra "
              "node (the output itself: 12)")
    for r in results["runs"]:
        if r["python_struct_loop_nodes_per_s"]:
            print(f"plain Python struct.unpack_from loop (parse only): {r['python_struct_loop_nodes_per_s'] / 1e6:.2f} "
                  f"M nodes/s")
    if args.json:
        write_results(args.json, results)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
