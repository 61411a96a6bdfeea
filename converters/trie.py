"""The official DART `.trie` n-gram file: a byte-exact writer and a streamed converter to `NGramModel`.

Official format (little-endian, no padding; the reference's `TrieNgram::save`):

    u64 order, u64 node_count
    node_count x node:  i32 token, u64 parent, i32 freq, u64 n_children,
                        then n_children x (i32 child_token, u64 child_id)

Node i is the i-th record (node 0 = root; the reference writes token 0 and parent 0 for it). `freq` of a node is the
number of windows `seq[i : i + order]` that begin with the node's n-gram, which is `NGramModel.count`. Children come
in any order. The reference appends nodes as it creates them, so parents precede children there; the reader does not
rely on it (see `read_official_trie`).

Every record starts at a file offset that is a multiple of 4 (header 16 bytes, node 24 + 12 * n_children bytes), so
the reader views each chunk as uint32 words and works on word offsets.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Optional, Union

import numpy as np
import torch

from dart_core.errors import DartInputError
from dart_core.ngram import NGramModel

HEADER = struct.Struct("<QQ")  # order, node_count
NODE = struct.Struct("<iQiQ")  # token, parent, freq, n_children
CHILD = struct.Struct("<iQ")  # child_token, child_id
HEADER_BYTES, NODE_BYTES, CHILD_BYTES = HEADER.size, NODE.size, CHILD.size  # 16, 24, 12
NODE_WORDS, CHILD_WORDS = NODE_BYTES // 4, CHILD_BYTES // 4  # 6, 3

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_MAX_ORDER = 62  # the largest order whose int64 key space holds a base of at least 2
_REC, _LISTED = np.uint8(1), np.uint8(2)  # per-node flags: own record resolved, named by its parent's child list

DEFAULT_CHUNK_BYTES = 4 << 20  # measured: as fast as 8-32 MiB, far smaller transients
NODE_ORDERS = ("bfs", "dfs", "random", "children-first")


class TrieFormatError(DartInputError):
    """The `.trie` file is truncated, corrupt or inconsistent; the message names the byte offset."""


# =====================================================================================================================
# helpers shared by the writer and the reader
# =====================================================================================================================


def max_key_base(order: int) -> int:
    """Largest base b with b**order <= 2**63 - 1: the widest digit range an int64 key of `order` digits holds."""
    if order < 1:
        raise DartInputError(f"n-gram order must be >= 1, got {order}")
    b = int(round(_INT64_MAX ** (1.0 / order)))
    while b ** order > _INT64_MAX:
        b -= 1
    while (b + 1) ** order <= _INT64_MAX:
        b += 1
    return b


def key_depths(keys: np.ndarray, base: int, order: int) -> np.ndarray:
    """Depth (n-gram length) of packed keys [N] int64 -> [N] int64: the key of an n-gram of length d lies in
    [base**(d-1), base**d) because every digit is >= 1."""
    bounds = np.array([base ** d for d in range(order)], dtype=np.int64)  # [order]: 1, base, base**2, ...
    return np.searchsorted(bounds, keys, side="right").astype(np.int64)


def decode_key(key: int, base: int) -> tuple[int, ...]:
    """The n-gram (token ids) of one packed key."""
    out = []
    while key > 0:
        key, digit = divmod(int(key), base)
        out.append(digit - 1)
    return tuple(reversed(out))


def _u64(words: np.ndarray, at: np.ndarray) -> np.ndarray:
    """u64 values stored in words[at] (low) and words[at + 1] (high) -> [len(at)] uint64."""
    return words[at].astype(np.uint64) | (words[at + 1].astype(np.uint64) << np.uint64(32))


# =====================================================================================================================
# writer
# =====================================================================================================================


def _model_arrays(source, order: Optional[int]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(sorted keys [N] int64, counts [N] int64, base, order) of an NGramModel or of token sequences."""
    if isinstance(source, NGramModel):
        if order is not None and int(order) != source.order:
            raise DartInputError(f"order {order} given but the model has order {source.order}")
        model = source
    else:
        if order is None:
            raise DartInputError("order is required when writing token sequences")
        model = NGramModel.build(source, order=int(order))
    keys = model.keys.cpu().numpy().astype(np.int64, copy=False)
    counts = model.counts.cpu().numpy().astype(np.int64)
    if keys.size == 0 or keys[0] != 0:  # an empty model still has a root in the official format
        keys = np.concatenate(([0], keys)).astype(np.int64)
        counts = np.concatenate(([0], counts)).astype(np.int64)
    return keys, counts, model.vocab_bound + 1, model.order


