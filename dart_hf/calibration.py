"""Tree budget calibration: the number of draft nodes (`TreeConfig.remain_total`) that decodes fastest on this
machine, for this target and this head, measured once and cached.

A bigger tree accepts more tokens per step but costs a bigger verify forward. On a GPU a forward over 61 tokens
costs about as much as one over 1 token, so the reference's 60 nodes are right; on a CPU the 60-node tree costs several
times a single-token step and a much smaller tree wins. The rule:

Acceptance, tau(R). The beam search's pool does not depend on `remain_total`: a tree of R draft nodes is exactly the
best R pool entries by score (ties: pool order), i.e. the nodes of the R_max-node tree whose selection rank
(`dart_core.tree.score_ranks`: 0-based position among the draft nodes sorted by score descending, ties by node
order) is below R. Scores never increase from a node to its children, so ranks increase along every root-to-leaf
path, and greedy verification of the R-node tree accepts exactly the leading nodes of the R_max tree's accepted path
whose rank is < R. One greedy run with a large tree (R_max = 60) that records these ranks at every verify step
(`DartStats.accepted_ranks`) therefore tells, for every step and every R <= R_max, what a tree of R nodes would have
accepted from the same state, and

    tau(R) = 1 + mean over steps of #(leading accepted nodes with rank < R)           (`DartStats.tau_at`)

Per step this is exact (greedy; tested against real R-node runs from the same states). Over a whole run it is an
estimate: a smaller tree accepts less, so its later steps start at other positions than the R_max run's.

Latency. `t_verify(k)`: one target forward over k new tokens on a cache of `context_length` (256) tokens, the way the
tree loop runs it (4D tree mask, tapped hidden states), median of `repeats`, measured at k = 1, 2, 4, ..., 64 (and
R_max + 1), made non-decreasing in k (pool-adjacent-violators: a dip is noise) and interpolated linearly. The head
forward, the tree search and the rest of a verify step (acceptance, KV compaction) are taken per step from the
calibration run (they hardly depend on R).
`t_plain`: one plain forward over 1 token on the same cache (a step of ordinary decoding).

Choice. R* = argmax over candidate R of  tau(R) / (t_head + t_tree + t_rest + t_verify(R + 1))  (tokens per
second; ties: the smaller R), and the expected speedup over plain decoding is that rate times t_plain.

Cache. The result is a JSON file in `$DART_SPEC_CACHE/calibration/` (default `~/.cache/dart-spec/calibration/`),
named by a hash of: the device (CPU model string and core count, or CUDA device name), torch's thread count, the
target (config, dtype, attention implementation) and the head (config, weights, n-gram, search settings other than
`remain_total`).

    tree = dart_hf.calibrate(model, tokenizer, head)                # measure now (progress bar), cache, TreeConfig
    tree = dart_hf.tuned_tree_config(model, tokenizer, head)        # cached result, else calibrate
    model.generate(ids, dart_head=head, dart_tree_config=tree)      # or: head.tree_config = tree
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from dart_core import DartHead, TreeConfig
from dart_core.errors import DartInputError
from dart_core.io import atomic_write
from dart_core.sync import synchronize
from dart_hf.loop import DartStats, dart_decoding, last_stats
from dart_hf.target import (keep_accepted_path, plan_for, tree_attention_mask,
                            tree_forward, tree_forwards, tree_settings)

FORMAT_VERSION = 3  # 3: the few-row product measured per machine (older tree sizes used a fixed rule: stale)
LATENCY_GRID = (1, 2, 4, 8, 16, 32, 64)
CANDIDATES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60)
DEFAULT_PROMPTS = (
    "Explain in a few sentences how a hash table works and when it is a bad choice.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed? Show the steps.",
    "List five tips for writing clear emails.",
)


@dataclasses.dataclass
class Calibration:
    """A calibration result. Times are in milliseconds; `rows` has one entry per candidate tree size:
    {remain_total, tau, verify_ms, step_ms, tokens_per_s, speedup}."""

    remain_total: int
    tree_config: dict
    expected_speedup: float
    rows: list[dict]
    verify_ms: dict[int, float]
    plain_ms: float
    head_ms: float
    tree_ms: float
    rest_ms: float
    steps: int
    max_nodes: int
    context_length: int
    prompts: int
    new_tokens: int
    seconds: float
    identity: dict = dataclasses.field(default_factory=dict)
    created: str = ""
    version: int = FORMAT_VERSION

    def to_tree_config(self) -> TreeConfig:
        return TreeConfig.from_dict(self.tree_config)

    @property
    def plain_tokens_per_s(self) -> float:
        return 1e3 / self.plain_ms

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return out

    @classmethod
    def from_dict(cls, raw) -> "Calibration":
        """The calibration a cache file holds; DartInputError naming what is wrong with it."""
        if not isinstance(raw, dict):
            raise DartInputError(f"not a calibration (a JSON {type(raw).__name__}, not an object)")
        if raw.get("version") != FORMAT_VERSION:
            raise DartInputError(f"format version {raw.get('version')!r}, not {FORMAT_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in raw and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise DartInputError(f"missing {', '.join(missing)}")
        data = {k: v for k, v in raw.items() if k in known}
        try:
            data["verify_ms"] = {int(k): float(v) for k, v in raw["verify_ms"].items()}
            result = cls(**data)
            tree = result.to_tree_config()
        except (AttributeError, TypeError, ValueError) as err:
            raise DartInputError(f"malformed field ({type(err).__name__}: {err})") from None
        if not isinstance(result.identity, dict) or type(result.remain_total) is not int:
            raise DartInputError("malformed identity or remain_total")
        if not 1 <= result.remain_total <= max(CANDIDATES + (int(result.max_nodes),)) or \
                tree.remain_total != result.remain_total:
            raise DartInputError(f"tree size {result.remain_total} outside the calibrated candidates")
        return result

    def format_table(self) -> str:
        """A plain-text table: the latency grid, then tau, step time and expected speedup per tree size."""
        lines = [f"target forward over k new tokens on a {self.context_length}-token cache (median ms):",
                 "  " + "  ".join(f"k={k}: {ms:.1f}" for k, ms in sorted(self.verify_ms.items())),
                 f"plain 1-token forward {self.plain_ms:.1f} ms; per step: head {self.head_ms:.1f} ms, "
                 f"tree search {self.tree_ms:.1f} ms, acceptance + KV compaction {self.rest_ms:.1f} ms "
                 f"({self.steps} steps of a {self.max_nodes}-node run)",
                 f"{'nodes':>5} {'tau':>6} {'verify ms':>9} {'step ms':>8} {'tok/s':>7} {'speedup':>7}"]
        for row in self.rows:
            mark = "  <- chosen" if row["remain_total"] == self.remain_total else ""
            lines.append(f"{row['remain_total']:5d} {row['tau']:6.3f} {row['verify_ms']:9.1f} {row['step_ms']:8.1f} "
                         f"{row['tokens_per_s']:7.1f} {row['speedup']:6.2f}x{mark}")
        return "\n".join(lines)


# ---- the rule ---------------------------------------------------------------------------------------------------

def interpolate(points: dict[int, float], k: float) -> float:
    """Piecewise-linear interpolation of measured `points` {k: value}; linear extrapolation past the ends."""
    ks = sorted(points)
    if len(ks) == 1:
        return points[ks[0]]
    if k <= ks[0]:
        lo, hi = ks[0], ks[1]
    elif k >= ks[-1]:
        lo, hi = ks[-2], ks[-1]
    else:
        hi = next(x for x in ks if x >= k)
        lo = max(x for x in ks if x <= k)
        if lo == hi:
            return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)


def monotone(points: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve (least squares, pool-adjacent-violators): a forward over more tokens never
    costs less, so a dip in the measurements is noise."""
    blocks: list[list[float]] = []  # [sum, count]
    for k in sorted(points):
        blocks.append([points[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(sorted(points), values))


def choose_tree_size(tau: dict[int, float], verify_s: dict[int, float], fixed_s: float,
                     plain_s: float) -> tuple[int, list[dict]]:
    """R* = argmax_R tau(R) / (fixed_s + t_verify(R + 1)); ties go to the smaller R.

    tau {R: tau(R)}; verify_s {k: seconds of a verify forward over k tokens} (made non-decreasing in k, then
    interpolated); fixed_s: per-step head + tree search + the rest of a verify step; plain_s: one plain decoding step.
    Returns (R*, one row per R).
    """
    verify_s = monotone(verify_s)
    rows = []
    for r in sorted(tau):
        verify = interpolate(verify_s, r + 1)
        step = fixed_s + verify
        rate = tau[r] / step
        rows.append({"remain_total": r, "tau": tau[r], "verify_ms": verify * 1e3, "step_ms": step * 1e3,
                     "tokens_per_s": rate, "speedup": rate * plain_s})
    best = max(rows, key=lambda row: (row["tokens_per_s"], -row["remain_total"]))
    return best["remain_total"], rows


# ---- measurements -----------------------------------------------------------------------------------------------

@torch.no_grad()
def measure_latency(model, sizes: Iterable[int], layer_ids: Sequence[int] = (), context_length: int = 256,
                    repeats: int = 5, progress: Optional[bool] = None) -> tuple[dict[int, float], float]:
    """({k: median seconds of one verify forward over k new tokens}, median seconds of one plain 1-token forward).

    Both run on a DynamicCache holding `context_length` tokens; the verify forward is the tree loop's (4D additive
    tree mask, explicit positions, hidden states at `layer_ids`), the plain one is ordinary decoding's. The sizes are
    timed round robin (one warm-up round, then `repeats`); the cache is cut back to `context_length` after every
    forward.
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = int(model.get_input_embeddings().weight.shape[0])
    sizes = sorted(set(int(k) for k in sizes))
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_length), generator=gen).to(device)
    block = torch.randint(0, vocab, (1, max(sizes)), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=context, past_key_values=cache, use_cache=True)
    no_nodes = torch.zeros(1, 0, dtype=torch.long, device=device)
    past_columns = torch.ones(1, context_length, dtype=torch.bool, device=device)

    def timed(run, kernels) -> float:
        with kernels():  # entered outside the clock, as the loop enters it once per call
            synchronize(device)
            t0 = time.perf_counter()
            run()
            synchronize(device)
            elapsed = time.perf_counter() - t0
        keep_accepted_path(cache, context_length, no_nodes)  # the loop's compaction, keeping none of the block
        return elapsed

    def verify(k: int) -> None:
        chain = torch.ones(1, k, k, dtype=torch.bool, device=device).tril()  # the shape matters, not the tree
        mask = tree_attention_mask(chain, past_columns, dtype)
        positions = torch.arange(context_length, context_length + k, device=device)[None]
        tree_forward(model, block[:, :k], positions, mask, cache, tuple(layer_ids)).logits.float()

    def plain() -> None:
        positions = torch.tensor([[context_length]], device=device)
        model(input_ids=block[:, :1], position_ids=positions, past_key_values=cache, use_cache=True)

    runs = {k: (functools.partial(verify, k), functools.partial(tree_forwards, model)) for k in sizes}
    runs[0] = (plain, contextlib.nullcontext)  # 0 = the plain 1-token forward, with the model's own kernels
    times: dict[int, list[float]] = {k: [] for k in runs}
    bar = tqdm(total=(repeats + 1) * len(runs), desc="calibrate: latency", unit="fwd", disable=_disable(progress))
    try:
        # round robin, so that a slow spell of the machine hits every size alike; the first round is a warm-up
        for round_ in range(repeats + 1):
            for k, (run, kernels) in runs.items():
                elapsed = timed(run, kernels)
                if round_:
                    times[k].append(elapsed)
                bar.update()
    finally:
        bar.close()
    plain_s = statistics.median(times.pop(0))
    latency = {k: statistics.median(v) for k, v in times.items()}
    return latency, plain_s


class _CountingStreamer:
    """A streamer that advances a progress bar by the generated tokens (the first `put` is the prompt)."""

    def __init__(self, bar) -> None:
        self.bar, self.seen_prompt = bar, False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.bar.update(int(value.numel()))
        self.seen_prompt = True

    def end(self) -> None:
        pass


def acceptance_run(model, head: DartHead, prompts: Sequence[torch.Tensor], tree_config: TreeConfig,
                   max_new_tokens: int = 64, progress: Optional[bool] = None) -> DartStats:
    """Greedy DART decoding of every prompt ([1, n] ids) with `tree_config`; the merged statistics."""
    from tqdm.auto import tqdm

    merged = DartStats()
    device = next(model.parameters()).device
    bar = tqdm(total=len(prompts) * max_new_tokens, desc="calibrate: acceptance", unit="tok",
               disable=_disable(progress))
    try:
        for ids in prompts:
            ids = ids.to(device)
            decode = functools.partial(dart_decoding, dart_head=head, dart_tree_config=tree_config,
                                       dart_streamer=_CountingStreamer(bar))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           custom_generate=decode)
            merged.merge(last_stats(model))
    finally:
        bar.close()
    return merged


def _disable(progress: Optional[bool]) -> Optional[bool]:
    return None if progress is None else not progress


def encode_prompts(tokenizer, prompts: Iterable) -> list[torch.Tensor]:
    """Strings (chat template when the tokenizer has one) or token ids -> list of [1, n] LongTensors."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (or pass token ids)")
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
            else:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        else:
            ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        out.append(ids)
    if not out:
        raise ValueError("calibration needs at least one prompt")
    return out


def base_tree_config(model, head: DartHead) -> TreeConfig:
    """The search settings decoding would use without calibration: the head's, else the reference's with the EOS."""
    return tree_settings(head, model.generation_config)


def run_calibration(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, max_nodes: int = 60,
                    candidates: Optional[Iterable[int]] = None, max_new_tokens: int = 64, context_length: int = 256,
                    repeats: int = 5, progress: Optional[bool] = None) -> Calibration:
    """Measure and choose (the module docstring has the rule); nothing is cached. `prompts`: strings or token ids
    (default: a few built-in chat prompts)."""
    t_start = time.perf_counter()
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    sizes = sorted({int(r) for r in (candidates or CANDIDATES) if 1 <= int(r) <= max_nodes} | {max_nodes})
    plan = plan_for(model, head, tokenizer)
    ids = encode_prompts(tokenizer, DEFAULT_PROMPTS if prompts is None else prompts)
    base = base_tree_config(model, head)
    stats = acceptance_run(model, head, ids, dataclasses.replace(base, remain_total=max_nodes), max_new_tokens,
                           progress)
    if not stats.steps:
        raise ValueError("the calibration run made no verify step (prompts end at once?); use longer generations")
    grid = sorted({k for k in LATENCY_GRID if k <= max_nodes + 1} | {max_nodes + 1})
    latency, plain_s = measure_latency(model, grid, plan.layer_ids, context_length, repeats, progress)
    head_s = stats.head_time / stats.steps
    tree_s = stats.tree_time / stats.steps
    rest_s = max(stats.verify_time - stats.target_time, 0.0) / stats.steps
    tau = {r: stats.tau_at(r) for r in sizes}
    best, rows = choose_tree_size(tau, latency, head_s + tree_s + rest_s, plain_s)
    chosen = next(row for row in rows if row["remain_total"] == best)
    return Calibration(
        remain_total=best, tree_config=dataclasses.replace(base, remain_total=best).to_dict(),
        expected_speedup=chosen["speedup"], rows=rows, verify_ms={k: s * 1e3 for k, s in latency.items()},
        plain_ms=plain_s * 1e3, head_ms=head_s * 1e3, tree_ms=tree_s * 1e3, rest_ms=rest_s * 1e3, steps=stats.steps,
        max_nodes=max_nodes, context_length=context_length, prompts=len(ids), new_tokens=stats.new_tokens,
        seconds=time.perf_counter() - t_start, identity=identity(model, head),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# ---- cache ------------------------------------------------------------------------------------------------------

def calibration_dir() -> Path:
    """`$DART_SPEC_CACHE/calibration` or `~/.cache/dart-spec/calibration`."""
    root = os.environ.get("DART_SPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dart-spec")
    return Path(root) / "calibration"


def device_name(device: torch.device) -> str:
    """'cuda:<device name>' or 'cpu:<CPU model string> (<n> cores)'."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model_name = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model_name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    model_name = model_name or platform.processor() or platform.machine()
    return f"{device.type}:{model_name} ({os.cpu_count()} cores)"


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{t.numel()};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def target_identity(model) -> str:
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k != "transformers_version"}
    attention = getattr(model.config, "_attn_implementation", None)
    return _digest({"class": type(model).__name__, "config": config, "dtype": str(next(model.parameters()).dtype),
                    "attention": attention})


def head_identity(head: DartHead, base: TreeConfig) -> str:
    ngram = head.ngram
    ngram_id = None
    if ngram is not None:
        keys = ngram.keys.reshape(-1)
        sample = torch.cat((keys[:4096], keys[-4096:])) if keys.numel() > 8192 else keys
        ngram_id = [ngram.order, ngram.vocab_bound, ngram.num_nodes, _tensor_digest({"k": sample})]
    search = {k: v for k, v in base.to_dict().items() if k != "remain_total"}
    return _digest({"class": type(head).__name__, "config": head.config.to_dict(), "weights":
                    _tensor_digest(head.state_dict()), "ngram": ngram_id, "search": search})


def identity(model, head: DartHead) -> dict:
    """What a calibration is valid for: device, torch threads, target, head (the cache key is its hash)."""
    return {"device": device_name(next(model.parameters()).device), "threads": torch.get_num_threads(),
            "target": target_identity(model), "head": head_identity(head, base_tree_config(model, head)),
            "version": FORMAT_VERSION}


def calibration_path(model, head: DartHead, ident: Optional[dict] = None) -> Path:
    return calibration_dir() / f"{_digest(ident or identity(model, head))}.json"


def cached_calibration(model, head: DartHead) -> Optional[Calibration]:
    """The cached calibration for this device, thread count, target and head, or None. A cache file that cannot be
    read as one is ignored with a warning naming it (calibrating again replaces it)."""
    ident = identity(model, head)
    path = calibration_path(model, head, ident)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        warnings.warn(f"ignoring the calibration cache {path}: unreadable ({err})", stacklevel=2)
        return None
    try:
        result = Calibration.from_dict(json.loads(text))
    except (ValueError, DartInputError) as err:  # json's errors are ValueErrors
        warnings.warn(f"ignoring the calibration cache {path}: {err}; `dart-spec demo --calibrate` (or "
                      "dart_hf.calibrate) replaces it", stacklevel=2)
        return None
    return result if result.identity == ident else None


def save_calibration(result: Calibration) -> Path:
    path = calibration_dir() / f"{_digest(result.identity)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(str(path), "w") as fh:
        json.dump(result.to_dict(), fh, indent=2)
    return path


def calibrate(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, save: bool = True,
              **kwargs) -> TreeConfig:
    """Measure now (progress bars), cache the result (`save=True`) and return the tuned TreeConfig.

    The other settings come from `head.tree_config` (else the reference's with the target's EOS). Keyword arguments
    go to `run_calibration` (max_nodes, candidates, max_new_tokens, context_length, repeats, progress).
    """
    kwargs.setdefault("progress", True)
    result = run_calibration(model, tokenizer, head, prompts, **kwargs)
    if save:
        save_calibration(result)
    return result.to_tree_config()


def tuned_tree_config(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, refresh: bool = False,
                      **kwargs) -> TreeConfig:
    """The cached calibration's TreeConfig for this machine, target and head; calibrates (and caches) when there
    is none or `refresh=True`."""
    if not refresh:
        cached = cached_calibration(model, head)
        if cached is not None:
            return cached.to_tree_config()
    return calibrate(model, tokenizer, head, prompts, **kwargs)
