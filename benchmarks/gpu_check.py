"""GPU check: plain `generate()` vs DART on SmolLM2-135M-Instruct with the shipped head, in one short run.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json                 # the default GPU run
    python benchmarks/gpu_check.py --device cpu --dtypes float32 --nodes 4 --prompts 1 --max-new-tokens 8 \\
        --out /tmp/gpu_check.json                                                          # a CPU smoke run

For each dtype (default float32 and bfloat16: the model and head are cast, each dtype checked against its own plain
run) it times, prompt by prompt, plain greedy decoding and then DART with the shipped head at each tree size
(`--nodes`, default 60, 16 and 8 draft nodes: the head's own tree settings with `remain_total` replaced; no cached
calibration is used), `--max-new-tokens` (128) per prompt, batch 1, after one short warm-up generate of each kind.
Interleaving the settings per prompt makes a device that is still warming up, or a slow spell, hit them alike (run
blockwise, the first block of a cold GPU ran up to 2-3x slower than the last).

Measured (every clock waits for the device: `torch.cuda.synchronize` around each generate, `dart_sync_timing=True`
inside DART's loop, so the phase times are device time):

- identity: DART's output token for token equal to plain's, per prompt, the unsynced reruns too (exit status 1
  when any differs, after the JSON is written);
- plain: tokens/s, ms per token (wall / new tokens) and ms per step (wall less a 1-token generate of the same prompt,
  i.e. less setup and prefill, over the remaining tokens);
- DART: tokens/s, tau (tokens per verify step, bonus included), ms per verify step ((wall - prefill) / steps) and
  within it head / tree / mask / target / accept / compact / verify / other ms, the overhead per step over a plain
  step (DART step ms - plain step ms; as a fraction of the plain step: the goal on an H100/H200-class GPU is <= 0.15)
  and the speedup (DART tokens/s over plain's);
- `--unsynced-prompts` (1): the first prompts run once more without `dart_sync_timing`, right after their synced run,
  so the cost of the phase synchronisations shows (`sync_cost_ms_per_step`; the synced numbers are the conservative
  ones).

Prompts: MT-Bench first turns (chat template) from `--prompt-file` (JSON lines with "turns" lists, or "prompt" /
"text" strings), by default the MT-Bench set shipped in `dart_bench/data/`. One JSON is written (atomically, rewritten after every prompt so a run cut short leaves its finished ones) with
the device name, versions, commit and settings. Its CPU runs are no speed claim; the GPU rows of docs/benchmark-history.md come
from its GPU runs.

JSON: `environment` (device, device_name, torch, transformers, cuda, python, commit: git HEAD or
$DART_SPEC_COMMIT), `settings`, `identity`, `complete`, `elapsed_s`, and per dtype `dtypes.<dtype>`: `tree_config`
(the head's, before `remain_total` is replaced), `plain` (tokens_per_s, ms_per_token, step_ms, ...), `trees.<nodes>`
(identical / prompts, identity, tokens_per_s, speedup, tau, steps, prefill_ms, step_ms, phases_ms_per_step,
overhead_ms_per_step, overhead_fraction, overhead_goal_met (CUDA only), unsynced, per_prompt) and `skipped`.

Budget (the default run must finish in under 5 minutes on an H200): plain SmolLM2 decoding there is launch bound
at about 27 ms/token and a DART step takes about 40 ms; the shipped head's tau on MT-Bench is about 2.0 / 2.2 / 2.4
at 8 / 16 / 60 nodes (benchmarks/results/tree_settings.json). Per dtype: plain 8 x 128 tokens ~ 28 s, each tree
~ 8 x 128 / tau steps x 40 ms ~ 17-21 s plus ~ 2.5 s for its unsynced prompt, warm-up and loading ~ 6 s: ~ 95 s. Two
dtypes ~ 3.2 min, with Python start-up and the GGUF's one-time conversion ~ 3.7 min. Plain decoding is therefore
timed once per prompt (not per tree). `--budget-s` (default 270) starts no prompt after that many seconds (the JSON
then lists the prompt runs it skipped; exit status 2), so a slower machine still ends near 5 minutes with every
setting measured on the same prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import torch

from dart_bench import (DATA_DIR, Progress, chat_ids, environment, first_difference, prompts_from_file,
                        script_parser, timed_generate, write_results)
from dart_core.acceptance import tau_of

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT_FILE = DATA_DIR / "mt_bench_questions.jsonl"
PHASES = ("head", "tree", "mask", "target", "accept", "compact", "verify")
# Token-for-token identity with plain greedy is required in float32 (exit status 1 otherwise). In bfloat16 / float16
# a multi-token forward (the tree) rounds differently from a one-token forward, so greedy outputs drift apart at
# near-ties: transformers' own prompt-lookup decoding does the same (docs/benchmark-history.md,
# benchmarks/bench_cpu_speed.py); identity there is reported, not required.
EXACT_DTYPES = ("float32", "float64")
OVERHEAD_GOAL = 0.15  # overhead per step as a fraction of a plain step, H100/H200-class GPU, SmolLM2-135M
WARMUP_TOKENS = 16


def first_prompts(path: Path, count: int) -> list[str]:
    """The first `count` prompts of a JSON-lines file (`dart_bench.prompts_from_file`)."""
    return prompts_from_file(path, count, missing_hint=" (pass --prompt-file FILE: JSON lines of MT-Bench "
                                                       "questions, or rows with a \"prompt\" or \"text\" string)")


def greedy(model, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> tuple[torch.Tensor, float]:
    """A greedy generate() call: (output ids [1, L], wall seconds), the device synchronised before and after."""
    return timed_generate(model, ids, max_new_tokens=max_new_tokens, do_sample=False, sync=ids.device, **kwargs)


# ---- one dtype ----------------------------------------------------------------------------------------------------
def load(device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, head) on `device` in `dtype`: the shipped default, its head's own tree settings."""
    from dart_hf.default import load_default

    model, tokenizer, head = load_default()
    model.to(device=device, dtype=dtype)
    head.to(device=device, dtype=dtype)
    head.eval()
    if head.ngram is not None:  # not a module: head.to() leaves it on the CPU, and the tree search runs on `device`
        head.ngram = head.ngram.to(device)
    if head.get_input_embeddings() is not model.get_input_embeddings():  # shared, as load_default set it up
        head.set_input_embeddings(model.get_input_embeddings())
    return model, tokenizer, head


