"""The context's own continuations in DART's tree (docs/DESIGN.md §2.6): plain `generate()`, prompt lookup, DART and
DART with context paths, per prompt set, in one run.

    python benchmarks/bench_context.py --json benchmarks/results/context.json

SmolLM2-135M-Instruct (float32) with the shipped head attached (`dart_hf.enable(model, head)`: each step's tree
chosen by `dart_hf.controller`, its first call measuring this machine), greedy, batch 1, `--max-new-tokens` each.
Prompt sets: the first `--per-set` MT-Bench first turns, GSM8K questions and HumanEval prompts shipped with the
package, and `--per-set` copy-heavy prompts of each kind of `dart_bench.copy_prompts` (summarize, rag, extract, edit:
this Python's standard-library documentation and source cut to about `--document-tokens` tokens). Each prompt runs
the four methods back to back (after one warm-up call of each on the first prompt). Per set and method: tokens/s
(new tokens over the wall time of the set's calls), its ratio to plain's, tau, and the share of accepted draft tokens
proposed by the head's search, the context, or both. Outputs must be identical to plain's (exit status 1 otherwise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dart_hf
from dart_bench import PROMPT_LOOKUP_TOKENS, chat_ids, environment, prompt_set, script_parser, timed, write_results
from dart_bench.copy_prompts import COPY_KINDS, copy_prompts

METHODS = {"plain": dict(dart_head=False),
           "prompt_lookup": dict(dart_head=False, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
           "dart": dict(dart_context_draft=False),
           "dart_context": dict(dart_context_draft=True)}
PACKAGE_SETS = ("mt_bench", "gsm8k", "humaneval")


def run_set(model, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Every prompt through every method back to back -> per method: tokens/s, tau, accepted tokens by source."""
    seconds = {m: 0.0 for m in METHODS}
    tokens = {m: 0 for m in METHODS}
    sources = {m: [0, 0, 0] for m in METHODS if m.startswith("dart")}
    accepted = {m: [0, 0] for m in sources}  # accepted draft tokens, steps
    identical = 0
    for ids in prompts:
        outs = {}
        for method, kwargs in METHODS.items():
            out, s = timed(model.generate, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, **kwargs)
            outs[method] = out
            seconds[method] += s
            tokens[method] += out.shape[1] - ids.shape[1]
            stats = model.dart_stats if method in sources else None
            if stats is not None:
                for i, n in enumerate((stats.accepted_head, stats.accepted_context, stats.accepted_both)):
                    sources[method][i] += n
                accepted[method][0] += sum(stats.accepted_lengths)
                accepted[method][1] += stats.steps
        identical += all(torch.equal(o, outs["plain"]) for o in outs.values())
    rate = {m: tokens[m] / seconds[m] for m in METHODS}
    out = {"prompts": len(prompts), "prompt_tokens": [int(p.shape[1]) for p in prompts], "identical": identical,
           "tokens_per_s": rate, "speedup": {m: rate[m] / rate["plain"] for m in METHODS},
           "tau": {m: (1 + a / n if n else None) for m, (a, n) in accepted.items()}, "accepted_by_source": {}}
    for m, (head, context, both) in sources.items():
        total = head + context + both
        out["accepted_by_source"][m] = {"head": head / total if total else 0.0,
                                        "context": context / total if total else 0.0,
                                        "both": both / total if total else 0.0}
    return out


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--per-set", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--document-tokens", type=int, default=700)
    parser.add_argument("--sets", default=",".join(PACKAGE_SETS + COPY_KINDS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default()
    dart_hf.enable(model, head)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    texts = {name: (copy_prompts(tokenizer, name, args.per_set, args.document_tokens) if name in COPY_KINDS
                    else prompt_set(name, args.per_set)) for name in sets}
    prompts = {name: [chat_ids(tokenizer, t) for t in ts] for name, ts in texts.items()}
    first = next(iter(prompts.values()))[0]
    for kwargs in METHODS.values():  # warm-up (and the first call's measurement of this machine)
        model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=16, do_sample=False, **kwargs)
    results = {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
               "threads": args.threads, "max_new_tokens": args.max_new_tokens, "sets": {}}
    print("| prompts | prompt tokens | plain tok/s | prompt lookup | DART | DART + context | tau DART / + context "
          "| accepted from head / context / both |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ps in prompts.items():
        row = results["sets"][name] = run_set(model, ps, args.max_new_tokens)
        share = row["accepted_by_source"]["dart_context"]
        tau = row["tau"]
        print(f"| {name} ({row['identical']}/{row['prompts']} identical) | {min(row['prompt_tokens'])}-"
              f"{max(row['prompt_tokens'])} | {row['tokens_per_s']['plain']:.1f} | "
              f"{row['speedup']['prompt_lookup']:.2f}x | {row['speedup']['dart']:.2f}x | "
              f"{row['speedup']['dart_context']:.2f}x | {tau['dart'] or 0:.2f} / {tau['dart_context'] or 0:.2f} | "
              f"{share['head']:.0%} / {share['context']:.0%} / {share['both']:.0%} |", flush=True)
    if args.json:
        write_results(args.json, results)
    return 0 if all(r["identical"] == r["prompts"] for r in results["sets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
