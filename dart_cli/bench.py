"""`dart-spec bench`: plain, prompt lookup, DART tree, DART chain and the EAGLE3-style drafter on SmolLM2."""

from __future__ import annotations

import argparse
import importlib.util
import platform
from pathlib import Path

from dart_bench import METHODS, PROMPT_SETS
from dart_cli.errors import UsageError
from dart_cli.numbers import checked, integer, real
from dart_cli.threads import set_threads


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="compare decoding methods on SmolLM2 in one run (JSON, markdown table, PNG charts)",
        description="Time plain generate(), prompt lookup, DART tree, DART chain (assistant_model=) and an "
                    "EAGLE3-style drafter on SmolLM2-135M-Instruct, batch 1, over MT-Bench, HumanEval and "
                    "GSM8K prompts at each temperature; every prompt runs all methods back to back. Writes "
                    "results.json, table.md, speedup.png and breakdown.png into --out.")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--data", metavar="DIR",
                   help="directory with mt_bench_questions.jsonl, humaneval.jsonl and gsm8k.jsonl (default: the "
                        "sets shipped in dart_bench/data)")
    p.add_argument("--sets", nargs="+", choices=PROMPT_SETS, default=list(PROMPT_SETS), help="prompt sets")
    p.add_argument("--per-set", type=integer(1), default=6, help="prompts per set (default 6)")
    p.add_argument("--methods", nargs="+", choices=METHODS,
                   help="methods (default: all; without --eagle3 all but eagle3); plain is always included")
    p.add_argument("--temperatures", nargs="+", type=real(0.0), default=[0.0, 1.0], help="default: 0 1")
    p.add_argument("--repeats", type=integer(1), default=3, help="repeats of the whole grid (default 3)")
    p.add_argument("--max-new-tokens", type=integer(1), default=128, help="default 128")
    p.add_argument("--head", metavar="DIR", help="DART head directory (default: the shipped one)")
    p.add_argument("--eagle3", metavar="DIR", help="EAGLE3-style drafter directory (dart-spec train --mode eagle3)")
    p.add_argument("--no-calibrate", action="store_false", dest="calibrate",
                   help="use the drafters' own tree settings instead of this machine's calibration (cached; measured "
                        "first when missing): DART's node count; the EAGLE3-style drafter's node count for each of "
                        "a few (topk, depth) searches, keeping the fastest")
    p.add_argument("--recalibrate", action="store_true", help="measure the tree sizes again even when cached")
    p.add_argument("--threads", type=integer(1), default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                   help="sampling seed base, 0..2**63-1 (default 0)")
    p.add_argument("--no-charts", action="store_false", dest="charts", help="skip the PNG charts (no matplotlib)")
    p.set_defaults(run=checked(p, _run_bench), reads=("data", "head", "eagle3"), writes="out")


def _run_bench(args: argparse.Namespace) -> int:
    if args.per_set < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise UsageError("--per-set, --repeats and --max-new-tokens must be >= 1")
    set_threads(args.threads)
    chosen = args.methods or [m for m in METHODS if m != "eagle3" or args.eagle3]
    methods = ["plain"] + [m for m in chosen if m != "plain"]
    if "eagle3" in methods and not args.eagle3:
        raise UsageError("method eagle3 needs --eagle3 DIR (a drafter from `dart-spec train --mode eagle3`)")
    if args.eagle3 and not Path(args.eagle3, "config.json").is_file():
        raise FileNotFoundError(f"EAGLE3-style drafter not found: no config.json in {args.eagle3}")
    if args.charts and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("charts need matplotlib (pip install 'dart-spec[bench]'), or pass --no-charts")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file; give a directory for the report")
    Path(args.out).mkdir(parents=True, exist_ok=True)  # a read-only or full disk says so now, not after the runs
    import torch

    import dart_hf
    from dart_bench import (DATA_DIR, EAGLE3_SEARCHES, BenchConfig, calibrated_tree, load_prompt_sets, markdown_table,
                            run_bench, write_report)
    from dart_core import Eagle3Head
    from dart_hf.calibration import device_name
    from dart_hf.target import plan_for

    prompt_sets = load_prompt_sets(args.data or DATA_DIR, args.per_set, args.sets)
    config = BenchConfig(methods=tuple(methods), temperatures=tuple(args.temperatures), repeats=args.repeats,
                         max_new_tokens=args.max_new_tokens, seed=args.seed)
    model, tokenizer, head = dart_hf.load_default(args.head)
    drafters = {"dart": head}
    if args.eagle3:
        param = next(model.parameters())
        drafters["eagle3"] = Eagle3Head.from_pretrained(args.eagle3, dtype=param.dtype, device=param.device).eval()
        plan_for(model, drafters["eagle3"], tokenizer)
    config.validate(drafters)
    trees, searched = {}, {}
    for name, drafter in drafters.items():
        if args.calibrate:
            searches = EAGLE3_SEARCHES if name == "eagle3" else ({},)
            _, searched[name] = calibrated_tree(model, tokenizer, drafter, searches, refresh=args.recalibrate)
            for row in searched[name]:
                print(f"{name} calibration: {row}")
        trees[name] = drafter.tree_config.to_dict() if drafter.tree_config else None
        print(f"{name}: {trees[name]}")
    results = run_bench(model, tokenizer, drafters, prompt_sets, config, progress=True)
    results["environment"] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "machine": device_name(next(model.parameters()).device),
                              "python": platform.python_version(), "tree_configs": trees, "calibrations": searched,
                              "head": args.head or "shipped", "eagle3": args.eagle3, "per_set": args.per_set,
                              "sets": list(args.sets)}
    paths = write_report(results, args.out, charts=args.charts)
    print(markdown_table([r for r in results["summary"] if r["set"] == "all"]))
    for row in results["dart_vs_eagle3"]:
        ratio = row["drafting_cost_ratio"]
        relation = f"{ratio:.1f}x cheaper" if ratio >= 1 else f"{1 / ratio:.1f}x more expensive"
        print(f"temperature {row['temperature']:g}: DART drafting {row['dart_drafting_ms_per_step']:.1f} ms/step vs "
              f"EAGLE3-style {row['eagle3_drafting_ms_per_step']:.1f} (DART {relation}); "
              f"tokens/s DART / EAGLE3-style {row['tokens_per_s_ratio']:.2f}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
