"""dart_bench: decoding methods compared on one target, one machine, one run (`dart-spec bench`, `benchmarks/`).

Benchmarking, not an integration: it drives `dart_hf` from outside like any user would, and adds the prompt sets,
the timing hook, the summary and the charts.

Methods (batch size 1, `max_new_tokens` per prompt):

- `plain`: `model.generate()`;
- `prompt_lookup`: transformers' prompt lookup decoding (`prompt_lookup_num_tokens`);
- `dart_tree`: `generate(dart_head=head)`, one target forward verifies the DART draft tree;
- `dart_chain`: `generate(assistant_model=head)`, transformers' assisted loop with the tree's best chain;
- `eagle3`: `generate(dart_head=eagle3_head)`, the EAGLE3-style baseline (`dart_core.eagle3`) drafting its tree
  level by level, verified like DART's.

Every prompt runs all methods back to back (so slow drifts of the machine hit all of them alike), for each
temperature and repeat. A forward hook on the target counts its forwards and times them, the same way for every
method. Per (temperature, prompt set, method) the summary gives:

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
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from dart_core import TreeConfig
from dart_runtime.sync import synchronize
from dart_core.errors import DartInputError

METHODS = ("plain", "prompt_lookup", "dart_tree", "dart_chain", "eagle3")
PROMPT_SETS = ("mt_bench", "humaneval", "gsm8k")
PROMPT_LOOKUP_TOKENS = 10
DATA_DIR = Path(__file__).resolve().parent / "data"  # the shipped prompt sets (see data/README.md)
# EAGLE3-style drafter searches the bench calibrates (TreeConfig topk, max_depth): its drafting cost grows with both,
# so the best setting depends on the machine like DART's node count does (EAGLE-2's GPU default is topk 10, depth 7)
EAGLE3_SEARCHES = ({"topk": 1, "max_depth": 3}, {"topk": 2, "max_depth": 3}, {"topk": 4, "max_depth": 3},
                   {"topk": 1, "max_depth": 7}, {"topk": 4, "max_depth": 7}, {"topk": 10, "max_depth": 7})


# ---- prompts ------------------------------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DartInputError(f"{path}: not a JSON-lines file ({err})") from None


def read_prompt_rows(name: str, data_dir: str | Path = DATA_DIR) -> list[dict]:
    """The rows of one prompt file of `data_dir` (default: the sets shipped in `dart_bench/data/`): `name` is
    mt_bench_questions, humaneval or gsm8k."""
    return _read_jsonl(Path(data_dir) / f"{name}.jsonl")


def load_prompt_sets(data_dir: str | Path, per_set: int, sets: Sequence[str] = PROMPT_SETS) -> dict[str, list[str]]:
    """The first `per_set` prompts of each set: MT-Bench first turns, HumanEval prompts, GSM8K questions (the shipped
    slice is the end of the distillation order, held out from heads trained on a prefix of it)."""
    unknown = sorted(set(sets) - set(PROMPT_SETS))
    if unknown:
        raise DartInputError(f"unknown prompt set(s) {unknown}; known: {', '.join(PROMPT_SETS)}")
    fields = {"mt_bench": ("mt_bench_questions", lambda r: r["turns"][0]),
              "humaneval": ("humaneval", lambda r: r["prompt"]), "gsm8k": ("gsm8k", lambda r: r["question"])}
    out = {}
    for name in sets:
        file, field = fields[name]
        out[name] = [field(row) for row in read_prompt_rows(file, data_dir)][:per_set]
    return out


def first_difference(out: torch.Tensor, reference: torch.Tensor) -> Optional[int]:
    """The first index where token rows `out` [n] and `reference` [m] differ (a length difference counts there), or
    None when they are equal."""
    n = min(out.shape[0], reference.shape[0])
    differ = (out[:n] != reference[:n]).nonzero()
    if len(differ):
        return int(differ[0])
    return None if out.shape[0] == reference.shape[0] else n


# ---- measuring one generate call ----------------------------------------------------------------------------------
class TargetMeter:
    """Forward hooks on the target: how many forwards ran and how long each took (prefill = the first). On CUDA
    each forward is synchronised, so its time is the GPU's (the drafting and tree times of `DartStats` are host
    times, exact on CPU only)."""

    def __init__(self, model) -> None:
        self.times: list[float] = []
        self._start = 0.0
        device = next(model.parameters()).device
        self._sync = functools.partial(synchronize, device)
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)

    def reset(self) -> None:
        self.times = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


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
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kw)
    seconds = time.perf_counter() - t0
    stats = last_stats(model) if method in ("dart_tree", "dart_chain", "eagle3") else None
    times = meter.times
    return Run(new_tokens=int(out.shape[1] - ids.shape[1]), seconds=seconds, forwards=len(times),
               prefill_s=times[0] if times else 0.0, target_s=sum(times[1:]),
               draft_s=stats.head_time if stats is not None else 0.0,
               tree_s=stats.tree_time if stats is not None else 0.0, output=out[0, ids.shape[1]:].cpu())


# ---- tree settings per drafter ------------------------------------------------------------------------------------
def decoding_tree(model, head, remain_total: Optional[int] = None) -> TreeConfig:
    """The tree a `generate(dart_head=head)` call decodes with on this machine (`dart_hf.tree_choice`; a head without
    an acceptance curve: its own settings), with `remain_total` overriding the size."""
    from dart_hf.calibration import base_tree_config, tree_choice

    choice = tree_choice(model, head)
    tree = choice.tree_config if choice is not None else base_tree_config(model, head)
    return tree if remain_total is None else dataclasses.replace(tree, remain_total=remain_total)


def calibrated_tree(model, tokenizer, drafter, searches: Sequence[dict] = ({},), refresh: bool = False,
                    progress: Optional[bool] = True) -> tuple[TreeConfig, list[dict]]:
    """The fastest tree settings for `drafter` on this machine: for each search setting (TreeConfig overrides, e.g.
    {"topk": 2, "max_depth": 3}) the node count `dart_hf.calibration` chooses (the drafter's shipped acceptance curve
    for its own settings, else one measured now; this machine's cost, cached unless `refresh`), then the setting with
    the best expected speedup. Returns (TreeConfig, one row per setting)."""
    from dart_hf.calibration import base_tree_config, choose, machine_cost, measure_acceptance

    base = base_tree_config(model, drafter)
    shipped = drafter.acceptance
    rows, best = [], None
    for search in searches:
        drafter.tree_config = dataclasses.replace(base, **search)
        measure = refresh or search or shipped is None
        acceptance = measure_acceptance(model, tokenizer, drafter, progress=progress) if measure else shipped
        choice = choose(acceptance, machine_cost(model, drafter, refresh=refresh, progress=progress),
                        drafter.tree_config)
        rows.append({**search, "remain_total": choice.remain_total, "expected_speedup": choice.expected_speedup,
                     "head_ms": choice.cost.head_ms, "tree_ms": choice.cost.tree_ms})
        if best is None or choice.expected_speedup > best.expected_speedup:
            best = choice
    drafter.tree_config = best.tree_config
    return drafter.tree_config, rows


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

    from dart_hf.calibration import encode_prompts

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


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
                    repeats), "tokens_per_s": _median_range([rate(method, k) for k in repeats]),
                       "speedup": _median_range([rate(method, k) / rate("plain", k) for k in repeats]),
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


# ---- report -------------------------------------------------------------------------------------------------------
def markdown_table(summary: list[dict]) -> str:
    """The summary as one markdown table per temperature."""
    out = []
    for temperature in sorted({r["temperature"] for r in summary}):
        out.append(f"**temperature {temperature:g}**\n")
        out.append("| set | method | tok/s | speedup (median, range) | tau | draft ms/step | tree ms/step | "
                   "verify ms/step | other ms/step | identical |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary:
            if r["temperature"] != temperature:
                continue
            s = r["speedup"]
            ident = f"{100 * r['identical']:.0f}%" if "identical" in r else "-"
            out.append(f"| {r['set']} | {r['method']} | {r['tokens_per_s']['median']:.1f} | "
                       f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) | {r['tau']:.2f} | "
                       f"{r['draft_ms_per_step']:.1f} | {r['tree_ms_per_step']:.1f} | {r['verify_ms_per_step']:.1f} | "
                       f"{r['other_ms_per_step']:.1f} | {ident} |")
        out.append("")
    return "\n".join(out)


def write_charts(summary: list[dict], out_dir: str | Path) -> list[Path]:
    """speedup.png (speedup per set and method, one panel per temperature) and breakdown.png (ms per verify step
    by phase, all sets pooled, with tau); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    temperatures = sorted({r["temperature"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in summary))
    sets = list(dict.fromkeys(r["set"] for r in summary))
    paths = []

    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, temperature in zip(axes[0], temperatures):
        for m, method in enumerate(methods):
            values = [next((r["speedup"]["median"] for r in summary if r["temperature"] == temperature
                            and r["set"] == s and r["method"] == method), 0.0) for s in sets]
            ax.bar([i + m * width for i in range(len(sets))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        top = max([r["speedup"]["median"] for r in summary if r["temperature"] == temperature] + [1.0])
        ax.set_ylim(0, top * 1.15)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
        ax.set_ylabel("speedup over plain generate()")
        ax.set_title(f"temperature {temperature:g}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save_png(fig, out_dir / "speedup.png"))
    plt.close(fig)

    phases = ("draft_ms_per_step", "tree_ms_per_step", "verify_ms_per_step", "other_ms_per_step")
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 3.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [next(r for r in summary if r["temperature"] == temperature and r["set"] == "all"
                     and r["method"] == method) for method in methods]
        left = [0.0] * len(rows)
        for phase in phases:
            values = [r[phase] for r in rows]
            ax.barh(methods, values, left=left, label=phase.replace("_ms_per_step", ""))
            left = [a + b for a, b in zip(left, values)]
        for i, r in enumerate(rows):
            ax.text(left[i], i, f"  tau {r['tau']:.2f}", va="center", fontsize=8)
        ax.set_xlabel("ms per verify step (all sets)")
        ax.set_title(f"temperature {temperature:g}")
        ax.set_xlim(0, max(left) * 1.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(_save_png(fig, out_dir / "breakdown.png"))
    plt.close(fig)
    return paths


def _save_png(fig, path: Path) -> Path:
    """Save a figure atomically (a partial PNG never replaces a good one)."""
    from dart_core.io import atomic_write

    with atomic_write(str(path), "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    return path


def write_report(results: dict, out_dir: str | Path, charts: bool = True) -> list[Path]:
    """results.json, table.md and (with matplotlib) the charts into `out_dir`, each file replaced atomically."""
    from dart_core.io import atomic_write

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_write(str(out_dir / "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
        fh.write("\n")
    with atomic_write(str(out_dir / "table.md"), "w") as fh:
        fh.write(markdown_table(results["summary"]))
    paths = [out_dir / "results.json", out_dir / "table.md"]
    if charts:
        paths += write_charts(results["summary"], out_dir)
    return paths