def _node_ids(keys: np.ndarray, parent_idx: np.ndarray, depth: np.ndarray, base: int, order: int, node_order: str,
              rng: np.random.Generator, shuffle: bool = True) -> np.ndarray:
    """New node id [N] of each sorted key; id 0 is the root in every layout.

    bfs: level by level, siblings in random order (ascending token when not `shuffle`); dfs: pre-order (parents
    first, like the reference's creation order), siblings in a random token order; random: a random permutation
    (children often precede parents); children-first: bfs reversed, so every non-root node comes before its parent.
    """
    n = keys.size
    new_id = np.zeros(n, dtype=np.int64)
    if node_order in ("bfs", "children-first"):
        next_id = 1
        for d in range(1, order + 1):
            members = np.flatnonzero(depth == d)
            if members.size == 0:
                continue
            # by parent's new id; siblings shuffled (or by token when not shuffling: the canonical layout)
            sibling = rng.random(members.size) if shuffle else keys[members]
            ranked = members[np.lexsort((sibling, new_id[parent_idx[members]]))]
            new_id[ranked] = np.arange(next_id, next_id + ranked.size)
            next_id += ranked.size
        if node_order == "children-first":
            new_id[1:] = n - new_id[1:]  # 1..n-1 reversed
    elif node_order == "dfs":
        relabel = rng.permutation(base - 1) + 1  # digit -> shuffled digit (1..base-1), the sibling order
        padded = np.zeros(n, dtype=np.int64)  # shuffled digits, left-aligned to `order` places: sorted = pre-order
        rest, place = keys.copy(), np.ones(n, dtype=np.int64)
        for _ in range(order):
            digit = rest % base
            rest //= base
            mapped = np.where(digit > 0, relabel[np.maximum(digit - 1, 0)], 0)
            padded += mapped * place
            place *= base
        shift = np.array([base ** (order - d) for d in range(order + 1)], dtype=np.int64)[depth]
        padded = padded * shift
        new_id[np.argsort(padded, kind="stable")] = np.arange(n)
    elif node_order == "random":
        new_id[1:] = rng.permutation(n - 1) + 1
    else:
        raise DartInputError(f"node_order must be one of {NODE_ORDERS}, got {node_order!r}")
    return new_id


def write_official_trie(path: Union[str, os.PathLike], seqs_or_model, order: Optional[int] = None, *,
                        node_order: str = "bfs", shuffle_children: bool = True, seed: int = 0,
                        root_token: int = 0, root_parent: int = 0, nodes_per_block: int = 1 << 20) -> dict:
    """Write token sequences (or an `NGramModel`) as an official DART `.trie` file, byte for byte.

    `node_order` picks the node ids (see `_node_ids`); `shuffle_children` writes each child list (and bfs siblings)
    in random order, else ascending token: `node_order="bfs", shuffle_children=False` is a canonical layout.
    The root record carries `root_token` / `root_parent` (the reference writes 0 / 0) and freq = the number of
    windows. Written in blocks of `nodes_per_block` nodes. Returns {"nodes", "bytes", "order"}.
    """
    keys, counts, base, order = _model_arrays(seqs_or_model, order)
    if int(counts.max(initial=0)) > _INT32_MAX:
        raise DartInputError(f"count {int(counts.max())} does not fit the i32 freq field of the official format")
    rng = np.random.default_rng(seed)
    n = keys.size
    depth = key_depths(keys, base, order)  # [N]
    parent_idx = np.searchsorted(keys, keys // base)  # [N] index of each node's parent (root: itself)
    token = keys % base - 1  # [N] last token of each n-gram (root: -1, replaced below)
    new_id = _node_ids(keys, parent_idx, depth, base, order, node_order, rng, shuffle_children)

    # per new id: token, parent id, freq
    by_id = np.empty(n, dtype=np.int64)
    by_id[new_id] = np.arange(n)  # [N] sorted index of node with new id i
    tok_id = token[by_id]
    tok_id[0] = root_token
    par_id = new_id[parent_idx[by_id]]
    par_id[0] = root_parent
    freq_id = counts[by_id]

    # children grouped by parent id, each group in random (or token) order
    child_ids = np.arange(1, n)  # new ids of the non-root nodes
    tiebreak = rng.random(n - 1) if shuffle_children else tok_id[child_ids].astype(np.float64)
    child_ids = child_ids[np.lexsort((tiebreak, par_id[child_ids]))]  # [N-1]
    n_children = np.bincount(par_id[1:], minlength=n).astype(np.int64)  # [N]
    child_start = np.concatenate(([0], np.cumsum(n_children)))  # [N+1] into child_ids

    tmp = os.fspath(path) + ".partial"
    try:
        written = _write_records(tmp, order, n, tok_id, par_id, freq_id, child_ids, n_children, child_start,
                                 nodes_per_block)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"nodes": int(n), "bytes": written, "order": int(order)}


