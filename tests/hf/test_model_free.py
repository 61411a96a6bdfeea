"""Model-free drafting (docs/DESIGN.md §2.7) against independent re-derivations: the `OutputStore` against a list of
its sequences and a brute-force scan, a row's paths with a store against `reference_store_paths`, `ngram_paths`
against a best-first search over a dict of counts, `proposal_trees` against `reference_proposal_tree`; in
generate(), greedy output token for token plain's (the row's context, a store of earlier outputs, an n-gram table,
a carried cache) and sampling that keeps the target distribution; the refusals, before any work. Each comparison has
a control (a broken implementation or a lossy verifier) that it must catch."""

import copy
import functools
import io
import math
import pickle
import random
import threading
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import dart_hf
import dart_hf.loop
from dart_core import (DartInputError, ModelFreeDrafter, NGramModel, OutputStore, TreeConfig, VerifyResult,
                       verify_greedy)
from dart_core.context import (SOURCE_CONTEXT, SOURCE_NGRAM, SOURCE_STORE, ContextDrafter, ContextProposals,
                               ContextRow, ngram_paths)
from dart_core.model_free import DEFAULT_TREE
from dart_core.reference import DictTrie, reference_context_paths, reference_proposal_tree, reference_store_paths
from dart_core.tree import proposal_trees
from helpers.hf_models import left_padded, tiny_target
from helpers.sampling_checks import chi_square_pvalue, exact_two_token_distribution, lossy_verify
from helpers.tree_checks import check_structure


# ---- OutputStore: a list of sequences and a scan ------------------------------------------------------------------

class ListStore:
    """The store's model: its sequences oldest first, each cut to its last `cap` tokens; the oldest leave while the
    total is over the cap."""

    def __init__(self, cap: int) -> None:
        self.cap, self.seqs = cap, []

    def add(self, seq) -> None:
        seq = list(seq)[-self.cap:]
        if seq:
            self.seqs.append(seq)
        while sum(map(len, self.seqs)) > self.cap:
            self.seqs.pop(0)


def scan(seqs, suffix, count, depth):
    """The up to `depth` tokens after each of the latest `count` occurrences of `suffix` that something follows
    (newest sequence first, then latest position), within its sequence."""
    suffix, out = list(suffix), []
    if count < 1 or depth < 1:
        return out
    for seq in reversed(seqs):
        for end in range(len(seq) - 2, len(suffix) - 2, -1):
            if seq[end - len(suffix) + 1:end + 1] == suffix:
                out.append(seq[end + 1:end + 1 + depth])
    return out[:count]


def held(store: OutputStore):
    return store.__getstate__()["sequences"]


def assert_store_is(store: OutputStore, model: ListStore, r: random.Random, vocab: int, lookups: int = 40) -> None:
    assert held(store) == model.seqs
    assert len(store) == sum(map(len, model.seqs)) <= model.cap and store.sequences == len(model.seqs)
    for _ in range(lookups):  # suffixes from the held sequences (so they occur) and random ones
        n = r.randrange(store.min_match, store.max_match + 1)
        if model.seqs and r.random() < 0.7:
            seq = r.choice(model.seqs)
            at = r.randrange(len(seq) + 1)
            suffix = seq[max(0, at - n):at]
        else:
            suffix = [r.randrange(vocab) for _ in range(n)]
        count, depth = r.choice([1, 2, 4, 100]), r.choice([1, 3, 8])
        want = scan(model.seqs, suffix, count, depth) if store.min_match <= len(suffix) <= store.max_match else []
        assert store.continuations(suffix, count, depth) == want, (suffix, count, depth)


@pytest.mark.parametrize("seed", range(8))
def test_store_keeps_the_newest_sequences_within_its_cap_and_matches_a_scan(seed):
    r = random.Random(seed)
    cap, vocab = r.choice([1, 5, 20, 60]), r.choice([2, 4, 10])
    lo = r.choice([1, 2, 3])
    store, model = OutputStore(cap, lo, lo + r.choice([0, 1, 2])), ListStore(cap)
    for _ in range(30):
        seq = [r.randrange(vocab) for _ in range(r.choice([0, 1, 2, 5, 12, cap, cap + 3]))]
        store.add(torch.tensor(seq, dtype=torch.long) if r.random() < 0.3 else seq)
        model.add(seq)
        assert_store_is(store, model, r, vocab, lookups=10)


def test_store_by_hand():
    store = OutputStore(10, min_match=2)
    store.add([7, 8, 9, 7, 8])  # (7, 8) ends at 1 and at 4; the one at 4 ends the sequence: nothing follows it
    assert store.continuations([7, 8], 5, 3) == [[9, 7, 8]]
    store.add([1, 7, 8, 2])  # newer: first
    assert store.continuations([7, 8], 5, 3) == [[2], [9, 7, 8]]
    assert store.continuations([7, 8], 1, 3) == [[2]]
    assert store.continuations([8], 5, 3) == [] and store.continuations([1, 7, 8, 2, 3], 5, 3) == []  # not indexed
    assert store.continuations([7, 8], 0, 3) == [] and store.continuations([7, 8], 3, 0) == []
    store.add([5, 5])  # 11 tokens: the oldest sequence leaves
    assert held(store) == [[1, 7, 8, 2], [5, 5]] and len(store) == 6
    assert store.continuations([7, 8], 5, 3) == [[2]]
    with pytest.raises(ValueError, match=">= 0"):
        store.add([3, -1])
    assert held(store) == [[1, 7, 8, 2], [5, 5]]  # a refused add changes nothing


def test_a_sequence_longer_than_the_cap_keeps_its_tail():
    store = OutputStore(6, min_match=2)
    store.add([1, 2])
    store.add(list(range(20, 30)))
    assert held(store) == [[24, 25, 26, 27, 28, 29]] and len(store) == 6
    assert store.continuations([24, 25], 2, 3) == [[26, 27, 28]]
    assert store.continuations([22, 23], 2, 3) == [] and store.continuations([1, 2], 2, 3) == []
    store.add([9] * 6)  # exactly the cap: the whole store is the new sequence
    assert held(store) == [[9] * 6]