def plain_run(model, ids: torch.Tensor, max_new_tokens: int, repeat: int, prompt: int) -> tuple[dict, torch.Tensor]:
    """Plain greedy decoding of one prompt: (its row, its output)."""
    _, one = greedy(model, ids, 1)  # setup + prefill + the first token
    out, t = greedy(model, ids, max_new_tokens)
    row = {"repeat": repeat, "prompt": prompt, "prompt_tokens": int(ids.shape[1]), "new_tokens": out.shape[1] -
           ids.shape[1], "wall_s": t, "one_token_wall_s": one}
    return row, out


def dart_run(model, head, tree_config, graph: bool, ids: torch.Tensor, plain_out: torch.Tensor, max_new_tokens: int,
             repeat: int, prompt: int, synced: bool = True) -> dict:
    """DART with `tree_config` (and `dart_cuda_graph=graph`) on one prompt, compared with plain's output: its row
    (per-phase seconds when `synced`)."""
    out, t = greedy(model, ids, max_new_tokens, dart_head=head, dart_tree_config=tree_config,
                            dart_sync_timing=synced, dart_cuda_graph=graph)
    stats = model.dart_stats
    mismatch = first_difference(out[0, ids.shape[1]:], plain_out[0, ids.shape[1]:])
    row = {"repeat": repeat, "prompt": prompt, "new_tokens": out.shape[1] - ids.shape[1], "wall_s": t,
           "prefill_s": stats.prefill_time, "steps": stats.steps, "accepted": sum(stats.accepted_lengths),
           "tree_nodes": stats.tree_nodes, "tau": stats.tau, "identical": mismatch is None,
           "first_mismatch": mismatch}
    if synced:
        row["phases_s"] = {name: float(getattr(stats, f"{name}_time", 0.0)) for name in PHASES}
    return row


def plain_summary(rows: list[dict]) -> dict:
    wall = sum(r["wall_s"] for r in rows)
    new = sum(r["new_tokens"] for r in rows)
    stepped = [r for r in rows if r["new_tokens"] > 1]
    first_wall = sum(r["one_token_wall_s"] for r in stepped)
    steps_tokens = sum(r["new_tokens"] - 1 for r in stepped)
    return {"prompts": len(rows), "new_tokens": new, "wall_s": wall,
            "tokens_per_s": new / wall if wall else 0.0, "ms_per_token": wall * 1e3 / new if new else 0.0,
            "step_ms": (sum(r["wall_s"] for r in stepped) - first_wall) * 1e3 / steps_tokens if steps_tokens else 0.0,
            "one_token_generate_ms": first_wall * 1e3 / max(1, len(stepped)), "per_prompt": rows}