def _write_records(tmp: str, order: int, n: int, tok_id, par_id, freq_id, child_ids, n_children, child_start,
                   nodes_per_block: int) -> int:
    """Serialise the header and node records (by new id) to `tmp` in blocks; returns the bytes written."""
    written = 0
    with open(tmp, "wb") as fh:
        fh.write(HEADER.pack(order, n))
        written += HEADER_BYTES
        for a in range(0, n, nodes_per_block):
            b = min(n, a + nodes_per_block)
            nch = n_children[a:b]  # [m]
            rec_words = NODE_WORDS + CHILD_WORDS * nch  # [m]
            rec_at = np.concatenate(([0], np.cumsum(rec_words)[:-1]))  # [m] word offset of each record in the block
            words = np.zeros(int(rec_words.sum()), dtype=np.uint32)
            words[rec_at] = tok_id[a:b].astype(np.int32).view(np.uint32)
            words[rec_at + 1] = par_id[a:b] & 0xFFFFFFFF
            words[rec_at + 2] = par_id[a:b] >> 32
            words[rec_at + 3] = freq_id[a:b].astype(np.int32).view(np.uint32)
            words[rec_at + 4] = nch & 0xFFFFFFFF
            words[rec_at + 5] = nch >> 32
            kids = child_ids[child_start[a]:child_start[b]]  # [E] the children of nodes a..b-1, grouped
            first = np.repeat(rec_at + NODE_WORDS - CHILD_WORDS * (np.cumsum(nch) - nch), nch)
            at = first + CHILD_WORDS * np.arange(kids.size)  # [E] word offset of each child entry
            words[at] = tok_id[kids].astype(np.int32).view(np.uint32)
            words[at + 1] = kids & 0xFFFFFFFF
            words[at + 2] = kids >> 32
            fh.write(words.astype("<u4", copy=False).tobytes())
            written += words.size * 4
    return written


# =====================================================================================================================
# reader
# =====================================================================================================================


