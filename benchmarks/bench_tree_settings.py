"""Tree-search settings and n-gram tables for a head: tau at several tree sizes, on prompts outside its training data.

    python benchmarks/bench_tree_settings.py --mt-bench 20 --humaneval 10 --json benchmarks/results/tree_settings.json \
        --settings '[{}, {"ngram_weight": 0.0}, {"ngram_weight": 1.0}]' --ngram runs/other-ngram.safetensors

Greedy DART decoding with the shipped SmolLM2 head (or `--head`) on a few chat and code requests written for this
script, plus the last GSM8K training questions of the distillation order (`--gsm8k`: held out from heads distilled
from a prefix of that order, not from the shipped head, whose data covers all of GSM8K train) and the first MT-Bench
and HumanEval prompts (`--mt-bench`, `--humaneval`: held out from every shipped head). Every setting (a JSON object
of `TreeConfig` fields that replace the head's) runs once with a `--max-nodes` tree; the selection rank of each
accepted node gives the tau a smaller tree of the same search would have reached (`DartStats.tau_at`), so one run
per setting covers every tree size; each row also gives the tau of each prompt set alone (`tau_by_set`). Each `--ngram` file is run with the head's
settings. Measures acceptance only: tokens/s on a CPU come from `bench_default_head.py`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

import dart_hf
from dart_bench import encode_prompts, prompt_set, script_parser, write_results
from dart_core import TreeConfig
from dart_core.ngram import NGramModel
from dart_hf.calibration import acceptance_run, base_tree_config
from dart_hf.loop import DartStats

TREE_SIZES = (1, 2, 3, 4, 8, 16, 32, 60)  # float32 trees on a CPU: 1-4 nodes; bfloat16: 8-32; a GPU: 60
# requests written for this script (not from any benchmark set)
OWN_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a few tests.",
    'def merge_intervals(intervals):\n    """Merge overlapping intervals given as (start, end) pairs and return them '
    'sorted."""\n',
    "Explain the difference between a list and a tuple in Python, with short examples.",
    "Give me three tips for writing a clear cover letter for a software job.",
    "Write a short story (about 100 words) about a robot that learns to paint.",
    'def parse_csv_line(line, sep=","):\n    """Split one CSV line into fields, honouring double quotes."""\n',
)


def parse_settings(text: str) -> list[dict]:
    """The --settings JSON: a list of objects whose keys are TreeConfig fields (remain_total excluded)."""
    settings = json.loads(text)
    fields = {f.name for f in dataclasses.fields(TreeConfig)} - {"remain_total"}
    if not isinstance(settings, list) or not all(isinstance(s, dict) for s in settings):
        raise ValueError("--settings must be a JSON list of objects, e.g. '[{}, {\"ngram_weight\": 1.0}]'")
    for s in settings:
        unknown = sorted(set(s) - fields)
        if unknown:
            raise ValueError(f"unknown tree setting(s) {unknown}; allowed: {', '.join(sorted(fields))}")
    return settings


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=1)
    parser.add_argument("--settings", default="[{}]", help="JSON list of TreeConfig overrides (default: '[{}]')")
    parser.add_argument("--ngram", nargs="*", default=[], metavar="FILE", help="n-gram files to try instead")
    parser.add_argument("--gsm8k", type=int, default=0, help="GSM8K questions, default 0")
    parser.add_argument("--mt-bench", type=int, default=0, help="MT-Bench first turns, default 0")
    parser.add_argument("--humaneval", type=int, default=0, help="HumanEval prompts, default 0")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-nodes", type=int, default=60, help="tree size of the runs, default 60")
    parser.add_argument("--head", metavar="DIR", help="another DART head for SmolLM2 (default: the shipped one)")
    args = parser.parse_args(argv)
    counts = {"gsm8k": args.gsm8k, "mt_bench": args.mt_bench, "humaneval": args.humaneval}  # prompt set -> count
    try:
        settings = parse_settings(args.settings)
        sets = {name: prompt_set(name, n) for name, n in counts.items()}
    except ValueError as err:  # json.JSONDecodeError and DartInputError included
        parser.error(str(err))
    ngram_files = [Path(p) for p in args.ngram]
    missing = [str(p) for p in ngram_files if not p.is_file()]
    if missing:
        parser.error(f"n-gram file(s) not found: {', '.join(missing)}")
    torch.set_num_threads(args.threads)
    model, tokenizer, head = dart_hf.load_default(args.head)
    named = {**{name: texts for name, texts in sets.items() if texts}, "own": list(OWN_PROMPTS)}
    encoded = {name: encode_prompts(tokenizer, texts) for name, texts in named.items()}
    prompts = [ids for ids_of_set in encoded.values() for ids in ids_of_set]
    base = base_tree_config(model, head)
    # (what the row says, TreeConfig overrides, n-gram): every n-gram file is loaded (and checked) before any run
    runs = ([({"settings": s}, s, head.ngram) for s in settings]
            + [({"ngram": str(p)}, {}, NGramModel.load(p)) for p in ngram_files])
    sizes = [r for r in TREE_SIZES if r <= args.max_nodes]
    rows = []
    for label, overrides, ngram in runs:
        config = dataclasses.replace(base, remain_total=args.max_nodes, **overrides)
        head.ngram = ngram
        by_set = {name: acceptance_run(model, head, ids, config, max_new_tokens=args.max_new_tokens)
                  for name, ids in encoded.items()}  # one run per prompt set, merged: the same run as one over all
        stats = DartStats()
        for part in by_set.values():
            stats.merge(part)
        row = {**label, "tau": {r: round(stats.tau_at(r), 3) for r in sizes},
               "tau_by_set": {name: {r: round(part.tau_at(r), 3) for r in sizes} for name, part in by_set.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        prompt_sets = {"own": len(OWN_PROMPTS), **{name: len(texts) for name, texts in sets.items()}}
        write_results(args.json, {"head": args.head or "shipped", "base": dataclasses.asdict(base),
                                  "prompts": len(prompts), "prompt_sets": prompt_sets,
                                  "max_new_tokens": args.max_new_tokens, "threads": args.threads, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
