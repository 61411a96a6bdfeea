"""What a user gets on this CPU: plain `generate()`, prompt lookup and DART (a head attached with `dart_hf.enable`, each
step's tree chosen by `dart_hf.controller`) in float32 and bfloat16, in one run.

    python benchmarks/bench_cpu_speed.py --per-set 4 --max-new-tokens 96 --json benchmarks/results/cpu_speed.json

SmolLM2-135M-Instruct and the shipped head, greedy, batch 1, the first `--per-set` prompts of each shipped set
(MT-Bench first turns, HumanEval prompts, GSM8K questions; chat template). For each dtype the model is cast, the head
attached with `dart_hf.enable(model, head)` (no calibration command run before: the controller learns from the
calls' own steps) and each prompt runs plain, prompt lookup
(`prompt_lookup_num_tokens=10`) and DART back to back, after one warm-up call of each. Per method and dtype: tokens/s
summed over the prompts and its ratio to plain's of the same dtype, median over `--repeats`; and per prompt the first
new token where the method's output leaves plain's in the same dtype (None: identical). float32 outputs must be
identical (exit status 1 otherwise); in bfloat16 a several-token forward rounds differently from a one-token forward,
for prompt lookup and DART alike, so the agreement is reported.
"""

from __future__ import annotations

import statistics
import sys
import warnings

import torch

import dart_hf
from dart_bench import (DATA_DIR, PROMPT_LOOKUP_TOKENS, Clock, encode_prompts, first_difference, load_prompt_sets,
                        script_parser, timed, write_results)
from dart_hf.calibration import device_name
from dart_hf.controller import tree_choice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = {"plain": dict(dart_head=False), "prompt_lookup": dict(dart_head=False,
                                                                 prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
           "dart": {}}


def run_dtype(dtype: str, prompts: list[torch.Tensor], max_new_tokens: int, repeats: int) -> dict:
    """One dtype: the head attached, every prompt through every method `repeats` times (methods back to back)."""
    model, _, head = dart_hf.load_default(target_dtype=DTYPES[dtype])
    dart_hf.enable(model, head)
    common = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    with warnings.catch_warnings(record=True) as fallbacks:
        warnings.simplefilter("always")
        warm_up = {method: timed(model.generate, prompts[0], attention_mask=torch.ones_like(prompts[0]), **common,
                                 **kwargs)[1] for method, kwargs in METHODS.items()}
        first_call_s = warm_up["dart"]  # the process's first DART call (its steps the controller's first estimates)
        clock = Clock()  # (method, repeat) -> the seconds of each prompt
        outputs, taus = {m: [] for m in METHODS}, []
        for r in range(repeats):
            for ids in prompts:
                for method, kwargs in METHODS.items():
                    out = clock.run((method, r), model.generate, ids, attention_mask=torch.ones_like(ids), **common,
                                    **kwargs)
                    if r == 0:
                        outputs[method].append(out[0, ids.shape[1]:])
                        if method == "dart" and model.dart_stats is not None:
                            taus.append(model.dart_stats.tau)
    choice = tree_choice(model, head)  # the best tree by what the calls measured
    tokens = max_new_tokens * len(prompts)
    seconds = {m: [clock.total((m, r)) for r in range(repeats)] for m in METHODS}
    rate = {m: statistics.median(tokens / s for s in seconds[m]) for m in METHODS}
    ratio = {m: statistics.median(seconds["plain"][r] / seconds[m][r] for r in range(repeats)) for m in METHODS}
    parted = {m: [first_difference(out, ref) for out, ref in zip(outputs[m], outputs["plain"])]
              for m in ("prompt_lookup", "dart")}
    return {"tokens_per_s": rate, "speedup": ratio, "first_difference": parted,
            "tree": None if choice is None else {"remain_total": choice.remain_total,
                                                 "expected_speedup": choice.expected_speedup},
            "first_call_s": first_call_s, "dart_tau": statistics.mean(taus) if taus else None,
            "fell_back_to_plain": any(issubclass(w.category, dart_hf.DartFallbackWarning) for w in fallbacks)}


def median_parting(parted: list, max_new_tokens: int) -> float:
    """Median first new token where outputs part (an identical output counts as `max_new_tokens`)."""
    return statistics.median(max_new_tokens if p is None else p for p in parted)


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, tokenizer = dart_hf.load_smollm2()
    texts = [t for texts in load_prompt_sets(DATA_DIR, args.per_set).values() for t in texts]
    prompts = encode_prompts(tokenizer, texts)
    results = {"machine": device_name(torch.device("cpu")), "threads": args.threads, "torch": torch.__version__,
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "dtypes": {}}
    for dtype in args.dtypes:
        row = results["dtypes"][dtype] = run_dtype(dtype, prompts, args.max_new_tokens, args.repeats)
        tree = row["tree"]
        expected = tree and tree["expected_speedup"] and round(tree["expected_speedup"], 2)
        print(f"{dtype}: tree {tree and tree['remain_total']} (expected {expected}x,"
              f" first call {row['first_call_s']:.1f} s{', fell back to plain' if row['fell_back_to_plain'] else ''})")
        for method in METHODS:
            line = f"  {method:14s} {row['tokens_per_s'][method]:6.1f} tok/s  {row['speedup'][method]:.2f}x"
            if method != "plain":
                parted = row["first_difference"][method]
                line += (f"  identical {sum(p is None for p in parted)}/{len(parted)}, median first difference "
                         f"{median_parting(parted, args.max_new_tokens):g}")
            print(line, flush=True)
    if args.json:
        write_results(args.json, results)
    fp32 = results["dtypes"].get("float32")
    return 1 if fp32 and any(p is not None for m in ("prompt_lookup", "dart") for p in fp32["first_difference"][m]) \
        else 0


if __name__ == "__main__":
    sys.exit(main())
