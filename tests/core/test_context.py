"""Context drafting (docs/DESIGN.md §2.6) against brute-force re-derivations on random token streams, and the merged
tree search against `reference_merged_tree`; controls with a deliberately broken matcher must fail."""

import dataclasses
import random

import pytest
import torch

from dart_core import DartInputError, NGramModel, TreeConfig, build_draft_tree, build_draft_trees
from dart_core.context import SOURCE_CONTEXT, SOURCE_HEAD, ContextDrafter, ContextProposals, ContextRow
from dart_core.reference import DictTrie, reference_context_paths, reference_merged_tree
from dart_core.tree import topk_draft_tokens

from helpers.tree_checks import check_structure, tree_as_dict


def random_config(r: random.Random, **extra) -> TreeConfig:
    lo = r.choice([1, 2, 2, 3])
    return TreeConfig(context_draft=True, context_min_match=lo, context_max_match=lo + r.choice([0, 1, 2, 3]),
                      context_matches=r.choice([1, 2, 4, 8]), context_depth=r.choice([1, 3, 8, 16]),
                      eos_token_id=r.choice([None, 0, 1]), max_depth=r.choice([None, None, 2, 5]), **extra)


def trie_of(row: ContextRow, cfg: TreeConfig) -> dict:
    """{token path: score} of a row's context entries, rebuilt from (token, parent, depth, score)."""
    entries = row.paths(cfg)
    paths = []
    for token, parent, depth, _, _ in entries:
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        assert len(paths[-1]) == depth
    return {p: e[3] for p, e in zip(paths, entries)}


