"""Tests of dart_core.ngram against an independent dict-of-dicts trie built straight from the semantics."""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
import torch

import dart_core.ngram as ngram_mod
from dart_core.ngram import NGramModel, pack_ngrams


# --------------------------------------------------------------------------- reference


def ref_trie(sequences, order):
    """Literal reference: every window seq[i:i+order] adds +1 to every node on its path, root included."""
    root = {"count": 0, "children": {}}
    for seq in sequences:
        seq = list(seq)
        for i in range(len(seq)):
            node = root
            node["count"] += 1
            for t in seq[i:i + order]:
                node = node["children"].setdefault(t, {"count": 0, "children": {}})
                node["count"] += 1
    return root


def ref_node(root, ngram):
    node = root
    for t in ngram:
        node = node["children"].get(t)
        if node is None:
            return None
    return node


def ref_probability(root, order, context, tokens):
    """Per-token back-off from the longest context suffix (<= order-1) down to length 1."""
    q = [0.0] * len(tokens)
    matched = [False] * len(tokens)
    for length in range(min(order - 1, len(context)), 0, -1):
        node = ref_node(root, context[len(context) - length:])
        if node is None:
            continue
        for j, t in enumerate(tokens):
            if not matched[j] and t in node["children"]:
                q[j] = float(np.float32(node["children"][t]["count"]) / np.float32(node["count"]))
                matched[j] = True
    return q


def ref_all_ngrams(root):
    out = {}

    def walk(node, path):
        out[tuple(path)] = node["count"]
        for t, child in node["children"].items():
            walk(child, path + [t])

    walk(root, [])
    return out


def random_corpus(rng, vocab, num_seqs, max_len):
    seqs = []
    for _ in range(num_seqs):
        n = rng.randrange(0, max_len + 1)
        seqs.append([rng.randrange(vocab) for _ in range(n)])
    return seqs


def random_queries(rng, seqs, vocab, order, num):
    """(context, tokens) pairs: seen and unseen contexts of every length, seen, unseen and out-of-vocab tokens."""
    nonempty = [s for s in seqs if s]
    out = []
    for _ in range(num):
        kind = rng.random()
        clen = rng.randrange(0, order + 2)
        if kind < 0.6 and nonempty:  # a context that occurs in the corpus
            s = rng.choice(nonempty)
            end = rng.randrange(1, len(s) + 1)
            context = s[max(0, end - clen):end]
        else:  # random, often unseen, sometimes out of vocab
            context = [rng.randrange(vocab + 3) for _ in range(clen)]
        tokens = [rng.randrange(vocab + 3) for _ in range(rng.randrange(1, 12))]
        if nonempty and context:
            # tokens that do follow the context somewhere (exercise matches at every back-off length)
            for s in nonempty:
                for i in range(len(s) - 1):
                    if s[i] == context[-1] and rng.random() < 0.3:
                        tokens.append(s[i + 1])
        out.append((context, tokens))
    return out


def pad_batch(queries, width):
    """[N, width] contexts right-aligned and left-padded with -1 (only the last `width` ids kept), [N, M] tokens."""
    m = max(len(t) for _, t in queries)
    ctx = torch.full((len(queries), width), -1, dtype=torch.long)
    tok = torch.zeros((len(queries), m), dtype=torch.long)
    for i, (c, t) in enumerate(queries):
        c = c[len(c) - width:] if width else []
        if c:
            ctx[i, width - len(c):] = torch.tensor(c)
        # pad the candidate list by repeating its first token (compared per position anyway)
        tok[i] = torch.tensor(t + [t[0]] * (m - len(t)))
    return ctx, tok


CASES = [(seed, vocab, order) for seed, vocab, order in [
    (0, 7, 2), (1, 7, 3), (2, 7, 4), (3, 12, 3), (4, 20, 3), (5, 50, 3), (6, 10, 4), (7, 30, 2), (8, 5, 5),
]]


# --------------------------------------------------------------------------- hand-worked example

HAND = [[1, 2, 3, 1, 2, 4], [5, 2, 6]]


