"""What one drafting step of a head costs on this machine: `head.draft` as the decoding loop calls it.

    python benchmarks/bench_head_step.py --head dart_hf/assets/smollm2-135m-dart runs/wide-head --threads 1 \
        --json benchmarks/results/head_step.json

Each head (SmolLM2-135M-Instruct's embedding shared, the dtype `dart_hf.load_default` gives a head on this machine,
the loop's few-row linear products) first takes `--cache` rows (a prompt's pass), then drafts `--rows` new rows
(a verify step's accepted tokens and bonus) per step, its cache growing as in decoding, with the tree search's
top-k of the head's tree settings. The heads run in interleaved rounds (A, B, A, B, ...), so a slow spell of a
shared machine hits all alike; the median and the quartiles of `--rounds` steps, and each head's cost relative to the
first. Random hidden states stand in for the target's: the cost depends on shapes only.
"""

from __future__ import annotations

import statistics
import sys

import torch

import dart_hf
from dart_bench import script_parser, write_results
from dart_core import DartHead, TreeConfig
from dart_runtime.matmul import few_row_linears
from dart_runtime.timing import interleaved_seconds


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=1)
    parser.add_argument("--head", nargs="+", required=True, metavar="DIR", help="head directories (first: the base)")
    parser.add_argument("--rows", type=int, default=3, help="new rows per step (default 3)")
    parser.add_argument("--cache", type=int, default=256, help="rows cached before the first step (default 256)")
    parser.add_argument("--rounds", type=int, default=60, help="timed steps per head (default 60)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, first = dart_hf.load_default(args.head[0])
    dtype = first.fc.weight.dtype
    heads = {args.head[0]: first}
    for directory in args.head[1:]:
        head = DartHead.from_pretrained(directory, dtype=dtype)
        head.set_input_embeddings(model.get_input_embeddings())
        heads[directory] = head
    g = torch.Generator().manual_seed(0)
    states = {}
    for name, head in heads.items():
        cfg = head.config
        tree = head.tree_config or TreeConfig()
        cache = head.new_cache(1, capacity=args.cache + (args.rounds + 2) * args.rows)
        aux = torch.randn(1, args.cache, 3 * cfg.target_hidden_size, generator=g).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (1, args.cache), generator=g)
        with torch.inference_mode(), few_row_linears(head):
            head.draft(aux, ids, None, cache, tree)
        step_aux = torch.randn(1, args.rows, 3 * cfg.target_hidden_size, generator=g).to(dtype)
        step_ids = torch.randint(0, cfg.vocab_size, (1, args.rows), generator=g)
        states[name] = (head, cache, tree, step_aux, step_ids)

    def step(name):
        head, cache, tree, aux, ids = states[name]

        def run():
            with torch.inference_mode(), few_row_linears(head):
                return head.draft(aux, ids, None, cache, tree)
        return run

    times = interleaved_seconds({name: step(name) for name in heads}, rounds=args.rounds, warmup=2)
    base = statistics.median(times[args.head[0]])
    rows = []
    for name, seconds in times.items():
        q1, median, q3 = statistics.quantiles(seconds, n=4)
        head = heads[name]
        row = {"head": name, "parameters": sum(p.numel() for p in head.parameters()),
               "intermediate_size": head.config.intermediate_size, "dtype": str(dtype).removeprefix("torch."),
               "ms_median": round(1e3 * statistics.median(seconds), 3), "ms_q1": round(1e3 * q1, 3),
               "ms_q3": round(1e3 * q3, 3), "relative": round(statistics.median(seconds) / base, 3)}
        rows.append(row)
        print(row, flush=True)
    if args.json:
        write_results(args.json, {"rows_per_step": args.rows, "cache": args.cache, "rounds": args.rounds,
                                  "threads": args.threads, "heads": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