def dart_summary(rows: list[dict], unsynced_rows: list[dict], plain: dict, tree_config, graph: bool,
                 device: torch.device) -> dict:
    """One DART setting over the prompts (`rows`, synced) against plain decoding of the same prompts."""
    wall = sum(r["wall_s"] for r in rows)
    prefill = sum(r["prefill_s"] for r in rows)
    new = sum(r["new_tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    identical = sum(r["identical"] for r in rows)
    step_ms = (wall - prefill) * 1e3 / steps if steps else 0.0
    per_step = {f"{name}_ms": sum(r["phases_s"][name] for r in rows) * 1e3 / steps if steps else 0.0
                for name in PHASES}
    per_step["draft_ms"] = per_step["head_ms"] + per_step["tree_ms"]
    per_step["other_ms"] = step_ms - per_step["head_ms"] - per_step["tree_ms"] - per_step["verify_ms"]
    tokens_per_s = new / wall if wall else 0.0
    row = {"remain_total": tree_config.remain_total, "cuda_graph": graph,
           "tree_nodes_max": max((r["tree_nodes"] for r in rows), default=0),
           "prompts": len(rows), "identical": identical, "identity": identical == len(rows),
           "new_tokens": new, "wall_s": wall, "tokens_per_s": tokens_per_s,
           "speedup": tokens_per_s / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0,
           "steps": steps, "tau": tau_of(sum(r["accepted"] for r in rows), steps),
           "prefill_ms": prefill * 1e3 / len(rows) if rows else 0.0, "step_ms": step_ms,
           "phases_ms_per_step": per_step,
           "overhead_ms_per_step": step_ms - plain["step_ms"],
           "overhead_fraction": (step_ms - plain["step_ms"]) / plain["step_ms"] if plain["step_ms"] else None}
    # the goal is for a CUDA GPU (H100/H200 class); a CPU run says nothing about it
    row["overhead_goal_met"] = (row["overhead_fraction"] <= OVERHEAD_GOAL if device.type == "cuda"
                                and row["overhead_fraction"] is not None else None)
    if unsynced_rows:
        synced = rows[:len(unsynced_rows)]  # the same prompts, with the phase synchronisations

        def ms_per_step(rs):
            n = sum(r["steps"] for r in rs)
            return sum(r["wall_s"] - r["prefill_s"] for r in rs) * 1e3 / n if n else 0.0

        row["unsynced"] = {"prompts": len(unsynced_rows), "identical": sum(r["identical"] for r in unsynced_rows),
                           "step_ms": ms_per_step(unsynced_rows), "synced_step_ms": ms_per_step(synced),
                           "sync_cost_ms_per_step": ms_per_step(synced) - ms_per_step(unsynced_rows)}
        row["identity"] = row["identity"] and row["unsynced"]["identical"] == len(unsynced_rows)
    row["per_prompt"] = rows
    return row


def runs_of(args) -> list[tuple[str, tuple[int, bool]]]:
    """(label, (draft nodes, CUDA graph)) of every DART setting: "60", "60+graph", ..."""
    return [(f"{n}+graph" if graph else str(n), (n, graph)) for n in args.nodes for graph in args.cuda_graph]


def run_dtype(dtype_name: str, args, prompts: list[str], progress: Progress, result: dict, save) -> None:
    """Plain and every DART setting, prompt by prompt (so that a device's warm-up or a slow spell hits them alike),
    then the unsynced reruns; summaries rewritten after every prompt."""
    from dart_hf.target import tree_settings

    device = torch.device(args.device)
    dtype = getattr(torch, dtype_name)
    entry = result["dtypes"].setdefault(dtype_name, {"trees": {}, "skipped": []})
    if progress.elapsed > args.budget_s:
        entry["skipped"] = ["all prompts"]
        progress(f"{dtype_name}: skipped (past the {args.budget_s:.0f} s budget)")
        return
    progress(f"{dtype_name}: loading on {device}")
    model, tokenizer, head = load(device, dtype)
    base = tree_settings(head, model.generation_config)
    configs = {label: (dataclasses.replace(base, remain_total=n), graph) for label, (n, graph) in runs_of(args)}
    entry["tree_config"] = base.to_dict()
    encoded = [chat_ids(tokenizer, text, device) for text in prompts]
    warm = encoded[0]
    greedy(model, warm, WARMUP_TOKENS)
    for config, graph in configs.values():  # also captures the CUDA graphs (kept with the head)
        greedy(model, warm, WARMUP_TOKENS, dart_head=head, dart_tree_config=config, dart_sync_timing=True,
                       dart_cuda_graph=graph)
        greedy(model, warm, WARMUP_TOKENS, dart_head=head, dart_tree_config=config, dart_cuda_graph=graph)
    progress(f"{dtype_name}: warmed up; plain and DART {', '.join(configs)}, prompt by prompt")
    plain_rows = []
    rows = {label: [] for label in configs}
    unsynced = {label: [] for label in configs}

    def summarize() -> None:
        entry["plain"] = plain_summary(plain_rows)
        entry["trees"] = {label: dart_summary(rows[label], unsynced[label], entry["plain"], config, graph, device)
                          for label, (config, graph) in configs.items() if rows[label]}
        save()

    order = [(r, i) for r in range(args.repeats) for i in range(len(encoded))]
    for n, (r, i) in enumerate(order):
        if progress.elapsed > args.budget_s:
            entry["skipped"] = [f"prompt {j + 1} repeat {q + 1}" for q, j in order[n:]]
            progress(f"{dtype_name}: past the {args.budget_s:.0f} s budget, {len(order) - n} prompt runs skipped")
            break
        ids = encoded[i]
        plain_row, plain_out = plain_run(model, ids, args.max_new_tokens, r, i)
        plain_rows.append(plain_row)
        line = [f"plain {plain_row['wall_s'] * 1e3 / max(plain_row['new_tokens'], 1):.1f} ms/token"]
        for label, (config, graph) in configs.items():
            row = dart_run(model, head, config, graph, ids, plain_out, args.max_new_tokens, r, i)
            rows[label].append(row)
            if r == 0 and i < args.unsynced_prompts:  # right after, without the phase synchronisations
                unsynced[label].append(dart_run(model, head, config, graph, ids, plain_out, args.max_new_tokens, r,
                                                i, synced=False))
            step_ms = (row["wall_s"] - row["prefill_s"]) * 1e3 / max(row["steps"], 1)
            line.append(f"{label}: tau {row['tau']:.2f}, {step_ms:.1f} ms/step"
                        + ("" if row["identical"] else f", DIFFERS at new token {row['first_mismatch']}"))
        progress(f"  prompt {i + 1}/{len(encoded)}: " + "; ".join(line))
        summarize()
    summarize()
    plain = entry["plain"]
    progress(f"{dtype_name} plain: {plain['tokens_per_s']:.1f} tok/s, {plain['step_ms']:.2f} ms/step")
    for label, row in entry["trees"].items():
        progress(f"{dtype_name} DART {label} nodes: {row['identical']}/{row['prompts']} identical, "
                 f"{row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), tau {row['tau']:.2f}, "
                 f"{row['step_ms']:.2f} ms/step, overhead {row['overhead_ms_per_step']:.2f} ms "
                 f"({100 * (row['overhead_fraction'] or 0):.0f}% of a plain step)")
    del model, head
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- report -------------------------------------------------------------------------------------------------------
def table(result: dict) -> str:
    lines = [f"{result['environment']['device_name']}: {result['settings']['prompts']} prompts x "
             f"{result['settings']['max_new_tokens']} tokens",
             "| dtype | run | identical | tok/s | speedup | tau | ms/step | overhead ms (frac) | head | tree | "
             "target | other |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in result["dtypes"].items():
        plain = entry.get("plain")
        if plain:
            lines.append(f"| {name} | plain | - | {plain['tokens_per_s']:.1f} | 1.00 | 1.00 | {plain['step_ms']:.2f} "
                         "| - | - | - | - | - |")
        for nodes, row in entry["trees"].items():
            p = row["phases_ms_per_step"]
            frac = row["overhead_fraction"]
            lines.append(f"| {name} | DART {nodes} | {row['identical']}/{row['prompts']} | {row['tokens_per_s']:.1f} "
                         f"| {row['speedup']:.2f} | {row['tau']:.2f} | {row['step_ms']:.2f} | "
                         f"{row['overhead_ms_per_step']:.2f} ({'-' if frac is None else f'{frac:.2f}'}) | "
                         f"{p['head_ms']:.2f} | {p['tree_ms']:.2f} | {p['target_ms']:.2f} | {p['other_ms']:.2f} |")
        if entry.get("skipped"):
            lines.append(f"| {name} | skipped: {', '.join(entry['skipped'])} | | | | | | | | | | |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = script_parser(__doc__, json=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when available), cuda:N or cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--nodes", default="60,16,8", help="draft nodes per tree, comma-separated (default 60,16,8)")
    parser.add_argument("--prompts", type=int, default=8, help="first N prompts of the prompt file (default 8)")
    parser.add_argument("--prompt-file", type=Path, default=DEFAULT_PROMPT_FILE,
                        help=f"JSON lines of prompts (default {DEFAULT_PROMPT_FILE})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="times each prompt is run per setting (default 1)")
    parser.add_argument("--unsynced-prompts", type=int, default=1,
                        help="prompts run again per tree without dart_sync_timing (default 1; 0: none)")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="start no prompt after this many seconds (default 270)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--cuda-graph", default=None,
                        help="off, on or off,on: DART runs without / with dart_cuda_graph (default: off,on on CUDA, "
                             "off elsewhere)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"),
                        help="JSON to write (default benchmarks/results/gpu_check.json)")
    args = parser.parse_args(argv)
    try:
        args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        args.nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        parser.error("--nodes takes comma-separated integers")
    for name in args.dtypes:
        if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
            parser.error(f"--dtypes: {name!r} is not a torch floating-point dtype")
    if not args.dtypes or not args.nodes or min(args.nodes) < 1:
        parser.error("--dtypes and --nodes need at least one entry; nodes must be >= 1")
    for name in ("prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.unsynced_prompts < 0:
        parser.error("--unsynced-prompts must be >= 0")
    modes = args.cuda_graph or ("off,on" if args.device.startswith("cuda") else "off")
    if not set(modes.split(",")) <= {"off", "on"}:
        parser.error("--cuda-graph takes off, on or off,on")
    args.cuda_graph = [mode == "on" for mode in modes.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no CUDA device")
    progress = Progress()
    prompts = first_prompts(args.prompt_file, args.prompts)
    result = {"script": "benchmarks/gpu_check.py", "complete": False, "environment": environment(device, REPO),
              "settings": {"dtypes": args.dtypes, "nodes": args.nodes, "prompts": args.prompts,
                           "prompt_file": args.prompt_file.name,
                           "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
                           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                           "unsynced_prompts": args.unsynced_prompts, "budget_s": args.budget_s,
                           "cuda_graph": args.cuda_graph,
                           "warmup_tokens": WARMUP_TOKENS, "overhead_goal_fraction": OVERHEAD_GOAL,
                           "sync_timing": True, "greedy": True, "batch_size": 1},
              "dtypes": {}}

    def save() -> None:
        result["elapsed_s"] = progress.elapsed
        write_results(args.out, result)

    progress(f"gpu_check on {result['environment']['device_name']} ({device}): dtypes {args.dtypes}, "
             f"nodes {args.nodes}, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    for dtype_name in args.dtypes:
        run_dtype(dtype_name, args, prompts, progress, result, save)
    exact = [row for name, entry in result["dtypes"].items() if name in EXACT_DTYPES for row in entry["trees"].values()]
    reduced = [row for name, entry in result["dtypes"].items() if name not in EXACT_DTYPES
               for row in entry["trees"].values()]
    skipped = [s for entry in result["dtypes"].values() for s in entry.get("skipped", [])]
    result["identity"] = all(row["identity"] for row in exact) if exact else None
    result["identity_reduced_precision"] = all(row["identity"] for row in reduced) if reduced else None
    result["complete"] = not skipped
    save()
    print(table(result))
    verdict = {True: "100%", False: "BROKEN", None: "not checked"}[result["identity"]]
    if result["identity_reduced_precision"] is False:
        verdict += " (float32); bfloat16/float16 outputs differ from plain's: expected, see EXACT_DTYPES"
    print(f"wrote {args.out} ({progress.elapsed:.1f} s); identity {verdict}"
          + ("" if result["complete"] else f"; skipped: {skipped}"), flush=True)
    if result["identity"] is False:
        return 1
    return 0 if result["complete"] else 2


if __name__ == "__main__":
    sys.exit(main())
