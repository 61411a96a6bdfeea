"""`dart-spec distill`, `dart-spec train` and `dart-spec ngram build`: make training data, train a head, build an n-gram."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from dart_cli.errors import UsageError
from dart_cli.numbers import MAX_SEED, checked, integer, real, seed
from dart_cli.threads import set_threads
from dart_core.errors import DartInputError


# below this a sampling temperature overflows the logits it divides (float32: about 1e-38) long before it differs from
# greedy decoding; numeric options are checked as the command line is parsed (dart_cli.numbers)
MIN_TEMPERATURE = 1e-6


# ---- distill --------------------------------------------------------------------------------------------------------
def add_distill(sub) -> None:
    p = sub.add_parser(
        "distill", help="answer prompts with the target itself and store the tokens as training shards",
        description="Self-distillation data: the target answers each prompt (chat template; greedy unless "
                    "--temperature) and the prompt "
                    "+ answer tokens go to DIR/shard-NNNNN.npz, one shard per batch. Resumable: existing shards are "
                    "skipped. With --text, raw text files are tokenised into shards instead (no generation).")
    p.add_argument("--target", default="smollm2", help="'smollm2' (default) or a local transformers model directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output data directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE.jsonl", help="prompts, one JSON object per line (see --field)")
    src.add_argument("--mixed", metavar="GSM8K.jsonl",
                     help="the built-in mix: GSM8K questions from this file + code + chat prompts")
    src.add_argument("--text", nargs="+", metavar="FILE", help="raw text files to tokenise (paragraph = sequence)")
    p.add_argument("--field", default="prompt", help="JSON field holding the prompt text (default: prompt)")
    p.add_argument("--batch-size", type=integer(1), default=16,
                   help="prompts per generate call and shard (default 16)")
    p.add_argument("--max-new-tokens", type=integer(1), default=256, help="answer length limit (default 256)")
    p.add_argument("--limit", type=integer(1), metavar="N", help="use only the first N prompts")
    p.add_argument("--seed", type=seed(), default=0, help="shuffle seed of --mixed, 0..2**64-1 (default 0)")
    p.add_argument("--temperature", type=real(MIN_TEMPERATURE), metavar="T",
                   help=f"sample the answers at this temperature (>= {MIN_TEMPERATURE:g}) instead of greedy decoding")
    p.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=1.0,
                   help="nucleus of the sampled answers, in (0, 1] (default 1.0)")
    p.add_argument("--sample-seed", type=seed(), default=0,
                   help="sampling seed, 0..2**64-1; batch i draws with seed + i (default 0)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=integer(1), metavar="N", help="torch CPU threads")
    p.set_defaults(run=checked(p, _run_distill), reads=("prompts", "mixed", "text", "target"), writes="out")


def read_prompts(path: str, field: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except UnicodeDecodeError as err:
        raise DartInputError(f"{path}: not UTF-8 text ({err})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DartInputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DartInputError(f"{path}:{number}: no string field {field!r} (choose one with --field)")
        prompts.append(record[field])
    if not prompts:
        raise DartInputError(f"{path}: no prompts")
    return prompts


def _run_distill(args: argparse.Namespace) -> int:
    from dart_train.data import distill, write_text_shards
    from dart_train.trainer import load_target, resolve_device

    set_threads(args.threads)
    device = resolve_device(args.device)
    sampling = None
    if args.temperature is not None:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.sample_seed}
    if args.text:
        missing = [f for f in args.text if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"text file not found: {missing[0]}")
        _, tokenizer = _tokenizer_only(args.target)
        shards = write_text_shards(tokenizer, args.text, args.out)
        print(f"wrote {shards} raw-text shard(s) to {args.out}")
        return 0
    if args.prompts:
        prompts = read_prompts(args.prompts, args.field)
    else:
        if not os.path.isfile(args.mixed):
            raise FileNotFoundError(f"GSM8K file not found: {args.mixed}")
        from dart_train.prompts import mixed_prompts

        prompts = mixed_prompts(args.mixed, seed=args.seed)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    model, tokenizer = load_target(args.target, device, with_tokenizer=True)
    written = distill(model, tokenizer, prompts, args.out, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, sampling=sampling)
    print(f"{len(prompts)} prompts: wrote {written} new shard(s) to {args.out}")
    return 0


def _tokenizer_only(target: str):
    if target == "smollm2":
        from dart_hf import load_smollm2

        return load_smollm2()
    if not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"target not found: {target} is not 'smollm2' or a model directory with config.json")
    from transformers import AutoTokenizer

    try:
        return None, AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no tokenizer in target directory {target} ({err})") from None


# ---- prompts --------------------------------------------------------------------------------------------------------
def add_prompts(sub) -> None:
    p = sub.add_parser(
        "prompts", help="let the target write user turns (prompts without a dataset) into a JSONL file",
        description="The target's chat template with an empty user message, cut where the message's text begins: "
                    "the target samples the user's turn up to the template's end-of-turn token. Turns that do not "
                    "end within --max-new-tokens, short, long, repetitive or undecodable ones and duplicates (case "
                    "and spacing ignored) are dropped; the rest are appended to OUT as {\"prompt\": TEXT} lines "
                    "for `dart-spec distill --prompts OUT`. Resumable: batch i draws with --seed + i and "
                    "OUT.state.json records the progress after each batch, so a rerun continues (a larger --count "
                    "extends the same file).")
    p.add_argument("--target", default="smollm2", help="'smollm2' (default) or a local transformers model directory")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output prompts file (appended to)")
    p.add_argument("--count", type=integer(1), required=True, metavar="N", help="distinct turns to keep in all")
    p.add_argument("--batch-size", type=integer(1), default=32, help="turns sampled per generate call (default 32)")
    p.add_argument("--max-new-tokens", type=integer(1), default=128, help="longest turn in tokens (default 128)")
    p.add_argument("--temperature", type=real(MIN_TEMPERATURE), default=1.0,
                   help=f"sampling temperature, >= {MIN_TEMPERATURE:g} (default 1.0)")
    p.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=0.95,
                   help="nucleus, in (0, 1] (default 0.95)")
    p.add_argument("--seed", type=seed(), default=0, help="0..2**64-1; batch i draws with seed + i (default 0)")
    p.add_argument("--min-chars", type=integer(1), default=16, help="shortest turn kept, in characters (default 16)")
    p.add_argument("--max-chars", type=integer(1), default=1500,
                   help="longest turn kept, in characters (default 1500)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=integer(1), metavar="N", help="torch CPU threads")
    p.set_defaults(run=checked(p, _run_prompts), reads=("target",), writes="out")


def _run_prompts(args: argparse.Namespace) -> int:
    from dart_train.trainer import load_target, resolve_device
    from dart_train.user_turns import write_user_turns

    set_threads(args.threads)
    if args.max_chars < args.min_chars:
        raise UsageError(f"--max-chars {args.max_chars} is below --min-chars {args.min_chars}: no turn could be kept")
    device = resolve_device(args.device)
    model, tokenizer = load_target(args.target, device, with_tokenizer=True)
    state = write_user_turns(model, tokenizer, args.out, count=args.count, batch_size=args.batch_size,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed, min_chars=args.min_chars, max_chars=args.max_chars,
                             progress=True)
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(state["dropped"].items())) or "none"
    print(f"{args.out}: {state['kept']} turns from {state['batches']} batches (dropped: {dropped})")
    return 0 if state["kept"] >= args.count else 1


# ---- train ----------------------------------------------------------------------------------------------------------
def add_train(sub) -> None:
    from dart_core.io import WEIGHT_DTYPES
    from dart_train.trainer import MAX_DATA_WEIGHT, TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train", help="train a DART head on token shards (single process or torchrun)",
        description="Train a DART draft head for a transformers causal LM: target hidden states and logits are "
                    "computed on the fly, the head learns all D+1 positions of many anchors per sequence in one "
                    "pass (gamma-weighted forward KL). Writes OUT/head, OUT/checkpoint-latest, OUT/eval.jsonl. "
                    "Multi-GPU: torchrun --nproc_per_node N -m dart_cli.main train ...")
    p.add_argument("--mode", choices=("dart", "eagle3"), default=d.mode,
                   help="dart (default): a DART head; eagle3: the EAGLE3-style baseline drafter (benchmarks)")
    p.add_argument("--target", default=d.target, help="'smollm2' (default) or a local transformers model directory")
    p.add_argument("--data", nargs="+", required=True, metavar="DIR", help="data directories with shard-*.npz")
    p.add_argument("--data-weights", type=integer(1, MAX_DATA_WEIGHT), nargs="+", metavar="N",
                   help=f"one integer per --data directory, 1..{MAX_DATA_WEIGHT}: its training windows enter every "
                        "epoch N times (default 1 each; no copies are made; the held-out split does not change)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--draft-length", type=integer(1), default=d.draft_length,
                   help=f"D, mask rows (default {d.draft_length})")
    p.add_argument("--draft-vocab-size", type=integer(1), default=d.draft_vocab_size,
                   help=f"most frequent target tokens the head predicts (default {d.draft_vocab_size}, clamped to "
                        "the target vocab)")
    p.add_argument("--intermediate-size", type=integer(1), help="head MLP width (default: the target's)")
    p.add_argument("--seq-len", type=integer(3), default=d.seq_len,
                   help=f"tokens per sample; longer sequences are split into windows (default {d.seq_len})")
    p.add_argument("--batch-size", type=integer(1), default=d.batch_size, help=f"sequences per step and process "
                                                                         f"(default {d.batch_size})")
    p.add_argument("--anchors", type=integer(1), default=d.anchors_per_seq, dest="anchors_per_seq",
                   help=f"anchors (mask-row blocks) per sequence (default {d.anchors_per_seq})")
    p.add_argument("--gamma", type=real(0.0, 1.0), default=d.gamma,
                   help=f"loss weight decay per position, in [0, 1] (default {d.gamma})")
    p.add_argument("--lr", type=real(0.0, low_open=True), default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--weight-decay", type=real(0.0), default=d.weight_decay, help="AdamW weight decay (default 0)")
    p.add_argument("--warmup-steps", type=integer(0), default=d.warmup_steps, help=f"default {d.warmup_steps}")
    p.add_argument("--steps", type=integer(1), default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--grad-clip", type=real(0.0, low_open=True), default=d.grad_clip,
                   help=f"gradient norm clip (default {d.grad_clip})")
    p.add_argument("--eval-every", type=integer(1), default=d.eval_every, help=f"default {d.eval_every}")
    p.add_argument("--eval-sequences", type=integer(0), default=d.eval_sequences,
                   help=f"held-out windows per evaluation (default {d.eval_sequences})")
    p.add_argument("--tau-prompts", type=integer(0), default=d.tau_prompts,
                   help=f"held-out prompts for the tree-decoding tau measurement (default {d.tau_prompts}; 0: off)")
    p.add_argument("--tau-max-new-tokens", type=integer(0), default=d.tau_max_new_tokens,
                   help=f"default {d.tau_max_new_tokens}")
    p.add_argument("--tau-every-evals", type=integer(0), default=d.tau_every_evals,
                   help="also measure tau every K evaluations (default 0: at the end only)")
    p.add_argument("--checkpoint-every", type=integer(1), default=d.checkpoint_every,
                   help=f"default {d.checkpoint_every}")
    p.add_argument("--log-every", type=integer(1), default=d.log_every,
                   help=f"train.jsonl interval (default {d.log_every})")
    p.add_argument("--seed", type=seed(), default=d.seed, help=f"0..2**64-1 (default {d.seed})")
    p.add_argument("--heldout-fraction", type=real(0.0, 0.5), default=d.heldout_fraction,
                   help=f"sequences held out for evaluation, in [0, 0.5], by a hash of their tokens (copies fall on "
                        f"one side; default {d.heldout_fraction})")
    p.add_argument("--init-from", metavar="HEAD_DIR", help="warm start from a head directory (e.g. converted EAGLE3; with --mode eagle3 also a DART head)")
    p.add_argument("--lm-head-from-target", action="store_true", dest="init_lm_head_from_target",
                   help="start lm_head from the target's output rows of the draft vocabulary (default: random)")
    p.add_argument("--save-dtype", choices=tuple(WEIGHT_DTYPES), default=d.save_dtype,
                   help="dtype of OUT/head weights (default float32)")
    p.add_argument("--ngram", action="store_true", help="attach a 3-gram of the training data to OUT/head")
    p.add_argument("--ngram-order", type=integer(1), default=d.ngram_order, help=f"default {d.ngram_order}")
    p.add_argument("--device", default=d.device, help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--target-dtype", choices=tuple(WEIGHT_DTYPES),
                   help="dtype of the target's weights (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--head-precision", choices=("float32", "bfloat16"),
                   help="the head's forward/backward: bfloat16 autocast (float32 weights, optimizer and loss) or "
                        "float32 (default: bfloat16 on CUDA, and on a CPU where a head-sized bfloat16 product measures "
                        "faster than float32)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint-latest")
    p.add_argument("--force", action="store_true",
                   help="start afresh in an OUT that holds a run (deletes its head, checkpoint and logs)")
    p.add_argument("--stop-at", type=integer(1, None), metavar="STEP", help="stop after this step (checkpoint written)")
    p.add_argument("--time-budget", type=real(0.0, low_open=True), metavar="SECONDS",
                   help="seconds for the whole run, loading included: the step count (and so the cosine schedule) "
                        "is fitted to it after a timed warm-up, replacing --steps; the run always ends with the "
                        "final evaluation and a saved head")
    p.add_argument("--max-skipped-steps", type=integer(1), default=d.max_skipped_steps,
                   help="stop after this many consecutive steps with a non-finite loss or gradient (such steps "
                        f"never change the weights; default {d.max_skipped_steps})")
    p.add_argument("--threads", type=integer(1), metavar="N", help="torch CPU threads")
    p.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")
    p.set_defaults(run=checked(p, _run_train), reads=("data", "target", "init_from"), writes="out")


def _run_train(args: argparse.Namespace) -> int:
    from dart_train.trainer import TrainConfig, TrainingDiverged, train

    set_threads(args.threads)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    cfg.validate()  # before loading the target: bad input fails fast
    try:
        summary = train(cfg)
    except TrainingDiverged as err:
        print(f"dart-spec train: stopped: {err}", file=sys.stderr)
        return 1
    if "head" in summary:
        ev = summary.get("eval") or {}
        extra = "".join(f", {k} {ev[k]:.3f}" for k in ("loss", "tau") if k in ev)
        if summary.get("skipped_steps"):
            extra += f", {summary['skipped_steps']} step(s) skipped (non-finite loss or gradient)"
        if "seconds" in summary:
            extra += f", {summary['seconds']:.0f} s of a {cfg.time_budget:.0f} s budget"
        print(f"step {summary['step']}: wrote {summary['head']}{extra}")
    else:
        print(f"stopped at step {summary['step']}; checkpoint in {summary['out']}")
    return 0


# ---- ngram ----------------------------------------------------------------------------------------------------------
def add_ngram(sub) -> None:
    p = sub.add_parser("ngram", help="build the n-gram prior of the tree search",
                       description="N-gram files for the draft-tree search.")
    kinds = p.add_subparsers(dest="ngram_kind", metavar="KIND")
    kinds.required = True
    b = kinds.add_parser("build", help="count n-grams of token shards, raw text and/or the target's own samples "
                                       "into a .safetensors file",
                         description="Count every n-gram (n <= order) of the sequences in the data directories "
                                     "(prompt and answer tokens), of raw text files (tokenised with --target's "
                                     "tokenizer) and of --generate continuations the --target model samples (prompt "
                                     "and continuation tokens) into this project's n-gram file. With --target, the "
                                     "file records its tokenizer's fingerprint, and the table is refused for another "
                                     "tokenizer.")
    b.add_argument("--data", nargs="+", default=[], metavar="DIR", help="data directories with shard-*.npz")
    b.add_argument("--text", nargs="+", default=[], metavar="FILE", help="raw text files (need --target)")
    b.add_argument("--target", help="'smollm2' or a model directory: the tokenizer (recorded in OUT), the model of "
                                    "--generate, the default --vocab-size")
    b.add_argument("--out", required=True, metavar="FILE.safetensors", help="output file")
    b.add_argument("--order", type=integer(1), default=3, help="n-gram order (default 3)")
    b.add_argument("--vocab-size", type=integer(1), metavar="N", help="token ids must lie below N (default: the "
                                                                      "target's vocab with --target, else max id + 1)")
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    gen = b.add_argument_group("the target's own samples (--generate)")
    gen.add_argument("--generate", type=integer(1), metavar="N",
                     help="sample N continuations with the --target model (plain generate(), chat template), "
                          "continuation i answering prompt i modulo the number of prompts")
    gen.add_argument("--prompts", metavar="FILE",
                     help="the prompts of --generate: JSON lines with a \"prompt\" key, or one prompt per line")
    gen.add_argument("--temperature", type=real(MIN_TEMPERATURE), metavar="T",
                     help=f"sampling temperature, >= {MIN_TEMPERATURE:g} (default 1.0; no top-k, no top-p)")
    gen.add_argument("--max-new-tokens", type=integer(1), metavar="N",
                     help="tokens per continuation at most (default 256)")
    gen.add_argument("--seed", type=seed(), help="0..2**64-N; continuation i samples with seed + i (default 0)")
    gen.add_argument("--device", help="auto (default: CUDA when available), cpu, cuda, cuda:N")
    gen.add_argument("--threads", type=integer(1), metavar="N", help="torch CPU threads")
    b.set_defaults(run=checked(b, _run_ngram_build), reads=("data", "text", "target", "prompts"), writes="out")


GENERATE_OPTIONS = ("prompts", "temperature", "max_new_tokens", "seed", "device", "threads")


def _check_generate_args(args: argparse.Namespace) -> None:
    """--generate's settings together (each number was checked as parsed), defaults filled in `args`."""
    if args.generate is None:
        given = [name for name in GENERATE_OPTIONS if getattr(args, name) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} is a setting of --generate N")
        return
    if not args.target or not args.prompts:
        raise UsageError("--generate needs --target (the model that samples) and --prompts FILE")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.max_new_tokens = 256 if args.max_new_tokens is None else args.max_new_tokens
    args.seed = 0 if args.seed is None else args.seed
    if args.seed > MAX_SEED + 1 - args.generate:
        raise UsageError(f"--seed {args.seed} with --generate {args.generate}: continuation i samples with seed + i, "
                         "which must stay <= 2**64-1")


