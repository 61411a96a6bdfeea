"""Host synchronisations and operators per DART step, by phase: the CPU proxies of a step's cost on a GPU.

    python benchmarks/step_syncs.py --json benchmarks/results/step_syncs.json
    PYTHONPATH=<an older checkout> python benchmarks/step_syncs.py ...      # the same counts for older code

SmolLM2 with the shipped head, greedy, `--prompts` MT-Bench first turns, `--max-new-tokens` tokens, batch 1. Every
aten operator run inside the loop's phases is counted with a TorchDispatchMode: `draft` (the head forward:
`head.draft`; the tree search: `head.build_tree`) and `verify_step` (mask build: `tree_attention_mask`; the target
forward: `tree_forward`; acceptance: `_Verifier.accept`; KV compaction: `keep_accepted_path`; the rest of the step:
"other"). Host synchronisations are the operators that read a device value back (`aten._local_scalar_dense`:
`.item()`, `int()`, `bool()`; `aten.nonzero` and other data-dependent shapes, e.g. `repeat_interleave` without
`output_size`) plus `Tensor.tolist()` calls. The
emission (stopping criteria on every accepted prefix) is counted apart: its synchronisations come with the
criteria, one per accepted token, as in plain decoding. Reported per step: min / median / max over steps, so
"fixed" means min == max. Counts, not times: run anywhere.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dart_hf
import dart_hf.loop as loop
from dart_bench import chat_ids, median_range, prompt_set, script_parser, write_results

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave")
PHASES = ("head", "tree", "mask", "target", "accept", "compact", "other", "emit")


class Counter(TorchDispatchMode):
    """Counts operators and synchronisations into the current phase (a stack: the innermost phase wins)."""

    def __init__(self):
        super().__init__()
        self.phases: list[str] = []
        self.ops = collections.Counter()
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.phases:
            phase = self.phases[-1]
            self.ops[phase] += 1
            name = func.__name__.split(".")[0]
            if name in SYNC_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
                self.syncs[phase] += 1
        return func(*args, **(kwargs or {}))


def in_phase(counter: Counter, name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        counter.phases.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            counter.phases.pop()
    return wrapped


@contextlib.contextmanager
def instrumented(counter: Counter, head):
    """Wrap the loop's phase functions (module attributes and drafter methods) for the duration."""
    saved = []

    def patch(owner, attr, name):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, in_phase(counter, name, getattr(owner, attr)))

    patch(loop, "draft", "other")
    patch(loop, "verify_step", "other")
    patch(loop.Run, "emit", "emit")
    patch(loop, "tree_attention_mask", "mask")
    patch(loop, "tree_forward", "target")
    patch(loop, "keep_accepted_path", "compact")
    patch(loop._Verifier, "accept", "accept")
    patch(type(head), "draft", "head")
    patch(type(head), "build_tree", "tree")
    original_tolist = torch.Tensor.tolist

    def tolist(self):
        if counter.phases:
            counter.syncs[counter.phases[-1]] += 1
        return original_tolist(self)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield
    finally:
        torch.Tensor.tolist = original_tolist
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def per_step_counts(model, head, ids, max_new_tokens) -> tuple[list[dict], list[dict]]:
    """(ops, syncs) per DART step: the draft + verify of one step, by phase (the prefill's first emit excluded)."""
    steps_ops, steps_syncs = [], []
    counter = Counter()
    original = loop.verify_step

    def verify_then_record(*args, **kwargs):
        out = original(*args, **kwargs)
        steps_ops.append(dict(counter.ops))
        steps_syncs.append(dict(counter.syncs))
        counter.ops.clear()
        counter.syncs.clear()
        return out

    loop.verify_step = verify_then_record
    try:
        with instrumented(counter, head):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           dart_head=head)
    finally:
        loop.verify_step = original
    return steps_ops, steps_syncs


def summary(rows: list[dict]) -> dict:
    out = {}
    for phase in PHASES[:-1]:  # the emit of step i runs before step i+1's draft: counted apart below
        out[phase] = median_range(r.get(phase, 0) for r in rows)
    out["step_without_target"] = median_range(sum(v for k, v in r.items() if k not in ("target", "emit"))
                                              for r in rows)
    return out


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    model, tokenizer, head = dart_hf.load_default()
    ops, syncs = [], []
    for text in prompt_set("mt_bench", args.prompts):
        o, s = per_step_counts(model, head, chat_ids(tokenizer, text), args.max_new_tokens)
        ops += o[1:]  # the first row also holds the prefill's emission
        syncs += s[1:]
    results = {"steps": len(ops), "tree_nodes": model.dart_stats.tree_nodes, "operators": summary(ops),
               "syncs": summary(syncs), "emit_syncs_per_step": median_range(r.get("emit", 0) for r in syncs)}
    print(f"{results['steps']} steps, {results['tree_nodes']} tree nodes")
    for phase in PHASES[:-1] + ("step_without_target",):
        o, s = results["operators"][phase], results["syncs"][phase]
        print(f"  {phase:20s} operators {o['min']:>5} / {o['median']:>7} / {o['max']:>5}   "
              f"syncs {s['min']:>3} / {s['median']:>5} / {s['max']:>3}   (min / median / max per step)")
    e = results["emit_syncs_per_step"]
    print(f"  emission syncs per step {e['min']} / {e['median']} / {e['max']}")
    if args.json:
        write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