def test_clear_forgets_every_sequence():
    store = OutputStore(50, min_match=2)
    for seq in ([1, 2, 3, 4], [2, 3, 5], [1, 2, 3, 6]):
        store.add(seq)
    store.clear()
    assert len(store) == 0 and store.sequences == 0 and held(store) == []
    assert store.continuations([2, 3], 4, 4) == [] and store.continuations([1, 2, 3], 4, 4) == []
    store.add([2, 3, 7])  # usable again, with none of the old positions
    assert store.continuations([2, 3], 4, 4) == [[7]]


def test_save_load_round_trip(tmp_path):
    r = random.Random(1)
    store, model = OutputStore(40, min_match=2, max_match=5), ListStore(40)
    for _ in range(12):
        seq = [r.randrange(6) for _ in range(r.randrange(1, 10))]
        store.add(seq)
        model.add(seq)
    store.save(tmp_path / "store.npz")
    loaded = OutputStore.load(tmp_path / "store.npz")
    assert (loaded.max_tokens, loaded.min_match, loaded.max_match) == (40, 2, 5)
    assert_store_is(loaded, model, r, 6)
    smaller, model_smaller = OutputStore.load(tmp_path / "store.npz", max_tokens=10), ListStore(10)
    for seq in model.seqs:
        model_smaller.add(seq)
    assert smaller.max_tokens == 10 and held(smaller) == model_smaller.seqs
    OutputStore(5).save(tmp_path / "empty.npz")
    assert held(OutputStore.load(tmp_path / "empty.npz")) == []
    with pytest.raises(FileNotFoundError):
        OutputStore.load(tmp_path / "missing.npz")


def npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


CORRUPT = {
    "random bytes": lambda good: bytes(random.Random(0).randrange(256) for _ in range(300)),
    "empty": lambda good: b"",
    "text": lambda good: b"not a store\n",
    "offsets past the tokens": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 7]), settings=np.array([9, 2, 4])),
    "decreasing offsets": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 4, 2, 5]), settings=np.array([9, 2, 4])),
    "float tokens": lambda good: npz(tokens=np.arange(5.0), offsets=np.array([0, 5]), settings=np.array([9, 2, 4])),
    "negative tokens": lambda good: npz(tokens=np.array([-3, 4]), offsets=np.array([0, 2]), settings=np.array([9, 2, 4])),
    "no cap": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 5])),
    "no offsets": lambda good: npz(tokens=np.arange(5), settings=np.array([9, 2, 4])),
    "a zero cap": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 5]), settings=np.array([0, 2, 4])),
    "a match range upside down": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 5]),
                                                  settings=np.array([9, 4, 2])),
    "truncated": lambda good: good[:len(good) // 2],
    "an .npy array": lambda good: np.save(buffer := io.BytesIO(), np.arange(5)) or buffer.getvalue(),
    "two settings": lambda good: npz(tokens=np.arange(5), offsets=np.array([0, 5]), settings=np.array([3, 4])),
}


@pytest.mark.parametrize("kind", CORRUPT)
def test_a_corrupt_store_file_is_one_dart_input_error(tmp_path, kind):
    store = OutputStore(100)
    store.add([1, 2, 3, 4, 5])
    store.add([3, 4, 9])
    store.save(tmp_path / "good.npz")
    path = tmp_path / "bad.npz"
    path.write_bytes(CORRUPT[kind]((tmp_path / "good.npz").read_bytes()))
    with pytest.raises(DartInputError):
        OutputStore.load(path)


def test_pickle_and_deepcopy_keep_the_contents():
    r = random.Random(2)
    store, model = OutputStore(30, 1, 3), ListStore(30)
    for _ in range(10):
        seq = [r.randrange(5) for _ in range(r.randrange(1, 8))]
        store.add(seq)
        model.add(seq)
    for again in (pickle.loads(pickle.dumps(store)), copy.deepcopy(store)):
        assert (again.max_tokens, again.min_match, again.max_match) == (30, 1, 3)
        assert_store_is(again, model, r, 5)
        again.add([4, 4, 4])  # a copy is a store of its own
        assert held(store) == model.seqs


def test_four_threads_adding_and_matching_at_once():
    cap, per_thread = 400, 150
    store = OutputStore(cap)
    errors, seen, added = [], [], {t: [] for t in range(4)}

    def work(t: int) -> None:
        r = random.Random(t)
        try:
            for i in range(per_thread):
                # (t, i) tags make every sequence unique; a common body makes lookups find other threads' tokens
                added[t].append([1000 + t, 2000 + i] + [r.randrange(4) for _ in range(r.randrange(1, 12))])
                store.add(added[t][-1])
                suffix = [r.randrange(4) for _ in range(r.choice([2, 3, 4]))]
                seen.append((suffix, store.continuations(suffix, 3, 5)))
                len(store), store.sequences
        except Exception as err:  # noqa: BLE001 - any error in a thread fails the test
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    kept = held(store)
    assert 0 < len(store) == sum(map(len, kept)) <= cap and store.sequences == len(kept)
    # the newest of each thread's sequences are kept: each thread's kept ones are its last few, in order
    for t in range(4):
        mine = [seq[1] - 2000 for seq in kept if seq[0] == 1000 + t]
        assert mine == list(range(per_thread - len(mine), per_thread))
    # the index agrees with the contents: every lookup equals a scan of what is held
    r = random.Random(9)
    model = ListStore(cap)
    model.seqs = kept
    assert_store_is(store, model, r, 4, lookups=200)
    # what the threads saw were continuations of their suffixes in sequences added
    possible = set()
    for seq in (seq for seqs in added.values() for seq in seqs):
        for n in (2, 3, 4):
            for end in range(n - 1, len(seq) - 1):
                possible.add((tuple(seq[end - n + 1:end + 1]), tuple(seq[end + 1:end + 6])))
    assert len(seen) == 4 * per_thread and sum(map(len, (c for _, c in seen))) > 100
    for suffix, conts in seen:
        assert all((tuple(suffix), tuple(cont)) in possible for cont in conts)