def test_hand_worked_counts():
    m = NGramModel.build(HAND, order=3)
    assert m.order == 3 and m.vocab_bound == 7
    assert m.count(()) == 9  # total tokens
    assert m.count([1]) == 2 and m.count([2]) == 3 and m.count([4]) == 1
    assert m.count([1, 2]) == 2 and m.count([2, 3]) == 1 and m.count([2, 6]) == 1
    assert m.count([1, 2, 3]) == 1 and m.count([1, 2, 4]) == 1 and m.count([3, 1, 2]) == 1
    assert m.count([4, 5]) == 0  # windows never cross a sequence boundary
    assert m.count([2, 1]) == 0 and m.count([9]) == 0
    # root + 6 unigrams + bigrams {12,23,31,24,52,26} + trigrams {123,231,312,124,526}
    assert m.num_nodes == 1 + 6 + 6 + 5
    with pytest.raises(ValueError, match="longer than the model order"):
        m.count([1, 2, 3, 4])


def test_hand_worked_probability():
    m = NGramModel.build(HAND, order=3)
    third = float(np.float32(1) / np.float32(3))
    # [1,2] has children 3, 4 (count 1 each of 2); 6 backs off to [2] (children 3, 4, 6 of 3)
    assert m.probability([1, 2], [3, 4, 6, 5, 2]) == [0.5, 0.5, third, 0.0, 0.0]
    assert m.probability([9, 1, 2], [3]) == [0.5]  # only the last order-1 tokens count
    assert m.probability([1], [2, 3]) == [1.0, 0.0]
    assert m.probability([3], [1]) == [1.0]
    assert m.probability([3, 2], [3, 6]) == [third, third]  # [3,2] unseen: all back off to [2]
    assert m.probability([99, 3], [1]) == [1.0]  # out-of-vocabulary context id: back off to [3]
    assert m.probability([3, 99], [1]) == [0.0]
    assert m.probability([], [1, 2]) == [0.0, 0.0]
    assert m.probability([1, 2], []) == []
    assert m.probability([4], [5]) == [0.0]  # 4 ends a sequence

    ctx = torch.tensor([[1, 2], [-1, 1], [-1, -1], [99, 3], [3, 2], [9, 1]])
    tok = torch.tensor([[3, 4, 6, 5, 2], [2, 3, 2, 2, 2], [1, 2, 3, 4, 5], [1, 2, 1, 1, 1], [3, 6, 3, 3, 3],
                        [2, 3, 2, 2, 2]])
    expect = torch.tensor([[0.5, 0.5, third, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1],
                           [third, third, third, third, third], [1, 0, 1, 1, 1]], dtype=torch.float32)
    got = m.batch_probability(ctx, tok)
    assert got.dtype == torch.float32 and got.shape == (6, 5)
    assert torch.equal(got, expect)
    # a wider context window: only the last order-1 columns matter
    wide = torch.cat((torch.full((6, 3), 5), ctx), 1)
    assert torch.equal(m.batch_probability(wide, tok), expect)


# --------------------------------------------------------------------------- random comparisons


@pytest.mark.parametrize("seed,vocab,order", CASES)
def test_counts_match_reference_trie(seed, vocab, order):
    rng = random.Random(seed)
    seqs = random_corpus(rng, vocab, 12, 80)
    root = ref_trie(seqs, order)
    m = NGramModel.build(seqs, order=order, vocab_size=vocab)
    ref = ref_all_ngrams(root)
    assert m.num_nodes == len(ref)
    for ngram, c in ref.items():
        assert m.count(ngram) == c, ngram
    assert m.count(()) == sum(len(s) for s in seqs)


@pytest.mark.parametrize("seed,vocab,order", CASES)
def test_probability_matches_reference(seed, vocab, order):
    rng = random.Random(100 + seed)
    seqs = random_corpus(rng, vocab, 10, 100)
    root = ref_trie(seqs, order)
    m = NGramModel.build(seqs, order=order)
    for context, tokens in random_queries(rng, seqs, vocab, order, 150):
        assert m.probability(context, tokens) == ref_probability(root, order, context, tokens), (context, tokens)


