"""The draft vocabulary of a trained head: the most frequent target tokens of the training data.

The head's `lm_head` predicts over `draft_vocab_size` draft ids. Draft id i stands for target id `target_ids[i]`,
where `target_ids` are the `draft_vocab_size` most frequent tokens (ties: smaller id first), sorted by target id.
The head stores the map as buffers (docs/DESIGN.md §2.2): `d2t[i] = target_ids[i] - i` and `t2d[target_ids] = True`.
When the data holds fewer distinct tokens than `draft_vocab_size`, the lowest unused target ids fill the rest.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from dart_core.errors import DartInputError


def count_tokens(sequences: Iterable[tuple[np.ndarray, int]], vocab_size: int, responses_only: bool = True) -> np.ndarray:
    """int64 [vocab_size] occurrences of each token in `(tokens, prompt_length)` pairs.

    With `responses_only` (default) only tokens at positions >= prompt_length count: those are the tokens the head
    learns to predict (raw text has prompt_length 0, so every token counts). Ids outside [0, vocab_size) raise.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, (tokens, prompt_length) in enumerate(sequences):
        arr = np.asarray(tokens, dtype=np.int64)
        if responses_only:
            arr = arr[prompt_length:]
        if arr.size == 0:
            continue
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            raise DartInputError(f"sequence {i}: token id {lo if lo < 0 else hi} outside the target vocab "
                                 f"0..{vocab_size - 1}")
        counts += np.bincount(arr, minlength=vocab_size)
    return counts


def select_draft_tokens(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """int64 [draft_vocab_size] target ids, sorted ascending: the most frequent (ties by smaller id), then the lowest
    ids never seen if fewer than `draft_vocab_size` tokens occur."""
    counts = np.asarray(counts, dtype=np.int64)
    vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab_size:
        raise DartInputError(f"draft_vocab_size must be in 1..{vocab_size} (the target vocab), "
                             f"got {draft_vocab_size}")
    ids = np.arange(vocab_size, dtype=np.int64)
    # lexsort: last key is primary -> by count descending, then by id ascending
    order = np.lexsort((ids, -counts))
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.size < draft_vocab_size:
        unused = np.setdiff1d(ids, seen, assume_unique=True)  # sorted ascending
        seen = np.concatenate((seen, unused[: draft_vocab_size - seen.size]))
    return np.sort(seen)


def draft_vocab_buffers(target_ids: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [vocab_size]) for sorted `target_ids` [Vd]."""
    tid = torch.as_tensor(np.asarray(target_ids), dtype=torch.long)
    if tid.numel() and (bool((tid[1:] <= tid[:-1]).any()) or int(tid[0]) < 0 or int(tid[-1]) >= vocab_size):
        raise ValueError("draft target ids must be strictly increasing and inside the target vocab")
    d2t = tid - torch.arange(tid.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[tid] = True
    return d2t, t2d


def build_draft_vocab(sequences: Iterable[tuple[np.ndarray, int]], vocab_size: int, draft_vocab_size: int,
                      responses_only: bool = True) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """(target_ids [Vd], d2t [Vd], t2d [vocab_size]) from training sequences; see the module docstring."""
    target_ids = select_draft_tokens(count_tokens(sequences, vocab_size, responses_only), draft_vocab_size)
    d2t, t2d = draft_vocab_buffers(target_ids, vocab_size)
    return target_ids, d2t, t2d
