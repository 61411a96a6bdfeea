"""N-gram count store (`NGramModel`): the prior q(token | context) of the draft-tree search.

Semantics follow the count trie of the DART reference: for every start position i of every training sequence the
window `seq[i : i + order]` is inserted and every trie node on its path (root included) gets +1, so `count(w)` is the
number of occurrences of the n-gram w (len(w) <= order) and the root count is the number of tokens.

`q(t | context)` backs off per token: for len = min(order - 1, len(context)) down to 1, a token not matched yet that
is a child of `context[-len:]` gets `count(context[-len:] + [t]) / count(context[-len:])` (float32) and is matched;
tokens never matched get 0.

Storage: every stored n-gram (lengths 0..order) is one int64 key in a single sorted array, with its count in a
parallel int32 array (12 bytes per trie node). The key of (t1..tn) is `sum_i (t_i + 1) * V1**(n - i)` with
`V1 = vocab_bound + 1`: digits are token + 1, so n-grams of different lengths never collide, the root is key 0, and a
token -1 ("absent") contributes digit 0, making a left-padded window pack to the shorter n-gram.

A table may carry the fingerprint of the tokenizer whose ids it counts (`tokenizer_fingerprint`, saved in the file's
metadata); `check_ngram_tokenizer` refuses it for another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from dart_core.errors import DartInputError
from dart_core.io import write_safetensors_arrays

FORMAT_NAME = "dart-ngram"
FORMAT_VERSION = 1
TOKENIZER_KEY = "tokenizer"  # the file metadata key of the tokenizer fingerprint (a JSON string)

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_SAFETENSORS_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4")}

DeviceLike = Union[str, torch.device, None]


def pack_ngrams(tokens, base: int):
    """Keys of n-grams: tokens [..., n] int64 (numpy or torch; -1 = absent) -> [...] int64.

    Digit i is `tokens[..., i] + 1`, most significant first, in base `base` (= vocab_bound + 1). Token ids must lie
    in [-1, base - 2]; the caller guarantees that `base**n` fits in int64.
    """
    n = tokens.shape[-1]
    if n == 0:
        return tokens.sum(-1) * 0  # [...] zeros, numpy or torch alike
    key = tokens[..., 0] + 1
    for i in range(1, n):
        key = key * base + (tokens[..., i] + 1)
    return key


def _check_key_space(vocab_bound: int, order: int) -> None:
    if isinstance(order, bool) or not isinstance(order, (int, np.integer)) or order < 1:
        raise DartInputError(f"n-gram order must be an integer >= 1, got {order!r}")
    if isinstance(vocab_bound, bool) or not isinstance(vocab_bound, (int, np.integer)) or vocab_bound < 0:
        raise DartInputError(f"vocab size must be an integer >= 0, got {vocab_bound!r}")
    if (int(vocab_bound) + 1) ** int(order) > _INT64_MAX:
        raise DartInputError(
            f"vocab size {vocab_bound} with n-gram order {order} does not fit the int64 key space: "
            f"(vocab size + 1) ** order = {(int(vocab_bound) + 1) ** int(order)} > 2**63 - 1; "
            "use a smaller order or vocabulary"
        )


def _as_int_sequence(seq, index: int) -> np.ndarray:
    """One training sequence as a 1-D int64 numpy array (empty arrays pass through)."""
    if isinstance(seq, torch.Tensor):
        if seq.dtype == torch.bool or seq.is_floating_point() or seq.is_complex():
            if seq.numel() == 0:
                return np.zeros(0, dtype=np.int64)
            raise DartInputError(f"sequence {index}: token ids must be integers, got dtype {seq.dtype}")
        arr = seq.detach().cpu().numpy()
    else:
        arr = np.asarray(seq)
    if arr.ndim != 1:
        raise DartInputError(f"sequence {index}: expected a 1-D token sequence, got shape {list(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise DartInputError(f"sequence {index}: token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise DartInputError(f"sequence {index}: token id {int(arr.max())} does not fit int64")
    return arr.astype(np.int64, copy=False)


def _strictly_increasing(a: np.ndarray, chunk: int = 1 << 22) -> bool:
    """Whether a 1-D array is sorted strictly increasing (read in chunks: bounded temporary memory)."""
    for start in range(0, a.size - 1, chunk):
        seg = a[start: start + chunk + 1]
        if not bool(np.all(seg[1:] > seg[:-1])):
            return False
    return True


def tokenizer_fingerprint(tokenizer) -> dict:
    """What fixes the meaning of a tokenizer's ids: {"vocab_size": len(tokenizer), "vocab_sha256": the SHA-256 of
    its sorted (token, id) pairs as canonical JSON, "special_tokens": its sorted [token, id] pairs}.

    Duck-typed: any object with `len()`, `get_vocab()`, `all_special_tokens` and `all_special_ids` (a transformers
    tokenizer, for one).
    """
    vocab = sorted((str(token), int(i)) for token, i in tokenizer.get_vocab().items())
    dump = json.dumps(vocab, separators=(",", ":"))
    special = sorted({(str(t), int(i)) for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)})
    return {"vocab_size": int(len(tokenizer)), "vocab_sha256": hashlib.sha256(dump.encode("ascii")).hexdigest(),
            "special_tokens": [list(pair) for pair in special]}


def _checked_fingerprint(value) -> dict:
    """`value` if it is a `tokenizer_fingerprint` (its three fields, nothing else), else DartInputError saying why."""
    if not isinstance(value, dict) or set(value) != {"vocab_size", "vocab_sha256", "special_tokens"}:
        raise DartInputError("a tokenizer fingerprint is an object with exactly vocab_size, vocab_sha256 and "
                             f"special_tokens, got {str(value)[:120]}")
    size, digest, special = value["vocab_size"], value["vocab_sha256"], value["special_tokens"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DartInputError(f"tokenizer vocab_size must be an integer >= 0, got {size!r}")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise DartInputError(f"tokenizer vocab_sha256 must be 64 lowercase hex digits, got {str(digest)[:80]!r}")
    if not isinstance(special, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
            and not isinstance(p[1], bool) for p in special):
        raise DartInputError(f"tokenizer special_tokens must be a list of [token, id] pairs, got {str(special)[:120]}")
    return {"vocab_size": size, "vocab_sha256": digest, "special_tokens": [list(p) for p in special]}


def _some(pairs: list, shown: int = 3) -> str:
    """A few (token, id) pairs for a message."""
    text = ", ".join(f"{token!r} = {i}" for token, i in pairs[:shown])
    return text + (f" and {len(pairs) - shown} more" if len(pairs) > shown else "")


def check_ngram_tokenizer(ngram: "NGramModel", tokenizer, model_vocab: Optional[int] = None) -> None:
    """DartInputError when `ngram` was not counted for `tokenizer` (ids of another vocabulary would draft garbage),
    naming every difference: the vocabulary size (both numbers), its contents, the special tokens that differ.

    A table without a fingerprint (older files, tables built from ids alone) is only checked against `model_vocab`,
    the model's vocabulary (embedding rows): its `vocab_bound` must not exceed it. Every table is, when it is given.
    """
    problems = []
    if model_vocab is not None and ngram.vocab_bound > model_vocab:
        problems.append(f"its vocabulary bound {ngram.vocab_bound} exceeds the model's vocabulary of {model_vocab}")
    if ngram.tokenizer is not None:
        built, given = ngram.tokenizer, tokenizer_fingerprint(tokenizer)
        if built["vocab_size"] != given["vocab_size"]:
            problems.append(f"it was built for a vocabulary of {built['vocab_size']} tokens, the tokenizer has "
                            f"{given['vocab_size']}")
        elif built["vocab_sha256"] != given["vocab_sha256"]:
            problems.append(f"the vocabulary's tokens or ids differ (same size, {given['vocab_size']})")
        built_special = {tuple(p) for p in built["special_tokens"]}
        given_special = {tuple(p) for p in given["special_tokens"]}
        if built_special != given_special:
            parts = []
            if built_special - given_special:
                parts.append(f"the table's {_some(sorted(built_special - given_special))} are not the tokenizer's")
            if given_special - built_special:
                parts.append(f"the tokenizer's {_some(sorted(given_special - built_special))} are not the table's")
            problems.append("special tokens differ: " + ", ".join(parts))
    if problems:
        raise DartInputError("the n-gram table does not fit this tokenizer: " + "; ".join(problems))


def _unique_counts(keys: np.ndarray, key_space: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values of `keys` (all in [0, key_space)) and how often each occurs."""
    if key_space <= min(max(1 << 22, 2 * keys.size), 1 << 25):  # a dense histogram is cheaper than a sort
        counts = np.bincount(keys, minlength=key_space)
        uniq = np.flatnonzero(counts)
        return uniq.astype(np.int64, copy=False), counts[uniq]
    return np.unique(keys, return_counts=True)