class PausingLock:
    """The store's lock, where the thread named "reader" waits at its first acquire until `go` is set."""

    def __init__(self) -> None:
        self.inner, self.waiting, self.go = threading.Lock(), threading.Event(), threading.Event()

    def __enter__(self):
        if threading.current_thread().name == "reader" and not self.go.is_set():
            self.waiting.set()
            self.go.wait(5)
        self.inner.acquire()

    def __exit__(self, *exc):
        self.inner.release()


def test_a_lookup_racing_a_clear_returns_only_true_continuations():
    store = OutputStore(100)
    store.add([1, 2, 3, 4, 5])
    store._lock = PausingLock()
    got = []
    reader = threading.Thread(target=lambda: got.append(store.continuations([1, 2], 4, 3)), name="reader")
    reader.start()
    assert store._lock.waiting.wait(5)  # the lookup has begun and waits for the lock
    store.clear()
    store.add([9, 9, 9, 9, 9])
    store._lock.go.set()
    reader.join()
    assert got in ([[[3, 4, 5]]], [[]])  # the old store's answer or the new one's, never another suffix's


@pytest.mark.parametrize("cap", [0, -3, 1.5, True, "10", None])
def test_store_cap_is_validated(cap):
    with pytest.raises(DartInputError, match="cap"):
        OutputStore(cap)


def test_store_match_lengths_are_validated():
    for lo, hi in ((0, 2), (3, 2)):
        with pytest.raises(DartInputError, match="min_match"):
            OutputStore(10, lo, hi)
    assert OutputStore(np.int64(7)).max_tokens == 7


# ---- a row's paths with a store ----------------------------------------------------------------------------------

def random_case(seed: int):
    """A random row, a store's sequences (some copied from the row, so that matches of every length occur) and
    settings: (stream, [sequences], cfg, (store min, store max), cap)."""
    r = random.Random(seed)
    vocab = r.choice([3, 4, 6, 12])
    lo = r.choice([1, 2, 2, 3])
    cfg = TreeConfig(context_draft=True, context_min_match=lo, context_max_match=lo + r.choice([0, 1, 2, 3]),
                     context_matches=r.choice([1, 2, 4, 8]), context_depth=r.choice([1, 3, 8, 16]),
                     eos_token_id=r.choice([None, 0, 1]), max_depth=r.choice([None, None, 2, 5]))
    store_lo = r.choice([lo, lo, 1, 2])
    store_match = (store_lo, max(store_lo, cfg.context_max_match + r.choice([-1, 0, 0, 1])))
    stream = [r.randrange(vocab) for _ in range(r.randrange(8, 80))]
    seqs = []
    for _ in range(r.randrange(0, 12)):
        if r.random() < 0.5:  # a piece of the row
            a = r.randrange(len(stream))
            seqs.append(stream[a:a + r.randrange(1, 20)])
        else:
            seqs.append([r.randrange(vocab) for _ in range(r.randrange(1, 30))])
    return stream, seqs, cfg, store_match, r.choice([10**6, 10**6, 60])


def store_of(seqs, store_match, cap) -> tuple[OutputStore, list]:
    store, model = OutputStore(cap, *store_match), ListStore(cap)
    for seq in seqs:
        store.add(seq)
        model.add(seq)
    return store, model.seqs


def entries_as_dict(entries) -> dict:
    """{token path: (score, sources)} of proposal entries, rebuilt from (token, parent, depth, score, sources)."""
    paths = []
    for token, parent, depth, _, _ in entries:
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        assert len(paths[-1]) == depth and parent < len(paths) - 1
    assert len(set(paths)) == len(paths)
    return {p: (e[3], e[4]) for p, e in zip(paths, entries)}


