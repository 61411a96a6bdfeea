"""Tokenised training data: self-distilled chat answers and raw text, stored as compact resumable shards.

A data directory holds `shard-NNNNN.npz` files, each with `tokens` int32 [total] (sequences back to back),
`offsets` int64 [n+1] and `prompt_lengths` int32 [n] (tokens of the chat prompt at the start of each sequence; 0 for
raw text). Shards are written atomically, so an interrupted job resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from dart_core.errors import DartInputError
from dart_core.io import atomic_write

SHARD_FORMAT = "shard-{:05d}.npz"


def write_shard(path: Path, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> None:
    """One shard file, atomically."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences else \
        np.zeros(0, dtype=np.int32)
    with atomic_write(str(path), "wb") as fh:
        np.savez(fh, tokens=tokens, offsets=offsets, prompt_lengths=np.asarray(prompt_lengths, dtype=np.int32))


def read_shards(directory: str | os.PathLike) -> Iterator[tuple[np.ndarray, int]]:
    """(sequence int32 [L], prompt_length) for every sequence of every shard, in shard order."""
    files = sorted(Path(directory).glob("shard-*.npz"))
    if not files:
        raise FileNotFoundError(f"no data shards (shard-*.npz) in {directory}")
    for file in files:
        tokens, offsets, prompts = read_shard(file)
        for i in range(len(prompts)):
            yield tokens[offsets[i]:offsets[i + 1]], int(prompts[i])


