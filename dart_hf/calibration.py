"""What DART's speed decisions start from: a head's acceptance curve and this machine's cost of a verify step.

The tree size each step verifies is decided while DART runs (`dart_hf.controller`); these measurements are its
priors, taken on request (`dart-spec calibrate`, `dart_hf.calibrate`), never by a decoding call.

Acceptance, tau(R): the head and the target only, so it is measured once when a head is made (`measure_acceptance`,
`dart-spec calibrate`, `dart-spec train`) and shipped in the head's config.json (`dart_core.AcceptanceCurve`). The
beam search's pool does not depend on `remain_total`: a tree of R draft nodes is exactly the best R pool entries by
score (`dart_core.tree.score_ranks`), ranks increase along every root-to-leaf path, and greedy verification of the
R-node tree accepts exactly the leading nodes of the R_max tree's accepted path whose rank is < R. One greedy run with
a large tree (R_max = 60) that records these ranks (`DartStats.accepted_ranks`) therefore gives

    tau(R) = 1 + mean over steps of #(leading accepted nodes with rank < R)           (`DartStats.tau_at`)

exactly per step (tested against real R-node runs from the same states); over a run it is an estimate, since a
smaller tree's later steps start elsewhere.

Cost (`MachineCost`): the machine, dtype, threads, target and head, measured on request in a few seconds
(`machine_cost`, one line on stderr) and cached; a controller that finds it predicts untimed tree sizes from it.
`t_verify(k)`: one target forward over k new tokens on a 256-token cache, the way the tree loop runs it (4D tree
mask, tapped hidden states, its kernels), at k = 1, 2, 4, ..., R_max + 1, made non-decreasing in k
(pool-adjacent-violators: a dip is noise) and interpolated linearly; `t_plain`: one plain 1-token forward on the same cache; the head forward, tree search and the rest of a step
(acceptance, cache compaction) per step from a short DART run that decodes its full length whatever the target's EOS
(they hardly depend on R). A measurement that cannot be made (a run without verify steps, a time that is not a
positive number) raises `DartInputError`; nothing empty or absurd is cached.

Cache: `$DART_SPEC_CACHE/machine/` (default `~/.cache/dart-spec/machine/`), one JSON per hash of the device (CPU model
string and core count, or CUDA device name), torch's thread count, the target (config, dtype, attention) and the head
(config, weights, search settings other than `remain_total`). A cache that cannot be read or written (a read-only
home, a path under a regular file) never fails a call: the value lives in memory for the process, after one
`DartCacheWarning`; a file whose values do not validate is ignored with one warning (a later measurement replaces it).

    cost = dart_hf.calibration.machine_cost(model, head)      # measured once per machine setting, then cached
    curve = dart_hf.calibration.measure_acceptance(model, tokenizer, head)   # head.acceptance = curve; save_pretrained
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from dart_core import AcceptanceCurve, DartHead, TreeConfig
from dart_core.cost import FORMAT_VERSION, MachineCost
from dart_core.errors import DartInputError
from dart_core.io import atomic_write, cache_root
from dart_runtime.matmul import adopt_kernel_choices, kernel_choices
from dart_runtime.timing import interleaved_seconds, now
from dart_hf.compat import attention_implementation
from dart_hf.loop import DartStats, dart_decoding, is_enabled, last_stats
from dart_hf.target import (attention_layout, keep_accepted_path, plan_for, sliding_dropped, tree_attention_mask,
                            tree_forward, tree_settings, verify_kernels, whole_sliding_layers)

LATENCY_GRID = (1, 2, 4, 8, 16, 32, 64)
CANDIDATES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60)
# the acceptance curve's prompts; none is a prompt the demo or a benchmark times, so the tree they pick is not fitted
# to the text it is then timed on
DEFAULT_PROMPTS = (
    "Describe how binary search finds a value in a sorted list and what its running time is.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed? Show the steps.",
    "List five tips for writing clear emails.",
)
COST_RUN_TOKENS = 24  # new tokens of the short DART run that times the head, the tree search and the rest of a step
COST_RUN_STEPS = 3  # verify steps that run must make: whatever the head drafts, a step of its 8-node tree yields <= 9


# ---- measurements ----------------------------------------------------------------------------------------------------

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
    layout = attention_layout(model)
    no_nodes = torch.zeros(1, 0, dtype=torch.long, device=device)
    past_columns = torch.ones(1, context_length, dtype=torch.bool, device=device)

    def verify(k: int) -> None:
        chain = torch.ones(1, k, k, dtype=torch.bool, device=device).tril()  # the shape matters, not the tree
        depths = torch.arange(k, device=device)[None]
        mask = tree_attention_mask(chain, past_columns, dtype, depths, layout, sliding_dropped(cache, context_length))
        positions = torch.arange(context_length, context_length + k, device=device)[None]
        tree_forward(model, block[:, :k], positions, mask, cache, tuple(layer_ids)).logits.float()

    def plain() -> None:
        positions = torch.tensor([[context_length]], device=device)
        model(input_ids=block[:, :1], position_ids=positions, past_key_values=cache, use_cache=True)

    runs = {k: functools.partial(verify, k) for k in sizes}
    runs[0] = plain  # the plain 1-token forward, with the model's own kernels
    bar = tqdm(total=(repeats + 1) * len(runs), desc="calibrate: latency", unit="fwd", disable=_disable(progress))

    def compact(*_) -> None:  # the loop's compaction, keeping none of the block
        keep_accepted_path(cache, context_length, no_nodes)
        bar.update()

    try:
        with whole_sliding_layers(cache):  # as in the loop: sliding-window layers keep the blocks until compaction
            model(input_ids=context, past_key_values=cache, use_cache=True)
            # round robin, so that a slow spell of the machine hits every size alike; the first round is a warm-up;
            # each forward of k rows (plain: 0) in the loop's kernels for it, entered outside the clock
            times = interleaved_seconds(runs, repeats, warmup=1, sync=device,
                                        around=functools.partial(verify_kernels, model), after=compact)
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
                   max_new_tokens: int = 64, progress: Optional[bool] = None, **generate_kwargs) -> DartStats:
    """Greedy DART decoding of every prompt ([1, n] ids) with `tree_config` (more `generate()` arguments in
    `generate_kwargs`); the merged statistics."""
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
            # an attached head's generate() would decline another custom_generate: this call is the model's own
            own = {"dart_head": False} if is_enabled(model) else {}
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           custom_generate=decode, **own, **generate_kwargs)
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


def measure_acceptance(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, max_nodes: int = 60,
                       candidates: Optional[Iterable[int]] = None, max_new_tokens: int = 64,
                       progress: Optional[bool] = None) -> AcceptanceCurve:
    """tau(R) of `head` on `model` for each candidate R <= `max_nodes` (the module docstring has the rule), from one
    greedy run with a `max_nodes`-node tree over `prompts` (strings or token ids; default: a few built-in chat
    prompts). Ship it with `head.acceptance = curve; head.save_pretrained(...)`."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    sizes = sorted({int(r) for r in (candidates or CANDIDATES) if 1 <= int(r) <= max_nodes} | {max_nodes})
    plan_for(model, head, tokenizer)
    ids = encode_prompts(tokenizer, DEFAULT_PROMPTS if prompts is None else prompts)
    base = base_tree_config(model, head)
    stats = acceptance_run(model, head, ids, dataclasses.replace(base, remain_total=max_nodes), max_new_tokens,
                           progress)
    if not stats.steps:
        raise ValueError("the acceptance run made no verify step (prompts end at once?); use longer generations")
    name = model.config.name_or_path or type(model).__name__
    return AcceptanceCurve(tau={r: stats.tau_at(r) for r in sizes}, steps=stats.steps, new_tokens=stats.new_tokens,
                           prompts=len(ids), target=str(name), measured=time.strftime("%Y-%m-%d"))