def assert_same_paths(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for path, (score, sources) in ref.items():
        assert got[path][0] == pytest.approx(score, rel=1e-9, abs=1e-9) and got[path][1] == sources, path


def row_store_differences(seeds=range(20)) -> int:
    """How many (seed, prefix) cases' paths differ from the reference."""
    differs = 0
    for seed in seeds:
        stream, seqs, cfg, store_match, cap = random_case(seed)
        store, kept = store_of(seqs, store_match, cap)
        row = ContextRow(stream[:1], cfg.context_min_match, cfg.context_max_match)
        for n in range(2, len(stream) + 1):
            row.extend(stream[n - 1:n])
            got = entries_as_dict(row.paths(cfg, store))
            ref = reference_store_paths(stream[:n], kept, cfg, store_match)
            differs += set(got) != set(ref) or any(abs(got[p][0] - ref[p][0]) > 1e-9 or got[p][1] != ref[p][1]
                                                   for p in ref)
    return differs


@pytest.mark.parametrize("seed", range(20))
def test_row_and_store_paths_equal_the_brute_force(seed):
    stream, seqs, cfg, store_match, cap = random_case(seed)
    store, kept = store_of(seqs, store_match, cap)
    row = ContextRow(stream[:1], cfg.context_min_match, cfg.context_max_match)
    for n in range(2, len(stream) + 1):  # the row grows a token at a time, the store stays
        row.extend(stream[n - 1:n])
        assert_same_paths(entries_as_dict(row.paths(cfg, store)), reference_store_paths(stream[:n], kept, cfg,
                                                                                         store_match))
        if not seqs:  # an empty store: the row's own paths
            assert {p: s for p, (s, _) in entries_as_dict(row.paths(cfg, store)).items()} == pytest.approx(
                reference_context_paths(stream[:n], cfg))


def test_the_random_cases_cover_every_store_rule():
    """The comparison above sees each rule: the store's match alone, a longer store match replacing the row's, one as
    long joining it, and the row's alone."""
    cases = dict(store_alone=0, store_wins=0, joined=0, row_alone=0)
    for seed in range(20):
        stream, seqs, cfg, store_match, cap = random_case(seed)
        _, kept = store_of(seqs, store_match, cap)
        for n in range(2, len(stream) + 1):
            bits = {b for _, b in reference_store_paths(stream[:n], kept, cfg, store_match).values()}
            own = reference_context_paths(stream[:n], cfg)
            if bits and all(b == SOURCE_STORE for b in bits):
                cases["store_wins" if own else "store_alone"] += 1
            elif any(b & SOURCE_STORE for b in bits):
                cases["joined"] += 1
            elif bits:
                cases["row_alone"] += 1
    assert min(cases.values()) > 0, cases


def test_row_and_store_by_hand():
    cfg = TreeConfig(context_draft=True, context_min_match=2, context_max_match=3, context_matches=4,
                     context_depth=2)
    row = ContextRow([5, 7, 8, 1, 4, 7, 8], 2, 3)  # its own match: (7, 8) -> 1 4
    store = OutputStore(100, 2, 3)
    store.add([7, 8, 2, 2])
    assert row.continuations(4, 2, None, store) == (2, [[1, 4], [2, 2]], [SOURCE_CONTEXT, SOURCE_STORE])
    store.add([4, 7, 8, 6])  # a longer match (4, 7, 8) in the store replaces the row's
    assert row.continuations(4, 2, None, store) == (3, [[6]], [SOURCE_STORE])
    store.add([1, 4, 7, 8])  # (4, 7, 8) ends this sequence: nothing follows, the earlier occurrence stays
    assert row.continuations(4, 2, None, store) == (3, [[6]], [SOURCE_STORE])
    assert row.continuations(4, 2, 1, None) == (2, [[1]], [SOURCE_CONTEXT])  # cut after the EOS (1)
    assert [e[:3] + e[4:] for e in row.paths(cfg, store)] == [(6, -1, 1, SOURCE_STORE)]  # the trie of that match


@pytest.mark.parametrize("broken", ["earliest store occurrences", "store ignored", "a longer store match joins",
                                    "an as-long store match is dropped", "store continuations one token short"])
def test_control_a_broken_store_match_is_caught(monkeypatch, broken):
    original_row, original_store = ContextRow.continuations, OutputStore.continuations

    def earliest(self, suffix, count, depth):
        return original_store(self, suffix, 10**6, depth)[::-1][:count]

    def short(self, suffix, count, depth):
        return [c[:-1] for c in original_store(self, suffix, count, depth) if len(c) > 1]

    def row_mutant(self, count, depth, eos_token_id=None, store=None):
        m_row, own, _ = original_row(self, count, depth, eos_token_id, None)
        m, conts, sources = original_row(self, count, depth, eos_token_id, store)
        stored = [c for c, s in zip(conts, sources) if s == SOURCE_STORE]
        if broken == "store ignored":
            return m_row, own, [SOURCE_CONTEXT] * len(own)
        if broken == "a longer store match joins" and m > m_row > 0:
            return m, own + stored, [SOURCE_CONTEXT] * len(own) + [SOURCE_STORE] * len(stored)
        if broken == "an as-long store match is dropped" and m == m_row:
            return m_row, own, [SOURCE_CONTEXT] * len(own)
        return m, conts, sources

    if broken == "earliest store occurrences":
        monkeypatch.setattr(OutputStore, "continuations", earliest)
    elif broken == "store continuations one token short":
        monkeypatch.setattr(OutputStore, "continuations", short)
    else:
        monkeypatch.setattr(ContextRow, "continuations", row_mutant)
    assert row_store_differences() > 0


def test_drafter_takes_the_ngram_only_where_context_and_store_match_nothing():
    cfg = TreeConfig(context_draft=True, context_matches=2, context_depth=3)
    ngram = NGramModel.build([[9, 8, 7, 6, 5, 4, 3] * 3], order=3, vocab_size=20)
    store = OutputStore(100, min_match=2)
    store.add([11, 12, 13, 14])
    rows = [[1, 2, 3, 1, 2], [0, 11, 12], [0, 9, 8], [0, 15, 16]]  # context / store / n-gram / nothing at all
    drafter = ContextDrafter(rows, cfg, store, ngram)
    assert drafter.width == 2 * 2 * 3
    out = drafter.propose()
    by_row = [set(out.sources[b][out.depths[b] > 0].tolist()) for b in range(4)]
    assert by_row == [{SOURCE_CONTEXT}, {SOURCE_STORE}, {SOURCE_NGRAM}, set()]
    used = int((out.depths[2] > 0).sum())
    want = ngram_paths(ngram, rows[2], cfg, drafter.width)
    assert used == len(want) and out.tokens[2, :used].tolist() == [e[0] for e in want]
    assert int((drafter.propose(budget=2).depths[2] > 0).sum()) == 2  # the n-gram's budget
    assert int((drafter.propose(roots=[2, 12, 5, 16]).depths[2] > 0).sum()) == 0  # a row not at its root: nothing
    no_ngram = ContextDrafter(rows, cfg, store).propose()
    assert int((no_ngram.depths[2] > 0).sum()) == 0


# ---- n-gram paths: best first over a dict of counts ---------------------------------------------------------------

def brute_top(trie: DictTrie, context, k):
    """The k most frequent children of the longest suffix of `context` (order - 1 tokens at most) that has any, as
    (token, count / count(suffix)), count descending then token ascending."""
    for n in range(min(trie.order - 1, len(context)), 0, -1):
        ctx = tuple(context[len(context) - n:])
        children = {key[-1]: c for key, c in trie.counts.items() if len(key) == n + 1 and key[:-1] == ctx}
        if children:
            ranked = sorted(children.items(), key=lambda tc: (-tc[1], tc[0]))[:k]
            return [(t, c / trie.counts[ctx]) for t, c in ranked]
    return []


def full_ngram_tree(trie, tokens, cfg):
    """{path: score} of every node the search may reach: each node's `context_matches` likeliest children, to the
    depth cap, nothing after an EOS."""
    out, frontier = {}, [((), 0.0)]
    while frontier:
        path, score = frontier.pop()
        if len(path) >= cfg.context_path_depth() or (path and path[-1] == cfg.eos_token_id):
            continue
        for token, q in brute_top(trie, list(tokens) + list(path), cfg.context_matches):
            child = (path + (token,), score + cfg.level_weight(len(path)) * math.log(q))
            out[child[0]] = child[1]
            frontier.append(child)
    return out


def ngram_case(seed):
    r = random.Random(seed)
    vocab, order = r.choice([3, 5, 8]), r.choice([2, 3, 4])
    seqs = [[r.randrange(vocab) for _ in range(r.randrange(10, 60))] for _ in range(r.randrange(1, 4))]
    cfg = TreeConfig(context_draft=True, context_matches=r.choice([1, 2, 3]), context_depth=r.choice([1, 2, 4]),
                     eos_token_id=r.choice([None, 0, 1]), max_depth=r.choice([None, 3]),
                     level_weight_exponent=r.choice([0.0, 0.7]))
    tokens = [r.randrange(vocab) for _ in range(r.randrange(1, 6))]
    return seqs, order, vocab, cfg, tokens, r.choice([1, 3, 8, 40])


def ngram_mismatch(seed) -> str:
    """'' when `ngram_paths` is a best-first search of the reference tree, else what differs."""
    seqs, order, vocab, cfg, tokens, budget = ngram_case(seed)
    ngram, trie = NGramModel.build(seqs, order=order, vocab_size=vocab), DictTrie(seqs, order)
    entries = ngram_paths(ngram, tokens, cfg, budget)
    full = full_ngram_tree(trie, tokens, cfg)
    got = entries_as_dict(entries)
    if len(entries) != min(budget, len(full)):
        return f"{len(entries)} entries, want {min(budget, len(full))}"
    for path, (score, source) in got.items():
        if path not in full or abs(score - full[path]) > 1e-9 or source != SOURCE_NGRAM:
            return f"{path} {score} {source}"
    best = sorted(full.values(), reverse=True)[:budget]  # ties may pick either node: the scores must be the best
    if any(abs(a - b) > 1e-9 for a, b in zip(sorted((s for s, _ in got.values()), reverse=True), best)):
        return "not the best scores"
    return ""


@pytest.mark.parametrize("seed", range(16))
def test_ngram_paths_are_the_best_nodes_of_the_ngram_tree(seed):
    seqs, order, vocab, cfg, tokens, budget = ngram_case(seed)
    entries = ngram_paths(NGramModel.build(seqs, order=order, vocab_size=vocab), tokens, cfg, budget)
    got = entries_as_dict(entries)  # parents precede children (checked there); prefix-closed:
    assert all(len(p) == 1 or p[:-1] in got for p in got)
    assert len(entries) <= budget
    for token, parent, depth, score, _ in entries:
        assert depth <= cfg.context_path_depth()
        if parent >= 0:
            assert score <= entries[parent][3] + 1e-12  # never increasing along a path
            assert entries[parent][0] != cfg.eos_token_id or cfg.eos_token_id is None  # nothing after an EOS
    assert ngram_mismatch(seed) == ""


def test_the_ngram_cases_reach_the_budget_the_depth_cap_and_the_eos():
    budget_bound = depth_bound = eos_leaf = 0
    for seed in range(16):
        seqs, order, vocab, cfg, tokens, budget = ngram_case(seed)
        entries = ngram_paths(NGramModel.build(seqs, order=order, vocab_size=vocab), tokens, cfg, budget)
        budget_bound += len(entries) == budget
        depth_bound += any(e[2] == cfg.context_path_depth() > 1 for e in entries)
        eos_leaf += any(e[0] == cfg.eos_token_id and e[2] < cfg.context_path_depth() for e in entries)
    assert budget_bound and depth_bound and eos_leaf, (budget_bound, depth_bound, eos_leaf)


def test_control_the_least_frequent_continuations_are_caught(monkeypatch):
    original = NGramModel.top_continuations

    def least(self, context, k):
        return original(self, context, 10**6)[::-1][:k]

    monkeypatch.setattr(NGramModel, "top_continuations", least)
    assert any(ngram_mismatch(seed) for seed in range(16))


# ---- trees from proposals alone ----------------------------------------------------------------------------------

def random_entries(r: random.Random, count: int, vocab: int = 6):
    """A trie of `count` entries, parents first, scores never increasing along a path (equal ones often: ties)."""
    entries, children = [], {}
    for _ in range(count):
        parent = r.randrange(-1, len(entries))
        taken = children.setdefault(parent, set())
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            continue
        token = r.choice(free)
        taken.add(token)
        depth = 1 if parent < 0 else entries[parent][2] + 1
        base = 0.0 if parent < 0 else entries[parent][3]
        score = base - r.choice([0.0, 0.5, 0.5, 1.0, r.random()])
        if r.random() < 0.05:
            score = float("-inf")
        entries.append((token, parent, depth, score, r.choice([SOURCE_CONTEXT, SOURCE_STORE, SOURCE_NGRAM, 6])))
    return entries


def proposal_case(seed):
    r = random.Random(seed)
    rows = [random_entries(r, r.choice([0, 0, 1, 3, 8, 20])) for _ in range(r.randrange(1, 5))]
    width = max([len(e) for e in rows] + [0]) + r.choice([0, 2])
    return rows, width, r.choice([1, 2, 5, 12, 60]), r.choice([1, 2, 3, 32]), [r.randrange(50, 60) for _ in rows]


def proposal_mismatch(seed, reference=reference_proposal_tree) -> str:
    rows, width, remain, max_depth, roots = proposal_case(seed)
    trees = proposal_trees(ContextProposals.pack(rows, width), torch.tensor(roots), remain, max_depth)
    refs = [reference(e, remain, max_depth) for e in rows]
    if trees.num_nodes != 1 + max(len(ref) for ref in refs):
        return f"{trees.num_nodes} nodes"
    for b, ref in enumerate(refs):
        tree = trees[b]
        got = {p: (s, src) for p, s, src in zip(tree.paths(), tree.scores[1:].tolist(), tree.sources[1:].tolist())}
        if set(got) != set(ref) or any(abs(got[p][0] - ref[p][0]) > 1e-5 or got[p][1] != ref[p][1] for p in ref):
            return f"row {b}"
    return ""


@pytest.mark.parametrize("seed", range(24))
def test_proposal_trees_equal_the_brute_force_selection(seed):
    rows, width, remain, max_depth, roots = proposal_case(seed)
    trees = proposal_trees(ContextProposals.pack(rows, width), torch.tensor(roots), remain, max_depth)
    assert proposal_mismatch(seed) == ""
    n = trees.num_nodes
    for b in range(len(rows)):
        kept = len(reference_proposal_tree(rows[b], remain, max_depth))
        assert trees.valid[b].tolist() == [True] * (1 + kept) + [False] * (n - 1 - kept)  # valid first
        check_structure(trees[b], roots[b])  # root first, parents precede, depth = parent's + 1, prefix-closed
        pad = slice(1 + kept, n)
        assert (trees.tokens[b, pad] == 0).all() and (trees.parents[b, pad] == -1).all()
        assert (trees.depths[b, pad] == 0).all() and torch.isinf(trees.scores[b, pad]).all()
        assert (trees.sources[b, pad] == 0).all() and trees.sources[b, 0] == 0


def test_the_proposal_cases_have_empty_rows_ties_and_cuts():
    empty = cut = tie_at_cut = 0
    for seed in range(24):
        rows, width, remain, max_depth, roots = proposal_case(seed)
        for entries in rows:
            usable = sorted((e[3] for e in entries if 1 <= e[2] <= max_depth and math.isfinite(e[3])), reverse=True)
            empty += not usable
            cut += len(usable) > remain
            tie_at_cut += len(usable) > remain and usable[remain - 1] == usable[remain]
    assert empty and cut and tie_at_cut, (empty, cut, tie_at_cut)


def test_no_proposals_give_the_roots_alone():
    trees = proposal_trees(ContextProposals.pack([[], []], 0), torch.tensor([3, 4]), 8, 4)
    assert trees.num_nodes == 1 and trees.tokens[:, 0].tolist() == [3, 4] and trees.valid.all()
    trees = proposal_trees(ContextProposals.pack([[], []], 5), torch.tensor([3, 4]), 8, 4)
    assert trees.num_nodes == 1


@pytest.mark.parametrize("broken", ["deeper first on ties", "later entry first on ties", "one node short"])
def test_control_a_perturbed_selection_is_caught(broken):
    def perturbed(entries, remain_total, max_depth):
        paths = []
        for token, parent, *_ in entries:
            paths.append((paths[parent] if parent >= 0 else ()) + (int(token),))
        usable = [i for i, e in enumerate(entries) if 1 <= e[2] <= max_depth and math.isfinite(e[3])]
        key = {"deeper first on ties": lambda i: (-entries[i][3], -entries[i][2], i),
               "later entry first on ties": lambda i: (-entries[i][3], entries[i][2], -i),
               "one node short": lambda i: (-entries[i][3], entries[i][2], i)}[broken]
        keep = remain_total - 1 if broken == "one node short" else remain_total
        return {paths[i]: (float(entries[i][3]), int(entries[i][4])) for i in sorted(usable, key=key)[:keep]}

    assert any(proposal_mismatch(seed, perturbed) for seed in range(24))


# ---- generate(): greedy output token for token plain's ------------------------------------------------------------

def repeating_prompts(seed: int, rows: int, vocab: int = 96) -> list[torch.Tensor]:
    """Prompts that repeat a random phrase (a tiny random target then often goes on copying: context matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        phrase = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        out.append(torch.cat((phrase.repeat(2), torch.randint(3, vocab, (int(torch.randint(0, 4, (1,),
                                                                                              generator=g)),),
                                                                     generator=g))))
    return out


GREEDY = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
MF = dict(dart_head=ModelFreeDrafter(), dart_tree_config=DEFAULT_TREE)  # a fixed tree: DART whatever this CPU's speed


def check_counts(stats) -> None:
    assert stats is not None and stats.steps > 0
    assert stats.accepted_head == stats.accepted_both == 0  # no head
    assert stats.accepted_context == sum(stats.accepted_lengths)
    assert stats.accepted_store + stats.accepted_ngram <= stats.accepted_context


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_model_free_equals_plain(rows):
    model = dart_hf.enable(tiny_target(seed=rows), False)
    ids, mask = left_padded(repeating_prompts(rows, rows))
    if rows > 1:
        assert not bool(mask.all())  # the batch is left-padded
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    out = model.generate(ids, attention_mask=mask, **GREEDY, **MF, dart_store=False)
    assert torch.equal(out, plain)
    check_counts(model.dart_stats)
    assert model.dart_stats.accepted_context > 0 and model.dart_stats.accepted_store == 0
    assert model.dart_stats.forwards < 40  # trees were verified: fewer forwards than tokens


def test_the_default_enable_attaches_a_model_free_drafter_whose_output_is_plains():
    model = tiny_target(seed=4)
    ids, mask = left_padded(repeating_prompts(4, 2))
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    dart_hf.enable(model)
    assert isinstance(model._dart_attached.head, ModelFreeDrafter) and isinstance(model.dart_store, OutputStore)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), plain)  # DART or plain, as it chooses
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY, dart_tree_config=DEFAULT_TREE), plain)
    check_counts(model.dart_stats)
    assert dart_hf.enable(tiny_target(), False)._dart_attached is None  # enable(model, False) attaches no drafter


def test_a_store_of_earlier_outputs_is_used_and_the_output_stays_plains():
    model = dart_hf.enable(tiny_target(seed=5), False)
    store = OutputStore(100_000)
    ids, mask = left_padded(repeating_prompts(5, 3))
    others, other_mask = left_padded(repeating_prompts(50, 3))
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    plain_others = model.generate(others, attention_mask=other_mask, **GREEDY)
    # outputs of other prompts, then of these prompts, kept by earlier DART calls (their outputs plain's too)
    assert torch.equal(model.generate(others, attention_mask=other_mask, **GREEDY, **MF, dart_store=store),
                       plain_others)
    first = model.generate(ids, attention_mask=mask, **GREEDY, **MF, dart_store=store)
    before = model.dart_stats
    assert torch.equal(first, plain) and store.sequences == 6
    again = model.generate(ids, attention_mask=mask, **GREEDY, **MF, dart_store=store)
    stats = model.dart_stats
    assert torch.equal(again, plain)
    check_counts(stats)
    assert stats.accepted_store > 0  # the store's continuations were accepted
    assert stats.forwards < before.forwards  # and they paid: the same prompts again take fewer forwards
    # what each call kept: each row's last 16 prompt tokens and its new tokens
    for b in range(3):
        real = ids[b][mask[b].bool()].tolist()
        assert held(store)[-3 + b] == real[-16:] + plain[b, ids.shape[1]:].tolist()


@pytest.mark.parametrize("how", [
    "the model's generation_config", "generation_config=",
    "eos_token_id=",
])
def test_outputs_are_kept_up_to_the_first_eos(how):
    from transformers import GenerationConfig

    model = dart_hf.enable(tiny_target(seed=5), False, store=1000)
    ids, mask = left_padded(repeating_prompts(5, 3))
    full = model.generate(ids, attention_mask=mask, **GREEDY)
    eos = int(full[1, ids.shape[1] + 3])  # row 1 stops at its 4th new token (or earlier)
    kwargs = dict(GREEDY, attention_mask=mask)
    if how == "eos_token_id=":
        kwargs["eos_token_id"] = eos
    elif how == "generation_config=":
        kwargs = dict(attention_mask=mask, generation_config=GenerationConfig(eos_token_id=eos, **GREEDY))
    else:
        model.generation_config.eos_token_id = eos
    plain = model.generate(ids, **kwargs)
    assert (plain[1, -3:] == 0).all()  # row 1 ended and was padded
    out = model.generate(ids, **kwargs, dart_head=ModelFreeDrafter(), dart_tree_config=DEFAULT_TREE)
    assert torch.equal(out, plain)
    kept = held(model.dart_store)
    assert len(kept) == 3
    for b in range(3):
        new = plain[b, ids.shape[1]:].tolist()
        new = new[:new.index(eos) + 1] if eos in new else new
        assert kept[b] == ids[b][mask[b].bool()].tolist()[-16:] + new


def test_an_ngram_table_drafts_where_nothing_matches():
    model = dart_hf.enable(tiny_target(seed=6), False)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])  # no token twice: no context match at first
    plain = model.generate(prompt, **GREEDY)
    ngram = NGramModel.build([plain[0].tolist()], order=3, vocab_size=96)  # the target's own continuation
    out = model.generate(prompt, **GREEDY, **MF, dart_store=False, dart_ngram=ngram)
    assert torch.equal(out, plain)
    check_counts(model.dart_stats)
    assert model.dart_stats.accepted_ngram > 0
    without = model.generate(prompt, **GREEDY, **MF, dart_store=False)
    assert torch.equal(without, plain) and model.dart_stats.accepted_ngram == 0
    attached = model.generate(prompt, **GREEDY, dart_head=ModelFreeDrafter(ngram), dart_tree_config=DEFAULT_TREE,
                              dart_store=False)  # the drafter's own table
    assert torch.equal(attached, plain) and model.dart_stats.accepted_ngram > 0


def chat(model, **kwargs):
    """Two turns through one cache, batch 1."""
    cache = DynamicCache(config=model.config)
    history, outputs = torch.zeros(1, 0, dtype=torch.long), []
    for message in ([5, 17, 33, 2, 9, 5, 17, 33], [7, 8, 9, 7, 8]):
        ids = torch.cat((history, torch.tensor([message])), dim=1)
        history = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache, **kwargs)
        outputs.append(history)
    return outputs


def test_a_carried_cache_across_two_calls_equals_plain():
    model = dart_hf.enable(tiny_target(seed=8), False)
    plain = chat(model)
    store = OutputStore(1000)
    got = chat(model, **MF, dart_store=store)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    check_counts(model.dart_stats)
    assert store.sequences == 2


def lossy_greedy(trees, logits, **kwargs):
    """A wrong greedy verifier: where nothing was accepted it accepts the root's first child anyway."""
    result = verify_greedy(trees, logits, **kwargs)
    wrong = (result.accept_length == 0) & trees.valid[:, 1] if trees.num_nodes > 1 else result.accept_length < 0
    nodes = result.accepted_nodes.clone()
    nodes[:, 1] = torch.where(wrong, 1, nodes[:, 1])
    bonus = torch.where(wrong, logits[:, 1].argmax(-1) if trees.num_nodes > 1 else result.bonus_token,
                        result.bonus_token)
    return VerifyResult(nodes, torch.where(wrong, 1, result.accept_length), bonus)


def test_control_a_wrong_acceptance_parts_from_plain(monkeypatch):
    model = dart_hf.enable(tiny_target(seed=3), False)
    ids, mask = left_padded(repeating_prompts(3, 3))
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    g = torch.Generator().manual_seed(0)  # a table of random text: wrong drafts wherever the context matches nothing
    noise = NGramModel.build([torch.randint(0, 96, (4000,), generator=g)], order=2, vocab_size=96)
    kwargs = dict(attention_mask=mask, **GREEDY, **MF, dart_store=False, dart_ngram=noise)
    assert torch.equal(model.generate(ids, **kwargs), plain)
    assert model.dart_stats.tree_nodes > 1
    monkeypatch.setattr(dart_hf.loop, "verify_greedy", lossy_greedy)
    assert not torch.equal(model.generate(ids, **kwargs), plain)


# ---- sampling keeps the target distribution ------------------------------------------------------------------------

SAMPLING_PROMPT = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]])
SAMPLING_TREE = TreeConfig(remain_total=8, context_matches=4, context_depth=3, context_min_match=1)