@pytest.mark.parametrize("fast_pack", [True, False])
@pytest.mark.parametrize("seed,vocab,order", CASES)
def test_batch_probability_matches_reference(seed, vocab, order, fast_pack, monkeypatch):
    monkeypatch.setattr(ngram_mod, "_FAST_PACK", fast_pack)
    rng = random.Random(200 + seed)
    seqs = random_corpus(rng, vocab, 10, 100)
    root = ref_trie(seqs, order)
    m = NGramModel.build(seqs, order=order)
    queries = random_queries(rng, seqs, vocab, order, 120)
    for width in sorted({0, 1, order - 1, order + 2}):
        ctx, tok = pad_batch(queries, width)
        got = m.batch_probability(ctx, tok)
        assert got.shape == tok.shape and got.dtype == torch.float32
        for i, (context, _) in enumerate(queries):
            visible = context[len(context) - width:] if width else []
            expect = ref_probability(root, order, visible, tok[i].tolist())
            assert got[i].tolist() == expect, (width, context, tok[i].tolist())


def test_batch_probability_many_candidates_and_int32():
    rng = random.Random(7)
    seqs = random_corpus(rng, 9, 8, 120)
    root = ref_trie(seqs, 3)
    m = NGramModel.build(seqs, order=3)
    queries = [(q[0], (q[1] * 40)[:ngram_mod._FAST_PACK_MAX_M + 20]) for q in random_queries(rng, seqs, 9, 3, 30)]
    ctx, tok = pad_batch(queries, 2)
    got = m.batch_probability(ctx.int(), tok.int())  # M above the matmul threshold, int32 ids
    for i, (context, _) in enumerate(queries):
        assert got[i].tolist() == ref_probability(root, 3, context, tok[i].tolist())


def test_unpacked_backoff_cases():
    m = NGramModel.build([[0, 1, 2, 0, 1, 3, 4, 1, 2]], order=4)
    root = ref_trie([[0, 1, 2, 0, 1, 3, 4, 1, 2]], 4)
    ctx = torch.tensor([[2, 0, 1], [4, 0, 1], [-1, 4, 1], [3, -1, 1], [1, 2, -1], [-1, -1, -1]])
    tok = torch.tensor([[2, 3, 0], [2, 3, 0], [2, 3, 0], [2, 3, 0], [2, 3, 0], [2, 3, 0]])
    got = m.batch_probability(ctx, tok)
    ctx_lists = [[2, 0, 1], [4, 0, 1], [4, 1], None, None, []]
    for i, c in enumerate(ctx_lists):
        if c is not None:
            assert got[i].tolist() == ref_probability(root, 4, c, [2, 3, 0])
    third = float(np.float32(1) / np.float32(3))
    # (2,0,1) occurs once, followed by 3; 2 backs off to (0,1): twice, followed by 2 and 3
    assert got[0].tolist() == [0.5, 1.0, 0.0]
    # (4,1) occurs once, followed by 2; 3 backs off to (1): 3 times, followed by 2, 3, 2
    assert got[2].tolist() == [1.0, third, 0.0]
    # an absent (-1) id inside the window: n-grams over it are unseen, shorter suffixes still count
    assert got[3].tolist() == ref_probability(root, 4, [1], [2, 3, 0])
    assert got[4].tolist() == [0.0, 0.0, 0.0]  # the context ends in an unknown id
    assert got[5].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_search_state(order):
    rng = random.Random(order)
    seqs = random_corpus(rng, 6, 6, 80)
    root = ref_trie(seqs, order)
    m = NGramModel.build(seqs, order=order, vocab_size=6)
    contexts = [[], [1], [2, 3], [4, 0, 1, 2, 3]]
    width = max(len(c) for c in contexts)
    ctx = torch.tensor([[-1] * (width - len(c)) + c for c in contexts])
    state = m.context_state(ctx)
    assert state.shape == (4, m.state_width) and state.dtype == torch.int64
    cand = torch.tensor([list(range(7))] * 4)
    paths = [list(c) for c in contexts]
    for step in range(4):
        got = m.batch_probability(state, cand)
        for i, p in enumerate(paths):
            assert got[i].tolist() == ref_probability(root, order, p, list(range(7))), (step, p)
        nxt = [rng.randrange(7) for _ in paths]
        state = m.advance_state(state, torch.tensor(nxt))
        paths = [p + [t] for p, t in zip(paths, nxt)]
    narrow = m.context_state(torch.tensor([[5]]))
    assert narrow.tolist() == [[-1] * (m.state_width - 1) + [5]]
    with pytest.raises(ValueError):
        m.context_state(torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        m.advance_state(state, torch.tensor([[1]] * 4))


def test_order_one_and_empty_model():
    m = NGramModel.build([[1, 2, 1]], order=1)
    assert m.count([1]) == 2 and m.count(()) == 3
    assert m.probability([1], [1, 2]) == [0.0, 0.0]
    assert m.batch_probability(torch.tensor([[1]]), torch.tensor([[1, 2]])).tolist() == [[0.0, 0.0]]
    empty = NGramModel.build([[], []], order=3)
    assert empty.num_nodes == 1 and empty.count(()) == 0 and empty.vocab_bound == 0
    assert empty.probability([1, 2], [3]) == [0.0]
    assert empty.batch_probability(torch.tensor([[1, 2]]), torch.tensor([[3]])).tolist() == [[0.0]]
    m3 = NGramModel.build([[1, 2, 3]], order=3)
    out = m3.batch_probability(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long))
    assert out.shape == (0, 4)
    assert m3.batch_probability(torch.zeros(3, 0, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)).tolist() \
        == [[0.0, 0.0]] * 3