def read_shard(file: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int [total], offsets int64 [n+1], prompt_lengths int [n]) of one shard, checked: ValueError naming the
    file for anything that is not a well-formed shard (unreadable, truncated, wrong arrays, offsets that decrease or
    leave the token array, prompt lengths outside their sequence, negative token ids)."""
    if not file.is_file():
        raise DartInputError(f"{file}: not a file")
    try:
        with np.load(file, allow_pickle=False) as data:
            tokens, offsets, prompts = data["tokens"], data["offsets"], data["prompt_lengths"]
    except Exception as err:  # noqa: BLE001 -- corrupt bytes fail inside zip and header parsing in any way
        raise DartInputError(f"{file}: not a readable data shard ({type(err).__name__}: {err})") from None
    for name, array in (("tokens", tokens), ("offsets", offsets), ("prompt_lengths", prompts)):
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise DartInputError(f"{file}: {name} must be a 1-D integer array, got {array.dtype} {list(array.shape)}")
    if len(offsets) != len(prompts) + 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens):
        raise DartInputError(f"{file}: offsets/prompt_lengths do not match the token array (corrupt shard)")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        raise DartInputError(f"{file}: offsets decrease at sequence {int(np.argmax(lengths < 0))} (corrupt shard)")
    if ((prompts < 0) | (prompts > lengths)).any():
        raise DartInputError(f"{file}: prompt length outside its sequence at sequence "
                             f"{int(np.argmax((prompts < 0) | (prompts > lengths)))} (corrupt shard)")
    if tokens.size and int(tokens.min()) < 0:
        raise DartInputError(f"{file}: negative token id {int(tokens.min())} (corrupt shard)")
    return tokens, offsets.astype(np.int64), prompts


@torch.no_grad()
def distill(model, tokenizer, prompts: Sequence[str], out_dir: str | os.PathLike, batch_size: int = 16,
            max_new_tokens: int = 256, progress: bool = True, sampling: Optional[dict] = None) -> int:
    """Answer `prompts` with `model` itself (chat template), one shard per batch; returns shards written. Greedy, or
    sampled with `sampling` = {"temperature", "top_p", "seed"} (batch i seeded with seed + i, so a resumed run draws
    what an uninterrupted one would).

    Resumable: shards already present are skipped, so re-running continues where an interrupted run stopped. What
    the shards answer is recorded in `DISTILL_MANIFEST` (a hash of the prompts, batch size and answer length); a
    directory holding shards of other prompts or settings is refused (ValueError), never silently mixed.
    """
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DartInputError(f"{name} must be an integer >= 1, got {value!r}")
    if sampling:
        check_sampling(sampling)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_distill_manifest(out, prompts, batch_size, max_new_tokens, sampling)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    written = 0
    bar = tqdm(total=len(batches), desc="distill", unit="batch", disable=not progress)
    for index, batch in enumerate(batches):
        path = out / SHARD_FORMAT.format(index)
        if path.exists():
            bar.update(1)
            continue
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        decoding = dict(do_sample=False)
        if sampling:
            torch.manual_seed((sampling["seed"] + index) % 2**64)
            decoding = dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=0)
        result = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, pad_token_id=pad,
                                **decoding).cpu()
        enc = enc.to("cpu")
        sequences, prompt_lengths = [], []
        width = enc["input_ids"].shape[1]
        for row, mask in zip(result, enc["attention_mask"]):
            prompt = row[:width][mask.bool()].tolist()
            answer = row[width:].tolist()
            answer = _cut_after_eos(answer, tokenizer.eos_token_id, pad)
            sequences.append(prompt + answer)
            prompt_lengths.append(len(prompt))
        write_shard(path, sequences, prompt_lengths)
        written += 1
        bar.update(1)
        bar.set_postfix(tokens=sum(len(s) for s in sequences))
    bar.close()
    return written


DISTILL_MANIFEST = "distill.json"


def check_sampling(sampling: dict) -> None:
    """DartInputError unless `sampling` is {"temperature": finite > 0, "top_p": in (0, 1], "seed": 0..2**64-1}."""
    if not isinstance(sampling, dict) or set(sampling) != {"temperature", "top_p", "seed"}:
        raise DartInputError(f"sampling must give temperature, top_p and seed, got {sampling!r}")
    temperature, top_p, seed = sampling["temperature"], sampling["top_p"], sampling["seed"]
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DartInputError(f"sampling {name} must be a finite number, got {value!r}")
    if temperature <= 0 or not 0 < top_p <= 1:
        raise DartInputError(f"sampling temperature must be > 0 and top_p in (0, 1], got {temperature!r}, {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise DartInputError(f"sampling seed must be an integer in 0..2**64-1, got {seed!r}")


def check_distill_manifest(out: Path, prompts: Sequence[str], batch_size: int, max_new_tokens: int,
                           sampling: Optional[dict] = None) -> None:
    """Record what a distillation into `out` answers, or check that the shards already there answer the same."""
    digest = hashlib.sha256(json.dumps(list(prompts)).encode("utf-8")).hexdigest()
    manifest = {"prompts_sha256": digest, "prompts": len(prompts), "batch_size": batch_size,
                "max_new_tokens": max_new_tokens}
    if sampling:
        manifest["sampling"] = dict(sampling)
    file = out / DISTILL_MANIFEST
    if file.is_file():
        try:
            saved = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DartInputError(f"{file}: unreadable ({err}); remove it only if the shards beside it are disposable")
        if saved != manifest:
            changed = [k for k in {**saved, **manifest} if saved.get(k) != manifest.get(k)]
            raise DartInputError(f"{out} holds shards of another distillation (different {', '.join(changed)}); "
                                 "write into a new --out directory")
        return
    if any(out.glob("shard-*.npz")):
        raise DartInputError(f"{out} holds data shards that no distillation manifest ({DISTILL_MANIFEST}) describes; "
                             "write into a new --out directory")
    with atomic_write(str(file), "w") as fh:
        json.dump(manifest, fh, indent=2)


def _cut_after_eos(tokens: list[int], eos: int | None, pad: int | None) -> list[int]:
    """Drop everything after the first EOS (kept) and trailing padding."""
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    while tokens and pad is not None and tokens[-1] == pad:
        tokens.pop()
    return tokens


def text_sequences(tokenizer, files: Sequence[str | os.PathLike]) -> list[np.ndarray]:
    """Raw text files -> token sequences (int32), one per paragraph (blocks separated by blank lines).

    No special tokens are added; empty paragraphs are skipped. Missing files raise FileNotFoundError.
    """
    out = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {file}")
        text = path.read_text(encoding="utf-8", errors="replace")
        paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
        for paragraph in paragraphs:
            if paragraph:
                ids = tokenizer(paragraph, add_special_tokens=False)["input_ids"]
                if ids:
                    out.append(np.asarray(ids, dtype=np.int32))
    return out


def write_text_shards(tokenizer, files: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                      sequences_per_shard: int = 256) -> int:
    """Tokenise raw text files into shards (prompt_length 0: every token is a training target); returns shards
    written. Existing shards in `out_dir` are refused (FileExistsError) so raw text never mixes into a distill run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("shard-*.npz")):
        raise FileExistsError(f"{out} already holds data shards; write raw-text shards into an empty directory")
    sequences = text_sequences(tokenizer, files)
    if not sequences:
        raise DartInputError(f"no text in {', '.join(map(str, files))}")
    shards = 0
    for index, start in enumerate(range(0, len(sequences), sequences_per_shard)):
        chunk = sequences[start:start + sequences_per_shard]
        write_shard(out / SHARD_FORMAT.format(index), chunk, [0] * len(chunk))
        shards += 1
    return shards
