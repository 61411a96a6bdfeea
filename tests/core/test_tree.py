"""The draft-tree beam search against a slow, obviously-correct re-derivation of docs/DESIGN.md §2.3, plus hand-worked cases."""

import random

import numpy as np
import pytest
import torch

from dart_core import DraftTree, DraftTreeBatch, NGramModel, TreeConfig, build_draft_tree, build_draft_trees
from dart_core.reference import DictTrie, reference_tree
from dart_core.tree import topk_draft_tokens
from helpers.tree_checks import check_structure, tree_as_dict


def random_inputs(rng, levels, k, vocab, sharp=1.0):
    logits = torch.randn(levels, max(vocab, k), generator=rng) * sharp
    return topk_draft_tokens(logits, k)


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_on_random_inputs(seed):
    rng = torch.Generator().manual_seed(seed)
    r = random.Random(seed)
    vocab = r.choice([30, 60, 200])
    order = r.choice([2, 3, 3, 4]) if vocab <= 60 else 3
    seqs = [[r.randrange(vocab) for _ in range(r.randrange(50, 400))] for _ in range(3)]
    ngram, trie = NGramModel.build(seqs, order=order, vocab_size=vocab), DictTrie(seqs, order)
    levels, k = r.choice([(1, 5), (3, 4), (5, 8), (9, 25)])
    cfg = TreeConfig(topk=k, beam_width=r.choice([1, 3, 20]), remain_total=r.choice([5, 60, 500]),
                     ngram_weight=r.choice([0.0, 0.5, 2.0]), eos_token_id=r.choice([None, 0, 1]))
    tokens, probs = random_inputs(rng, levels, k, vocab, sharp=r.choice([0.5, 3.0]))
    context = [r.randrange(vocab) for _ in range(r.randrange(1, 6))]
    tree = build_draft_tree(tokens, probs, context, ngram, cfg)
    ref = reference_tree(tokens, probs, context, trie, cfg)
    got = tree_as_dict(tree)
    assert set(got) == set(ref)
    for path, score in ref.items():
        assert got[path] == pytest.approx(score, rel=1e-6, abs=1e-6)
    check_structure(tree, context[-1])


def test_hand_worked_two_levels():
    # two levels, K=2; p = (0.8, 0.2) at level 0, (0.6, 0.4) at level 1; no n-gram; beam 2; keep 4 of the 6.
    tokens = torch.tensor([[10, 11], [20, 21]])
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    cfg = TreeConfig(topk=2, beam_width=2, remain_total=4, ngram_weight=0.0)
    tree = build_draft_tree(tokens, probs, [5], None, cfg)
    lw1 = 2 ** -0.7
    expected = {
        (10,): np.log(0.8), (11,): np.log(0.2),
        (10, 20): np.log(0.8) + lw1 * 0.9 * np.log(0.6), (10, 21): np.log(0.8) + lw1 * 0.9 * np.log(0.4),
        (11, 20): np.log(0.2) + lw1 * 0.9 * np.log(0.6), (11, 21): np.log(0.2) + lw1 * 0.9 * np.log(0.4),
    }
    best4 = sorted(expected, key=lambda p: -expected[p])[:4]
    assert set(tree.paths()) == set(best4) == {(10,), (11,), (10, 20), (10, 21)}
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    mask = tree.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False]


def test_ngram_prior_reorders_and_level0_ignores_it():
    # After context [1, 2] the corpus always continues with 3, so the n-gram lifts 3 over 4 at level 1 even though
    # the head prefers 4; at level 0 the n-gram is ignored.
    ngram = NGramModel.build([[7, 1, 2, 3] * 20], order=3, vocab_size=10)
    tokens = torch.tensor([[2, 9], [4, 3]])
    probs = torch.tensor([[0.5, 0.5], [0.7, 0.3]])
    cfg = TreeConfig(topk=2, beam_width=1, remain_total=3, ngram_weight=0.5)
    tree = build_draft_tree(tokens, probs, [7, 1], ngram, cfg)
    # level 0: tie between 2 and 9 (n-gram would favour 2 but is not applied) -> pool order keeps 2 first
    # level 1 after 2: q(3 | 1,2) = 1, q(4 | 1,2) = 0 -> 3 wins despite p
    assert set(tree.paths()) == {(2,), (9,), (2, 3)}
    plain = build_draft_tree(tokens, probs, [7, 1], None, cfg)
    assert set(plain.paths()) == {(2,), (9,), (2, 4)}


def test_eos_extensions_enter_the_beam_last():
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9]])  # token 0 is EOS and the most likely at level 0
    probs = torch.tensor([[0.9, 0.06, 0.04], [0.5, 0.3, 0.2]])
    cfg = TreeConfig(topk=3, beam_width=1, remain_total=9, ngram_weight=0.0, eos_token_id=0)
    tree = build_draft_tree(tokens, probs, [4], None, cfg)
    depth2 = {p for p in tree.paths() if len(p) == 2}
    assert depth2 == {(5, 7), (5, 8), (5, 9)}  # the beam continued from 5, not from EOS
    assert (0,) in tree.paths()  # EOS itself still is a node (the final pool ignores EOS ordering)


