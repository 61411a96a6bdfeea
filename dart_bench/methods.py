"""Decoding methods compared on one target, one machine, one run (`dart-spec bench`).

Benchmarking, not an integration: it drives `dart_hf` from outside like any user would. Methods (batch size 1,
`max_new_tokens` per prompt):

- `plain`: `model.generate()`;
- `prompt_lookup`: transformers' prompt lookup decoding (`prompt_lookup_num_tokens`);
- `dart_tree`: `generate(dart_head=head)`, one target forward verifies the DART draft tree;
- `dart_chain`: `generate(assistant_model=head)`, transformers' assisted loop with the tree's best chain;
- `eagle3`: `generate(dart_head=eagle3_head)`, the EAGLE3-style baseline (`dart_core.eagle3`) drafting its tree
  level by level, verified like DART's.

Every prompt runs all methods back to back (so slow drifts of the machine hit all of them alike), for each
temperature and repeat. A forward hook on the target (`timing.TargetMeter`) counts its forwards and times them, the
same way for every method. Per (temperature, prompt set, method) the summary gives:

- tokens/s (new tokens / wall seconds, summed over the set's prompts), median over repeats;
- speedup: tokens/s divided by plain's of the same set, temperature and repeat; median (and range) over repeats;
- tau: new tokens after the first / target forwards after the prefill (tokens per verify step; plain = 1);
- per verify step, in ms: drafting (`DartStats.head_time`: the head forward; EAGLE3: all its levels), tree
  (`tree_time`: DART's tree search / chain extraction; EAGLE3: the final node selection), verify (target forwards),
  other (the rest of the wall time: acceptance, cache compaction, logits processing, the loop itself;
  prompt lookup's matching lands here);
- identical: at temperature 0, the fraction of outputs equal to plain's token for token.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dart_bench.prompts import encode_prompts
from dart_bench.timing import TargetMeter, median_range, timed_generate
from dart_core.errors import DartInputError

METHODS = ("plain", "prompt_lookup", "dart_tree", "dart_chain", "eagle3")
PROMPT_LOOKUP_TOKENS = 10
# EAGLE3-style drafter searches the bench calibrates (TreeConfig topk, max_depth): its drafting cost grows with both,
# so the best setting depends on the machine like DART's node count does (EAGLE-2's GPU default is topk 10, depth 7)
EAGLE3_SEARCHES = ({"topk": 1, "max_depth": 3}, {"topk": 2, "max_depth": 3}, {"topk": 4, "max_depth": 3},
                   {"topk": 1, "max_depth": 7}, {"topk": 4, "max_depth": 7}, {"topk": 10, "max_depth": 7})


def first_difference(out: torch.Tensor, reference: torch.Tensor) -> Optional[int]:
    """The first index where token rows `out` [n] and `reference` [m] differ (a length difference counts there), or
    None when they are equal."""
    n = min(out.shape[0], reference.shape[0])
    differ = (out[:n] != reference[:n]).nonzero()
    if len(differ):
        return int(differ[0])
    return None if out.shape[0] == reference.shape[0] else n


# ---- measuring one generate call ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """One generate call: new tokens, wall seconds, target forwards and their seconds (prefill apart), drafting and
    tree seconds (0 where the method has none), and the output ids."""

    new_tokens: int
    seconds: float
    forwards: int
    prefill_s: float
    target_s: float
    draft_s: float
    tree_s: float
    output: torch.Tensor


def generate_kwargs(method: str, drafters: dict, temperature: float) -> dict:
    """The `generate()` arguments of a method (beyond ids, mask, max_new_tokens)."""
    if temperature > 0:
        kw = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        kw = dict(do_sample=False)
    if method == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    elif method == "dart_tree":
        kw.update(dart_head=drafters["dart"], dart_tree_config=drafters["dart"].tree_config)
    elif method == "dart_chain":
        kw["assistant_model"] = drafters["dart"]
    elif method == "eagle3":
        kw.update(dart_head=drafters["eagle3"], dart_tree_config=drafters["eagle3"].tree_config)
    elif method != "plain":
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    return kw


def run_once(model, meter: TargetMeter, ids: torch.Tensor, method: str, drafters: dict, temperature: float,
             max_new_tokens: int, seed: int) -> Run:
    from dart_hf import last_stats

    torch.manual_seed(seed)
    kw = generate_kwargs(method, drafters, temperature)
    meter.reset()
    out, seconds = timed_generate(model, ids, max_new_tokens=max_new_tokens, **kw)
    stats = last_stats(model) if method in ("dart_tree", "dart_chain", "eagle3") else None
    times = meter.times
    return Run(new_tokens=int(out.shape[1] - ids.shape[1]), seconds=seconds, forwards=len(times),
               prefill_s=times[0] if times else 0.0, target_s=sum(times[1:]),
               draft_s=stats.head_time if stats is not None else 0.0,
               tree_s=stats.tree_time if stats is not None else 0.0, output=out[0, ids.shape[1]:].cpu())


# ---- the whole benchmark ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchConfig:
    methods: tuple[str, ...] = METHODS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    repeats: int = 3
    max_new_tokens: int = 128
    seed: int = 0

    def validate(self, drafters: dict) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise DartInputError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
        needs = {"dart_tree": "dart", "dart_chain": "dart", "eagle3": "eagle3"}
        missing = sorted({needs[m] for m in self.methods if m in needs and drafters.get(needs[m]) is None})
        if missing:
            raise DartInputError(f"no drafter given for {', '.join(missing)} (methods {', '.join(self.methods)})")
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise DartInputError("repeats and max_new_tokens must be >= 1")
        if any(t < 0 for t in self.temperatures):
            raise DartInputError(f"temperatures must be >= 0, got {list(self.temperatures)}")


def run_bench(model, tokenizer, drafters: dict, prompt_sets: dict[str, list[str]], config: BenchConfig,
              progress: Optional[bool] = None) -> dict:
    """Run every (temperature, repeat, set, prompt, method) and return {"config", "runs", "summary"}.

    `drafters`: {"dart": DartHead, "eagle3": Eagle3Head} (those the methods need). The model must be enabled
    (`dart_hf.enable`). `plain` always runs (first, for every prompt): speedups and identity are relative to it. `runs` holds one record per generate call (no token ids); `summary` is `summarize(runs)`.
    """
    from tqdm.auto import tqdm

    config.validate(drafters)
    methods = ["plain"] + [m for m in config.methods if m != "plain"]  # plain first: identity is checked against it
    encoded = {name: encode_prompts(tokenizer, prompts) for name, prompts in prompt_sets.items()}
    total = len(config.temperatures) * config.repeats * sum(map(len, encoded.values())) * len(methods)
    device = next(model.parameters()).device
    meter = TargetMeter(model)
    records = []
    bar = tqdm(total=total, desc="bench", unit="run", disable=None if progress is None else not progress)
    try:
        warm = encoded[next(iter(encoded))][0].to(device)  # first-call costs (allocations, kernels) out of the runs
        for temperature in config.temperatures:
            for method in methods:
                run_once(model, meter, warm, method, drafters, temperature, 8, config.seed)
        for temperature in config.temperatures:
            for repeat in range(config.repeats):
                for set_name, prompts in encoded.items():
                    for index, ids in enumerate(prompts):
                        ids = ids.to(device)
                        seed = config.seed + 100_003 * repeat + index
                        plain_output = None
                        for method in methods:
                            run = run_once(model, meter, ids, method, drafters, temperature, config.max_new_tokens,
                                           seed)
                            if method == "plain":
                                plain_output = run.output
                            record = {k: v for k, v in dataclasses.asdict(run).items() if k != "output"}
                            record.update(temperature=temperature, repeat=repeat, set=set_name, prompt=index,
                                          method=method)
                            if temperature == 0 and plain_output is not None:
                                record["identical"] = bool(torch.equal(run.output, plain_output))
                            records.append(record)
                            bar.update(1)
    finally:
        bar.close()
        meter.close()
    summary = summarize(records)
    return {"config": dataclasses.asdict(config), "runs": records, "summary": summary,
            "dart_vs_eagle3": dart_vs_eagle3(summary)}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (temperature, set, method), plus set "all" pooling the sets (module docstring)."""
    rows = []
    temperatures = sorted({r["temperature"] for r in records})
    sets = list(dict.fromkeys(r["set"] for r in records)) + ["all"]
    methods = list(dict.fromkeys(r["method"] for r in records))
    for temperature in temperatures:
        for set_name in sets:
            chosen = [r for r in records if r["temperature"] == temperature and (set_name == "all"
                                                                                  or r["set"] == set_name)]
            repeats = sorted({r["repeat"] for r in chosen})

            def rate(method, repeat):
                rs = [r for r in chosen if r["method"] == method and r["repeat"] == repeat]
                return sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)

            for method in methods:
                mine = [r for r in chosen if r["method"] == method]
                if not mine:
                    continue
                steps = sum(max(r["forwards"] - 1, 0) for r in mine)
                per_step = (lambda total: 1e3 * total / steps if steps else 0.0)
                draft, tree = sum(r["draft_s"] for r in mine), sum(r["tree_s"] for r in mine)
                target = sum(r["target_s"] for r in mine)
                rest = sum(r["seconds"] - r["prefill_s"] for r in mine) - draft - tree - target
                row = {"temperature": temperature, "set": set_name, "method": method, "prompts": len(mine) // len(
                    repeats), "tokens_per_s": median_range([rate(method, k) for k in repeats]),
                       "speedup": median_range([rate(method, k) / rate("plain", k) for k in repeats]),
                       "tau": sum(r["new_tokens"] - 1 for r in mine) / steps if steps else 0.0,
                       "draft_ms_per_step": per_step(draft), "tree_ms_per_step": per_step(tree),
                       "verify_ms_per_step": per_step(target), "other_ms_per_step": per_step(rest)}
                flags = [r["identical"] for r in mine if "identical" in r]
                if flags:
                    row["identical"] = sum(flags) / len(flags)
                rows.append(row)
    return rows


def dart_vs_eagle3(summary: list[dict]) -> list[dict]:
    """Per temperature (all sets pooled): drafting cost per step (draft + tree ms) of the DART tree and of the
    EAGLE3-style drafter, their ratio, and the tokens/s ratio DART / EAGLE3. Empty without both methods."""
    out = []
    for temperature in sorted({r["temperature"] for r in summary}):
        pick = {r["method"]: r for r in summary if r["temperature"] == temperature and r["set"] == "all"}
        if "dart_tree" not in pick or "eagle3" not in pick:
            continue
        dart, eagle = pick["dart_tree"], pick["eagle3"]
        dart_ms = dart["draft_ms_per_step"] + dart["tree_ms_per_step"]
        eagle_ms = eagle["draft_ms_per_step"] + eagle["tree_ms_per_step"]
        out.append({"temperature": temperature, "dart_drafting_ms_per_step": dart_ms,
                    "eagle3_drafting_ms_per_step": eagle_ms, "drafting_cost_ratio": eagle_ms / dart_ms,
                    "tokens_per_s_ratio": dart["tokens_per_s"]["median"] / eagle["tokens_per_s"]["median"],
                    "dart_tau": dart["tau"], "eagle3_tau": eagle["tau"]})
    return out