def sample_pairs(model, store, draws, seed):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    accepted_store = 0
    for _ in range(draws):  # each call's output joins the store: later calls match the same prompt's outputs
        out = model.generate(SAMPLING_PROMPT, max_new_tokens=3, do_sample=True, top_k=0, dart_head=ModelFreeDrafter(),
                             dart_tree_config=SAMPLING_TREE, dart_store=store)
        counts[out[0, -3], out[0, -2]] += 1
        accepted_store += model.dart_stats.accepted_store
    return counts, accepted_store


@pytest.mark.slow  # statistical: 700 generate() calls
def test_sampling_with_a_store_keeps_the_distribution_and_a_lossy_control_fails(monkeypatch):
    model = dart_hf.enable(tiny_target(vocab=8, layers=4, hidden=16, seed=3), False)
    exact = exact_two_token_distribution(model, SAMPLING_PROMPT).flatten()
    store = OutputStore(10_000, 1, 4)
    counts, accepted_store = sample_pairs(model, store, draws=500, seed=0)
    assert chi_square_pvalue(counts.flatten(), exact) > 1e-3
    assert accepted_store > 0  # the store's paths took part

    monkeypatch.setattr(dart_hf.loop, "verify_tree", lossy_verify)
    control, _ = sample_pairs(model, OutputStore(10_000, 1, 4), draws=200, seed=1)
    assert chi_square_pvalue(control.flatten(), exact) < 1e-6


