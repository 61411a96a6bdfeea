"""The n-gram table as a model-free drafter's source: `NGramModel.top_continuations` against a brute-force count of
the raw sequences."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from dart_core.ngram import NGramModel


def brute_counts(sequences, order):
    """count(w) for every n-gram w (1 <= len(w) <= order) of the sequences, straight from the windows."""
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, order + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i:i + n])] += 1
    return counts


def brute_top(counts, order, context, k):
    """The children of the longest suffix of `context` that has any, best k by (q desc, token asc)."""
    for n in range(min(order - 1, len(context)), 0, -1):
        suffix = tuple(context[len(context) - n:])
        children = [(w[-1], c) for w, c in counts.items() if len(w) == n + 1 and w[:-1] == suffix]
        if children:
            total = counts[suffix]
            return sorted(((t, c / total) for t, c in children), key=lambda tq: (-tq[1], tq[0]))[:k]
    return []


def corpus(rng, vocab, num_seqs, max_len, skew):
    """Random sequences; `skew` repeats a few tokens so that counts tie and differ at once."""
    hot = [rng.randrange(vocab) for _ in range(3)]
    return [[rng.choice(hot) if rng.random() < skew else rng.randrange(vocab) for _ in range(rng.randrange(max_len))]
            for _ in range(num_seqs)]


@pytest.mark.parametrize("seed,vocab,order", [(0, 5, 2), (1, 8, 3), (2, 30, 3), (3, 6, 4), (4, 200, 3), (5, 4, 5),
                                              (6, 50, 2)])
def test_top_continuations_match_brute_force(seed, vocab, order):
    rng = random.Random(seed)
    seqs = corpus(rng, vocab, 30, 40, skew=0.4)
    model = NGramModel.build(seqs, order=order, vocab_size=vocab)
    counts = brute_counts(seqs, order)
    flat = [t for s in seqs for t in s]
    for trial in range(300):
        length = rng.randrange(0, order + 2)
        if trial % 3 and len(flat) > length:  # a context taken from the corpus: its suffixes occur
            end = rng.randrange(length, len(flat) + 1)
            context = flat[end - length:end]
        else:  # random ids, some unseen (>= vocab, so >= vocab_bound)
            context = [rng.randrange(vocab + 3) for _ in range(length)]
        k = rng.choice([1, 2, 3, 5, vocab, vocab + 4])
        got = model.top_continuations(context, k)
        assert got == brute_top(counts, order, context, k), (context, k)
        for t, q in got:  # the values `probability` gives, but for float32 rounding
            assert model.probability(context, [t]) == [pytest.approx(q, rel=1e-6)]


def test_top_continuations_hand_worked():
    model = NGramModel.build([[1, 2, 3, 1, 2, 4], [5, 2, 6], [9, 2, 4]], order=3)
    assert model.top_continuations([1, 2], 5) == [(3, 0.5), (4, 0.5)]  # ties: token ascending
    assert model.top_continuations([1, 2], 1) == [(3, 0.5)]
    assert model.top_continuations([7, 2], 5) == [(4, 0.5), (3, 0.25), (6, 0.25)]  # unseen [7, 2]: back off to [2]
    assert model.top_continuations([10**9, 2], 2) == [(4, 0.5), (3, 0.25)]  # an id >= vocab_bound: back off too
    assert model.top_continuations([2, 10**9], 3) == []  # the last id unseen: no suffix matches
    assert model.top_continuations([6], 3) == []  # 6 ends its sequence: no children
    assert model.top_continuations([], 3) == [] and model.top_continuations([1, 2], 0) == []
    # a long history: only its last order-1 ids matter, whatever its type
    history = [6, 6, 6, 6, 1, 2]
    for context in (history, tuple(history), np.array(history), torch.tensor(history)):
        assert model.top_continuations(context, 5) == [(3, 0.5), (4, 0.5)]
    assert NGramModel.build([[1, 2, 1, 2]], order=1).top_continuations([1], 3) == []
    assert NGramModel.build([], order=3).top_continuations([1, 2], 3) == []


def test_top_continuations_converted_tables():
    """A table that is not one corpus's counts: zero counts are no children, q never exceeds 1."""
    base = 4  # vocab_bound 3
    key = lambda *ids: sum((t + 1) * base ** (len(ids) - 1 - i) for i, t in enumerate(ids))  # noqa: E731
    keys = [0, key(0), key(1), key(0, 1), key(0, 2), key(1, 0)]
    counts = [9, 2, 3, 0, 5, 0]
    model = NGramModel.from_counts(torch.tensor(keys), torch.tensor(counts), order=2, vocab_bound=3)
    assert model.top_continuations([0], 3) == [(2, 1.0)]  # 5 / 2, capped; the zero count of (0, 1) is left out
    assert model.top_continuations([1], 3) == []  # its only child has count 0


def test_top_continuations_bad_input():
    model = NGramModel.build([[1, 2, 3]], order=3)
    with pytest.raises(ValueError, match="k must be"):
        model.top_continuations([1], -1)
    with pytest.raises(ValueError, match="k must be"):
        model.top_continuations([1], 2.0)
    with pytest.raises(ValueError, match="negative"):
        model.top_continuations([-1, 2], 2)
    with pytest.raises(ValueError, match="integer"):
        model.top_continuations([1.5], 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_top_continuations_refuse_a_device_model():
    model = NGramModel.build([[1, 2, 3]], order=3).to("cuda")
    with pytest.raises(ValueError, match="on the CPU"):
        model.top_continuations([1, 2], 2)