def record_starts(words: np.ndarray, limit: int, jump_log2: int = 3) -> tuple[np.ndarray, int]:
    """Word offsets [m] of the complete node records at the start of `words` (uint32 view of a buffer that begins at
    a record) and the word offset just past the last of them; at most `limit` records.

    Vectorised: `nxt[w]` is where a record starting at word w would end (W + 1 when it would not fit); the records
    are the orbit of 0 under `nxt`. A short Python loop follows `nxt` in jumps of 2**jump_log2 records (`nxt`
    composed with itself by repeated squaring), then all orbit points are filled in with one gather per step.
    """
    w_total = int(words.size)
    end_sentinel, over = w_total, w_total + 1
    idx_type = np.int32 if 4 * w_total + NODE_WORDS < 2**31 else np.int64
    nxt = np.full(w_total + 2, over, dtype=idx_type)  # [W+2]
    nxt[end_sentinel] = end_sentinel
    if w_total >= NODE_WORDS:
        span = w_total - NODE_WORDS + 1  # candidate starts whose 6-word header fits
        ends = np.minimum(words[4:4 + span], w_total).astype(idx_type)  # low word of n_children, clipped
        ends *= CHILD_WORDS
        ends += np.arange(NODE_WORDS, NODE_WORDS + span, dtype=idx_type)
        ends[(words[5:5 + span] != 0) | (ends > w_total)] = over  # high word set or past the buffer: no fit
        nxt[:span] = ends
        del ends
    jump = nxt
    for _ in range(jump_log2):
        jump = jump[jump]
    step = 1 << jump_log2
    starts = []
    p, blocks_needed = 0, -(-limit // step)
    get = jump.item
    while p < w_total and len(starts) < blocks_needed:
        starts.append(p)
        p = get(p)
    del jump
    if not starts:
        return np.zeros(0, dtype=np.int64), 0
    pos = np.empty((step, len(starts)), dtype=idx_type)  # [step, blocks]
    pos[0] = starts
    for s in range(1, step):
        pos[s] = nxt[pos[s - 1]]
    orbit = pos.T.reshape(-1)  # block by block: file order
    orbit = orbit[:np.count_nonzero(orbit < w_total)].astype(np.int64)  # increasing until a sentinel
    if orbit.size and nxt[orbit[-1]] == over:
        orbit = orbit[:-1]  # the last record does not fit in the buffer
    orbit = orbit[:limit]
    end = int(nxt[orbit[-1]]) if orbit.size else 0
    return orbit, end


class _TrieState:
    """Keys and counts of every node while the file streams past (13 bytes per node).

    keys   [N] int64: packed key of each node id in the provisional base (-1 = not known yet)
    counts [N] int32: freq of each node id
    flags  [N] uint8: _REC once the node's own record was resolved, _LISTED once its parent's child list named it
    """

    def __init__(self, node_count: int, order: int, base: int, token_limit: int, path: str):
        self.n, self.order, self.base, self.token_limit, self.path = node_count, order, base, token_limit, path
        self.keys = np.full(node_count, -1, dtype=np.int64)
        self.keys[0] = 0
        self.counts = np.zeros(node_count, dtype=np.int32)
        self.flags = np.zeros(node_count, dtype=np.uint8)
        self.flags[0] = _REC | _LISTED
        self.deepest_parent = base ** (order - 1)  # keys >= this lie at depth `order`: they have no children
        self.max_token = -1
        self.entries = 0
        self.root_freq = 0
        self.first_unresolved: Optional[str] = None
        self.vocab_given = False

    def fail(self, message: str) -> None:
        raise TrieFormatError(f"{self.path}: {message}")

    # ---- checks of one chunk -----------------------------------------------------------------------------------
    def validate(self, ids, tok, parent, freq, nch, rec_off, owner, ctok, cid, ent_off) -> None:
        """Range checks of the records [m] and child entries [E] of one chunk (first pass only)."""
        n, limit = self.n, self.token_limit

        def first(mask: np.ndarray) -> Optional[int]:
            """Index of the first True (file order) or None."""
            hits = np.flatnonzero(mask)
            return int(hits[0]) if hits.size else None

        nonroot = ids != 0
        i = first(nch > n - 1)
        if i is not None:
            self.fail(f"node {ids[i]} at byte offset {rec_off[i]} claims {nch[i]} children but the file has only "
                      f"{n} nodes (corrupt)")
        i = first(nonroot & ((tok < 0) | (tok > limit)))
        if i is not None:
            self.fail(f"node {ids[i]} at byte offset {rec_off[i]} has token id {tok[i]} outside "
                      f"{self._token_range()}")
        i = first(nonroot & (parent >= np.uint64(n)))
        if i is not None:
            self.fail(f"node {ids[i]} at byte offset {rec_off[i]} has parent id {parent[i]} but the file has only "
                      f"{n} nodes (ids 0..{n - 1})")
        i = first(nonroot & (freq < 0))
        if i is not None:
            self.fail(f"node {ids[i]} at byte offset {rec_off[i]} has a negative freq {freq[i]}")
        i = first(cid >= np.uint64(n))
        if i is not None:
            self.fail(f"child entry at byte offset {ent_off[i]} (in the list of node {owner[i]}) names child id "
                      f"{cid[i]} but the file has only {n} nodes (ids 0..{n - 1})")
        i = first(cid == 0)
        if i is not None:
            self.fail(f"child entry at byte offset {ent_off[i]} (in the list of node {owner[i]}) names the root "
                      "(node 0) as a child")
        i = first((ctok < 0) | (ctok > limit))
        if i is not None:
            self.fail(f"child entry at byte offset {ent_off[i]} (in the list of node {owner[i]}) has token id "
                      f"{ctok[i]} outside {self._token_range()}")

    def _token_range(self) -> str:
        return f"0..{self.token_limit}" + (" (vocab size)" if self.vocab_given else " (the int64 key space)")

    # ---- key resolution ----------------------------------------------------------------------------------------
    def resolve(self, ids, tok, parent, rec_off, owner, ctok, cid, ent_off, first_pass: bool) -> int:
        """Give keys to the chunk's nodes from both sources, checking they agree; returns how many records and
        entries are still unresolved (their parent's key is not known yet: another pass picks them up)."""
        keys, flags, base = self.keys, self.flags, self.base
        r = np.flatnonzero((flags[ids] & _REC) == 0)  # pending records
        e = np.arange(cid.size) if first_pass else np.flatnonzero((flags[cid] & _LISTED) == 0)  # pending entries
        while r.size or e.size:
            progressed = False
            if r.size:
                pk = keys[parent[r]]
                known = pk >= 0
                if known.any():
                    rr, pk = r[known], pk[known]
                    self._check_depth(pk, ids[rr], rec_off[rr])
                    new = pk * base + tok[rr] + 1
                    node = ids[rr]
                    cur = keys[node]
                    bad = np.flatnonzero((cur >= 0) & (cur != new))
                    if bad.size:
                        j = rr[bad[0]]
                        self.fail(f"node {ids[j]} at byte offset {rec_off[j]} (token {tok[j]}, parent {parent[j]}) "
                                  "does not match the child-list entry that names it (other token or other parent)")
                    keys[node] = new
                    flags[node] |= _REC
                    r = r[~known]
                    progressed = True
            if e.size:
                pk = keys[owner[e]]
                known = pk >= 0
                if known.any():
                    ee, pk = e[known], pk[known]
                    self._check_depth(pk, owner[ee], ent_off[ee], entry=True)
                    new = pk * base + ctok[ee] + 1
                    node = cid[ee]
                    cur = keys[node]
                    bad = np.flatnonzero((cur >= 0) & (cur != new))
                    if bad.size:
                        j = ee[bad[0]]
                        self.fail(f"child entry at byte offset {ent_off[j]} says node {cid[j]} is the child of node "
                                  f"{owner[j]} with token {ctok[j]}, but node {cid[j]}'s own record disagrees "
                                  "(other token or other parent)")
                    if first_pass:
                        dup = np.flatnonzero(flags[node] & _LISTED)
                        if dup.size:
                            j = ee[dup[0]]
                            self.fail(f"child entry at byte offset {ent_off[j]} names node {cid[j]}, which another "
                                      "child list already names")
                    keys[node] = new
                    flags[node] |= _LISTED
                    e = e[~known]
                    progressed = True
            if not progressed:
                break
        if (r.size or e.size) and self.first_unresolved is None:
            if r.size:
                j = r[0]
                self.first_unresolved = (f"node {ids[j]} at byte offset {rec_off[j]} (parent {parent[j]}): its parent "
                                         "chain never reaches the root (a cycle or an orphan)")
            else:
                j = e[0]
                self.first_unresolved = (f"child entry at byte offset {ent_off[j]} of node {owner[j]}: node "
                                         f"{owner[j]} is not reachable from the root (a cycle or an orphan)")
        return int(r.size + e.size)

    def _check_depth(self, parent_keys, nodes, offsets, entry: bool = False) -> None:
        deep = np.flatnonzero(parent_keys >= self.deepest_parent)
        if deep.size:
            j = deep[0]
            what = (f"child entry at byte offset {offsets[j]} (in the list of node {nodes[j]})" if entry
                    else f"node {nodes[j]} at byte offset {offsets[j]}")
            self.fail(f"{what} lies at depth > order {self.order} given in the header (wrong order?)")


class _ChunkReader:
    """Reads a `.trie` file in large chunks and yields the complete records of each, parsed into numpy arrays."""

    def __init__(self, path: str, node_count: int, chunk_bytes: int, fail):
        self.path, self.n, self.chunk_bytes, self.fail = path, node_count, max(int(chunk_bytes), 1 << 12), fail
        self.size = os.path.getsize(path)

    def chunks(self):
        """Yield (ids [m], tok, parent, freq, nch, rec_off, owner [E], ctok, cid, ent_off) per chunk."""
        buf = np.empty(self.chunk_bytes, dtype=np.uint8)
        done, filled, buf_off = 0, 0, HEADER_BYTES  # nodes parsed, bytes in buf, file offset of buf[0]
        with open(self.path, "rb") as fh:
            fh.seek(HEADER_BYTES)
            eof = False
            while done < self.n:
                if not eof and filled < buf.size:
                    got = fh.readinto(memoryview(buf)[filled:])
                    filled += got
                    eof = got == 0 or fh.tell() >= self.size
                usable = filled - filled % 4
                words = buf[:usable].view("<u4")
                rec, end = record_starts(words, self.n - done)
                if rec.size == 0:
                    buf = self._grow_for_first(buf, filled, buf_off, eof, done)
                    continue
                yield self._parse(words, rec, done, buf_off)
                done += rec.size
                consumed = end * 4
                buf[:filled - consumed] = buf[consumed:filled]
                filled -= consumed
                buf_off += consumed
            remaining = filled + max(self.size - fh.tell(), 0)
            if remaining:
                self.fail(f"{remaining} trailing byte(s) after the last node (node {self.n - 1}), from byte offset "
                          f"{buf_off}")

    def _grow_for_first(self, buf, filled, buf_off, eof, done):
        """The first record in the buffer is incomplete: read on (bigger buffer) or report truncation."""
        need = NODE_BYTES
        if filled >= NODE_BYTES:
            nch = int.from_bytes(bytes(buf[16:24]), "little")
            if nch > self.n - 1:
                self.fail(f"node {done} at byte offset {buf_off} claims {nch} children but the file has only "
                          f"{self.n} nodes (corrupt)")
            need = NODE_BYTES + CHILD_BYTES * nch
        if eof:
            part = "header" if filled < NODE_BYTES else "child list"
            self.fail(f"truncated: node {done} starts at byte offset {buf_off} and needs {need} bytes but the file "
                      f"ends at byte offset {buf_off + filled} (inside its {part}; {done} of {self.n} nodes read)")
        if need > buf.size:
            bigger = np.empty(max(need, 2 * buf.size), dtype=np.uint8)
            bigger[:filled] = buf[:filled]
            return bigger
        return buf  # the buffer was not full yet: the next read completes the record

    @staticmethod
    def _parse(words, rec, first_id, buf_off):
        m = rec.size
        ids = np.arange(first_id, first_id + m, dtype=np.int64)
        tok = words[rec].view(np.int32).astype(np.int64)
        parent = _u64(words, rec + 1)
        freq = words[rec + 3].view(np.int32)
        nch = _u64(words, rec + 4).astype(np.int64)  # fits: the record ends inside the buffer
        rec_off = buf_off + 4 * rec
        total = int(nch.sum())
        at = np.repeat(rec + NODE_WORDS - CHILD_WORDS * (np.cumsum(nch) - nch), nch) + CHILD_WORDS * np.arange(total)
        owner = np.repeat(ids, nch)
        ctok = words[at].view(np.int32).astype(np.int64)
        cid = _u64(words, at + 1)
        ent_off = buf_off + 4 * at
        return ids, tok, parent, freq, nch, rec_off, owner, ctok, cid, ent_off


def read_trie_header(path: Union[str, os.PathLike], strict_size: bool = True) -> tuple[int, int]:
    """(order, node_count) of a `.trie` file; with `strict_size`, the file size must be exactly what that many nodes
    take (fails fast on truncated downloads and appended bytes, before any streaming)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"n-gram trie not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise TrieFormatError(f"{path}: truncated header: the file has {size} bytes, the header needs "
                              f"{HEADER_BYTES} (byte offset 0)")
    order, node_count = HEADER.unpack(head)
    if not 1 <= order <= _MAX_ORDER:
        raise TrieFormatError(f"{path}: header at byte offset 0 gives n-gram order {order}; expected 1..{_MAX_ORDER} "
                              "(not a DART .trie file?)")
    if node_count < 1:
        raise TrieFormatError(f"{path}: header at byte offset 8 gives {node_count} nodes; a trie has at least the root")
    if strict_size:
        # every non-root node is named by exactly one child entry, so a valid file has exactly this size
        expected = HEADER_BYTES + NODE_BYTES * node_count + CHILD_BYTES * (node_count - 1)
        if size < expected:
            raise TrieFormatError(
                f"{path}: truncated: {node_count} nodes (header, byte offset 8) take exactly {expected} bytes but the "
                f"file ends at byte offset {size} ({expected - size} bytes missing)")
        if size > expected:
            raise TrieFormatError(
                f"{path}: {size - expected} trailing byte(s) from byte offset {expected}, where the {node_count} nodes "
                "of the header end (garbage appended, or a wrong node count)")
    return int(order), int(node_count)


def read_official_trie(path: Union[str, os.PathLike], vocab_size: Optional[int] = None, progress=True,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES, strict_size: bool = True) -> tuple[NGramModel, dict]:
    """Stream an official `.trie` file into an `NGramModel`.

    Memory follows the output, never the input: 13 bytes per node while streaming (key, count, flags), ~24 at the
    sort, plus ~50 MB of chunk buffers; the file is read in `chunk_bytes` pieces.

    Keys are built in a provisional base (the widest the int64 key space allows for the order, or vocab_size + 1)
    from two independent sources — each record's (parent, token) and its parent's child-list entry — which must
    agree. Records whose parent's key is not known yet (a child stored before its parent in another chunk) are
    picked up by another pass over the file; a pass without progress means a cycle or orphan and fails.
    Then the keys are re-encoded to base max_token + 2 (or vocab_size + 1), sorted, and counts are checked
    (every non-root n-gram's count >= the sum of its children's). The root's freq is kept unless it is below the
    sum of its children's (the reference's `reduce` leaves it negative): then that sum, capped to int32, is used.

    `progress`: True shows a tqdm bar, None only on a terminal, False never. Returns (model, stats).
    """
    from tqdm.auto import tqdm

    path = os.fspath(path)
    t0 = time.perf_counter()
    order, n = read_trie_header(path, strict_size=strict_size)
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise DartInputError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if (int(vocab_size) + 1) ** order > _INT64_MAX:
            raise DartInputError(f"vocab size {vocab_size} with the trie's order {order} does not fit the int64 key "
                                 f"space of NGramModel ((vocab size + 1) ** order > 2**63 - 1)")
        base, token_limit = int(vocab_size) + 1, int(vocab_size) - 1
    else:
        base = max_key_base(order)
        token_limit = base - 2
    state = _TrieState(n, order, base, token_limit, path)
    state.vocab_given = vocab_size is not None
    reader = _ChunkReader(path, n, chunk_bytes, state.fail)

    passes, pending = 0, None
    disable = None if progress is None else not progress
    while True:
        passes += 1
        first = passes == 1
        state.first_unresolved = None
        unresolved = 0
        desc = "trie -> n-gram" if first else f"trie -> n-gram (pass {passes})"
        with tqdm(total=n, desc=desc, unit=" nodes", unit_scale=True, disable=disable, smoothing=0.1) as bar:
            for ids, tok, parent, freq, nch, rec_off, owner, ctok, cid, ent_off in reader.chunks():
                if first:
                    state.validate(ids, tok, parent, freq, nch, rec_off, owner, ctok, cid, ent_off)
                    state.counts[ids] = freq
                    if ids[0] == 0:
                        state.root_freq = int(freq[0])
                    state.entries += int(cid.size)
                    nonroot = tok[1:] if ids[0] == 0 else tok
                    if nonroot.size:
                        state.max_token = max(state.max_token, int(nonroot.max()))
                    if ctok.size:
                        state.max_token = max(state.max_token, int(ctok.max()))
                parent_ids = parent.astype(np.int64)
                if ids[0] == 0:
                    parent_ids[0] = 0
                unresolved += state.resolve(ids, tok, parent_ids, rec_off, owner, ctok, cid.astype(np.int64),
                                            ent_off, first)
                bar.update(ids.size)
        if first and state.entries != n - 1:
            state.fail(f"the child lists name {state.entries} nodes but the file has {n - 1} non-root nodes "
                       "(every non-root node must be listed by its parent exactly once)")
        if unresolved == 0:
            break
        if pending is not None and unresolved >= pending:
            state.fail(state.first_unresolved or "unresolved nodes")
        pending = unresolved

    unlisted = np.flatnonzero(state.flags != (_REC | _LISTED))
    if unlisted.size:
        state.fail(f"node {unlisted[0]} is not listed in its parent's child list")
    del state.flags

    vocab_bound = int(vocab_size) if vocab_size is not None else state.max_token + 1
    keys, counts = state.keys, state.counts
    del state.keys, state.counts
    final_base = vocab_bound + 1
    with tqdm(total=3, desc="n-gram: rebase, sort, check", unit=" step", disable=disable) as bar:
        if final_base != base:
            _rebase_inplace(keys, base, final_base, order)
        bar.update(1)
        counts = _sort_by_key(keys, counts)
        bar.update(1)
        root_count = _check_counts(keys, counts, final_base, order, path)
        bar.update(1)
    root_fixed = root_count != state.root_freq
    counts[0] = root_count
    model = NGramModel.from_counts(torch.from_numpy(keys), torch.from_numpy(counts), order, vocab_bound)
    seconds = time.perf_counter() - t0
    stats = {"source": path, "order": order, "nodes": n, "vocab_bound": vocab_bound, "max_token": state.max_token,
             "passes": passes, "input_bytes": os.path.getsize(path), "seconds": seconds,
             "nodes_per_s": n / seconds if seconds > 0 else float("inf"), "root_freq_in_file": state.root_freq,
             "root_count": root_count, "root_count_replaced": root_fixed}
    return model, stats


def _sort_by_key(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sort `keys` [N] in place and return `counts` [N] in the same order.

    Peak extra memory ~16 bytes per node (the int64 permutation + timsort's buffer), and the permutation is freed
    before the keys are sorted. Timsort ("stable") because files keep long presorted runs (a parent-first layout is
    close to key order), where it beats quicksort several times over; on random orders it is about as fast."""
    order = np.argsort(keys, kind="stable")
    counts = counts[order]
    del order
    keys.sort(kind="stable")
    return counts