# --------------------------------------------------------------------------- build


def test_build_input_types_agree():
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [], [5, 3, 5], [8]]
    a = NGramModel.build(seqs)
    b = NGramModel.build([np.array(s, dtype=np.int32) for s in seqs])
    c = NGramModel.build(torch.tensor(s, dtype=torch.long) for s in seqs)  # a generator, tensors
    for other in (b, c):
        assert torch.equal(a.keys, other.keys) and torch.equal(a.counts, other.counts)
    assert a.keys.dtype == torch.int64 and a.counts.dtype == torch.int32
    assert bool((a.keys[1:] > a.keys[:-1]).all()) and int(a.keys[0]) == 0
    assert NGramModel.build(seqs, vocab_size=100).vocab_bound == 100


def test_build_large_vocab_matches_reference():
    # key spaces above the bincount threshold take the np.unique path
    rng = random.Random(3)
    seqs = [[rng.randrange(3000) if rng.random() < 0.5 else rng.randrange(20) for _ in range(2500)]
            for _ in range(2)]
    m = NGramModel.build(seqs, order=3)
    ref = ref_all_ngrams(ref_trie(seqs, 3))
    assert m.num_nodes == len(ref)
    sample = random.Random(0).sample(sorted(ref), 500)
    for ngram in sample:
        assert m.count(ngram) == ref[ngram]


def test_build_bad_input():
    with pytest.raises(ValueError, match="negative token id -1 in sequence 2 at position 1"):
        NGramModel.build([[1, 2], [], [3, -1]])
    with pytest.raises(ValueError, match="token id 9 >= vocab_size 5 in sequence 0 at position 2"):
        NGramModel.build([np.array([1, 2, 9])], vocab_size=5)
    with pytest.raises(ValueError, match="vocab_size 5"):
        NGramModel.build([[1, 5]], vocab_size=5)
    with pytest.raises(ValueError, match="integers"):
        NGramModel.build([[1.5, 2.0]])
    with pytest.raises(ValueError, match="1-D"):
        NGramModel.build([[[1, 2]]])
    with pytest.raises(ValueError, match="order"):
        NGramModel.build([[1, 2]], order=0)