def measurable_context(model, wanted: int, block: int) -> int:
    """`wanted` cache positions, fewer where the target's position limit leaves no room for a `block` of new tokens
    after them; DartInputError where it leaves none."""
    cfg = model.config.get_text_config(decoder=True)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if not isinstance(limit, int):
        return wanted
    room = min(wanted, limit - block - 1)
    if room < 1:
        raise DartInputError(f"the target's {limit} positions leave no room to time a {block}-token verify forward")
    return room


def measure_machine_cost(model, head: DartHead, *, max_nodes: int = 60, context_length: int = 256, repeats: int = 3,
                         progress: Optional[bool] = None) -> MachineCost:
    """Time this machine's verify forwards for k = 1 .. `max_nodes` + 1 tokens and a plain step (`measure_latency`),
    then the rest of a step from a DART run of `COST_RUN_TOKENS` new tokens on fixed random ids (its acceptance does
    not matter; no EOS ends it early). DartInputError when that run makes fewer than `COST_RUN_STEPS` verify steps."""
    t_start = now()
    plan = plan_for(model, head)
    grid = sorted({k for k in LATENCY_GRID if k <= max_nodes + 1} | {max_nodes + 1})
    context_length = measurable_context(model, context_length, max(grid))
    latency, plain_s = measure_latency(model, grid, plan.layer_ids, context_length, repeats, progress)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    tree = dataclasses.replace(base_tree_config(model, head), remain_total=min(8, max_nodes), eos_token_id=None)
    no_eos = dict(eos_token_id=[], pad_token_id=0)  # decode the full length whatever the target's EOS
    acceptance_run(model, head, [prompt], tree, max_new_tokens=4, progress=False, **no_eos)  # warm-up
    stats = acceptance_run(model, head, [prompt], tree, max_new_tokens=COST_RUN_TOKENS, progress=False, **no_eos)
    if stats.steps < COST_RUN_STEPS:
        raise DartInputError(f"the timing run made {stats.steps} verify steps of the {COST_RUN_STEPS} it needs "
                             f"({stats.new_tokens} new tokens)")
    steps = stats.steps
    return MachineCost(
        verify_ms={k: s * 1e3 for k, s in latency.items()}, plain_ms=plain_s * 1e3,
        head_ms=stats.head_time / steps * 1e3, tree_ms=stats.tree_time / steps * 1e3,
        rest_ms=max(stats.verify_time - stats.target_time, 0.0) / steps * 1e3, context_length=context_length,
        seconds=now() - t_start, identity=identity(model, head),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# ---- the cache ---------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """`$DART_SPEC_CACHE/machine` or `~/.cache/dart-spec/machine`."""
    return Path(cache_root()) / "machine"


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


DIGEST_ELEMENTS = 1 << 16  # a tensor's digest reads at most this many of its elements, evenly spaced


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of the tensors' names, dtypes, shapes and up to `DIGEST_ELEMENTS` evenly spaced elements of each (two
    heads trained apart differ in nearly every weight; a whole head's bytes take tens of ms to hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(tensors[name].shape)};".encode())
        t = t[:: -(-t.numel() // DIGEST_ELEMENTS)] if t.numel() > DIGEST_ELEMENTS else t
        h.update(t.to("cpu").contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def target_identity(model) -> str:
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k != "transformers_version"}
    attention = attention_implementation(model.config)
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
    return _digest({"class": type(head).__name__, **head.identity(), "weights": _tensor_digest(head.state_dict()),
                    "ngram": ngram_id, "search": search})


def identity(model, head: DartHead) -> dict:
    """What a machine cost is valid for: device, torch threads, target (dtype included), head (the cache key is its
    hash)."""
    return {"device": device_name(next(model.parameters()).device), "threads": torch.get_num_threads(),
            "target": target_identity(model), "head": head_identity(head, base_tree_config(model, head)),
            "version": FORMAT_VERSION}


def cost_path(ident: dict) -> Path:
    return cache_dir() / f"{_digest(ident)}.json"


class DartCacheWarning(UserWarning):
    """A dart-spec cache file could not be read or written; what it would hold lives in memory for the process."""


_WARNED_PATHS: set[str] = set()  # cache directories already warned about (one warning per directory and process)
_MEMORY: dict[str, dict] = {}  # path -> what could not be written there, for this process


def _warn_once(path: Path, what: str, err: BaseException) -> None:
    directory = str(path.parent)
    if directory not in _WARNED_PATHS:
        _WARNED_PATHS.add(directory)
        warnings.warn(f"dart-spec cannot {what} its cache in {directory} ({type(err).__name__}: {err}); what it "
                      "measures is kept in memory for this process (set DART_SPEC_CACHE to a writable directory)",
                      DartCacheWarning, stacklevel=3)


NO_FILE = object()  # what `read_cache_file` returns where there is nothing to read


def read_cache_file(path: Path) -> object:
    """The JSON value in `path` (or what this process could not write there), or `NO_FILE` when there is none or it
    cannot be read (one `DartCacheWarning` per directory); malformed JSON, or JSON nested too deeply to parse,
    raises ValueError."""
    if str(path) in _MEMORY:
        return _MEMORY[str(path)]
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return NO_FILE
    except (OSError, UnicodeDecodeError) as err:
        _warn_once(path, "read", err)
        return NO_FILE
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("its JSON is nested too deeply to read") from None


def write_cache_file(path: Path, data: dict) -> bool:
    """Write `data` to `path` atomically; where that fails, keep it in memory for the process (one
    `DartCacheWarning` per directory). Returns whether it reached the disk."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(str(path), "w") as fh:
            json.dump(data, fh, indent=2)
    except OSError as err:
        _warn_once(path, "write", err)
        _MEMORY[str(path)] = data
        return False
    _MEMORY.pop(str(path), None)
    return True


# ---- the few-row kernel choices, kept across processes -------------------------------------------------------------
KERNELS_VERSION = 2  # 2: keyed by weight shape (1: by a module's group of shapes)
_KERNELS = {"loaded": False, "saved": 0}  # whether this process adopted the cached choices; how many it last saved
_KERNELS_LOCK = threading.Lock()


def kernel_choices_path() -> Path:
    """Where this machine's few-row kernel choices are kept (one file per CPU and torch version)."""
    machine = {"cpu": device_name(torch.device("cpu")), "torch": torch.__version__}
    return Path(cache_root()) / "kernels" / f"{_digest(machine)}.json"


def load_kernel_choices() -> None:
    """Once per process: adopt the few-row kernel choices an earlier process on this machine made
    (`dart_runtime.matmul.adopt_kernel_choices`), so that its first trees of each size do not try both kernels again.
    A file that is not such choices is ignored with one `DartCacheWarning` (and replaced at the next save)."""
    with _KERNELS_LOCK:
        if _KERNELS["loaded"]:
            return
        _KERNELS["loaded"] = True
        path = kernel_choices_path()
        try:
            raw = read_cache_file(path)
            if raw is not NO_FILE:
                if not isinstance(raw, dict) or raw.get("version") != KERNELS_VERSION:
                    raise ValueError("not a kernel choice file of this version")
                adopt_kernel_choices(raw.get("choices"))
        except ValueError as err:
            warnings.warn(f"ignoring the kernel choices {path}: {err}; they are learned again", DartCacheWarning,
                          stacklevel=3)
        _KERNELS["saved"] = len(kernel_choices())


def save_kernel_choices() -> None:
    """Keep this process's few-row kernel choices for later processes, when it made new ones."""
    choices = kernel_choices()
    with _KERNELS_LOCK:
        if len(choices) <= _KERNELS["saved"]:
            return
        _KERNELS["saved"] = len(choices)
    write_cache_file(kernel_choices_path(), {"version": KERNELS_VERSION, "choices": choices})


def cached_machine_cost(model, head: DartHead, ident: Optional[dict] = None) -> Optional[MachineCost]:
    """The cached cost for this device, thread count, target and head (`ident`: their `identity`, when known), or
    None. A cache file that cannot be read as one is ignored with a warning naming it (measuring again replaces it)."""
    ident = identity(model, head) if ident is None else ident
    path = cost_path(ident)
    try:
        raw = read_cache_file(path)
        result = None if raw is NO_FILE else MachineCost.from_dict(raw)
    except (ValueError, DartInputError) as err:  # json's errors are ValueErrors
        warnings.warn(f"ignoring the machine-cost cache {path}: {err}; calls learn step costs from their own steps "
                      "(`dart-spec calibrate` measures it again)", DartCacheWarning, stacklevel=2)
        return None
    return result if result is not None and result.identity == ident else None


def save_machine_cost(cost: MachineCost) -> Path:
    """Cache `cost` under its identity (in memory for the process where the cache cannot be written)."""
    path = cost_path(cost.identity)
    write_cache_file(path, cost.to_dict())
    return path


def machine_cost(model, head: DartHead, *, refresh: bool = False, progress: Optional[bool] = None,
                 **kwargs) -> MachineCost:
    """The cached cost for this machine, target and head; measured (a few seconds, one line on stderr) and cached
    when there is none or `refresh=True`. Keyword arguments go to `measure_machine_cost`."""
    if not refresh:
        cached = cached_machine_cost(model, head)
        if cached is not None:
            return cached
    device = next(model.parameters()).device
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    print(f"dart-spec: measuring what a verify step costs on this machine ({device_name(device)}, {dtype}, "
          f"{torch.get_num_threads()} threads); once, cached in {cache_dir()}", file=sys.stderr, flush=True)
    cost = measure_machine_cost(model, head, progress=progress, **kwargs)
    save_machine_cost(cost)
    return cost


def calibrate(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, max_nodes: int = 60,
              candidates: Optional[Iterable[int]] = None, max_new_tokens: int = 64, context_length: int = 256,
              repeats: int = 3, progress: Optional[bool] = True):
    """Measure both priors now: the acceptance curve (set as `head.acceptance`; `head.save_pretrained` ships it) and
    this machine's cost (cached); returns the choice they give at batch 1 (a `TreeChoice`, `dart_hf.tree_choice`)."""
    from dart_hf.controller import tree_choice  # (the controller reads this module's measurements)

    head.acceptance = measure_acceptance(model, tokenizer, head, prompts, max_nodes=max_nodes, candidates=candidates,
                                         max_new_tokens=max_new_tokens, progress=progress)
    machine_cost(model, head, refresh=True, progress=progress, max_nodes=max(head.acceptance.tau),
                 context_length=context_length, repeats=repeats)
    return tree_choice(model, head)
