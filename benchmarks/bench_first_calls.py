"""A new user's first calls with the shipped head attached, against plain generate() in the same conditions: each
session is a fresh process with an empty dart-spec cache (as a notebook's first cell, a CI job or a command-line
tool starts), idle or with one other process keeping one of the two cores busy, at 1 and 2 threads.

    python benchmarks/bench_first_calls.py --json benchmarks/results/first_calls.json
    python benchmarks/bench_first_calls.py --scenarios first --configs 2:idle --repeats 1 --new-tokens 8   # quick

Scenarios (`--scenarios`), SmolLM2-135M-Instruct float32, greedy, held-out chat prompts
(`dart_bench/data/fresh_prompts.jsonl`):
- first: one call of `--new-tokens` (64) tokens, the session's first; one session per prompt (`--repeats`);
- cannot_pay: a head of the shipped shape with random weights and no acceptance curve (it accepts next to nothing),
  4 calls x 48 tokens on 4 prompts, the session's total time;
- batches: one untimed call at batch 1, then two calls at batch 4 (4 prompts, left-padded) and two at batch 8, 48
  tokens each; each call timed; a second call repeats the first one's prompts, so the store of earlier outputs that
  `enable` attaches can copy its answers;
- demo: `dart-spec demo`'s own measurement (plain and DART alternated after a streamed warm-up), in a fresh session.

Each of `--repeats` repeats runs a plain session and a DART session back to back, plain first in even repeats and
DART first in odd ones, so that a machine whose speed drifts favours neither (plain: the same calls with
`dart_head=False` on a model with nothing attached); a ratio is plain's seconds over DART's for the same calls (the
demo: its tokens/s ratio), reported per timed call as the median and the minimum over the repeats. A process's own
speed varies: the same plain calls run up to 1.5x slower in one fresh process than in the next, and that holds for the
whole process. So each session ends with `REFERENCE_CALLS` plain calls of its first timed call's work (the faster
kept), and each ratio is also given at the same process speed: multiplied by the DART session's reference time over
the plain session's.
Every DART output must equal plain's. Configs (`--configs`): threads:load pairs, load `idle` or `busy` (one spinning
process beside the session for its whole duration, model loading included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dart_bench import DATA_DIR, environment, prompts_from_file, script_parser, write_results
from dart_bench.load import busy_cores

SCENARIOS = ("first", "cannot_pay", "batches", "demo")
CONFIGS = "1:idle,1:busy,2:idle,2:busy"
MARK = "RESULT "
REFERENCE_CALLS = 2  # plain calls after a session's timed ones that measure the process's own speed (the faster kept)


def _session(spec: dict) -> dict:
    """One fresh process's calls (run in the child): seconds of each timed call, the outputs, the steps."""
    import dart_hf
    from dart_bench import chat_batch, timed

    torch.set_num_threads(spec["threads"])
    if spec["scenario"] == "demo":
        from dart_cli.demo import model_demo

        result = model_demo(max_new_tokens=spec["new_tokens"], repeats=3)
        return {"ratio": result["speedup"], "identical": bool(result["identical"])}
    model, tokenizer, head = dart_hf.load_default()
    tokenizer.padding_side = "left"
    if spec["scenario"] == "cannot_pay":
        from benchmarks.bench_controller import head_that_cannot_pay

        head = head_that_cannot_pay(model, curve=False)
    if spec["dart"]:
        dart_hf.enable(model, head)
    texts = prompts_from_file(DATA_DIR / "fresh_prompts.jsonl", 16)
    calls = {  # (batch of prompts, new tokens, timed)
        "first": [([texts[spec["repeat"] % len(texts)]], spec["new_tokens"], True)],
        "cannot_pay": [([t], 48, True) for t in texts[:4]],
        "batches": [(texts[8:9], 16, False)] + [(texts[:4], 48, True)] * 2 + [(texts[:8], 48, True)] * 2,
    }[spec["scenario"]]
    seconds, outputs, steps = [], [], []

    def generate(prompts: list[str], n: int, dart: bool):
        batch = chat_batch(tokenizer, prompts)
        return timed(model.generate, **batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                     **({} if dart else {"dart_head": False}))

    for prompts, n, counted in calls:
        out, s = generate(prompts, n, spec["dart"])
        stats = model.dart_stats if spec["dart"] else None
        if counted:
            seconds.append(s)
            outputs.append(out.tolist())
            steps.append(None if stats is None else stats.tree_sizes)
    prompts, n, _ = next(call for call in calls if call[2])  # the process's own speed: its first timed call, plain
    reference = min(generate(prompts, n, False)[1] for _ in range(REFERENCE_CALLS))
    return {"seconds": seconds, "outputs": outputs, "tree_sizes": steps, "reference_s": reference}