def test_key_space_overflow():
    NGramModel.build([[1, 2, 3]], order=3, vocab_size=2_000_000)  # (2e6 + 1) ** 3 < 2**63
    with pytest.raises(ValueError, match=r"vocab size 2097152 with n-gram order 3"):
        NGramModel.build([[1, 2, 3]], order=3, vocab_size=2**21)
    with pytest.raises(ValueError, match=r"vocab size 100000 with n-gram order 4"):
        NGramModel.build([[1, 2, 3]], order=4, vocab_size=100_000)
    with pytest.raises(ValueError, match="n-gram order 3"):
        NGramModel.from_counts([0], [1], order=3, vocab_bound=2**21)


@pytest.mark.parametrize("fast_pack", [True, False])
@pytest.mark.parametrize("order,vocab", [(3, 2_000_000), (2, 3_000_000_000)])
def test_key_space_edge_batch_probability(order, vocab, fast_pack, monkeypatch):
    # near the int64 limit, keys with unknown ids (digit `base`) may wrap around: they must still never match
    monkeypatch.setattr(ngram_mod, "_FAST_PACK", fast_pack)
    top = vocab - 1
    seqs = [[top, top - 1, top, top, 0, top], [top - 1, top, top - 1]]
    root = ref_trie(seqs, order)
    m = NGramModel.build(seqs, order=order, vocab_size=vocab)
    ids = [top, top - 1, 0, 1]
    queries = [([a, b], [top, top - 1, 0, vocab, vocab + 5, 2**62]) for a in ids + [vocab] for b in ids + [vocab]]
    queries += [([b], queries[0][1]) for b in ids + [vocab]] + [([], queries[0][1])]
    ctx, tok = pad_batch(queries, order - 1)
    got = m.batch_probability(ctx, tok)
    for i, (context, tokens) in enumerate(queries):
        expect = ref_probability(root, order, context, tokens)
        assert got[i].tolist() == expect and m.probability(context, tokens) == expect, context
    assert got.max().item() > 0


def test_bytes_per_node():
    rng = np.random.default_rng(0)
    m = NGramModel.build([rng.integers(0, 500, 20_000)], order=3)
    assert m.nbytes == 12 * m.num_nodes
    assert m.nbytes / m.num_nodes <= 16


def test_pack_ngrams():
    base = 11
    t = torch.tensor([[1, 2, 3], [-1, 2, 3], [-1, -1, 3], [-1, -1, -1]])
    keys = pack_ngrams(t, base)
    assert keys.tolist() == [2 * 121 + 3 * 11 + 4, 3 * 11 + 4, 4, 0]
    assert pack_ngrams(t.numpy(), base).tolist() == keys.tolist()
    assert pack_ngrams(torch.zeros(2, 0, dtype=torch.long), base).tolist() == [0, 0]
    m = NGramModel.build([[1, 2, 3, 4]], order=3, vocab_size=10)
    stored = set(m.keys.tolist())
    assert set(pack_ngrams(torch.tensor([[1, 2, 3], [-1, 3, 4], [-1, -1, 4]]), 11).tolist()) <= stored
    assert pack_ngrams(torch.tensor([[2, 1, 3]]), 11).item() not in stored


def test_from_counts():
    m = NGramModel.build(HAND, order=3)
    m2 = NGramModel.from_counts(m.keys.numpy(), m.counts.numpy(), order=3, vocab_bound=m.vocab_bound)
    assert m2.probability([1, 2], [3, 6]) == m.probability([1, 2], [3, 6])
    with pytest.raises(ValueError, match="sorted"):
        NGramModel.from_counts([0, 5, 3], [1, 1, 1], order=3, vocab_bound=7)
    with pytest.raises(ValueError, match="sorted"):
        NGramModel.from_counts([0, 3, 3], [1, 1, 1], order=3, vocab_bound=7)
    with pytest.raises(ValueError, match=">= 0"):
        NGramModel.from_counts([0, 3], [1, -1], order=3, vocab_bound=7)
    with pytest.raises(ValueError, match="equal length"):
        NGramModel.from_counts([0, 3], [1], order=3, vocab_bound=7)
    with pytest.raises(ValueError, match=r"\[0, "):
        NGramModel.from_counts([0, 8**3], [1, 1], order=3, vocab_bound=7)


