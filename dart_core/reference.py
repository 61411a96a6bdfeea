"""Slow, obviously-correct re-derivations of docs/DESIGN.md §2.3-2.4 and §2.6-2.7 (dict-based n-gram trie, list-based
beam search, brute-force context paths and merged trees, a row's paths with a store of earlier outputs, trees from
proposals alone). They are the yardstick the vectorised implementations are tested and benchmarked against; never used
for decoding.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from dart_core.config import MAX_TREE_NODES


class DictTrie:
    """A dict-of-counts n-gram store built by walking windows (docs/DESIGN.md §2.4), independent of NGramModel."""

    def __init__(self, seqs, order):
        self.order, self.counts = order, {}
        for seq in seqs:
            for i in range(len(seq)):
                window = tuple(seq[i:i + order])
                for n in range(len(window) + 1):
                    self.counts[window[:n]] = self.counts.get(window[:n], 0) + 1

    def q(self, context, token):
        for n in range(min(self.order - 1, len(context)), 0, -1):
            ctx = tuple(context[-n:])
            child = self.counts.get(ctx + (token,), 0)
            if child:
                return np.float32(child) / np.float32(self.counts[ctx])
        return np.float32(0.0)


def reference_tree(tokens, probs, context, trie, cfg):
    """Slow beam search over Python lists. Returns {token path: score} of the selected nodes (root excluded)."""
    levels, k = tokens.shape
    log_p = torch.log(probs.float() + 1e-10).numpy()  # the same elementwise log as production, the search is ours
    f32 = np.float32
    beams = [((), f32(0.0))]
    pool = []  # (path, score) in generation order: level by level, beam by beam, token by token
    for level in range(levels):
        lw, ow = f32((level + 1) ** -cfg.level_weight_exponent), f32(cfg.logit_weight_decay ** level)
        ext = []
        for path, score in beams:
            for j in range(k):
                tok = int(tokens[level, j])
                term = f32(log_p[level, j] * ow)
                if level > 0 and trie is not None and cfg.ngram_weight > 0:
                    q = trie.q(list(context) + list(path), tok)
                    lq = torch.log(torch.tensor([q + f32(1e-10)], dtype=torch.float32)).numpy()[0]
                    term = f32(term + f32(lq * f32(cfg.ngram_weight)))
                ext.append((path + (tok,), f32(score + f32(lw * term))))
        pool.extend(ext)
        is_eos = lambda p: cfg.eos_token_id is not None and p[-1] == cfg.eos_token_id  # noqa: E731
        beams = sorted(ext, key=lambda e: (is_eos(e[0]), -e[1]))[: cfg.beam_width]  # stable
    best = sorted(pool, key=lambda e: -e[1])[: cfg.remain_total]
    return {path: float(score) for path, score in best}




def _row_match(seq: list[int], cfg) -> tuple[int, list[int]]:
    """(m, ends): the longest suffix length m (context_min_match..context_max_match) of `seq` that also ends earlier
    in it and every such earlier end position, by scanning them all; (0, []) without one."""
    n = len(seq)
    for length in range(min(cfg.context_max_match, n - 1), cfg.context_min_match - 1, -1):
        suffix = seq[n - length:]
        ends = [e for e in range(length - 1, n - 1) if seq[e - length + 1:e + 1] == suffix]
        if ends:
            return length, ends
    return 0, []


def reference_context_paths(tokens, cfg):
    """Brute force of docs/DESIGN.md §2.6 for one row (`tokens`, ending with the root): {token path: score} of its
    context trie. Scans every earlier end position of every suffix length; scores in float64."""
    if not cfg.context_draft:
        return {}
    seq = [int(t) for t in tokens]
    depth = min(cfg.context_depth, cfg.max_depth or cfg.context_depth)
    m, ends = _row_match(seq, cfg)
    conts = []
    for e in sorted(ends, reverse=True)[:cfg.context_matches]:
        cont = seq[e + 1:e + 1 + depth]
        if cfg.eos_token_id is not None and cfg.eos_token_id in cont:
            cont = cont[:cont.index(cfg.eos_token_id) + 1]
        conts.append(tuple(cont))
    return {path: score for path, (score, _) in _score_trie(m, conts, [0] * len(conts), cfg).items()}


def reference_merged_tree(tokens, probs, context, trie, cfg, row_tokens):
    """The selected nodes of one tree with context drafting ({token path: score}, root excluded): the head's whole
    search pool (`reference_tree` with no node limit) and the row's context paths (`reference_context_paths`) as one
    pool, a path both hold scoring the larger of its two scores, then the best min(remain_total, head pool size) by
    score, shallower first on ties."""
    head = reference_tree(tokens, probs, context, trie, dataclasses.replace(cfg, remain_total=MAX_TREE_NODES))
    merged = dict(head)
    for path, score in reference_context_paths(row_tokens, cfg).items():
        if len(path) <= (cfg.max_depth or len(path)):
            merged[path] = max(merged.get(path, float("-inf")), score)
    best = sorted(merged.items(), key=lambda e: (-e[1], len(e[0])))[: min(cfg.remain_total, len(head))]
    return dict(best)


def _score_trie(m, conts, sources, cfg):
    """{token path: (score, source bits)} of the trie of continuations `conts` of a match of length m (§2.6 scores,
    float64), the bits of a path those of the continuations that begin with it."""
    paths = {}
    for cont in conts:
        for d in range(1, len(cont) + 1):
            path = cont[:d]
            if path in paths:
                continue
            reach = sum(1 for c in conts if c[:d] == path)
            siblings = sum(1 for c in conts if len(c) >= d and c[:d - 1] == path[:-1])
            parent = paths[path[:-1]][0] if d > 1 else 0.0
            bits = 0
            for c, source in zip(conts, sources):
                if c[:d] == path:
                    bits |= source
            paths[path] = (parent + cfg.level_weight(d - 1) * math.log(m * reach / (1 + m * siblings)), bits)
    return paths


def reference_store_paths(tokens, store_sequences, cfg, store_match=(2, 4)):
    """Brute force of docs/DESIGN.md §2.6-2.7 for one row (`tokens`, ending with the root) and a store holding
    `store_sequences` (oldest first) that indexes suffixes of `store_match` (min, max) tokens: {token path: (score,
    source bits)}. The row's longest earlier suffix match (its latest `context_matches` ends); the store's longest
    match of at least that length (its latest `context_matches` occurrences with a continuation: newest sequence
    first, latest position first within one, cut at the sequence's end): a longer one replaces the row's, one as long
    joins after the row's. Every continuation cut after its first EOS. Scans every position."""
    from dart_core.context import SOURCE_CONTEXT, SOURCE_STORE

    if not cfg.context_draft:
        return {}
    seq, n = [int(t) for t in tokens], len(tokens)
    depth = min(cfg.context_depth, cfg.max_depth or cfg.context_depth)
    count = cfg.context_matches
    m, ends = _row_match(seq, cfg)
    found = [(tuple(seq[e + 1:e + 1 + depth]), SOURCE_CONTEXT) for e in sorted(ends, reverse=True)[:count]]
    lo, hi = store_match
    for length in range(min(cfg.context_max_match, n), max(m, cfg.context_min_match) - 1, -1):
        if not lo <= length <= hi or depth < 1:
            continue
        suffix = seq[n - length:]
        extra = []
        for held in reversed(store_sequences):
            held = [int(t) for t in held]
            for e in range(len(held) - 2, length - 2, -1):  # an occurrence ending its sequence continues with nothing
                if held[e - length + 1:e + 1] == suffix:
                    extra.append((tuple(held[e + 1:e + 1 + depth]), SOURCE_STORE))
        if extra:
            if length > m:
                m, found = length, []
            found += extra[:count]
            break
    if not m or depth < 1:
        return {}
    conts, sources = [], []
    for cont, source in found:
        if cfg.eos_token_id is not None and cfg.eos_token_id in cont:
            cont = cont[:cont.index(cfg.eos_token_id) + 1]
        conts.append(cont)
        sources.append(source)
    return _score_trie(m, conts, sources, cfg)


def reference_proposal_tree(entries, remain_total, max_depth):
    """Brute force of `dart_core.tree.proposal_trees` for one row: `entries` (token, parent, depth, score, source
    bits) -> {token path: (score, source bits)} of the kept nodes: the usable entries (1 <= depth <= max_depth, finite
    score) sorted by score (descending), then depth, then entry index, the first `remain_total`."""
    paths = []
    for token, parent, depth, score, source in entries:
        paths.append((paths[parent] if parent >= 0 else ()) + (int(token),))
    usable = [i for i, (_, _, depth, score, _) in enumerate(entries)
              if 1 <= depth <= max_depth and math.isfinite(score)]
    usable.sort(key=lambda i: (-entries[i][3], entries[i][2], i))
    return {paths[i]: (float(entries[i][3]), int(entries[i][4])) for i in usable[:remain_total]}
