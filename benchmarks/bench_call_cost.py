"""What a DART generate() call costs beside plain generate() for a fixed output length, by prompt length.

    python benchmarks/bench_call_cost.py --json benchmarks/results/call_cost.json
    python benchmarks/bench_call_cost.py --prompt-tokens 50 --new-tokens 1,4 --repeats 1     # a quick check

SmolLM2-135M-Instruct and the shipped head (tree size: `dart_bench.decoding_tree`, the best by what calls measured,
else the head's own), greedy, batch 1. Prompts are GSM8K-style few-shot harness prompts ("Question: ...\\nAnswer: ..."
shots from the shipped GSM8K slice, then a question) cut to `--prompt-tokens` tokens. For each prompt length and each
output length n (`min_new_tokens` = `max_new_tokens` = n, so both decode exactly n tokens), plain and DART calls
alternate `--repeats` times after one warm-up each; the ratio is plain's median wall time over DART's. DART's per-call
phases (median ms, from `DartStats`): set-up (checks and preparation), prefill (the target on the prompt), first draft
(the head's pass over the prompt rows and the first tree search), and the rest of the call's wall time (decoding, and
generate()'s own preparation).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

import dart_hf
from dart_bench import decoding_tree, gsm8k_few_shot, interleave, read_prompt_rows, script_parser, write_results


def harness_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """[1, tokens] ids: few-shot GSM8K shots then a question, the shots cut from the front to fit."""
    rows = read_prompt_rows("gsm8k")
    ids = tokenizer(gsm8k_few_shot(rows[1:40], rows[0]), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"the shots give {ids.shape[1]} tokens, fewer than {tokens}")
    return ids[:, -tokens:]


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--prompt-tokens", default="50,400,1500")
    parser.add_argument("--new-tokens", default="1,2,4,8,16,32,128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--remain-total", type=int, help="draft nodes per tree (default: chosen for this machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default()
    tree = decoding_tree(model, head)
    if args.remain_total is not None:
        tree = dataclasses.replace(tree, remain_total=args.remain_total)
    results = {"threads": args.threads, "repeats": args.repeats, "tree": str(tree), "rows": []}
    print(f"tree: {tree}")
    print("prompt  new  plain ms  dart ms  ratio  setup  prefill  first-draft  decode  identical")
    for length in (int(x) for x in args.prompt_tokens.split(",")):
        ids = harness_prompt(tokenizer, length)

        def calls(n: int) -> dict:
            """plain and DART, both decoding exactly n tokens"""
            common = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return {"plain": lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **common),
                    "dart": lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **common,
                                                   dart_head=head, dart_tree_config=tree)}

        for warm in calls(4).values():  # warm-up
            warm()
        for n in (int(x) for x in args.new_tokens.split(",")):
            outputs, phases, same = {}, [], []

            def after(method, out, seconds, _):
                outputs[method] = out
                if method == "dart":
                    same.append(torch.equal(outputs["plain"], out))
                    s = dart_hf.last_stats(model)
                    phases.append((s.setup_time, s.prefill_time, s.first_draft_time,
                                   seconds - s.setup_time - s.prefill_time - s.first_draft_time))

            clock = interleave(calls(n), args.repeats, after=after)  # plain and DART alternate
            identical = all(same)
            plain_ms, dart_ms = 1000 * clock.median("plain"), 1000 * clock.median("dart")
            phase_ms = [1000 * statistics.median(p[i] for p in phases) for i in range(4)]
            row = {"prompt_tokens": length, "new_tokens": n, "plain_ms": plain_ms, "dart_ms": dart_ms,
                   "ratio": plain_ms / dart_ms, "setup_ms": phase_ms[0], "prefill_ms": phase_ms[1],
                   "first_draft_ms": phase_ms[2], "decode_ms": phase_ms[3], "identical": identical}
            results["rows"].append(row)
            print(f"{length:6d} {n:4d} {plain_ms:9.1f} {dart_ms:8.1f} {row['ratio']:6.2f} {phase_ms[0]:6.1f} "
                  f"{phase_ms[1]:8.1f} {phase_ms[2]:12.1f} {phase_ms[3]:7.1f}  {identical}")
    if args.json:
        write_results(args.json, results)
    return 0 if all(r["identical"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
