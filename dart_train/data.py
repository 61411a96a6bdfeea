"""Tokenised training data: self-distilled chat answers and raw text, stored as compact resumable shards.

A data directory holds `shard-NNNNN.npz` files, each with `tokens` int32 [total] (sequences back to back),
`offsets` int64 [n+1] and `prompt_lengths` int32 [n] (tokens of the chat prompt at the start of each sequence; 0 for
raw text). Shards are written atomically, so an interrupted job resumes at the first missing shard.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

SHARD_FORMAT = "shard-{:05d}.npz"


def write_shard(path: Path, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> None:
    """One shard file, atomically."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences else \
        np.zeros(0, dtype=np.int32)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
    os.close(fd)
    try:
        np.savez(tmp, tokens=tokens, offsets=offsets, prompt_lengths=np.asarray(prompt_lengths, dtype=np.int32))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_shards(directory: str | os.PathLike) -> Iterator[tuple[np.ndarray, int]]:
    """(sequence int32 [L], prompt_length) for every sequence of every shard, in shard order."""
    files = sorted(Path(directory).glob("shard-*.npz"))
    if not files:
        raise FileNotFoundError(f"no data shards (shard-*.npz) in {directory}")
    for file in files:
        try:
            with np.load(file) as data:
                tokens, offsets, prompts = data["tokens"], data["offsets"], data["prompt_lengths"]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{file}: not a readable data shard ({err})") from err
        if offsets[-1] != tokens.shape[0] or len(prompts) != len(offsets) - 1:
            raise ValueError(f"{file}: offsets/prompt_lengths do not match the token array (corrupt shard)")
        for i in range(len(prompts)):
            yield tokens[offsets[i]:offsets[i + 1]], int(prompts[i])


@torch.no_grad()
def distill(model, tokenizer, prompts: Sequence[str], out_dir: str | os.PathLike, batch_size: int = 16,
            max_new_tokens: int = 256, progress: bool = True) -> int:
    """Answer `prompts` with `model` itself (greedy, chat template), one shard per batch; returns shards written.

    Resumable: shards already present are skipped, so re-running continues where an interrupted run stopped.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
        result = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=pad).cpu()
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
        raise ValueError(f"no text in {', '.join(map(str, files))}")
    shards = 0
    for index, start in enumerate(range(0, len(sequences), sequences_per_shard)):
        chunk = sequences[start:start + sequences_per_shard]
        write_shard(out / SHARD_FORMAT.format(index), chunk, [0] * len(chunk))
        shards += 1
    return shards
