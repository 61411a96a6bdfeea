"""What an attached head gives against plain generate(), cell by cell, with each step's tree chosen by the
controller (`dart_hf.controller`): batch sizes, prompt lengths, thread counts, a head that cannot pay, a first call
on a loaded machine, held-out prompts.

    python benchmarks/bench_controller.py --json benchmarks/results/controller.json          # every cell
    python benchmarks/bench_controller.py --cells batch --batch-sizes 1,2 --max-new-tokens 8 --rounds 1   # quick

Every cell starts from an empty dart-spec cache (its own directory) and a freshly loaded SmolLM2-135M-Instruct
(float32) with the shipped head attached (`dart_hf.enable(model, head)`), as a new user's process would. Its first
attached call (which measures this machine once) is timed on its own against a plain call (`first_call`); then
`--rounds` rounds alternate plain `generate(dart_head=False)` and the attached `generate()` over the cell's prompts,
greedy, `--max-new-tokens` each. A round's ratio is DART's tokens/s over plain's (new tokens up to each row's stop,
over the wall time of the round's calls); the cell's `speedup` is the median over rounds. Outputs must be identical.

Cells (`--cells`, comma-separated groups):
- batch: the first 8 MT-Bench first turns, left-padded into batches of each `--batch-sizes` (2 threads);
- context: one prompt of about 100, 1,000 and 2,000 tokens (a request to summarise Python standard-library source of
  that length), batch 1, 2 threads;
- threads: the held-out prompts at 1 and 2 threads, batch 1;
- cannot_pay: a head of the shipped shape with random weights and no acceptance curve, and the same head shipping a
  flat curve that claims it pays (tau 1.3), batch 1, 2 threads;
- load: the first call (with its measurement) while two busy processes load both cores, then idle rounds;
- heldout: `dart_bench/data/fresh_prompts.jsonl` (chat prompts no head was trained, calibrated or tuned on), batch 1,
  2 threads.
"""

from __future__ import annotations

import os
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

import dart_hf
from dart_bench import DATA_DIR, chat_batch, environment, prompt_set, prompts_from_file, script_parser, timed, \
    write_results
from dart_bench.load import busy_cores
from dart_bench.replay import random_head, shipped_shape
from dart_core import AcceptanceCurve, DartHead

CELLS = ("batch", "context", "threads", "cannot_pay", "load", "heldout")


def new_tokens(out: torch.Tensor, width: int, pad: int) -> int:
    """Generated tokens of every row, a finished row's right padding excluded."""
    return int((out[:, width:] != pad).sum())


_CACHE: list[tempfile.TemporaryDirectory] = []  # the current cell's cache directory (each holds a converted SmolLM2)


def fresh(head_factory=None):
    """A new process's state: an empty cache directory (the previous cell's removed), SmolLM2 and the shipped head
    (or `head_factory(model)`)."""
    if _CACHE:
        _CACHE.pop().cleanup()
    _CACHE.append(tempfile.TemporaryDirectory(prefix="dart-bench-controller-"))
    os.environ["DART_SPEC_CACHE"] = _CACHE[-1].name
    model, tokenizer, head = dart_hf.load_default()
    if head_factory is not None:
        head = head_factory(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return dart_hf.enable(model, head), tokenizer, head


def run_cell(name: str, batches: list[dict], rounds: int, max_new_tokens: int, threads: int, head_factory=None,
             load_first: bool = False) -> dict:
    """One cell: the first attached call against a plain one, then `rounds` alternated rounds over `batches`."""
    torch.set_num_threads(threads)
    model, tokenizer, head = fresh(head_factory)
    pad = tokenizer.pad_token_id
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)

    def call(batch: dict, attached: bool):
        extra = {} if attached else {"dart_head": False}
        out, seconds = timed(model.generate, **batch, **common, **extra)
        return out, seconds, model.dart_stats

    first = batches[0]
    with busy_cores(2 if load_first else 0):
        first_dart = call(first, True)
    first_plain = call(first, False)
    width = first["input_ids"].shape[1]
    first_ratio = (new_tokens(first_dart[0], width, pad) / first_dart[1]) / (
        new_tokens(first_plain[0], width, pad) / first_plain[1])
    ratios, plain_rates, dart_rates, identical, runs, sizes, plain_calls = [], [], [], 0, 0, [], 0
    for _ in range(rounds):
        totals = {True: [0, 0.0], False: [0, 0.0]}
        for batch in batches:
            width = batch["input_ids"].shape[1]
            outs = {}
            for attached in (False, True):
                out, seconds, stats = call(batch, attached)
                outs[attached] = out
                totals[attached][0] += new_tokens(out, width, pad)
                totals[attached][1] += seconds
                if attached:
                    if stats is None:
                        plain_calls += 1
                    else:
                        sizes += stats.tree_sizes
            identical += int(torch.equal(outs[True], outs[False]))
            runs += 1
        plain_rates.append(totals[False][0] / totals[False][1])
        dart_rates.append(totals[True][0] / totals[True][1])
        ratios.append(dart_rates[-1] / plain_rates[-1])
    counts = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    row = {"cell": name, "threads": threads, "batches": len(batches), "rows": sum(len(b["input_ids"]) for b in batches),
           "prompt_tokens": [int(b["attention_mask"].sum(dim=1).max()) for b in batches],
           "speedup": statistics.median(ratios), "speedups": ratios,
           "plain_tokens_per_s": statistics.median(plain_rates), "dart_tokens_per_s": statistics.median(dart_rates),
           "first_call_speedup": first_ratio, "first_call_seconds": first_dart[1], "identical": identical,
           "runs": runs, "tree_sizes": dict(sorted(counts.items())), "calls_run_plain": plain_calls,
           "dart_calls": runs - plain_calls}
    print(f"{name}: {row['speedup']:.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}; plain "
          f"{row['plain_tokens_per_s']:.1f} tok/s), first call {first_ratio:.2f}x in {first_dart[1]:.1f} s, "
          f"{identical}/{runs} identical, steps by tree size {row['tree_sizes']}, {plain_calls} of {runs} calls "
          f"plain", flush=True)
    return row