def test_batched_rows_equal_single_trees():
    rng = torch.Generator().manual_seed(0)
    ngram = NGramModel.build([[random.Random(1).randrange(50) for _ in range(3000)]], order=3, vocab_size=50)
    cfg = TreeConfig()
    tok_b, prob_b, ctx_b = [], [], []
    for _ in range(5):
        t, p = random_inputs(rng, 9, 25, 50, sharp=2.0)
        tok_b.append(t), prob_b.append(p)
        ctx_b.append(torch.randint(0, 50, (4,), generator=rng))
    ctx_b[1][:2] = -1  # a short context in row 1
    batch = build_draft_trees(torch.stack(tok_b), torch.stack(prob_b), torch.stack(ctx_b), ngram, cfg)
    assert batch.tokens.shape == (5, 61) and bool(batch.valid.all())
    for i in range(5):
        ctx = [c for c in ctx_b[i].tolist() if c >= 0]
        single = build_draft_tree(tok_b[i], prob_b[i], ctx, ngram, cfg)
        assert torch.equal(batch[i].tokens, single.tokens) and torch.equal(batch[i].parents, single.parents)


@pytest.mark.parametrize("seed", range(8))
def test_levels_past_remain_total_change_nothing(seed):
    # `TreeConfig.draft_levels` drops the candidate levels deeper than remain_total: the trees must be identical,
    # ties included (sharp logits give probabilities of exactly 1, whose log term is 0, so a child ties its parent)
    rng = torch.Generator().manual_seed(seed)
    r = random.Random(seed)
    vocab = 40
    ngram = NGramModel.build([[r.randrange(vocab) for _ in range(600)]], order=3, vocab_size=vocab)
    levels, k = 9, 6
    tokens, probs = zip(*(random_inputs(rng, levels, k, vocab, sharp=r.choice([0.5, 3.0, 60.0])) for _ in range(3)))
    tokens, probs = torch.stack(tokens), torch.stack(probs)
    contexts = torch.randint(0, vocab, (3, 2), generator=rng)
    differs_one_level_short = 0
    for remain_total in (1, 2, 3, 5, 8):
        cfg = TreeConfig(topk=k, beam_width=r.choice([1, 4]), remain_total=remain_total,
                         ngram_weight=r.choice([0.0, 0.5]), eos_token_id=r.choice([None, 0]))
        kept = cfg.draft_levels(levels)
        assert kept == min(levels, remain_total)
        full = build_draft_trees(tokens, probs, contexts, ngram, cfg)
        cut = build_draft_trees(tokens[:, :kept], probs[:, :kept], contexts, ngram, cfg)
        for a, b in zip(full.tensors(), cut.tensors()):
            assert torch.equal(a, b)
        if kept > 1:  # control: one level fewer changes the trees, so the comparison above can fail
            short = build_draft_trees(tokens[:, :kept - 1], probs[:, :kept - 1], contexts, ngram, cfg)
            differs_one_level_short += not all(torch.equal(a, b) for a, b in zip(full.tensors(), short.tensors()))
    assert differs_one_level_short > 0


def test_draft_levels_bounds():
    assert TreeConfig(remain_total=60).draft_levels(7) == 7
    assert TreeConfig(remain_total=60, max_depth=4).draft_levels(7) == 4
    assert TreeConfig(remain_total=3).draft_levels(7) == 3
    assert TreeConfig(remain_total=3, max_depth=2).draft_levels(7) == 2


def test_stack_pads_and_indexing_recovers_trees():
    a = DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([0, 1]), torch.tensor([0.0, -1.0]))
    b = DraftTree(torch.tensor([3]), torch.tensor([-1]), torch.tensor([0]), torch.tensor([0.0]))
    batch = DraftTreeBatch.stack([a, b], num_nodes=3)
    assert batch.valid.tolist() == [[True, True, False], [True, False, False]]
    assert batch[1].tokens.tolist() == [3] and batch[0].parents.tolist() == [-1, 0]
    assert batch.ancestor_mask()[0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: build_draft_tree(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), [], None,
                                  TreeConfig(topk=3)), "at least the root token"),
        (lambda: build_draft_tree(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), [1], None,
                                  TreeConfig(topk=3)), "topk_probs shape"),
        (lambda: build_draft_tree(torch.zeros(2, 3), torch.ones(2, 3), [1], None, TreeConfig(topk=3)),
         "must be integer"),
        (lambda: build_draft_tree(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), [1], None, TreeConfig()),
         "TreeConfig.topk=25 but the candidates have K=3"),
        (lambda: topk_draft_tokens(torch.zeros(2, 10), 25), "topk=25 is larger than the draft vocabulary"),
        (lambda: TreeConfig(beam_width=0), "beam_width must be a positive integer"),
        (lambda: TreeConfig(ngram_weight=-1.0), "ngram_weight must be a finite number"),
        (lambda: build_draft_trees(torch.zeros(1, 2, 3, dtype=torch.long), torch.ones(1, 2, 3),
                                   torch.tensor([[4, -1]]), None, TreeConfig(topk=3)), "root token"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