def run_session(spec: dict, busy: bool) -> dict:
    """`_session(spec)` in a fresh process with an empty cache, removed afterwards (beside one busy process if
    `busy`)."""
    with tempfile.TemporaryDirectory(prefix="dart-bench-first-") as cache, busy_cores(1 if busy else 0):
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, DART_SPEC_CACHE=cache,
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, __file__, "--session", json.dumps(spec)], env=env, text=True,
                              capture_output=True)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith(MARK)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"session {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def compare(scenario: str, threads: int, busy: bool, repeat: int, new_tokens: int) -> dict:
    """A plain session and a DART session of one scenario, config and repeat -> ratios and identity."""
    spec = {"scenario": scenario, "threads": threads, "repeat": repeat, "new_tokens": new_tokens}
    if scenario == "demo":
        got = run_session({**spec, "dart": True}, busy)
        return {"ratios": [got["ratio"]], "identical": got["identical"]}
    first, second = (False, True) if repeat % 2 == 0 else (True, False)  # the order alternates over the repeats
    runs = {kind: run_session({**spec, "dart": kind}, busy) for kind in (first, second)}
    plain, dart = runs[False], runs[True]
    if scenario == "cannot_pay":
        ratios = [sum(plain["seconds"]) / sum(dart["seconds"])]
    else:
        ratios = [p / d for p, d in zip(plain["seconds"], dart["seconds"])]
    speed = dart["reference_s"] / plain["reference_s"]  # how much slower the DART session's process ran plain calls
    return {"ratios": ratios, "normalized": [r * speed for r in ratios],
            "identical": plain["outputs"] == dart["outputs"], "plain_s": plain["seconds"], "dart_s": dart["seconds"],
            "reference_s": [plain["reference_s"], dart["reference_s"]], "tree_sizes": dart["tree_sizes"]}


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}x" for v in values)


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--session", help=argparse.SUPPRESS)  # a child's spec
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--configs", default=CONFIGS, help=f"threads:load pairs (default {CONFIGS})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="sessions of each kind per scenario and config (medians and minima over them)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of the first call (the demo's: 128)")
    args = parser.parse_args(argv)
    if args.session:
        print(MARK + json.dumps(_session(json.loads(args.session))), flush=True)
        return 0
    scenarios = [s for s in args.scenarios.split(",") if s]
    if set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(set(scenarios) - set(SCENARIOS))}")
    configs = []
    for pair in args.configs.split(","):
        threads, _, load = pair.partition(":")
        if load not in ("idle", "busy") or not threads.isdigit():
            parser.error(f"a config is threads:idle or threads:busy, got {pair!r}")
        configs.append((int(threads), load == "busy"))
    rows = []
    for scenario in scenarios:
        for threads, busy in configs:
            if scenario == "demo" and not busy:
                continue  # the idle demo is BENCHMARKS.md's own row
            runs = [compare(scenario, threads, busy, r, 128 if scenario == "demo" else args.new_tokens)
                    for r in range(args.repeats)]
            by_call = [list(call) for call in zip(*(run["ratios"] for run in runs))]  # each timed call's repeats
            row = {"scenario": scenario, "threads": threads, "load": "busy" if busy else "idle",
                   "median": [statistics.median(c) for c in by_call], "min": [min(c) for c in by_call],
                   "ratios": by_call, "identical": all(run["identical"] for run in runs), "runs": runs}
            if scenario != "demo":
                normalized = [list(call) for call in zip(*(run["normalized"] for run in runs))]
                row["normalized_median"] = [statistics.median(c) for c in normalized]
                row["normalized_min"] = [min(c) for c in normalized]
            rows.append(row)
            same_speed = "" if scenario == "demo" else (f"; at the same process speed median "
                                                        f"{_ratios(row['normalized_median'])}, min "
                                                        f"{_ratios(row['normalized_min'])}")
            print(f"{scenario:10s} {threads} thread(s) {row['load']:4s}: median {_ratios(row['median'])}, min "
                  f"{_ratios(row['min'])}{same_speed}, identical {row['identical']}", flush=True)
    results = {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
               "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    print("\n| scenario | threads | load | median (each timed call) | min | same process speed: median, min | "
          "identical |\n|---|---|---|---|---|---|---|")
    for r in rows:
        same = f"{_ratios(r['normalized_median'])}; {_ratios(r['normalized_min'])}" if "normalized_median" in r else ""
        print(f"| {r['scenario']} | {r['threads']} | {r['load']} | {_ratios(r['median'])} | {_ratios(r['min'])} | "
              f"{same} | {r['identical']} |")
    if args.json:
        write_results(args.json, results)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