def head_that_cannot_pay(model, curve: bool) -> DartHead:
    """A head of the shipped shape with random weights (it accepts next to nothing); with `curve`, one that claims
    it pays (a flat tau of 1.3 at every size)."""
    cfg = model.config
    head = random_head(shipped_shape(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, draft_length=6))
    if curve:
        head.acceptance = AcceptanceCurve(tau={r: 1.3 for r in (1, 2, 3, 4, 8, 16, 60)}, steps=100, new_tokens=130,
                                          prompts=1)
    return head.eval()


def long_prompt(tokenizer, tokens: int) -> str:
    """A request to summarise Python standard-library source cut to about `tokens` tokens in all."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")
    source += (Path(sysconfig.get_paths()["stdlib"]) / "shlex.py").read_text(encoding="utf-8")
    ids = tokenizer(source)["input_ids"][: max(tokens - 30, 10)]
    return "Summarize what this Python code does, function by function:\n\n" + tokenizer.decode(ids)


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"groups of cells ({', '.join(CELLS)})")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--contexts", default="100,1000,2000")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the batch-1 cells (default 4)")
    args = parser.parse_args(argv)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = sorted(set(cells) - set(CELLS))
    if unknown:
        parser.error(f"unknown cells {unknown}")
    _, tokenizer, _ = dart_hf.load_default()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    rows = []
    kw = dict(rounds=args.rounds, max_new_tokens=args.max_new_tokens)
    heldout = prompts_from_file(DATA_DIR / "fresh_prompts.jsonl", args.prompts)
    singles = [chat_batch(tokenizer, [text]) for text in heldout]
    if "batch" in cells:
        texts = prompt_set("mt_bench", 8)
        for size in (int(s) for s in args.batch_sizes.split(",")):
            batches = [chat_batch(tokenizer, texts[i: i + size]) for i in range(0, len(texts) - size + 1, size)]
            rows.append(run_cell(f"batch {size}", batches, threads=2, **kw))
    if "context" in cells:
        for length in (int(s) for s in args.contexts.split(",")):
            rows.append(run_cell(f"prompt of {length} tokens", [chat_batch(tokenizer, [long_prompt(tokenizer, length)])],
                                 threads=2, **kw))
    if "threads" in cells:
        for threads in (1, 2):
            rows.append(run_cell(f"{threads} thread{'s' if threads > 1 else ''}", singles, threads=threads, **kw))
    if "cannot_pay" in cells:
        rows.append(run_cell("random head, no curve", singles, threads=2,
                             head_factory=lambda m: head_that_cannot_pay(m, curve=False), **kw))
        rows.append(run_cell("random head, a curve claiming 1.3", singles, threads=2,
                             head_factory=lambda m: head_that_cannot_pay(m, curve=True), **kw))
    if "load" in cells:
        rows.append(run_cell("first call under load", singles, threads=2, load_first=True, **kw))
    if "heldout" in cells:
        rows.append(run_cell("held-out prompts", [chat_batch(tokenizer, [t]) for t in
                                                  prompts_from_file(DATA_DIR / "fresh_prompts.jsonl", 16)],
                             threads=2, rounds=max(args.rounds - 1, 1), max_new_tokens=args.max_new_tokens))
    results = {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
               "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "cells": rows}
    print("\n| cell | threads | speedup (median of rounds) | rounds | first call | identical | steps by tree size |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cell']} | {r['threads']} | {r['speedup']:.2f}x | {', '.join(f'{x:.2f}' for x in r['speedups'])} "
              f"| {r['first_call_speedup']:.2f}x | {r['identical']}/{r['runs']} | {r['tree_sizes']} |")
    if args.json:
        write_results(args.json, results)
    return 0 if all(r["identical"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