# --------------------------------------------------------------------------- batch input validation


def test_batch_probability_bad_input():
    m = NGramModel.build(HAND, order=3)
    ctx, tok = torch.tensor([[1, 2]]), torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        m.batch_probability(ctx[0], tok)
    with pytest.raises(ValueError, match=r"same N"):
        m.batch_probability(ctx, torch.tensor([[3], [4]]))
    with pytest.raises(ValueError, match="integer"):
        m.batch_probability(ctx, tok.float())
    with pytest.raises(ValueError, match="integer"):
        m.batch_probability(ctx.bool(), tok)
    with pytest.raises(ValueError, match="negative candidate"):
        m.batch_probability(ctx, torch.tensor([[3, -1]]))
    with pytest.raises(ValueError, match="below -1"):
        m.batch_probability(torch.tensor([[-2, 2]]), tok)
    with pytest.raises(ValueError, match="negative"):
        m.probability([1, 2], [-3])
    with pytest.raises(ValueError, match="negative"):
        m.probability([-1, 2], [3])
    # unvalidated (the accelerator default): invalid ids just never match
    got = m.batch_probability(torch.tensor([[-5, 1], [1, 2]]), torch.tensor([[2, -1], [-7, 3]]), validate=False)
    assert got.tolist() == [[1.0, 0.0], [0.0, 0.5]]
    # ids >= vocab_bound are unseen, not errors
    assert m.batch_probability(torch.tensor([[1, 2]]), torch.tensor([[7, 10**9]])).tolist() == [[0.0, 0.0]]


# --------------------------------------------------------------------------- save / load


def _mapped_files():
    with open("/proc/self/maps") as f:
        rows = [line.split() for line in f]
    return [(int(r[0].split("-")[0], 16), int(r[0].split("-")[1], 16), r[5]) for r in rows if len(r) >= 6]


def test_save_load_roundtrip(tmp_path):
    rng = random.Random(11)
    seqs = random_corpus(rng, 15, 10, 100)
    m = NGramModel.build(seqs, order=3)
    path = tmp_path / "prior.ngram"
    m.save(path)
    m.save(path)  # overwriting works too
    assert os.listdir(tmp_path) == ["prior.ngram"]  # no temp files left behind
    loaded = NGramModel.load(path)
    assert loaded.order == 3 and loaded.vocab_bound == m.vocab_bound and loaded.num_nodes == m.num_nodes
    assert torch.equal(loaded.keys, m.keys) and torch.equal(loaded.counts, m.counts)
    queries = random_queries(rng, seqs, 15, 3, 40)
    for context, tokens in queries:
        assert loaded.probability(context, tokens) == m.probability(context, tokens)
    ctx, tok = pad_batch(queries, 2)
    assert torch.equal(loaded.batch_probability(ctx, tok), m.batch_probability(ctx, tok))
    assert loaded.to("cpu") is loaded

    # the standard reader agrees on the layout and metadata
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["format"] == ngram_mod.FORMAT_NAME
        assert np.array_equal(f.get_tensor("keys"), m.keys.numpy())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_load_is_memory_mapped(tmp_path):
    m = NGramModel.build([list(range(50)) * 3], order=3)
    path = tmp_path / "mapped.ngram"
    m.save(path)
    loaded = NGramModel.load(path)
    real = os.path.realpath(path)
    for t in (loaded.keys, loaded.counts):
        ptr = t.data_ptr()
        assert any(lo <= ptr < hi and name == real for lo, hi, name in _mapped_files()), "array is not file-backed"


def test_save_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    m = NGramModel.build(HAND, order=3)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)  # fails after the data went into the temp file
    with pytest.raises(OSError, match="disk full"):
        m.save(tmp_path / "x.ngram")
    assert os.listdir(tmp_path) == []