def _rebase_inplace(keys: np.ndarray, old: int, new: int, order: int, chunk: int = 1 << 22) -> None:
    """Re-encode packed keys [N] from base `old` to base `new` (every digit < new), chunk by chunk."""
    for s in range(0, keys.size, chunk):
        rest = keys[s:s + chunk].copy()
        out = np.zeros_like(rest)
        place = np.ones_like(rest)
        for _ in range(order):
            out += (rest % old) * place
            rest //= old
            place *= new
        keys[s:s + chunk] = out


def _check_counts(keys: np.ndarray, counts: np.ndarray, base: int, order: int, path: str,
                  chunk: int = 1 << 22) -> int:
    """Checks sorted unique keys and count consistency; returns the root count to store.

    Children of the n-gram with key p are exactly the keys p*base + 1 .. p*base + base - 1, so in sorted order they
    form one run of equal `key // base`; each non-root n-gram's count must be >= the sum over its run.
    """
    n = keys.size
    if n > 1:
        for s in range(0, n - 1, chunk):
            seg = keys[s:s + chunk + 1]
            dup = np.flatnonzero(seg[1:] == seg[:-1])
            if dup.size:
                raise TrieFormatError(f"{path}: two nodes stand for the same n-gram "
                                      f"{decode_key(int(seg[dup[0]]), base)} (a child list names one token twice)")
    root_children = 0
    carry_key, carry_sum = -1, 0  # the run that continues across a chunk boundary
    for s in range(1, n, chunk):
        k = keys[s:s + chunk]
        parents = k // base
        c = counts[s:s + chunk].astype(np.int64)
        starts = np.flatnonzero(np.concatenate(([True], parents[1:] != parents[:-1])))
        run_parent = parents[starts]
        run_sum = np.add.reduceat(c, starts)
        if carry_key >= 0:
            if run_parent[0] == carry_key:
                run_sum[0] += carry_sum
            else:
                run_parent = np.concatenate(([carry_key], run_parent))
                run_sum = np.concatenate(([carry_sum], run_sum))
        last_open = s + chunk < n
        if last_open:  # the last run may continue in the next chunk
            carry_key, carry_sum = int(run_parent[-1]), int(run_sum[-1])
            run_parent, run_sum = run_parent[:-1], run_sum[:-1]
        else:
            carry_key = -1
        is_root = run_parent == 0
        if is_root.any():
            root_children += int(run_sum[is_root].sum())
        run_parent, run_sum = run_parent[~is_root], run_sum[~is_root]
        if run_parent.size:
            at = np.searchsorted(keys, run_parent)
            parent_count = counts[at].astype(np.int64)
            bad = np.flatnonzero(parent_count < run_sum)
            if bad.size:
                j = bad[0]
                raise TrieFormatError(
                    f"{path}: n-gram {decode_key(int(run_parent[j]), base)} has count {parent_count[j]} but its "
                    f"continuations' counts sum to {run_sum[j]} (a node's freq must be >= its children's sum)")
    root = int(counts[0])
    return root if root >= root_children else min(root_children, _INT32_MAX)


def convert_trie(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], vocab_size: Optional[int] = None,
                 force: bool = False, progress=True, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """Official `.trie` -> this project's n-gram file (`NGramModel.save`, atomic). Returns stats (see
    `read_official_trie`) plus output_bytes and bytes_per_node. Refuses an existing `dst` unless `force`."""
    from dart_core.io import check_output_file

    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"n-gram trie not found: {src}")
    check_output_file(dst, force, sources=(src,))
    model, stats = read_official_trie(src, vocab_size=vocab_size, progress=progress, chunk_bytes=chunk_bytes)
    model.save(dst)
    size = os.path.getsize(dst)
    stats.update(output=dst, output_bytes=size, bytes_per_node=size / stats["nodes"],
                 input_bytes_per_node=stats["input_bytes"] / stats["nodes"])
    return stats

