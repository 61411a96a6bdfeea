"""lm-evaluation-harness's `generate_until` with and without DART, as an evaluation run drives a model.

    python benchmarks/bench_harness.py --json benchmarks/results/harness.json
    python benchmarks/bench_harness.py --questions 4 --batch-sizes 1 --shots 0     # a quick check

SmolLM2-135M-Instruct and the shipped head (tree size: `dart_bench.decoding_tree`, the best by what calls measured,
else the head's own), through `lm_eval.models.huggingface.HFLM(pretrained=model, batch_size=B).generate_until` with
GSM8K-style requests: `--shots` solved GSM8K training problems ("Question: ...\\nAnswer: ...") then a question, until
= ["Question:", "\\n\\n", "<|im_end|>"], `--max-gen-toks` 96, greedy, as the harness's GSM8K task asks. For each shot
count and batch size, plain HFLM (the model without a head) and HFLM on a copy of it with the head attached
(`dart_hf.enable(copy, head)`) alternate `--repeats` times over the same requests; the speedup is plain's median wall
time over DART's, and the continuations must be identical (exit status 1 otherwise).
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

import dart_hf
from dart_bench import decoding_tree, gsm8k_few_shot, read_prompt_rows, script_parser, timed, write_results

UNTIL = ["Question:", "\n\n", "<|im_end|>"]


def gsm8k_contexts(questions: int, shots: int) -> list[str]:
    """`shots` solved problems (the shipped slice's first ones) then each of its last `questions` questions."""
    rows = read_prompt_rows("gsm8k")
    if shots + questions > len(rows):
        raise ValueError(f"{shots} shots and {questions} questions need {shots + questions} GSM8K rows; "
                         f"the shipped slice has {len(rows)}")
    return [gsm8k_few_shot(rows[:shots], r) for r in rows[len(rows) - questions :]]


def requests(contexts: list[str], max_gen_toks: int):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(ctx, {"until": UNTIL, "max_gen_toks": max_gen_toks, "do_sample": False}))
            for i, ctx in enumerate(contexts)]


def main(argv=None) -> int:
    from lm_eval.models.huggingface import HFLM

    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--shots", default="0,5", help="comma-separated shot counts (default 0,5)")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-gen-toks", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default()  # `model` has no head attached: plain generate()
    attached = dart_hf.enable(copy.deepcopy(model), head)  # the same weights with the head attached
    tree = decoding_tree(model, head)  # what the attached head's calls decode with
    results = {"threads": args.threads, "tree": str(tree), "questions": args.questions, "rows": []}
    identical_all = True
    print(f"tree: {tree}")
    print("shots  batch  prompt tokens  plain s  DART s  speedup  identical")
    for shots in (int(s) for s in args.shots.split(",")):
        contexts = gsm8k_contexts(args.questions, shots)
        prompt_tokens = statistics.mean(len(tokenizer(c).input_ids) for c in contexts)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            plain_s, dart_s, identical = [], [], True
            for _ in range(args.repeats):  # plain and DART alternate
                plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch)
                want, seconds = timed(plain.generate_until, requests(contexts, args.max_gen_toks), disable_tqdm=True)
                plain_s.append(seconds)
                dart = HFLM(pretrained=attached, tokenizer=tokenizer, batch_size=batch)
                got, seconds = timed(dart.generate_until, requests(contexts, args.max_gen_toks), disable_tqdm=True)
                dart_s.append(seconds)
                identical &= got == want
            row = {"shots": shots, "batch_size": batch, "prompt_tokens": prompt_tokens,
                   "plain_s": statistics.median(plain_s), "dart_s": statistics.median(dart_s),
                   "speedup": statistics.median(plain_s) / statistics.median(dart_s), "identical": identical}
            results["rows"].append(row)
            identical_all &= identical
            print(f"{shots:5d} {batch:6d} {prompt_tokens:14.0f} {row['plain_s']:8.1f} {row['dart_s']:7.1f} "
                  f"{row['speedup']:7.2f}x  {identical}")
    if args.json:
        write_results(args.json, results)
    return 0 if identical_all else 1


if __name__ == "__main__":
    sys.exit(main())
