"""A new user's first calls with the shipped head attached, against plain generate() in the same conditions: each
session is a fresh process with an empty dart-spec cache (as a notebook's first cell, a CI job or a command-line
tool starts), idle or with one other process keeping one of the two cores busy, at 1 and 2 threads.

    python benchmarks/bench_first_calls.py --json benchmarks/results/first_calls.json
    python benchmarks/bench_first_calls.py --scenarios first --configs 2:idle --repeats 1 --new-tokens 8   # quick
    python benchmarks/bench_first_calls.py --scenarios first --configs 1:paired --repeats 9 [--control]

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
process beside the session for its whole duration, model loading included), or, at 1 thread and for the first call
only, `paired`: the plain and the DART session run at once, each on its own core and each the other's load, their first
calls started together once both have loaded. Slow spells that come from outside the process (a shared host) reach
both cores at once, so a pair's two first calls run through much the same spells, where sessions run one after the
other each meet their own. `--control` runs both sessions plain: the ratios that the sessions' own spread and any bias
of the harness give, against which DART's are read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dart_bench import DATA_DIR, environment, prompts_from_file, script_parser, write_results
from dart_bench.load import busy_cores

SCENARIOS = ("first", "cannot_pay", "batches", "demo")
CONFIGS = "1:idle,1:busy,2:idle,2:busy"
MARK = "RESULT "
REFERENCE_CALLS = 2  # plain calls after a session's timed ones that measure the process's own speed (the faster kept)
LOADS = ("idle", "busy", "paired")
BARRIER_TIMEOUT_S = 600.0  # how long a paired session waits for the other to load


def _wait_for_pair(barrier: str, name: str) -> None:
    """Mark this session ready in the directory `barrier`, then wait until both sessions of the pair are."""
    Path(barrier, name).touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(os.listdir(barrier)) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other session of the pair did not load within {BARRIER_TIMEOUT_S:.0f} s")
        time.sleep(0.005)


def _session(spec: dict) -> dict:
    """One fresh process's calls (run in the child): seconds of each timed call, the outputs, the steps."""
    import dart_hf
    from dart_bench import chat_batch, timed

    torch.set_num_threads(spec["threads"])
    if "core" in spec:  # a paired session: its own core
        os.sched_setaffinity(0, {spec["core"]})
    if spec["scenario"] == "demo":
        from dart_cli.demo import model_demo

        result = model_demo(max_new_tokens=spec["new_tokens"], repeats=3)
        return {"ratio": result["speedup"], "identical": bool(result["identical"])}
    model, tokenizer, head = dart_hf.load_default()
    tokenizer.padding_side = "left"
    if spec["scenario"] == "cannot_pay":
        from benchmarks.bench_controller import head_that_cannot_pay

        head = head_that_cannot_pay(model, curve=False)
    dart = spec["dart"] and not spec["control"]  # the control: the "DART" session runs plain too
    if dart:
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

    if "barrier" in spec:
        _wait_for_pair(spec["barrier"], "dart" if spec["dart"] else "plain")
    for prompts, n, counted in calls:
        out, s = generate(prompts, n, dart)
        stats = model.dart_stats if dart else None
        if counted:
            seconds.append(s)
            outputs.append(out.tolist())
            steps.append(None if stats is None else stats.tree_sizes)
    prompts, n, _ = next(call for call in calls if call[2])  # the process's own speed: its first timed call, plain
    reference = min(generate(prompts, n, False)[1] for _ in range(REFERENCE_CALLS))
    return {"seconds": seconds, "outputs": outputs, "tree_sizes": steps, "reference_s": reference}