# ---- refusals, before any work -------------------------------------------------------------------------------------

@pytest.fixture
def counted():
    """A tiny target enabled with nothing attached, whose forward counts its calls."""
    model = dart_hf.enable(tiny_target(seed=2), False)
    calls = []
    forward = model.forward

    @functools.wraps(forward)  # generate() reads the forward's signature
    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = counting
    return model, calls


PROMPT = torch.tensor([[5, 6, 7, 5, 6]])


@pytest.mark.parametrize("extra, match", [
    (dict(dart_context_draft=False), "dart_context_draft=False"),
    (dict(dart_cuda_graph=True), "dart_cuda_graph=True"),
    (dict(dart_tree_config=TreeConfig(context_draft=False)), "context_draft=True"),
])
def test_what_model_free_drafting_cannot_serve_is_refused_before_any_work(counted, extra, match):
    model, calls = counted
    with pytest.raises(DartInputError, match=match):
        model.generate(PROMPT, max_new_tokens=4, do_sample=False, dart_head=ModelFreeDrafter(), **extra)
    attached = dart_hf.enable(model)  # the same refusal for the attached drafter
    with pytest.raises(DartInputError, match=match):
        attached.generate(PROMPT, max_new_tokens=4, do_sample=False, **extra)
    assert calls == [] and attached.dart_store.sequences == 0
    assert model.generate(PROMPT, max_new_tokens=4, do_sample=False, dart_head=ModelFreeDrafter()).shape == (1, 9)
    assert calls  # the count sees a forward