class NGramModel:
    """Counts of all n-grams (n <= order) of a token corpus, queried as a back-off prior q(token | context).

    keys   [num_nodes] int64 sorted packed n-gram keys (see module docstring; key 0 = root)
    counts [num_nodes] int32 occurrences of each n-gram (root: total number of tokens)
    tokenizer  the `tokenizer_fingerprint` of the tokenizer whose ids it counts, or None (unknown)
    """

    def __init__(self, keys: torch.Tensor, counts: torch.Tensor, order: int, vocab_bound: int,
                 tokenizer: Optional[dict] = None):
        _check_key_space(vocab_bound, order)
        if keys.dtype != torch.int64 or counts.dtype != torch.int32:
            raise ValueError(f"keys must be int64 and counts int32, got {keys.dtype} and {counts.dtype}")
        if keys.dim() != 1 or counts.shape != keys.shape:
            raise ValueError(f"keys and counts must be 1-D of equal length, got {list(keys.shape)} and "
                             f"{list(counts.shape)}")
        if counts.device != keys.device:
            raise ValueError(f"keys and counts on different devices: {keys.device} and {counts.device}")
        self.keys = keys
        self.counts = counts
        self.order = int(order)
        self.vocab_bound = int(vocab_bound)
        self.tokenizer = None if tokenizer is None else _checked_fingerprint(tokenizer)
        self._base = self.vocab_bound + 1
        self._ctx_len = self.order - 1
        # [order-1] place values of the context columns, most significant (oldest id) first
        self._ctx_place = torch.tensor([self._base ** p for p in range(self._ctx_len - 1, -1, -1)],
                                       dtype=torch.int64, device=keys.device)
        # all keys but the last: a search there returns an index < num_nodes, which `keys` then confirms or not
        self._keys_search = keys[:-1] if keys.numel() else keys
        self._packers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._host: Optional[tuple[np.ndarray, np.ndarray]] = None  # numpy views of keys, counts (CPU models)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, sequences: Iterable, order: int = 3, vocab_size: Optional[int] = None,
              progress: bool = False, tokenizer: Optional[dict] = None) -> "NGramModel":
        """Count every n-gram (n <= order) of `sequences` (1-D int lists, numpy arrays or tensors).

        `vocab_size` bounds the token ids (default: max id + 1); ids outside [0, vocab_size) raise ValueError.
        Empty sequences are skipped. `tokenizer`: the `tokenizer_fingerprint` of the tokenizer that made the ids.
        """
        from tqdm.auto import tqdm

        if isinstance(order, bool) or not isinstance(order, (int, np.integer)) or order < 1:
            raise DartInputError(f"n-gram order must be an integer >= 1, got {order!r}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
                                       or vocab_size < 1):
            raise DartInputError(f"vocab_size must be a positive integer or None, got {vocab_size!r}")
        if vocab_size is not None:
            _check_key_space(int(vocab_size), order)
        if tokenizer is not None:
            tokenizer = _checked_fingerprint(tokenizer)
        order = int(order)

        arrays, seq_index = [], []  # the non-empty sequences and their positions in `sequences`
        for i, seq in enumerate(tqdm(sequences, desc="n-gram: reading", unit="seq", disable=not progress)):
            arr = _as_int_sequence(seq, i)
            if arr.size:
                arrays.append(arr)
                seq_index.append(i)
        lengths = np.array([a.size for a in arrays], dtype=np.int64)  # [S]
        total = int(lengths.sum())
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)  # [T]
        del arrays
        if total > _INT32_MAX:
            raise DartInputError(f"{total} tokens overflow the int32 counts of NGramModel (max {_INT32_MAX})")

        def locate(pos: int) -> str:
            s = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
            return f"sequence {seq_index[s]} at position {pos - int(lengths[:s].sum())}"

        if total:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0:
                raise DartInputError(f"negative token id {lo} in {locate(int(np.argmin(tokens)))}")
            if vocab_size is not None and hi >= vocab_size:
                raise DartInputError(f"token id {hi} >= vocab_size {vocab_size} in {locate(int(np.argmax(tokens)))}")
            vocab_bound = int(vocab_size) if vocab_size is not None else hi + 1
        else:
            vocab_bound = int(vocab_size) if vocab_size is not None else 0
        _check_key_space(vocab_bound, order)
        base = vocab_bound + 1

        # remaining[i] = tokens left in i's sequence from i on: an n-gram may start at i iff remaining[i] >= n
        ends = np.repeat(np.cumsum(lengths), lengths)  # [T]
        remaining = ends - np.arange(total, dtype=np.int64)  # [T]
        del ends
        digits = tokens + 1  # [T]
        del tokens

        key_parts = [np.zeros(1, dtype=np.int64)]
        count_parts = [np.array([total], dtype=np.int64)]
        rolling = np.zeros(total, dtype=np.int64)  # [T - n + 1] keys of the windows of length n starting at i
        for n in tqdm(range(1, order + 1), desc="n-gram: counting", unit="order", disable=not progress):
            m = total - n + 1
            if m <= 0:
                break
            rolling = rolling[:m] * base + digits[n - 1:]  # windows crossing a sequence end are dropped below
            uniq, cnt = _unique_counts(rolling[remaining[:m] >= n], base ** n)
            key_parts.append(uniq)
            count_parts.append(cnt)
        # n-grams of length n have keys in [base**(n-1), base**n): concatenation by length is sorted
        keys = np.concatenate(key_parts)
        counts = np.concatenate(count_parts).astype(np.int32)
        return cls(torch.from_numpy(keys), torch.from_numpy(counts), order, vocab_bound, tokenizer)

    @classmethod
    def from_counts(cls, keys, counts, order: int, vocab_bound: int) -> "NGramModel":
        """A model from packed keys (strictly increasing int64) and their counts (non-negative, fit int32)."""
        _check_key_space(vocab_bound, order)
        k = torch.as_tensor(keys)
        c = torch.as_tensor(counts)
        if k.dim() != 1 or c.dim() != 1 or k.shape != c.shape:
            raise DartInputError(f"keys and counts must be 1-D of equal length, got {list(k.shape)} and "
                                 f"{list(c.shape)}")
        for name, t in (("keys", k), ("counts", c)):
            if t.numel() and (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
                raise DartInputError(f"{name} must be integers, got {t.dtype}")
        k = k.to(torch.int64)
        if k.numel():
            if not bool((k[1:] > k[:-1]).all()):
                raise DartInputError("keys must be sorted strictly increasing (sorted and unique)")
            limit = (vocab_bound + 1) ** order
            if int(k[0]) < 0 or int(k[-1]) >= limit:
                raise DartInputError(f"keys must lie in [0, (vocab_bound + 1) ** order) = [0, {limit})")
            if int(c.min()) < 0:
                raise DartInputError("counts must be >= 0")
            if int(c.max()) > _INT32_MAX:
                raise DartInputError(f"count {int(c.max())} overflows int32")
        return cls(k.contiguous(), c.to(torch.int32).contiguous(), order, vocab_bound)

    # ------------------------------------------------------------------ persistence

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the model to a safetensors file (atomically: a reader sees the old file or the complete new one)."""
        metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "order": str(self.order),
                    "vocab_bound": str(self.vocab_bound)}
        if self.tokenizer is not None:
            metadata[TOKENIZER_KEY] = json.dumps(self.tokenizer, sort_keys=True)
        write_safetensors_arrays({"keys": self.keys.cpu().numpy(), "counts": self.counts.cpu().numpy()},
                                 os.fspath(path), metadata)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], device: DeviceLike = None) -> "NGramModel":
        """Read a file written by `save`; on CPU the arrays stay memory-mapped (no copy). Files without a tokenizer
        fingerprint load with `.tokenizer` None."""
        path = os.fspath(path)

        def bad(what: str) -> DartInputError:
            return DartInputError(f"{path}: not a valid n-gram file: {what}")

        size = os.path.getsize(path)
        if size < 8:
            raise bad(f"file too short ({size} bytes)")
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise bad(f"header length {header_len} exceeds the file size {size} (truncated or not safetensors)")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise bad("header is not a JSON object")
        meta = header.get("__metadata__")
        if not isinstance(meta, dict):
            raise bad("no __metadata__ in the header")
        if meta.get("format") != FORMAT_NAME:
            raise bad(f"format is {meta.get('format')!r}, expected {FORMAT_NAME!r}")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise bad(f"format_version is {meta.get('format_version')!r}, expected {str(FORMAT_VERSION)!r}")
        try:
            order, vocab_bound = int(meta["order"]), int(meta["vocab_bound"])
        except (KeyError, TypeError, ValueError):
            raise bad("metadata lacks integer 'order' and 'vocab_bound'") from None
        try:
            _check_key_space(vocab_bound, order)
        except ValueError as e:
            raise bad(str(e)) from None
        tokenizer = meta.get(TOKENIZER_KEY)
        if tokenizer is not None:
            try:
                tokenizer = _checked_fingerprint(json.loads(tokenizer))
            except (TypeError, ValueError, RecursionError) as e:  # JSONDecodeError, DartInputError: ValueErrors
                raise bad(f"metadata {TOKENIZER_KEY!r} is not a tokenizer fingerprint ({e})") from None

        data_start = 8 + header_len
        arrays = {}
        for name, dtype_name in (("keys", "I64"), ("counts", "I32")):
            info = header.get(name)
            if not isinstance(info, dict):
                raise bad(f"missing tensor {name!r}")
            if info.get("dtype") != dtype_name:
                raise bad(f"tensor {name!r} has dtype {info.get('dtype')!r}, expected {dtype_name}")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if (not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 0
                    or not isinstance(offsets, list) or len(offsets) != 2
                    or not all(isinstance(o, int) for o in offsets)):
                raise bad(f"tensor {name!r} has a malformed shape {shape!r} or data_offsets {offsets!r}")
            dtype = _SAFETENSORS_DTYPES[dtype_name]
            begin, end = offsets
            if begin < 0 or end - begin != shape[0] * dtype.itemsize:
                raise bad(f"tensor {name!r}: data_offsets {offsets} do not match shape {shape} of {dtype_name}")
            if data_start + end > size:
                raise bad(f"tensor {name!r}: data_offsets {offsets} run past the end of the file "
                          f"({size - data_start} data bytes; truncated?)")
            if shape[0] == 0:
                arrays[name] = np.zeros(0, dtype=dtype)
                continue
            arr = np.memmap(path, dtype=dtype, mode="c", offset=data_start + begin, shape=(shape[0],))
            if arr.ctypes.data % dtype.itemsize:  # misaligned data region: fall back to a copy
                arr = np.array(arr)
            arrays[name] = arr
        keys, counts = arrays["keys"], arrays["counts"]
        if keys.shape != counts.shape:
            raise bad(f"keys ({keys.shape[0]}) and counts ({counts.shape[0]}) differ in length")
        if keys.size:
            if not _strictly_increasing(keys):
                raise bad("keys are not sorted strictly increasing")
            if int(keys[0]) < 0 or int(keys[-1]) >= (vocab_bound + 1) ** order:
                raise bad(f"keys outside [0, (vocab_bound + 1) ** order) for vocab_bound {vocab_bound}, order {order}")
            if int(counts.min()) < 0:
                raise bad("negative counts")
        model = cls(torch.from_numpy(keys), torch.from_numpy(counts), order, vocab_bound, tokenizer)
        if device is not None and torch.device(device).type != "cpu":
            model = model.to(device)
        return model

    def to(self, device: DeviceLike) -> "NGramModel":
        """This model with its arrays on `device` (self if already there)."""
        device = torch.device(device)
        if self.keys.device == device or (device.index is None and self.keys.device.type == device.type):
            return self
        return NGramModel(self.keys.to(device), self.counts.to(device), self.order, self.vocab_bound, self.tokenizer)

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def num_nodes(self) -> int:
        """Number of stored n-grams (trie nodes, root included)."""
        return int(self.keys.numel())

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and count arrays."""
        return self.keys.numel() * self.keys.element_size() + self.counts.numel() * self.counts.element_size()

    @property
    def num_tokens(self) -> int:
        """Total number of training tokens (the root count)."""
        return self.count(())

    def __repr__(self) -> str:
        return (f"NGramModel(order={self.order}, vocab_bound={self.vocab_bound}, num_nodes={self.num_nodes}, "
                f"nbytes={self.nbytes}, device={self.device})")

    # ------------------------------------------------------------------ queries

    def _key(self, ngram: Sequence[int]) -> Optional[int]:
        """Packed key of an n-gram of valid ids, or None when some id is >= vocab_bound (never stored)."""
        key = 0
        for t in ngram:
            if t >= self.vocab_bound:
                return None
            key = key * self._base + int(t) + 1
        return key

    def _lookup(self, keys: list[Optional[int]]) -> list[int]:
        """Counts of packed keys (0 for absent keys and None)."""
        present = [k for k in keys if k is not None]
        if not present or self.num_nodes == 0:
            return [0] * len(keys)
        q = torch.tensor(present, dtype=torch.int64, device=self.keys.device)
        idx = torch.searchsorted(self.keys, q).clamp_(max=self.num_nodes - 1)
        found = torch.where(self.keys[idx] == q, self.counts[idx], 0).tolist()
        it = iter(found)
        return [next(it) if k is not None else 0 for k in keys]

    @staticmethod
    def _check_ids(ids, what: str) -> list[int]:
        out = []
        for t in ids:
            if isinstance(t, torch.Tensor):
                t = t.item()
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{what} must hold integer token ids, got {t!r}")
            if t < 0:
                raise ValueError(f"{what} holds a negative token id {t}")
            out.append(int(t))
        return out

    def count(self, ngram: Sequence[int]) -> int:
        """Occurrences of `ngram` (len <= order) in the training sequences; () gives the number of tokens."""
        ngram = self._check_ids(ngram, "ngram")
        if len(ngram) > self.order:
            raise ValueError(f"n-gram of length {len(ngram)} is longer than the model order {self.order}")
        return self._lookup([self._key(ngram)])[0]

    def probability(self, context: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """q(t | context) for each t in `tokens`, with per-token back-off (see module docstring)."""
        context = self._check_ids(context, "context")
        tokens = self._check_ids(tokens, "tokens")
        out = [0.0] * len(tokens)
        longest = min(self._ctx_len, len(context))
        if longest == 0 or not tokens:
            return out
        lengths = range(longest, 0, -1)
        ctx_keys = [self._key(context[-n:]) for n in lengths]
        queries = list(ctx_keys)
        for ck in ctx_keys:
            for t in tokens:
                queries.append(None if ck is None or t >= self.vocab_bound else ck * self._base + t + 1)
        found = self._lookup(queries)
        ctx_counts, child_counts = found[:longest], found[longest:]
        matched = [False] * len(tokens)
        for level in range(longest):
            denominator = np.float32(max(ctx_counts[level], 1))
            for j in range(len(tokens)):
                c = child_counts[level * len(tokens) + j]
                if not matched[j] and c > 0:
                    out[j] = float(np.float32(c) / denominator)
                    matched[j] = True
        return out

    def top_continuations(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        """The up-to-k most frequent continuations of `context` as (token, q), q descending, then token ascending.

        One back-off for the whole set: the longest suffix of `context` (length min(order-1, len(context)) down to 1)
        with at least one stored child gives all of them, q = count(suffix + [t]) / count(suffix) as a float64 (at
        most 1; `probability` gives the same values rounded to float32). A suffix holding an id >= vocab_bound has no
        children. [] when no suffix has any (empty context, order 1). CPU models only (ValueError elsewhere): a host
        look-up of two binary searches and a partial sort of one key range.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        if self._host is None:
            if self.keys.device.type != "cpu":
                raise ValueError(f"top_continuations needs the n-gram on the CPU, not {self.keys.device}: "
                                 "load it without a device (or .to('cpu')) for host look-ups")
            self._host = (self.keys.numpy(), self.counts.numpy())
        keys, counts = self._host
        longest = min(self._ctx_len, len(context))
        if longest == 0 or k == 0:
            return []
        tail = context[len(context) - longest:]
        if isinstance(tail, (torch.Tensor, np.ndarray)):
            tail = tail.tolist()
        tail = self._check_ids(tail, "context")
        base, bound = self._base, self.vocab_bound
        suffix_keys = []  # keys of tail[-1:], tail[-2:], ...: shortest first, cut at the first id >= vocab_bound
        key, place = 0, 1
        for t in reversed(tail):
            if t >= bound:
                break
            key += (t + 1) * place
            place *= base
            suffix_keys.append(key)
        for ck in reversed(suffix_keys):
            first = ck * base + 1  # children of ck: keys first .. first + vocab_bound - 1
            lo = int(keys.searchsorted(first))
            hi = int(keys.searchsorted(first + bound))
            if lo == hi:
                continue
            child = counts[lo:hi].astype(np.int64)  # [M]
            kept = None  # positions in lo..hi of the children when some counts are 0 (not children: `probability`)
            if not child.all():
                kept = np.flatnonzero(child)
                if kept.size == 0:
                    continue
                child = child[kept]
            at = int(keys.searchsorted(ck))
            total = max(int(counts[at]) if at < keys.size and keys[at] == ck else 0, 1)
            child = np.minimum(child, total)
            # one sort key per child: larger count first, then the earlier position (= smaller token)
            rank = (total - child) * child.size + np.arange(child.size)
            if child.size > k:
                pick = np.argpartition(rank, k - 1)[:k]
                pick = pick[np.argsort(rank[pick])]
            else:
                pick = np.argsort(rank)
            positions = lo + (pick if kept is None else kept[pick])
            tokens = (keys[positions] - first).tolist()
            return [(t, c / total) for t, c in zip(tokens, child[pick].tolist())]
        return []

    def batch_probability(self, contexts: torch.Tensor, tokens: torch.Tensor,
                          validate: Optional[bool] = None) -> torch.Tensor:
        """q values [N, M] float32 for candidate `tokens` [N, M] after `contexts` [N, C], row by row.

        contexts: the last C tokens of each context, right-aligned and left-padded with -1 (all -1 = empty context);
        only the last order-1 columns matter. Candidate ids >= vocab_bound get q = 0. `validate` (default: only on
        CPU, where it costs no device sync) raises ValueError for negative candidates or context ids below -1;
        unvalidated, those get q = 0 and count as absent context tokens respectively.
        """
        if not isinstance(contexts, torch.Tensor) or not isinstance(tokens, torch.Tensor):
            raise ValueError("contexts and tokens must be torch tensors")
        if contexts.dim() != 2 or tokens.dim() != 2 or contexts.shape[0] != tokens.shape[0]:
            raise ValueError(f"contexts must be [N, C] and tokens [N, M] with the same N, got "
                             f"{list(contexts.shape)} and {list(tokens.shape)}")
        for name, t in (("contexts", contexts), ("tokens", tokens)):
            if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                raise ValueError(f"{name} must hold integer token ids (int64), got {t.dtype}")
        device = self.keys.device
        if contexts.dtype != torch.int64 or contexts.device != device:
            contexts = contexts.to(device=device, dtype=torch.int64)
        if tokens.dtype != torch.int64 or tokens.device != device:
            tokens = tokens.to(device=device, dtype=torch.int64)
        n, m = tokens.shape
        width = min(self._ctx_len, contexts.shape[1])  # K: usable context columns
        ctx = contexts if contexts.shape[1] == width else contexts[:, contexts.shape[1] - width:]  # [N, K]
        if validate is None:
            validate = device.type == "cpu"
        if validate and m and n:
            if int(tokens.min()) < 0:
                raise ValueError(f"tokens hold negative candidate ids (min {int(tokens.min())})")
            if width and int(ctx.min()) < -1:
                raise ValueError(f"contexts hold ids below -1 (min {int(ctx.min())}); -1 is the only padding value")
        if width == 0 or m == 0 or n == 0 or self.num_nodes == 0 or self.vocab_bound == 0:
            return torch.zeros(n, m, dtype=torch.float32, device=device)

        # digit - 1 of every id: the id itself when in [0, vocab_bound), else vocab_bound (digit `base`: see
        # `_query_keys` for why that digit can never match a stored n-gram)
        lowered = torch.cat((ctx, tokens), 1).clamp_(-1, self.vocab_bound).remainder_(self._base)  # [N, K+M]
        fast = _FAST_PACK and device.type == "cpu" and m <= _FAST_PACK_MAX_M
        queries = self._query_keys(lowered, width, m, fast)  # [N*K*(1+M)]
        idx = torch.searchsorted(self._keys_search, queries)  # always a valid index into self.keys
        cnt = self.counts.take(idx).mul_(self.keys.take(idx) == queries).view(n, width, 1 + m)  # [N, K, 1+M]
        # per level l: [count(context suffix of length l+1), count(suffix + candidate) for each candidate]
        # [N, K, M] float32, > 0 exactly where matched; at most 1 even for a table whose counts are not those of one
        # corpus (the tree search relies on log q <= 0: `TreeConfig.draft_levels`)
        q_all = (cnt[:, :, 1:] / cnt[:, :, :1].clamp_min(1)).clamp_max_(1.0)
        levels = q_all.unbind(1)
        q = levels[0]
        for ql in levels[1:]:  # longer contexts override shorter ones where matched
            q = torch.where(ql > 0, ql, q)
        return q

    # ------------------------------------------------------------------ search state

    @property
    def state_width(self) -> int:
        """S: width of a search state (the last max(1, order-1) token ids)."""
        return max(1, self._ctx_len)

    def context_state(self, contexts: torch.Tensor) -> torch.Tensor:
        """Search states [N, S] int64 of contexts [N, C] (right-aligned, left-padded with -1), on the model device."""
        if not isinstance(contexts, torch.Tensor) or contexts.dim() != 2:
            raise ValueError(f"contexts must be an [N, C] tensor, got {getattr(contexts, 'shape', type(contexts))}")
        if contexts.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"contexts must hold integer token ids (int64), got {contexts.dtype}")
        contexts = contexts.to(device=self.keys.device, dtype=torch.int64)
        n, c = contexts.shape
        width = self.state_width
        if c >= width:
            return contexts[:, c - width:].contiguous()
        pad = torch.full((n, width - c), -1, dtype=torch.int64, device=contexts.device)
        return torch.cat((pad, contexts), 1)

    def advance_state(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """States [N, S] after appending one token per row (tokens [N])."""
        if states.dim() != 2 or tokens.dim() != 1 or tokens.shape[0] != states.shape[0]:
            raise ValueError(f"states must be [N, S] and tokens [N], got {list(states.shape)} and "
                             f"{list(tokens.shape)}")
        return torch.cat((states[:, 1:], tokens.to(states.dtype)[:, None]), 1)

    def _query_keys(self, lowered: torch.Tensor, width: int, m: int, use_matmul: bool) -> torch.Tensor:
        """Keys to look up: lowered digits [N, K+M] (digit - 1 of K context ids, then M candidates) -> [N*K*(1+M)].

        Row-major [N, K, 1+M]: for level l (context suffix of length l+1) the suffix key, then the key of suffix +
        candidate j. Digit `base` (absent, unknown or invalid id) carries into its left neighbour and leaves a 0 digit
        right of a non-zero one, a pattern no stored key has (overflow past int64 only wraps to a negative key):
        such suffixes, and every candidate after them, are unmatched, and a lookup for a shorter suffix without the
        offending id handles the back-off. Empty contexts thus match nothing.
        """
        n = lowered.shape[0]
        if use_matmul:  # one small integer matmul (CPU only) instead of a chain of broadcasts
            key = (width, m)
            packer = self._packers.get(key)
            if packer is None:
                if len(self._packers) >= 16:
                    self._packers.clear()
                packer = self._packers[key] = _query_packer(width, m, self._base, self.keys.device)
            return torch.addmm(packer[0], lowered, packer[1]).view(-1)
        digits = lowered + 1
        place = self._ctx_place[self._ctx_len - width:]  # [K]
        ctx_keys = (digits[:, :width] * place).flip(1).cumsum_(1)  # [N, K]: column l = key of the last l+1 ids
        child = torch.add(digits[:, None, width:], ctx_keys[:, :, None], alpha=self._base)  # [N, K, M]
        return torch.cat((ctx_keys[:, :, None], child), 2).view(n * width * (1 + m))


# Build the CPU query keys with one integer matmul (tests flip this to exercise the portable path on CPU too).
_FAST_PACK = True
# Largest candidate count M that uses the matmul packing (its matrix has (K+M) * K*(1+M) entries).
_FAST_PACK_MAX_M = 128


def _query_packer(width: int, m: int, base: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias [K*(1+M)], matrix [K+M, K*(1+M)]) with `bias + lowered @ matrix` = the query keys of `_query_keys`."""
    place = [base ** (width - 1 - j) for j in range(width)]  # of the K context columns, oldest first
    matrix = torch.zeros(width + m, width * (1 + m), dtype=torch.int64)
    bias = torch.zeros(width * (1 + m), dtype=torch.int64)
    for level in range(width):
        rows = range(width - 1 - level, width)  # the context columns of the suffix of length level+1
        col = level * (1 + m)
        for j in rows:
            matrix[j, col] = place[j]
            matrix[j, col + 1: col + 1 + m] = place[j] * base
        ctx_bias = sum(place[j] for j in rows)  # digits are lowered + 1
        bias[col] = ctx_bias
        bias[col + 1: col + 1 + m] = ctx_bias * base + 1
        matrix[width + torch.arange(m), col + 1 + torch.arange(m)] = 1
    return bias.to(device), matrix.to(device)


def draft_context_length(ngram: Optional["NGramModel"]) -> int:
    """Tokens of context the tree search reads per sequence (the last C tokens, ending with the root): the n-gram's
    search state width, 1 without an n-gram."""
    return ngram.state_width if ngram is not None else 1