def assert_same_trie(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for path, score in ref.items():
        assert got[path] == pytest.approx(score, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_paths_match_brute_force_on_random_streams(seed):
    r = random.Random(seed)
    vocab = r.choice([3, 5, 12, 50])
    cfg = random_config(r)
    stream = [r.randrange(vocab) for _ in range(r.randrange(20, 160))]
    row, fed = ContextRow(stream[:1], cfg.context_min_match, cfg.context_max_match), 1
    while fed < len(stream):  # the row grows by a step's tokens at a time (1 to 6), never rescanned
        n = min(len(stream), fed + r.randrange(1, 7))
        row.extend(stream[fed:n])
        fed = n
        assert_same_trie(trie_of(row, cfg), reference_context_paths(stream[:fed], cfg))


def test_a_hand_worked_row():
    # ... 7 8 9 | 7 8 4 | 7 8: the suffix (7, 8) ends at 1 and 4; latest first: continuations (4, 7, 8) and (9, 7, 8)
    cfg = TreeConfig(context_draft=True, context_min_match=2, context_max_match=3, context_matches=2, context_depth=3)
    row = ContextRow([7, 8, 9, 7, 8, 4, 7, 8], 2, 3)
    assert row.matches(2) == (2, [4, 1])
    paths = trie_of(row, cfg)
    assert set(paths) == {(4,), (4, 7), (4, 7, 8), (9,), (9, 7), (9, 7, 8)}
    import math
    first = math.log(2 * 1 / (1 + 2 * 2))  # one of the two continuations takes each first token
    assert paths[(4,)] == pytest.approx(first)
    assert paths[(4, 7)] == pytest.approx(first + cfg.level_weight(1) * math.log(2 / 3))


@pytest.mark.parametrize("broken", ["earliest occurrences", "shortest match", "suffix itself counted"])
def test_control_a_broken_matcher_is_caught(monkeypatch, broken):
    original = ContextRow.matches

    def earliest(self, count):
        m, ends = original(self, 10**6)
        return m, sorted(ends)[:count]

    def shortest(self, count):
        for length in range(self.min_match, min(self.max_match, len(self.tokens) - 1) + 1):
            ends = [e for e in self._ends[length].get(self._suffix(length), []) if e != len(self.tokens) - 1]
            if ends:
                return length, ends[::-1][:count]
        return 0, []

    def with_itself(self, count):
        m, ends = original(self, count)
        return m, ([len(self.tokens) - 1] + ends)[:count] if m else ends

    monkeypatch.setattr(ContextRow, "matches", {"earliest occurrences": earliest, "shortest match": shortest,
                                                "suffix itself counted": with_itself}[broken])
    differs = 0
    for seed in range(20):
        r = random.Random(seed)
        cfg = random_config(r)
        cfg = dataclasses.replace(cfg, context_matches=2, context_min_match=1, context_max_match=3, max_depth=None,
                                  context_depth=4)
        stream = [r.randrange(4) for _ in range(60)]
        row = ContextRow(stream, cfg.context_min_match, cfg.context_max_match)
        got, ref = trie_of(row, cfg), reference_context_paths(stream, cfg)
        differs += set(got) != set(ref) or any(abs(got[p] - ref[p]) > 1e-9 for p in ref)
    assert differs > 0


def test_drafter_rows_extend_select_and_pack():
    cfg = TreeConfig(context_draft=True, context_matches=2, context_depth=3)
    drafter = ContextDrafter([[1, 2, 3, 1, 2], torch.tensor([5, 6, 5]), [9]], cfg)
    assert drafter.width == 6
    first = drafter.propose()
    assert first.tokens.shape == (3, 6) and first.width == 6
    assert first.tokens[0, 0] == 3 and first.depths[0, :3].tolist() == [1, 2, 3]  # (1, 2) -> 3 1 2
    assert (first.depths[2] == 0).all() and torch.isinf(first.scores[2]).all()  # nothing matches in [9]
    drafter.extend([[3], [6], [9]])
    drafter.select(torch.tensor([2, 0]))
    assert [r.tokens for r in drafter.rows] == [[9, 9], [1, 2, 3, 1, 2, 3]]
    again = drafter.propose(roots=[9, 4])  # row 1's last token is not its root: it proposes nothing
    assert (again.depths[1] == 0).all()
    off = ContextDrafter([[1, 2, 1]], TreeConfig(context_draft=False)).propose()
    assert off.width == 0
    with pytest.raises(ValueError, match="2 rows of tokens for 3"):
        ContextDrafter([[1], [2], [3]], cfg).extend([[1], [2]])


@pytest.mark.parametrize("seed", range(16))
def test_merged_tree_matches_reference(seed):
    rng = torch.Generator().manual_seed(seed)
    r = random.Random(seed)
    vocab = r.choice([6, 20, 60])
    seqs = [[r.randrange(vocab) for _ in range(200)] for _ in range(2)]
    ngram, trie = NGramModel.build(seqs, order=3, vocab_size=vocab), DictTrie(seqs, 3)
    levels, k = r.choice([(1, 4), (3, 4), (4, 6)])
    cfg = random_config(r, topk=k, beam_width=r.choice([1, 3, 8]), remain_total=r.choice([4, 8, 30]),
                        ngram_weight=r.choice([0.0, 0.5]))
    levels = min(levels, cfg.remain_total)
    logits = torch.randn(levels, vocab, generator=rng) * r.choice([0.5, 3.0])
    tokens, probs = topk_draft_tokens(logits, k)
    # a row whose context repeats itself, so context paths exist and often coincide with the head's candidates
    row = [r.randrange(vocab) for _ in range(r.randrange(5, 40))] * 2 + [r.randrange(vocab)]
    proposals = ContextDrafter([row], cfg).propose()
    tree = build_draft_tree(tokens, probs, row[-3:], ngram, cfg, proposals=proposals)
    check_structure(tree, row[-1])
    ref = reference_merged_tree(tokens, probs, row[-3:], trie, cfg, row)
    got = tree_as_dict(tree)
    assert set(got) == set(ref)
    for path, score in ref.items():
        assert got[path] == pytest.approx(score, rel=1e-5, abs=1e-5)
    # sources: a node is the context's exactly when its path is a context path
    context_paths = set(reference_context_paths(row, cfg))
    for path, source in zip(tree.paths(), tree.sources[1:].tolist()):
        assert bool(source & SOURCE_CONTEXT) == (path in context_paths and len(path) <= (cfg.max_depth or 99))
        assert source != 0


def test_batched_merge_equals_each_row_alone():
    r = random.Random(3)
    cfg = TreeConfig(topk=4, beam_width=4, remain_total=10, context_draft=True, context_matches=3, context_depth=6)
    rows = [[r.randrange(8) for _ in range(30)] for _ in range(4)]
    rng = torch.Generator().manual_seed(3)
    tokens, probs = topk_draft_tokens(torch.randn(4, 3, 8, generator=rng), 4)
    proposals = ContextDrafter(rows, cfg).propose()
    contexts = torch.tensor([row[-2:] for row in rows])
    batch = build_draft_trees(tokens, probs, contexts, None, cfg, context=proposals)
    for b, row in enumerate(rows):
        alone = build_draft_tree(tokens[b], probs[b], row[-2:], None, cfg,
                                 proposals=ContextDrafter([row], cfg).propose())
        assert tree_as_dict(batch[b]) == tree_as_dict(alone)
        assert torch.equal(batch[b].sources, alone.sources)


def test_without_proposals_or_with_the_source_off_the_tree_is_the_heads():
    r = random.Random(5)
    row = [r.randrange(5) for _ in range(40)]
    tokens, probs = topk_draft_tokens(torch.randn(3, 10, generator=torch.Generator().manual_seed(5)), 4)
    on = TreeConfig(topk=4, remain_total=8, context_draft=True)
    head_only = build_draft_tree(tokens, probs, row[-2:], None, dataclasses.replace(on, context_draft=False))
    proposals = ContextDrafter([row], on).propose()
    off = build_draft_tree(tokens, probs, row[-2:], None, dataclasses.replace(on, context_draft=False),
                           proposals=proposals)
    assert tree_as_dict(off) == tree_as_dict(head_only) and (off.sources[1:] == SOURCE_HEAD).all()
    merged = build_draft_tree(tokens, probs, row[-2:], None, on, proposals=proposals)
    assert merged.num_nodes == head_only.num_nodes  # the node budget is the head's, whatever the context


def test_context_settings_are_validated():
    for bad, match in ((dict(context_draft=1), "context_draft"), (dict(context_depth=0), "context_depth"),
                       (dict(context_matches=99), "context_matches"),
                       (dict(context_min_match=3, context_max_match=2), "below context_min_match")):
        with pytest.raises(DartInputError, match=match):
            TreeConfig(**bad)
    cfg = TreeConfig(context_draft=True, topk=4)
    with pytest.raises(ValueError, match="must be \\[B=1, P\\]"):
        build_draft_trees(*topk_draft_tokens(torch.randn(1, 2, 10), 4), torch.tensor([[1]]), None, cfg,
                          context=ContextProposals(*(torch.zeros(2, 3, dtype=torch.long) for _ in range(4))))