def _start_session(spec: dict, cache: str) -> subprocess.Popen:
    """`_session(spec)` started in a fresh process whose dart-spec cache is `cache`."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, DART_SPEC_CACHE=cache, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, __file__, "--session", json.dumps(spec)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _session_result(spec: dict, process: subprocess.Popen) -> dict:
    """What the session `process` of `spec` printed, once it has ended; RuntimeError if it failed."""
    stdout, stderr = process.communicate()
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith(MARK)), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(f"session {spec} failed:\n{stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def run_session(spec: dict, busy: bool) -> dict:
    """`_session(spec)` in a fresh process with an empty cache, removed afterwards (beside one busy process if
    `busy`)."""
    with tempfile.TemporaryDirectory(prefix="dart-bench-first-") as cache, busy_cores(1 if busy else 0):
        return _session_result(spec, _start_session(spec, cache))


def run_pair(spec: dict) -> dict[bool, dict]:
    """A plain and a DART session of `spec` at once, each in a fresh process with an empty cache on its own core (the
    cores swap over the repeats), their timed calls started together -> {dart: the session's result}."""
    with tempfile.TemporaryDirectory(prefix="dart-bench-pair-") as root:
        barrier = os.path.join(root, "ready")
        os.mkdir(barrier)
        specs, processes = {}, {}
        for index, dart in enumerate((False, True)):
            core = (index + spec["repeat"]) % 2
            cache = os.path.join(root, f"cache-{core}")
            os.mkdir(cache)
            specs[dart] = {**spec, "dart": dart, "core": core, "barrier": barrier}
            processes[dart] = _start_session(specs[dart], cache)
        try:
            return {dart: _session_result(specs[dart], processes[dart]) for dart in (False, True)}
        finally:
            for process in processes.values():
                process.kill()


def compare(scenario: str, threads: int, load: str, repeat: int, new_tokens: int, control: bool = False) -> dict:
    """A plain session and a DART session of one scenario, config and repeat -> ratios and identity (`control`: the
    DART session runs plain too)."""
    spec = {"scenario": scenario, "threads": threads, "repeat": repeat, "new_tokens": new_tokens, "control": control}
    busy = load == "busy"
    if scenario == "demo":
        got = run_session({**spec, "dart": True}, busy)
        return {"ratios": [got["ratio"]], "identical": got["identical"]}
    if load == "paired":
        runs = run_pair(spec)
    else:
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
    parser.add_argument("--control", action="store_true",
                        help="both sessions plain (the DART one with nothing attached): the ratios the sessions' own "
                             "spread and any bias of the harness give, to read DART's against")
    args = parser.parse_args(argv)
    if args.session:
        print(MARK + json.dumps(_session(json.loads(args.session))), flush=True)
        return 0
    scenarios = [s for s in args.scenarios.split(",") if s]
    if set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(set(scenarios) - set(SCENARIOS))}")
    if args.control and "demo" in scenarios:
        parser.error("--control compares plain with plain: the demo has no such control")
    configs = []
    for pair in args.configs.split(","):
        threads, _, load = pair.partition(":")
        if load not in LOADS or not threads.isdigit():
            parser.error(f"a config is threads:idle, threads:busy or 1:paired, got {pair!r}")
        if load == "paired" and (threads != "1" or scenarios != ["first"] or (os.cpu_count() or 1) < 2):
            parser.error("paired sessions run at 1 thread, for the first call only (--scenarios first), on a machine "
                         "of two cores or more")
        configs.append((int(threads), load))
    rows = []
    for scenario in scenarios:
        for threads, load in configs:
            if scenario == "demo" and load != "busy":
                continue  # the idle demo is BENCHMARKS.md's own row
            runs = [compare(scenario, threads, load, r, 128 if scenario == "demo" else args.new_tokens, args.control)
                    for r in range(args.repeats)]
            by_call = [list(call) for call in zip(*(run["ratios"] for run in runs))]  # each timed call's repeats
            row = {"scenario": scenario, "threads": threads, "load": load,
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
            print(f"{scenario:10s} {threads} thread(s) {row['load']:6s}: median {_ratios(row['median'])}, min "
                  f"{_ratios(row['min'])}{same_speed}, identical {row['identical']}", flush=True)
    results = {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
               "new_tokens": args.new_tokens, "repeats": args.repeats, "control": args.control, "rows": rows}
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
