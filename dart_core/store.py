"""Earlier calls' outputs as a source of draft paths (docs/DESIGN.md §2.7): `OutputStore`.

A store holds token sequences (each an earlier call's prompt tail and output) back to back, bounded by a cap in
tokens: the oldest sequences leave first. It indexes every n-gram of the lengths `min_match..max_match` by the
positions where it ends, so a decoding step matches the row's suffix in it with a few dict look-ups, as the row's own
context is matched (`dart_core.context.ContextRow`). Thread-safe: calls on several threads add and match at once.
"""

from __future__ import annotations

import collections
import os
import threading
from array import array
from typing import Sequence, Union

import numpy as np
import torch

from dart_core.errors import DartInputError

DEFAULT_MAX_TOKENS = 65_536  # at most about 25 MB of index at 3..4-token matches (BENCHMARKS.md)
SEPARATOR = -1  # between sequences in the token array: no continuation runs past its own sequence
_KEY_BITS = 32  # bits per token in a packed n-gram key (token ids are < 2**31)


def _key(tokens: Sequence[int]) -> int:
    """One int per n-gram (distinct for distinct token tuples of one length)."""
    key = 0
    for t in tokens:
        key = (key << _KEY_BITS) | (int(t) + 1)
    return key


def check_store_cap(max_tokens) -> int:
    """`max_tokens` as an int >= 1; DartInputError naming the value otherwise."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise DartInputError(f"an output store's cap must be a positive number of tokens, got {max_tokens!r}")
    return int(max_tokens)


class OutputStore:
    """Earlier outputs, matched by suffix (docs/DESIGN.md §2.7). `max_tokens`: the cap (oldest sequences out);
    `min_match..max_match`: the suffix lengths indexed (a call matching other lengths finds nothing here; 2-token
    matches across calls are weak evidence, so the default starts at 3)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, min_match: int = 3, max_match: int = 4) -> None:
        self.max_tokens = check_store_cap(max_tokens)
        if not 1 <= min_match <= max_match:
            raise DartInputError(f"an output store needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = int(min_match), int(max_match)
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Forget every sequence."""
        with self._lock:
            self._tokens = array("q")  # token of global position p at p - self._offset; SEPARATOR after each sequence
            self._offset = 0  # global position of self._tokens[0]
            self._lengths: collections.deque[int] = collections.deque()  # tokens of each held sequence, oldest first
            self._held = 0  # tokens held (separators not counted)
            # length -> n-gram key -> its global end position, or a list of them ascending (the oldest first): most
            # n-grams occur once, and an int costs a fraction of a list
            self._ends: dict[int, dict[int, Union[int, list[int]]]] = {
                n: {} for n in range(self.min_match, self.max_match + 1)}

    def __len__(self) -> int:
        """Tokens held."""
        return self._held

    @property
    def sequences(self) -> int:
        return len(self._lengths)

    def add(self, tokens: Union[torch.Tensor, Sequence[int]]) -> None:
        """Keep one sequence (its last `max_tokens` tokens), the oldest sequences leaving while over the cap."""
        seq = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        if any(t < 0 for t in seq):
            raise ValueError("an output store holds token ids >= 0")
        seq = seq[len(seq) - self.max_tokens:] if len(seq) > self.max_tokens else seq
        if not seq:
            return
        with self._lock:
            start = self._offset + len(self._tokens)
            self._tokens.extend(seq)
            self._tokens.append(SEPARATOR)
            self._lengths.append(len(seq))
            self._held += len(seq)
            for n, ends in self._ends.items():
                for i in range(n - 1, len(seq)):
                    key = _key(seq[i - n + 1:i + 1])
                    held = ends.get(key)
                    if held is None:
                        ends[key] = start + i
                    elif isinstance(held, int):
                        ends[key] = [held, start + i]
                    else:
                        held.append(start + i)
            while self._held > self.max_tokens:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Drop the oldest sequence and its index entries (each the leftmost of its list)."""
        length = self._lengths.popleft()
        seq = self._tokens[:length].tolist()
        for n, ends in self._ends.items():
            for i in range(n - 1, length):
                key = _key(seq[i - n + 1:i + 1])
                held = ends[key]
                if isinstance(held, int):
                    del ends[key]
                else:
                    del held[0]
                    if len(held) == 1:
                        ends[key] = held[0]
        del self._tokens[:length + 1]
        self._offset += length + 1
        self._held -= length

    def continuations(self, suffix: Sequence[int], count: int, depth: int) -> list[list[int]]:
        """The up to `depth` tokens after each of the latest `count` occurrences of `suffix` (latest first), each
        within its own sequence; occurrences that end their sequence are skipped. [] for a suffix length the store
        does not index."""
        if count < 1 or depth < 1:
            return []
        out = []
        with self._lock:
            held = self._ends.get(len(suffix), {}).get(_key(suffix))
            for end in reversed([held] if isinstance(held, int) else held or ()):
                i = end + 1 - self._offset
                cont = self._tokens[i:i + depth].tolist()
                if SEPARATOR in cont:
                    cont = cont[:cont.index(SEPARATOR)]
                if cont:
                    out.append(cont)
                    if len(out) == count:
                        break
        return out

    def __getstate__(self) -> dict:
        """Pickled (an enabled model's copy, `torch.save`) as its settings and held sequences."""
        with self._lock:
            flat, lengths = self._tokens.tolist(), list(self._lengths)
        sequences, start = [], 0
        for length in lengths:
            sequences.append(flat[start:start + length])
            start += length + 1
        return {"max_tokens": self.max_tokens, "min_match": self.min_match, "max_match": self.max_match,
                "sequences": sequences}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_tokens"], state["min_match"], state["max_match"])
        for seq in state["sequences"]:
            self.add(seq)

    # ---- kept beside the cache ---------------------------------------------------------------------------------
    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the held sequences to `path` (.npz: tokens, offsets), atomically."""
        from dart_core.io import atomic_write

        with self._lock:
            flat = np.frombuffer(self._tokens, dtype=np.int64)
            keep = flat != SEPARATOR
            offsets = np.concatenate(([0], np.cumsum(np.fromiter(self._lengths, dtype=np.int64))))
            tokens = flat[keep].copy()
        with atomic_write(path) as handle:
            np.savez(handle, tokens=tokens, offsets=offsets,
                     settings=np.array([self.max_tokens, self.min_match, self.max_match], dtype=np.int64))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], max_tokens: int | None = None) -> "OutputStore":
        """A store holding the sequences `save` wrote to `path`, with its match lengths (cap: `max_tokens`, else the
        saved one); a file that is not such a store is one DartInputError."""
        try:
            raw = np.load(path, allow_pickle=False)
            if not isinstance(raw, np.lib.npyio.NpzFile):
                raise ValueError(f"a {type(raw).__name__}, not an .npz archive")
            with raw:
                tokens, offsets, settings = raw["tokens"], raw["offsets"], raw["settings"]
            if settings.shape != (3,) or settings.dtype.kind not in "iu":
                raise ValueError(f"settings are {settings!r}, not three integers (cap, shortest and longest match)")
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 -- whatever a damaged file makes numpy raise is one clear error
            raise DartInputError(f"{path} is not an output store ({type(err).__name__}: {err})") from None
        if (tokens.ndim != 1 or offsets.ndim != 1 or tokens.dtype.kind not in "iu" or offsets.dtype.kind not in "iu"
                or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens)
                or bool(np.any(np.diff(offsets) < 0)) or (len(tokens) and int(tokens.min()) < 0)):
            raise DartInputError(f"{path} is not an output store (tokens and offsets do not agree)")
        saved_cap, min_match, max_match = (int(x) for x in settings)
        store = cls(saved_cap if max_tokens is None else max_tokens, min_match, max_match)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            store.add(tokens[a:b].tolist())
        return store


__all__ = ["DEFAULT_MAX_TOKENS", "OutputStore", "check_store_cap"]
