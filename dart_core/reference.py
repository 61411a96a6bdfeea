"""Slow, obviously-correct re-derivations of docs/DESIGN.md §2.3-2.4 (dict-based n-gram trie, list-based beam search).

They are the yardstick the vectorised implementations are tested and benchmarked against; never used for decoding.
"""

from __future__ import annotations

import numpy as np
import torch


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