def test_a_model_free_drafter_as_assistant_model_is_refused_before_any_work(counted):
    model, calls = counted
    for enabled in (model, dart_hf.enable(model)):  # refused first, whether a drafter is attached or not
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: the refusal comes before any decision
            with pytest.raises(DartInputError, match="assistant_model takes a DartHead"):
                enabled.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant_model=ModelFreeDrafter())
    assert calls == []


@pytest.mark.parametrize("store", [0, -3, 1.5, "big"])
def test_enable_refuses_a_bad_store_and_leaves_the_model_as_it_was(store):
    model = tiny_target(seed=2)
    cls = type(model)
    with pytest.raises(DartInputError, match="cap"):
        dart_hf.enable(model, store=store)
    assert type(model) is cls and not hasattr(model, "_dart_store")


def test_enable_store_settings():
    own = OutputStore(77)
    assert dart_hf.enable(tiny_target(), store=own).dart_store is own
    assert dart_hf.enable(tiny_target(), store=123).dart_store.max_tokens == 123
    assert dart_hf.enable(tiny_target(), store=False).dart_store is None
    assert isinstance(dart_hf.enable(tiny_target()).dart_store, OutputStore)
    with pytest.raises(TypeError, match="dart_store must be"):
        dart_hf.enable(tiny_target(), False).generate(PROMPT, max_new_tokens=2, dart_head=ModelFreeDrafter(),
                                                      dart_store=5)
    with pytest.raises(TypeError, match="ngram must be"):
        ModelFreeDrafter(ngram=object())
    with pytest.raises(DartInputError, match="context_draft=True"):
        ModelFreeDrafter(tree_config=TreeConfig(context_draft=False))


def test_dart_store_false_keeps_nothing_and_the_attached_store_keeps_outputs():
    model = dart_hf.enable(tiny_target(seed=9), store=500)
    model.generate(PROMPT, max_new_tokens=6, do_sample=False, dart_tree_config=DEFAULT_TREE, dart_store=False)
    assert model.dart_store.sequences == 0
    out = model.generate(PROMPT, max_new_tokens=6, do_sample=False, dart_tree_config=DEFAULT_TREE)
    assert held(model.dart_store) == [out[0].tolist()]
    model.dart_store.clear()
    assert model.dart_store.sequences == 0
