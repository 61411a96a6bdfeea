"""Training a DART head for a Hugging Face causal LM: data split, head set-up, the loop, evaluation, checkpoints.

`train(TrainConfig(...))` (or `dart-spec train ...`) reads token shards (`dart_train.data`), runs the target on the
fly for hidden states and teacher logits (`dart_train.features`), and optimises the head with the multi-anchor
training forward and the gamma-weighted forward-KL loss (`dart_train.loss`). Everything that decides the result
(weights, data order, anchors) follows from `seed` and the step number, so a resumed run reproduces an uninterrupted
one exactly.

Output directory:
  head/                   the final head (DartHead.save_pretrained; taps recorded; optional n-gram)
  checkpoint-latest/      head weights + trainer_state.pt (optimizer, scheduler, step, RNG states), replaced atomically
  eval.jsonl              one JSON line per evaluation (held-out loss, per-position KL/accuracy, optional tau)
  train.jsonl             one JSON line per `log_every` steps (loss, accuracy, lr, tokens/s, time split)
  train_config.json       the TrainConfig of the run

Multi-process (torchrun): with WORLD_SIZE > 1 the process group is initialised (nccl on CUDA, gloo on CPU), every
rank takes its own `batch_size` sequences of each global step, the head is wrapped in DistributedDataParallel and
only rank 0 writes files. The loss is averaged per rank and DDP averages gradients over ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import statistics
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dart_core import DartConfig, DartHead, Eagle3Head, NGramModel
from dart_core.config import check_float, check_int
from dart_core.errors import DartInputError
from dart_core.io import WEIGHT_DTYPES, atomic_write, set_aside_copies, staged_directory
from dart_runtime.sync import synchronize
from dart_runtime.timing import interleaved_seconds, now
from dart_hf.loop import DartStats
from dart_hf.target import tree_settings
from dart_train.data import read_shards
from dart_train.features import TrainingBatch, collate, target_features
from dart_train.loss import LossOutput, TrainingForward, choose_anchors, dart_loss
from dart_train.vocab import build_draft_vocab

CHECKPOINT_DIR = "checkpoint-latest"
STATE_NAME = "trainer_state.pt"
# what a run trains: a DART head, or the EAGLE3-style baseline drafter (dart_core.eagle3) on the same data and loss
HEAD_CLASSES = {"dart": DartHead, "eagle3": Eagle3Head}
# the most times one data directory's windows enter an epoch (`data_weights`): past it a weight is a typo; the repeats
# are never materialised (`WeightedOrder`), so memory does not depend on the weights
MAX_DATA_WEIGHT = 10_000
MAX_SEED = 2**64 - 1  # torch's generators take 0..2**64-1; seeds derived from `seed` are reduced modulo 2**64
# what a checkpoint's data order and held-out split are (`DATA_ORDER` in its trainer state): 2 = the held-out split by
# content (`heldout_mask`) and the lazily permuted, weighted epochs of `WeightedOrder`. A checkpoint of another
# order is not resumed: its held-out sequences and windows to come would differ from those it was trained with.
DATA_ORDER = 2
# fields that must match when resuming (they decide shapes, data order and the held-out split)
RESUME_FIXED = ("mode", "target", "data", "data_weights", "draft_length", "draft_vocab_size", "intermediate_size", "seq_len",
                "batch_size", "anchors_per_seq", "seed", "heldout_fraction", "init_from")


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run (the `dart-spec train` flags; see README "Training").

    Sequences longer than `seq_len` are split into consecutive windows of `seq_len` tokens (each window is a
    separate sample; its prompt_length is what remains of the prompt inside it); windows with no response token to
    predict are dropped. `batch_size` is per process. `steps` counts optimizer steps. `mode` "eagle3" trains the
    EAGLE3-style baseline (D+1 unrolled steps instead of mask rows); `init_from` may then name a DART head, whose
    weights it starts from.
    """

    mode: str = "dart"
    target: str = "smollm2"
    data: list[str] = dataclasses.field(default_factory=list)
    # windows of data[i] enter each epoch data_weights[i] times (None: once each); the held-out split is unchanged
    data_weights: Optional[list[int]] = None
    out: str = "runs/dart-head"
    draft_length: int = 8
    draft_vocab_size: int = 8192
    intermediate_size: Optional[int] = None  # default: the target's intermediate_size
    seq_len: int = 512
    batch_size: int = 1
    anchors_per_seq: int = 32
    gamma: float = 0.6
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    steps: int = 1000
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_sequences: int = 64
    tau_prompts: int = 4
    tau_max_new_tokens: int = 64
    tau_every_evals: int = 0  # also measure tau every K evaluations (0: only at the end)
    checkpoint_every: int = 200
    log_every: int = 10
    seed: int = 0
    heldout_fraction: float = 0.02
    init_from: Optional[str] = None
    init_lm_head_from_target: bool = False  # True: lm_head starts from the target's rows (no gain measured)
    save_dtype: str = "float32"
    ngram: bool = False
    ngram_order: int = 3
    device: str = "auto"
    target_dtype: Optional[str] = None  # the target's weights: default bfloat16 on CUDA, float32 on the CPU
    # the head's forward/backward: "bfloat16" (autocast; float32 weights, optimizer, loss), "float32", or None: bfloat16
    # on CUDA; on the CPU whichever runs the head's step on the first batch faster (`Trainer.measure_head_precision`)
    head_precision: Optional[str] = None
    resume: bool = False
    force: bool = False  # start afresh in an `out` that holds a run (its head, checkpoint and logs are removed)
    stop_at: Optional[int] = None  # stop after this step (checkpoint written), e.g. for time-boxed jobs
    time_budget: Optional[float] = None  # seconds for the whole run: `steps` is fitted to it (see Trainer.run)
    max_skipped_steps: int = 10  # consecutive steps with a non-finite loss or gradient before the run stops
    progress: bool = True

    def validate(self) -> None:
        if not self.data:
            raise DartInputError("no training data: give at least one data directory")
        positive = ("draft_length", "draft_vocab_size", "seq_len", "batch_size", "anchors_per_seq", "steps",
                    "eval_every", "checkpoint_every", "log_every", "ngram_order", "max_skipped_steps")
        for name in positive:
            check_int("TrainConfig", name, getattr(self, name))
        for name in ("warmup_steps", "eval_sequences", "tau_prompts", "tau_max_new_tokens", "tau_every_evals"):
            check_int("TrainConfig", name, getattr(self, name), minimum=0)
        check_int("TrainConfig", "intermediate_size", self.intermediate_size, optional=True)
        if self.data_weights is not None:
            if not isinstance(self.data_weights, (list, tuple)) or len(self.data_weights) != len(self.data):
                raise DartInputError(f"data_weights must give one weight per data directory ({len(self.data)}), "
                                     f"got {self.data_weights!r}")
            for weight in self.data_weights:
                check_int("TrainConfig", "data_weights", weight)
                if weight > MAX_DATA_WEIGHT:
                    raise DartInputError(f"data_weights must be at most {MAX_DATA_WEIGHT} (times a directory's "
                                         f"windows enter each epoch), got {weight}")
        check_int("TrainConfig", "seed", self.seed, minimum=0)
        if self.seed > MAX_SEED:
            raise DartInputError(f"seed must be in 0..2**64-1, got {self.seed}")
        if self.seq_len < 3:
            raise DartInputError(f"seq_len must be >= 3 (a prediction needs two tokens of context), got {self.seq_len}")
        for name, lo, hi in (("gamma", 0.0, 1.0), ("heldout_fraction", 0.0, 0.5)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and lo <= value <= hi):
                raise DartInputError(f"{name} must be in [{lo}, {hi}], got {value!r}")
        for name in ("lr", "grad_clip"):
            check_float("TrainConfig", name, getattr(self, name), strict=True)
        check_float("TrainConfig", "weight_decay", self.weight_decay)
        if self.mode not in HEAD_CLASSES:
            raise DartInputError(f"mode must be one of {', '.join(HEAD_CLASSES)}, got {self.mode!r}")
        if self.target_dtype is not None and self.target_dtype not in WEIGHT_DTYPES:
            raise DartInputError(f"target_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.target_dtype!r}")
        if self.save_dtype not in WEIGHT_DTYPES:
            raise DartInputError(f"save_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.save_dtype!r}")
        if self.stop_at is not None and self.stop_at < 1:
            raise DartInputError(f"stop_at must be >= 1, got {self.stop_at!r}")
        if self.time_budget is not None:
            check_float("TrainConfig", "time_budget", self.time_budget, strict=True)
        if self.head_precision not in (None, "float32", "bfloat16"):
            raise DartInputError(f"head_precision must be float32 or bfloat16, got {self.head_precision!r}")
        for d in self.data:
            if not isinstance(d, (str, os.PathLike)):
                raise DartInputError(f"data must name directories, got {d!r}")
            if not os.path.isdir(d):
                raise FileNotFoundError(f"data directory not found: {d}")
        named: dict[str, str] = {}
        for d in self.data:  # the same directory twice would be one data set counted twice, not two
            real = os.path.realpath(d)
            if real in named:
                raise DartInputError(f"data names the directory {real} twice ({named[real]!r} and {str(d)!r}): give "
                                     "each directory once; data weights (--data-weights) repeat one")
            named[real] = str(d)
        resolve_device(self.device)
        if self.resume and self.force:
            raise DartInputError("--resume continues the run in --out and --force replaces it: give one")
        existing = run_files(Path(self.out))
        if existing and not (self.resume or self.force):
            raise FileExistsError(f"{self.out} already holds a training run ({', '.join(existing)}): --resume "
                                  "continues it, --force replaces it (its head, checkpoint and logs are deleted)")
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise FileNotFoundError(f"--init-from head directory not found: {self.init_from}")