def _write_raw(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _valid_parts(keys=(0, 2, 3), counts=(3, 2, 1), meta=None, dtypes=("I64", "I32")):
    k = np.asarray(keys, dtype=np.int64 if dtypes[0] == "I64" else np.int32).tobytes()
    c = np.asarray(counts, dtype=np.int32 if dtypes[1] == "I32" else np.int64).tobytes()
    header = {
        "__metadata__": meta or {"format": "dart-ngram", "format_version": "1", "order": "3", "vocab_bound": "5"},
        "keys": {"dtype": dtypes[0], "shape": [len(keys)], "data_offsets": [0, len(k)]},
        "counts": {"dtype": dtypes[1], "shape": [len(counts)], "data_offsets": [len(k), len(k) + len(c)]},
    }
    return header, k + c


def test_load_handwritten_valid_file(tmp_path):
    path = tmp_path / "ok.ngram"
    _write_raw(path, *_valid_parts())
    m = NGramModel.load(path)
    assert m.keys.tolist() == [0, 2, 3] and m.counts.tolist() == [3, 2, 1]
    assert m.count([1]) == 2 and m.count([2]) == 1


@pytest.mark.parametrize("corruption,message", [
    ("short", "too short"),
    ("truncated", "past the end"),
    ("garbage_header", "not valid JSON"),
    ("huge_header_len", "header length"),
    ("wrong_format", "format is 'other'"),
    ("wrong_version", "format_version"),
    ("missing_counts", "missing tensor 'counts'"),
    ("wrong_dtype", "dtype 'I64', expected I32"),
    ("unsorted", "not sorted"),
    ("duplicate_keys", "not sorted"),
    ("negative_counts", "negative counts"),
    ("bad_offsets", "do not match shape"),
])
def test_load_rejects_corrupt_files(tmp_path, corruption, message):
    path = tmp_path / "bad.ngram"
    good = tmp_path / "good.ngram"
    NGramModel.build(HAND, order=3).save(good)
    blob = good.read_bytes()
    header, data = _valid_parts()
    if corruption == "short":
        path.write_bytes(blob[:5])
    elif corruption == "truncated":
        path.write_bytes(blob[:len(blob) - 10])
    elif corruption == "garbage_header":
        path.write_bytes(struct.pack("<Q", 16) + b"{not json at all" + b"\0" * 32)
    elif corruption == "huge_header_len":
        path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    elif corruption == "wrong_format":
        header["__metadata__"]["format"] = "other"
        _write_raw(path, header, data)
    elif corruption == "wrong_version":
        header["__metadata__"]["format_version"] = "99"
        _write_raw(path, header, data)
    elif corruption == "missing_counts":
        del header["counts"]
        _write_raw(path, header, data)
    elif corruption == "wrong_dtype":
        _write_raw(path, *_valid_parts(dtypes=("I64", "I64")))
    elif corruption == "unsorted":
        _write_raw(path, *_valid_parts(keys=(0, 3, 2)))
    elif corruption == "duplicate_keys":
        _write_raw(path, *_valid_parts(keys=(0, 3, 3)))
    elif corruption == "negative_counts":
        _write_raw(path, *_valid_parts(counts=(3, -2, 1)))
    elif corruption == "bad_offsets":
        header["keys"]["data_offsets"] = [0, 16]
        _write_raw(path, header, data)
    with pytest.raises(ValueError, match=message) as info:
        NGramModel.load(path)
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------- accelerator


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(tmp_path):
    rng = random.Random(5)
    seqs = random_corpus(rng, 20, 10, 100)
    m = NGramModel.build(seqs, order=3)
    m.save(tmp_path / "m.ngram")
    gpu = NGramModel.load(tmp_path / "m.ngram", device="cuda")
    assert gpu.keys.is_cuda and gpu.counts.is_cuda
    queries = random_queries(rng, seqs, 20, 3, 60)
    ctx, tok = pad_batch(queries, 2)
    got = gpu.batch_probability(ctx.cuda(), tok.cuda())
    assert got.is_cuda
    assert torch.equal(got.cpu(), m.batch_probability(ctx, tok))
    assert gpu.probability(queries[0][0], queries[0][1]) == m.probability(queries[0][0], queries[0][1])