def read_generation_prompts(path: str) -> list[str]:
    """The prompts of `ngram build --generate`: JSON lines with a string "prompt" when the first non-blank line is
    a JSON object, else every non-blank line (stripped)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [(number, line) for number, line in enumerate(fh.read().split("\n"), 1) if line.strip()]
    except UnicodeDecodeError as err:
        raise DartInputError(f"{path}: not UTF-8 text ({err})") from None
    if not lines:
        raise DartInputError(f"{path}: no prompts")
    try:
        first = json.loads(lines[0][1])
    except json.JSONDecodeError:
        first = None
    if not isinstance(first, dict):
        return [line.strip() for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DartInputError(f"{path}:{number}: not valid JSON ({err.msg}); a JSON-lines prompts file holds "
                                 "one object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise DartInputError(f"{path}:{number}: no string field 'prompt'")
        prompts.append(record["prompt"])
    return prompts


def sample_continuations(model, tokenizer, prompts: list[str], count: int, temperature: float, max_new_tokens: int,
                         seed: int, progress: bool) -> list[list[int]]:
    """`count` token sequences, each a prompt (chat template, generation prompt added) and the model's sampled
    continuation: continuation i answers `prompts[i % len(prompts)]`, drawn by plain `generate()` at `temperature`
    (no top-k, no top-p) after `torch.manual_seed(seed + i)`."""
    import torch
    from tqdm.auto import tqdm

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sequences, tokens = [], 0
    bar = tqdm(range(count), desc="ngram: generating", unit="seq", disable=not progress)
    for i in bar:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
        torch.manual_seed(seed + i)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)
        sequences.append(out[0].tolist())
        tokens += len(sequences[-1])
        bar.set_postfix(tokens=tokens, refresh=False)
    bar.close()
    return sequences


def _run_ngram_build(args: argparse.Namespace) -> int:
    from dart_core import NGramModel
    from dart_core.io import check_output_file
    from dart_core.ngram import tokenizer_fingerprint
    from dart_train.data import read_shards, text_sequences

    if not args.data and not args.text and args.generate is None:
        raise UsageError("give --data DIR..., --text FILE... and/or --generate N")
    if args.text and not args.target:
        raise UsageError("--text needs --target (its tokenizer)")
    _check_generate_args(args)
    for d in args.data:
        if not os.path.isdir(d):
            raise FileNotFoundError(f"data directory not found: {d}")
    for f in args.text:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"text file not found: {f}")
    prompts = read_generation_prompts(args.prompts) if args.generate else []
    sources = [*args.data, *args.text, *([args.prompts] if args.prompts else [])]
    out = check_output_file(args.out, args.force, sources=sources)  # never one of the inputs
    sequences = []
    for d in args.data:
        sequences.extend(tokens for tokens, _ in read_shards(d))
    vocab_size, fingerprint = args.vocab_size, None
    if args.target:
        if args.generate:
            from dart_train.trainer import load_target, resolve_device

            set_threads(args.threads)
            model, tokenizer = load_target(args.target, resolve_device(args.device or "auto"), with_tokenizer=True)
            if not getattr(tokenizer, "chat_template", None):
                raise DartInputError(f"target {args.target}: its tokenizer has no chat template (--generate "
                                     "answers the prompts through it)")
        else:
            model, tokenizer = _tokenizer_only(args.target)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if vocab_size is None:
            vocab_size = int(model.get_input_embeddings().weight.shape[0]) if model is not None else len(tokenizer)
        sequences.extend(text_sequences(tokenizer, args.text))
        if args.generate:
            sequences.extend(sample_continuations(model, tokenizer, prompts, args.generate, args.temperature,
                                                  args.max_new_tokens, args.seed, progress=sys.stderr.isatty()))
    if not any(len(s) for s in sequences):
        raise DartInputError("no tokens in the given data")
    ngram = NGramModel.build(sequences, order=args.order, vocab_size=vocab_size, progress=sys.stderr.isatty(),
                             tokenizer=fingerprint)
    ngram.save(out)
    tokens = sum(len(s) for s in sequences)
    print(f"wrote {args.out}: order {ngram.order}, {ngram.num_nodes:,} nodes from {len(sequences):,} sequences "
          f"({tokens:,} tokens)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: dart-spec distill|train|ngram ...")