# what a run writes into its output directory (`--force` removes these, nothing else)
RUN_FILES = ("head", CHECKPOINT_DIR, "train_config.json", "train.jsonl", "eval.jsonl")


def run_files(out: Path) -> list[str]:
    """The names of RUN_FILES present in `out`, and the holders of old copies an interrupted swap of the head or
    checkpoint left beside them (`dart_core.io.set_aside_copies`)."""
    present = [name for name in RUN_FILES if (out / name).exists()]
    aside = [os.path.relpath(os.path.dirname(p), out) for name in ("head", CHECKPOINT_DIR)
             for p in set_aside_copies(out / name)]
    return present + aside


def clear_run(out: Path) -> None:
    """Remove a previous run's files from `out` (for `force`)."""
    for name in run_files(out):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# ---- target -----------------------------------------------------------------------------------------------------
def load_target(spec: str, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
                with_tokenizer: bool = False):
    """(model, tokenizer or None) for "smollm2" or a local transformers model directory; eval mode, frozen."""
    if spec == "smollm2":
        from dart_hf import load_smollm2

        model, tokenizer = load_smollm2()
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target not found: {spec} is not 'smollm2' or a model directory with config.json")
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                         attn_implementation="sdpa")
        except ValueError as err:  # transformers' word for a config or weights it cannot use
            raise DartInputError(f"target {spec}: not a causal LM transformers can load "
                                 f"({' '.join(str(err).split())[:300]})") from err
        tokenizer = None
        if with_tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as err:
                raise FileNotFoundError(f"no tokenizer in target directory {spec} ({err})") from err
    if dtype is not None:
        model.to(dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


# ---- data -------------------------------------------------------------------------------------------------------
def load_sequences(data_dirs: list[str], counts: Optional[list] = None) -> list[tuple[np.ndarray, int]]:
    """Every (tokens, prompt_length) of every shard of `data_dirs`, in order; `counts`, when given, receives the
    number of sequences of each directory."""
    out = []
    for d in data_dirs:
        before = len(out)
        out.extend((np.asarray(t, dtype=np.int64), int(p)) for t, p in read_shards(d))
        if counts is not None:
            counts.append(len(out) - before)
    if not out:
        raise DartInputError(f"the data directories {data_dirs} hold no sequences")
    return out


def content_keys(tokens: list[np.ndarray]) -> np.ndarray:
    """uint64 [n]: a hash of each sequence's token ids, its content alone (not its place, file or directory)."""
    return np.array([int.from_bytes(hashlib.blake2b(np.ascontiguousarray(t, dtype=np.int64).tobytes(),
                                                    digest_size=8).digest(), "little") for t in tokens],
                    dtype=np.uint64)


def heldout_mask(tokens: list[np.ndarray], fraction: float) -> np.ndarray:
    """bool [n]: sequence i (its token ids `tokens[i]`) is held out when a hash of its content falls below `fraction`
    (deterministic, seed-free).

    The split is by content, never by place: every copy of a sequence (the same data given twice, a directory and a
    copy of it, an answer distilled twice) falls on the same side, so no held-out sequence is ever also a training
    sequence. With fraction > 0 and at least two distinct sequences, at least one is held out (the content with the
    smallest hash, all its copies)."""
    keys = content_keys(tokens)
    mask = keys.astype(np.float64) / 2.0**64 < fraction
    if fraction > 0 and not mask.any() and len(np.unique(keys)) >= 2:
        mask = keys == keys.min()
    return mask


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (a well-spread 64-bit hash of a 64-bit value)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` of every element of a uint64 array (products wrap modulo 2**64, as in `_mix64`)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A seeded bijection of range(n), evaluated at any positions without a table (memory does not grow with n): a
    6-round Feistel network on the smallest even number of bits that holds n, applied again to any value >= n until
    it lands below n (cycle walking keeps it a bijection of range(n); fewer than 4 passes on average)."""

    ROUNDS = 6

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.low = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(_mix64((key + (r + 1) * 0x9E3779B97F4A7C15) & _MASK64)) for r in range(self.ROUNDS)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.low
        for key in self.keys:
            left, right = right, left ^ (_mix64_array(right ^ key) & self.low)
        return (left << half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """int64 array: the images of `positions` (ints in range(n))."""
        out = self._network(np.asarray(positions, dtype=np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._network(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def _derived_key(seed: int, *parts: int) -> int:
    """A 64-bit key of `seed` and `parts` (an epoch, a purpose): any seed in 0..2**64-1, no overflow."""
    key = _mix64(seed & _MASK64)
    for part in parts:
        key = _mix64((key ^ part) + 0x9E3779B97F4A7C15 & _MASK64)
    return key


class WeightedOrder:
    """Which training windows each global step takes: a pure function of (seed, step), computed as it is needed.

    An epoch holds every window of block i (one data directory's windows, consecutive indices) `weight` times: a
    virtual list of sum(count * weight) entries that is never built. It is permuted with a seeded `Permutation`
    (one per epoch), cut into groups of 64 batches, each group sorted by window length (little padding) and cut into
    batches of `per` windows, and the batches are taken in a second seeded permutation's order. Only the group of
    the batch asked for is built, so memory follows the windows and the group size, never the weights. An epoch has
    max(1, entries // per) batches (an epoch smaller than one batch repeats windows; the remainder is left out)."""

    GROUP_BATCHES = 64

    def __init__(self, lengths: np.ndarray, blocks: list[tuple[int, int, int]], per: int, seed: int) -> None:
        blocks = [(int(start), int(count), int(weight)) for start, count, weight in blocks if count > 0]
        if not blocks:
            raise ValueError("no training windows to order")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.per, self.seed = int(per), int(seed)
        self.window_start = np.array([b[0] for b in blocks], dtype=np.int64)
        self.count = np.array([b[1] for b in blocks], dtype=np.int64)
        sizes = [count * weight for _, count, weight in blocks]
        self.entry_end = np.cumsum(np.array(sizes, dtype=np.int64))
        self.entry_start = self.entry_end - np.array(sizes, dtype=np.int64)
        self.entries = int(sum(sizes))
        self.batches = max(1, self.entries // self.per)
        self._groups: dict[tuple[int, int], np.ndarray] = {}

    def window_of(self, entries: np.ndarray) -> np.ndarray:
        """The window index of each virtual entry (block i's entries cycle through its windows)."""
        block = np.searchsorted(self.entry_end, entries, side="right")
        return self.window_start[block] + (entries - self.entry_start[block]) % self.count[block]

    def batch(self, step: int) -> np.ndarray:
        """int64 [per]: the window indices of global step `step`."""
        epoch, slot = divmod(int(step), self.batches)
        b = int(Permutation(self.batches, _derived_key(self.seed, epoch, 1))(np.array([slot]))[0])
        group, index = divmod(b, self.GROUP_BATCHES)
        members = self._group(epoch, group)
        return members[index * self.per: (index + 1) * self.per]

    def _group(self, epoch: int, group: int) -> np.ndarray:
        cached = self._groups.get((epoch, group))
        if cached is not None:
            return cached
        size = self.GROUP_BATCHES * self.per
        positions = np.arange(group * size, min((group + 1) * size, self.batches * self.per), dtype=np.int64)
        entries = Permutation(self.entries, _derived_key(self.seed, epoch, 0))(positions % self.entries)
        windows = self.window_of(entries)
        members = windows[np.argsort(self.lengths[windows], kind="stable")]
        if len(self._groups) >= 4:
            self._groups.pop(next(iter(self._groups)))
        self._groups[(epoch, group)] = members
        return members


def split_windows(sequences: list[tuple[np.ndarray, int]], seq_len: int) -> list[tuple[np.ndarray, int]]:
    """Cut sequences into consecutive windows of at most `seq_len` tokens; keep windows with >= 3 tokens and a
    response token at position >= 2 (something to predict)."""
    out = []
    for tokens, prompt in sequences:
        for start in range(0, len(tokens), seq_len):
            window = tokens[start: start + seq_len]
            p = max(0, prompt - start)
            if len(window) >= 3 and max(p, 2) < len(window):
                out.append((window, min(p, len(window))))
    return out


def tau_prompt(tokens: np.ndarray, prompt_length: int, max_prompt: int = 256) -> Optional[np.ndarray]:
    """The prompt of a held-out sequence for the tau measurement (raw text: its first half, at most 64 tokens)."""
    if prompt_length <= 0:
        prompt_length = min(64, len(tokens) // 2)
    if prompt_length < 1 or prompt_length > max_prompt:
        return None
    return tokens[:prompt_length]


# ---- head -------------------------------------------------------------------------------------------------------
def head_dims_for(model) -> dict:
    """The head config fields the target fixes (widths, heads, rope, vocabulary, layer count)."""
    cfg = model.config.get_text_config()
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope_type in ("linear", "llama3") else None
    return dict(hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
                intermediate_size=int(cfg.intermediate_size), rms_norm_eps=float(cfg.rms_norm_eps),
                rope_theta=float(theta), rope_scaling=scaling,
                max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
                vocab_size=int(model.get_input_embeddings().weight.shape[0]),
                num_target_layers=int(cfg.num_hidden_layers))


def build_head(model, cfg: TrainConfig, train_sequences: list[tuple[np.ndarray, int]]) -> DartHead:
    """A fresh head shaped like the target (or `cfg.init_from`), draft vocab from the training data, taps recorded."""
    shape = head_dims_for(model)
    head_class = HEAD_CLASSES[cfg.mode]
    if cfg.init_from is not None:
        head = load_init_head(cfg.init_from, head_class)
        if head.config.num_target_layers is None and head.config.target_layer_ids is None:
            head.config.num_target_layers = shape["num_target_layers"]
        head.config.target_layer_ids = head.config.layer_ids_for(shape["num_target_layers"])
        return head.float()
    vocab = shape["vocab_size"]
    draft_vocab = min(cfg.draft_vocab_size, vocab)
    target_ids, d2t, t2d = build_draft_vocab(train_sequences, vocab, draft_vocab)
    torch.manual_seed(cfg.seed)
    config = DartConfig(
        hidden_size=shape["hidden_size"], intermediate_size=cfg.intermediate_size or shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], vocab_size=vocab, draft_vocab_size=draft_vocab, draft_length=cfg.draft_length,
        target_hidden_size=shape["hidden_size"], rms_norm_eps=shape["rms_norm_eps"],
        rope_theta=shape["rope_theta"], rope_scaling=shape["rope_scaling"],
        max_position_embeddings=shape["max_position_embeddings"], num_target_layers=shape["num_target_layers"])
    head = head_class(config)
    with torch.no_grad():
        if hasattr(head.midlayer, "mask_rep"):
            head.midlayer.mask_rep.normal_(0.0, 1.0)  # like the reference's torch.randn(2H)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        out = model.get_output_embeddings()
        if cfg.init_lm_head_from_target and out is not None and out.weight.shape[1] == config.hidden_size:
            head.lm_head.weight.copy_(out.weight[torch.as_tensor(target_ids)].float())
    return head


def load_init_head(path: str, head_class: type) -> DartHead:
    """The warm-start head of `--init-from`: a head of `head_class`, or an EAGLE3-style drafter built from a DART
    head's weights (minus the mask rows)."""
    if head_class is Eagle3Head:
        saved = DartConfig.from_pretrained(path).extra.get("architectures") or []
        if Eagle3Head.ARCHITECTURE not in saved:
            return Eagle3Head.from_dart_head(DartHead.from_pretrained(path, load_ngram=False))
    return head_class.from_pretrained(path, load_ngram=False)


# ---- schedule, time budget, checkpoints -----------------------------------------------------------------------------
class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient; the weights hold the last finite update."""


# steps the time budget skips before timing (the first steps are slow: allocator, kernel selection) and times
BUDGET_WARMUP_STEPS = {"cuda": 20, "cpu": 3}
BUDGET_TIMED_STEPS = {"cuda": 10, "cpu": 5}
UNFITTED_STEPS = 2**62
TAU_STEP_S = 0.06  # a DART decoding step of a ~100M target, CPU or GPU, for the budget's final reserve


def fit_steps(remaining_s: float, step_s: float, eval_s: float, eval_every: int, done: int) -> int:
    """Total optimizer steps that fit in `remaining_s` seconds after `done` steps: each step costs `step_s`, each
    periodic evaluation (every `eval_every` steps) and the final one cost `eval_s`. At least `done + 1`."""
    more = max(0.0, remaining_s - eval_s) / (step_s + eval_s / eval_every)
    return done + max(1, int(more))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _rng_state() -> dict:
    """The RNG states as tensors and plain data (what `torch.load(weights_only=True)` reads back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                       gauss], "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: Path, head: DartHead, optimizer, scheduler, state: dict) -> None:
    with staged_directory(out / CHECKPOINT_DIR, force=True) as tmp:
        head.save_pretrained(tmp)
        torch.save({**state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": _rng_state()}, Path(tmp) / STATE_NAME)


def find_checkpoint(out: Path) -> Path:
    # set-aside copies: a crash between the two renames of a checkpoint swap
    for path in [out / CHECKPOINT_DIR, *map(Path, set_aside_copies(out / CHECKPOINT_DIR))]:
        if (path / STATE_NAME).is_file():
            return path
    raise FileNotFoundError(f"--resume: no checkpoint in {out / CHECKPOINT_DIR}")


def load_trainer_state(file: Path) -> dict:
    """A checkpoint's trainer state: tensors and plain data only (never code: `weights_only=True`); ValueError
    naming the file when it is corrupt, truncated or not a trainer state."""
    try:
        with warnings.catch_warnings():  # garbage bytes read as an odd pickle protocol warn before they fail
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise DartInputError(f"{file}: not a readable trainer state (it holds objects other than tensors and plain "
                             "data; they are not loaded, since loading them could run code)") from None
    except Exception as err:  # noqa: BLE001 -- corrupt bytes fail inside the unpickler in any way (IndexError, ...)
        raise DartInputError(f"{file}: not a readable trainer state ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else 'truncated'}); delete the checkpoint or "
                             "train without --resume") from None
    need = ("step", "optimizer", "scheduler", "rng", "config")
    if not isinstance(state, dict) or any(k not in state for k in need) or isinstance(state["step"], bool) \
            or not isinstance(state["step"], int) or state["step"] < 0:
        raise DartInputError(f"{file}: not a trainer state of this project (needs {', '.join(need)})")
    return state


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the JSON lines of `path` whose "step" is <= last_step (atomically); a missing file is left alone."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                keep.append(line)
        except (ValueError, AttributeError):
            continue
    with atomic_write(str(path), "w") as fh:
        fh.write("".join(k + "\n" for k in keep))


# ---- distributed ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """"auto" (CUDA when available, else the CPU), "cpu", "cuda" or "cuda:N" -> a device this machine has;
    ValueError naming the problem otherwise."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DartInputError(f"--device {spec}: this machine has no CUDA device (torch {torch.__version__}, "
                                 f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
        index = local_rank if spec == "cuda" else int(spec[5:])
        if index >= torch.cuda.device_count():
            raise DartInputError(f"--device {spec}: there are {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    raise DartInputError(f"--device {spec!r} is not one of auto, cpu, cuda, cuda:N")


def init_distributed(device: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    dev = resolve_device(device, dist.local_rank)
    use_cuda = dev.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(hours=2))
    return dist, dev


def _all_reduce(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.world > 1:
        torch.distributed.all_reduce(t)
    return t


# ---- the loop -----------------------------------------------------------------------------------------------------
class Trainer:
    """One training run. `Trainer(cfg, model=None).run()`; `model` lets callers (tests) pass a loaded target."""

    def __init__(self, cfg: TrainConfig, model=None) -> None:
        cfg.validate()
        self.started = now()  # the time budget counts from here: data and target loading included
        self.cfg = cfg
        # with a time budget, `run` fits the step count (kept by checkpoints); until then the schedule is open-ended
        self.total_steps = cfg.steps if cfg.time_budget is None else UNFITTED_STEPS
        self.resumed_total_steps: Optional[int] = None  # the schedule's end in the checkpoint a run resumed from
        self.dist, self.device = init_distributed(cfg.device)
        self.out = Path(cfg.out)
        counts: list[int] = []
        sequences = load_sequences(cfg.data, counts)
        held = heldout_mask([t for t, _ in sequences], cfg.heldout_fraction)
        self.train_sequences = [s for s, h in zip(sequences, held) if not h]
        self.heldout_sequences = [s for s, h in zip(sequences, held) if h]
        # every training window once, directory by directory; the data weights repeat them in `self.order` alone
        self.train_windows: list[tuple[np.ndarray, int]] = []
        blocks, end = [], 0
        for weight, count in zip(cfg.data_weights or [1] * len(counts), counts):
            mine = [s for s, h in zip(sequences[end: end + count], held[end: end + count]) if not h]
            end += count
            windows = split_windows(mine, cfg.seq_len)
            blocks.append((len(self.train_windows), len(windows), weight))
            self.train_windows.extend(windows)
        self.heldout_windows = split_windows(self.heldout_sequences, cfg.seq_len)[: cfg.eval_sequences]
        if not self.train_windows:
            raise DartInputError(f"no training sequences with tokens to predict in {cfg.data}")
        self.order = WeightedOrder(np.array([len(w) for w, _ in self.train_windows]), blocks,
                                   cfg.batch_size * self.dist.world, cfg.seed)
        on_cuda = self.device.type == "cuda"
        if model is None:
            dtype = WEIGHT_DTYPES[cfg.target_dtype] if cfg.target_dtype else (torch.bfloat16 if on_cuda else None)
            model, _ = load_target(cfg.target, self.device, dtype)
        else:
            model.to(self.device).eval().requires_grad_(False)
        self.model = model
        self.head_precision = cfg.head_precision or ("bfloat16" if on_cuda else None)  # None: measured below
        if self.dist.main:
            if cfg.force and not cfg.resume:
                clear_run(self.out)
            self.out.mkdir(parents=True, exist_ok=True)


        self.start_step = 0
        resume_state = None
        if cfg.resume:
            ckpt = find_checkpoint(self.out)
            resume_state = load_trainer_state(ckpt / STATE_NAME)
            if resume_state.get("data_order") != DATA_ORDER:
                raise DartInputError(f"--resume: the checkpoint in {ckpt} was written by an earlier dart-spec, whose "
                                     "held-out split and data order differ from this one's (its held-out sequences "
                                     "may be training sequences now): train afresh with --force")
            saved = resume_state.get("config", {})
            diff = [k for k in RESUME_FIXED if k in saved and saved[k] != getattr(cfg, k)]
            if diff:
                raise DartInputError("--resume: settings differ from the checkpoint's: "
                                     + ", ".join(f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in diff))
            head = HEAD_CLASSES[cfg.mode].from_pretrained(ckpt, load_ngram=False)
            self.start_step = int(resume_state["step"])
            self.head_precision = self.head_precision or resume_state.get("head_precision")  # as it was trained
            self.resumed_total_steps = int(resume_state.get("total_steps", cfg.steps))
            if cfg.time_budget is None:
                self.total_steps = self.resumed_total_steps
        else:
            head = build_head(model, cfg, self.train_sequences)
        head.to(self.device)
        head.set_input_embeddings(model.get_input_embeddings())
        from dart_hf.target import plan_for

        self.layer_ids = plan_for(model, head).layer_ids
        self.head = head
        # target ids of the draft vocabulary: the teacher logits are taken at these columns
        self.vocab_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=self.device))

        # the n-gram of the training data, attached to the final head; built first so a time budget counts it
        self.ngram = NGramModel.build([t for t, _ in self.train_sequences], order=cfg.ngram_order,
                                      vocab_size=head.config.vocab_size) if cfg.ngram and self.dist.main else None
        self.forward = TrainingForward(head)
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(
                self.forward, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, self.schedule_end()))
        self.evals_done = 0
        if resume_state is not None:
            self.optimizer.load_state_dict(resume_state["optimizer"])
            self.scheduler.load_state_dict(resume_state["scheduler"])
            self.evals_done = int(resume_state.get("evals_done", 0))
            _set_rng_state(resume_state["rng"])
        if self.head_precision is None:
            self.head_precision = self.measure_head_precision()
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.head_precision == "bfloat16"
                         else None)
        if self.dist.main:
            with atomic_write(str(self.out / "train_config.json"), "w") as fh:
                json.dump(dataclasses.asdict(cfg), fh, indent=2)
            if resume_state is not None:  # drop log lines of steps after the checkpoint: they are redone
                for name in ("train.jsonl", "eval.jsonl"):
                    truncate_log(self.out / name, self.start_step)

    def schedule_end(self) -> int:
        """The step the cosine schedule ends at. Until a time budget's first fit, a resumed run keeps its checkpoint's
        schedule (its rate does not jump back to the peak for the steps the budget times)."""
        if self.total_steps == UNFITTED_STEPS and self.resumed_total_steps is not None:
            return self.resumed_total_steps
        return self.total_steps

    # -- data order: a pure function of (seed, step), so resuming needs only the step
    def samples_for(self, step: int) -> list[tuple[np.ndarray, int]]:
        """This process's `batch_size` windows of global step `step`."""
        batch = self.order.batch(step)
        mine = batch[self.dist.rank * self.cfg.batch_size: (self.dist.rank + 1) * self.cfg.batch_size]
        return [self.train_windows[int(i)] for i in mine]

    @property
    def _batches_per_epoch(self) -> int:
        return self.order.batches

    def measure_head_precision(self, margin: float = 0.9) -> str:
        """"bfloat16" when the head's forward and backward on the first batch take at most `margin` of float32's
        time under bfloat16 autocast on this machine (matrix units make it several times faster; elsewhere it can be
        slower), else "float32". Two timed repeats each after a warm-up; the weights are not changed."""
        batch = collate(self.samples_for(self.start_step)).to(self.device)
        with torch.no_grad():
            aux, teacher = target_features(self.model, self.layer_ids, batch.input_ids, batch.attention_mask,
                                           self.vocab_ids)
        anchors, valid = choose_anchors(batch.lengths.cpu(), batch.prompt_lengths.cpu(), self.cfg.anchors_per_seq,
                                        self.head.config.draft_length, torch.Generator().manual_seed(0))
        anchors, valid = anchors.to(self.device), valid.to(self.device)

        def step(precision) -> None:
            with precision:
                real, blocks = self.forward(aux[:, :-1], batch.input_ids[:, 1:], anchors, batch.lengths - 1)
            dart_loss(real, blocks, teacher, anchors, valid, batch.lengths, batch.prompt_lengths,
                      self.cfg.gamma).loss.backward()

        def clear_grads(*_) -> None:
            self.head.zero_grad(set_to_none=True)

        self.head.train()
        runs = {"float32": functools.partial(step, contextlib.nullcontext()),
                "bfloat16": functools.partial(step, torch.autocast(self.device.type, dtype=torch.bfloat16))}
        times = interleaved_seconds(runs, rounds=2, warmup=1, sync=self.device, after=clear_grads)
        fp32, bf16 = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
        votes = _all_reduce(torch.tensor([float(bf16 <= margin * fp32)], device=self.device), self.dist)
        return "bfloat16" if int(votes.item()) == self.dist.world else "float32"  # every rank alike

    def _anchor_generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(((self.cfg.seed * 1_000_003 + step) * 4099 + self.dist.rank) % 2**64)

    def compute(self, batch: TrainingBatch, generator: torch.Generator) -> tuple[LossOutput, float, float]:
        """Loss of one batch -> (LossOutput, target seconds, head forward seconds)."""
        t0 = now()
        aux, teacher = target_features(self.model, self.layer_ids, batch.input_ids, batch.attention_mask,
                                       self.vocab_ids)
        self._sync()
        t1 = now()
        anchors, valid = choose_anchors(batch.lengths.cpu(), batch.prompt_lengths.cpu(), self.cfg.anchors_per_seq,
                                        self.head.config.draft_length, generator)
        anchors, valid = anchors.to(self.device), valid.to(self.device)
        real_rows = batch.lengths - 1  # row i pairs aux[i] with x[i+1]
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            real, blocks = self.forward(aux[:, :-1], batch.input_ids[:, 1:], anchors, real_rows)
        out = dart_loss(real, blocks, teacher, anchors, valid, batch.lengths, batch.prompt_lengths, self.cfg.gamma)
        return out, t1 - t0, now() - t1

    def train_step(self, step: int) -> dict:
        batch = collate(self.samples_for(step)).to(self.device)
        self.head.train()
        out, t_target, t_fwd = self.compute(batch, self._anchor_generator(step))
        t0 = now()
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
        # a non-finite loss or gradient never reaches the weights or the optimizer state (every rank agrees)
        bad = _all_reduce((~(torch.isfinite(out.loss.detach()) & torch.isfinite(norm))).float()[None], self.dist)
        skipped = bool(bad.item() > 0)
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        t_head = t_fwd + now() - t0
        return {"loss": float(out.loss.detach()), "kl_sum": out.kl_sum, "correct": out.correct, "count": out.count,
                "tokens": batch.num_tokens, "target_s": t_target, "head_s": t_head, "skipped": skipped}

    def _sync(self) -> None:
        synchronize(self.device)  # honest per-phase timings

    @torch.no_grad()
    def evaluate(self) -> Optional[dict]:
        """Held-out loss (same weighting as training) and per-position KL / accuracy; None without held-out data."""
        windows = self.heldout_windows[self.dist.rank:: self.dist.world]
        if not self.heldout_windows:
            return None
        self.head.eval()
        d = self.head.config.draft_length
        kl_sum = torch.zeros(d + 1, dtype=torch.float64)
        correct, count = torch.zeros_like(kl_sum), torch.zeros_like(kl_sum)
        generator = torch.Generator().manual_seed(12345)  # the same anchors at every evaluation
        for i in range(0, len(windows), self.cfg.batch_size):
            batch = collate(windows[i: i + self.cfg.batch_size]).to(self.device)
            out, _, _ = self.compute(batch, generator)
            kl_sum += out.kl_sum.cpu()
            correct += out.correct.cpu()
            count += out.count.cpu()
        sums = _all_reduce(torch.stack((kl_sum, correct, count)).to(self.device), self.dist).cpu()
        kl_sum, correct, count = sums
        mean_kl = kl_sum / count.clamp(min=1)
        weights = self.cfg.gamma ** torch.arange(d + 1, dtype=torch.float64)
        return {"loss": float((weights * mean_kl).sum()), "kl": mean_kl.tolist(),
                "acc": (correct / count.clamp(min=1)).tolist(), "count": count.long().tolist()}

    @torch.no_grad()
    def measure_tau(self) -> Optional[dict]:
        """Tree-decoding tau (tokens per target verify step) on the prompts of a few held-out sequences."""
        import dart_hf

        prompts = [p for p in (tau_prompt(t, pl) for t, pl in self.heldout_sequences) if p is not None]
        prompts = prompts[: self.cfg.tau_prompts]
        if not prompts or not self.cfg.tau_max_new_tokens:
            return None
        self.head.eval()
        model = dart_hf.enable(self.model, False)
        merged, per_prompt = DartStats(), []
        for prompt in prompts:
            ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device)[None]
            model.generate(ids, attention_mask=torch.ones_like(ids), dart_head=self.head, do_sample=False,
                           max_new_tokens=self.cfg.tau_max_new_tokens)
            stats = model.dart_stats
            merged.merge(stats)
            per_prompt.append(stats.tau)
        return {"tau": merged.tau, "tau_per_prompt": per_prompt, "tau_prompts": len(prompts)}

    def _log(self, name: str, record: dict) -> None:
        if self.dist.main:
            with open(self.out / name, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def _eval_and_log(self, step: int, final: bool) -> Optional[dict]:
        record = self.evaluate()
        self.evals_done += 1
        want_tau = final or (self.cfg.tau_every_evals and self.evals_done % self.cfg.tau_every_evals == 0)
        tau = self.measure_tau() if want_tau and self.dist.main else None
        if record is None and tau is None:
            return None
        record = {"step": step, **(record or {}), **(tau or {})}
        self._log("eval.jsonl", record)
        if self.dist.world > 1:
            torch.distributed.barrier()
        return record

    def _checkpoint(self, step: int) -> None:
        if self.dist.main:
            save_checkpoint(self.out, self.head, self.optimizer, self.scheduler,
                            {"step": step, "total_steps": self.total_steps,
                             "samples_seen": step * self.cfg.batch_size * self.dist.world,
                             "evals_done": self.evals_done, "config": dataclasses.asdict(self.cfg),
                             "data_order": DATA_ORDER,
                             "head_precision": self.head_precision})
        if self.dist.world > 1:
            torch.distributed.barrier()

    def run(self) -> dict:
        """Train from `start_step` to `total_steps` (or `stop_at`); returns a summary dict.

        With `time_budget` (`_Budget`), the run times its steps after a warm-up (`BUDGET_WARMUP_STEPS`), fits
        `total_steps` (and so the cosine schedule) to what is left of the budget after every step from
        `BUDGET_TIMED_STEPS` on (`fit_steps`, periodic and final evaluations included), and, should it still run
        late, ends early: the final evaluation and the saved head always come inside the budget.
        """
        from tqdm import tqdm

        cfg = self.cfg
        d = self.head.config.draft_length
        bar = tqdm(total=None if self.total_steps == UNFITTED_STEPS else self.total_steps, initial=self.start_step,
                   desc="train", unit="step",
                   disable=not (cfg.progress and self.dist.main), dynamic_ncols=True)
        window = {"kl_sum": torch.zeros(d + 1, dtype=torch.float64), "correct": torch.zeros(d + 1, dtype=torch.float64),
                  "count": torch.zeros(d + 1, dtype=torch.float64), "loss": 0.0, "n": 0, "tokens": 0,
                  "target_s": 0.0, "head_s": 0.0, "skipped": 0, "t0": now()}
        budget = _Budget(self) if cfg.time_budget is not None else None
        last_eval, losses, skipped_total, skipped_in_a_row = None, [], 0, 0
        step = self.start_step
        def end() -> int:  # the time budget may move total_steps
            return min(self.total_steps, cfg.stop_at) if cfg.stop_at is not None else self.total_steps

        while step < end():
            t_step = now()
            result = self.train_step(step)
            t_step = now() - t_step
            step += 1
            losses.append(result["loss"])
            skipped_in_a_row = skipped_in_a_row + 1 if result["skipped"] else 0
            skipped_total += result["skipped"]
            if skipped_in_a_row >= cfg.max_skipped_steps:
                self._checkpoint(step)  # the weights are those of the last finite update
                raise TrainingDiverged(
                    f"{skipped_in_a_row} consecutive steps (up to step {step}) had a non-finite loss or gradient; "
                    f"none of them changed the weights. The checkpoint in {self.out / CHECKPOINT_DIR} holds the last "
                    f"finite state: lower --lr (now {cfg.lr}) or check the data, then --resume")
            if budget is not None and budget.after_step(step, t_step, bar):
                self.total_steps = step  # late: end the schedule here
            for k in ("kl_sum", "correct", "count"):
                window[k] += result[k].cpu()
            for k in ("loss", "tokens", "target_s", "head_s", "skipped"):
                window[k] += result[k]
            window["n"] += 1
            elapsed = now() - window["t0"]
            acc = (window["correct"] / window["count"].clamp(min=1)).tolist()
            tok_s = window["tokens"] * self.dist.world / max(elapsed, 1e-9)
            bar.set_postfix_str(f"loss {window['loss'] / window['n']:.3f} acc " +
                                "/".join(f"{a:.2f}" for a in acc[:3]) + f" {tok_s:.0f} tok/s"
                                + (f" skipped {skipped_total}" if skipped_total else ""))
            bar.update(1)
            if step % cfg.log_every == 0 or step == end():
                self._log("train.jsonl", {"step": step, "loss": window["loss"] / window["n"], "acc": acc,
                                          "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tok_s,
                                          "target_s_per_step": window["target_s"] / window["n"],
                                          "head_s_per_step": window["head_s"] / window["n"],
                                          "skipped_steps": window["skipped"], "total_steps": self.total_steps,
                                          "head_precision": self.head_precision})
                window.update(kl_sum=window["kl_sum"] * 0, correct=window["correct"] * 0,
                              count=window["count"] * 0, loss=0.0, n=0, tokens=0, target_s=0.0, head_s=0.0,
                              skipped=0, t0=now())
            if step % cfg.eval_every == 0 and step != self.total_steps:
                t_eval = now()
                last_eval = self._eval_and_log(step, final=False)
                if budget is not None:
                    budget.evaluated(now() - t_eval)
                if last_eval is not None and self.dist.main:
                    bar.write(f"step {step}: held-out loss {last_eval.get('loss', float('nan')):.4f} acc "
                              + "/".join(f"{a:.2f}" for a in last_eval.get("acc", [])[:4]))
            epoch_done = step % self._batches_per_epoch == 0
            if step % cfg.checkpoint_every == 0 or step == end() or epoch_done:
                self._checkpoint(step)
            if epoch_done and self.dist.main:  # kept apart from the rolling checkpoint: an epoch's end survives
                self.save_head(self.out / f"head-epoch-{step // self._batches_per_epoch}")
        bar.close()
        summary = {"step": step, "losses": losses, "out": str(self.out), "skipped_steps": skipped_total}
        if step == self.total_steps:
            if self.head.tree_config is None:  # the search settings travel with the head; EOS is the target's
                self.head.tree_config = tree_settings(self.head, self.model.generation_config)
            if self.ngram is not None:
                self.head.ngram = self.ngram
            summary["eval"] = self._eval_and_log(step, final=True)
            if self.dist.main:
                self.save_head(self.out / "head")
            summary["head"] = str(self.out / "head")
            if cfg.time_budget is not None:
                summary["seconds"] = now() - self.started
        if self.dist.world > 1:
            torch.distributed.barrier()
        return summary

    def save_head(self, dest: Path) -> None:
        with staged_directory(dest, force=True) as tmp:
            self.head.save_pretrained(tmp, dtype=WEIGHT_DTYPES[self.cfg.save_dtype])


class _Budget:
    """The time budget of one `Trainer.run`: times the steps after a warm-up, fits `total_steps` to the time left
    after every step from then on (so the cosine schedule follows the measured pace), and says when the run must end
    to finish (final evaluation, n-gram, saved head) inside the budget."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        kind = "cuda" if trainer.device.type == "cuda" else "cpu"
        self.first_timed = trainer.start_step + BUDGET_WARMUP_STEPS[kind]
        self.last_timed = self.first_timed + BUDGET_TIMED_STEPS[kind]
        self.deadline = trainer.started + trainer.cfg.time_budget
        self.timed_s, self.timed_steps, self.all_s = 0.0, 0, 0.0
        self.eval_s: Optional[float] = None  # measured at the first periodic evaluation
        # after the final evaluation: the tau measurement (at most TAU_STEP_S a decoding step) and saving
        cfg = trainer.cfg
        self.extras_s = 0.05 * cfg.time_budget + TAU_STEP_S * cfg.tau_prompts * cfg.tau_max_new_tokens

    def evaluated(self, seconds: float) -> None:
        self.eval_s = seconds

    def after_step(self, step: int, step_s: float, bar) -> bool:
        """Called after each step (`step` steps done, the last took `step_s` s); True when the run must end now."""
        trainer, cfg, at = self.trainer, self.trainer.cfg, now()
        self.all_s += step_s
        if step > self.first_timed:
            self.timed_s += step_s
            self.timed_steps += 1
        timed = step >= self.last_timed
        # before the timed steps are in, the (slower) warm-up steps stand in for the pace
        mean_s = self.timed_s / self.timed_steps if timed else self.all_s / (step - trainer.start_step)
        eval_batches = math.ceil(min(cfg.eval_sequences, len(trainer.heldout_windows)) / cfg.batch_size)
        eval_s = self.eval_s if self.eval_s is not None else eval_batches * mean_s  # the target forward dominates both
        if timed:
            first_fit = trainer.total_steps == UNFITTED_STEPS
            trainer.total_steps = fit_steps(self.deadline - at - self.extras_s, mean_s, eval_s, cfg.eval_every, step)
            if first_fit:
                trainer._log("train.jsonl", {"step": step, "time_budget_s": cfg.time_budget, "step_s": mean_s,
                                             "fitted_steps": trainer.total_steps})
            bar.total = trainer.total_steps
        return at + mean_s + eval_s + self.extras_s > self.deadline


def train(cfg: TrainConfig, model=None) -> dict:
    """Run one training job (see `Trainer`); returns {"step", "losses", "out", "eval", "head"}."""
    trainer = Trainer(cfg, model=model)
    try:
        return trainer.run()
    finally:
        if trainer.dist.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
