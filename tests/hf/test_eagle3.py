"""The EAGLE3-style baseline drafter: training unroll equals inference, the tree it drafts equals a slow
re-derivation, greedy decoding with it equals plain greedy, loading/saving and the trainer's eagle3 mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dart_hf
from dart_core import DartHead, Eagle3Head
from dart_core.eagle3 import select_draft_tree
from dart_train.trainer import train
from helpers.hf_models import random_head, tiny_target
from helpers.train_configs import tiny_train_config


def _eagle3(target, draft_length=4, draft_vocab=None, seed=1) -> Eagle3Head:
    head = Eagle3Head.from_dart_head(random_head(target, draft_length=draft_length, draft_vocab=draft_vocab,
                                                 seed=seed))
    head.set_input_embeddings(target.get_input_embeddings())
    return head.eval()


def _chain_by_hand(head, aux, ids, p):
    """Inference on the prefix 0..p, then D chain steps fed the teacher's tokens one row at a time ->
    [D+1, Vd] logits (step 0 first)."""
    cache = head.new_cache(1)
    logits0, hidden = head(aux[None, : p + 1], ids[None, : p + 1], cache)
    keys, values = cache.keys[:, :, : p + 1], cache.values[:, :, : p + 1]
    out = [logits0[0]]
    for j in range(1, head.config.draft_length + 1):
        token = ids[min(p + j, ids.shape[0] - 1)].reshape(1, 1)
        visible = torch.ones(1, 1, keys.shape[2], dtype=torch.bool)
        h, k, v = head.chain_rows(token, hidden[:, None] if hidden.dim() == 2 else hidden,
                                  torch.tensor([[p + j]]), keys, values, visible)
        out.append(head.logits(h)[0, 0])
        keys, values, hidden = torch.cat((keys, k), 2), torch.cat((values, v), 2), h
    return torch.stack(out)


@pytest.mark.parametrize("seed,draft_length", [(0, 3), (1, 1), (2, 5)])
def test_training_unroll_equals_inference_per_anchor(seed, draft_length):
    target = tiny_target(seed=seed)
    head = _eagle3(target, draft_length=draft_length, draft_vocab=48, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    n = 13
    aux = torch.randn(2, n, 3 * head.config.target_hidden_size, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (2, n), generator=g)
    anchors = torch.tensor([[0, 5, n - 1, 3], [7, 7, 2, n - 2]])
    with torch.no_grad():
        real, blocks = head.training_forward(aux, ids, anchors)
        worst, later_prefix_gap = 0.0, 0.0
        for b in range(2):
            for a in range(anchors.shape[1]):
                p = int(anchors[b, a])
                got = torch.cat((real[b, p: p + 1], blocks[b, a]))
                worst = max(worst, float((_chain_by_hand(head, aux[b], ids[b], p) - got).abs().max()))
                if p + 1 < n:  # control: one more real row of context changes the outputs (leaks would show)
                    later = _chain_by_hand(head, aux[b], ids[b], p + 1)
                    later_prefix_gap = max(later_prefix_gap, float((later[1:] - got[1:]).abs().max()))
    assert worst < 1e-5
    assert later_prefix_gap > 1e-2


def _candidates_by_hand(head, aux, ids, topk):
    """EAGLE-2 expansion re-derived one path at a time: every chain row recomputed from its root path."""
    cache = head.new_cache(1)
    logits0, h0 = head(aux, ids, cache)
    p = int(cache.lengths[0]) - 1
    keys, values = cache.keys[:, :, : p + 1], cache.values[:, :, : p + 1]

    def row_output(path_tokens):  # hidden of the chain row of the last token of `path_tokens` (draft ids)
        hidden, kk, vv = h0[:, None], keys, values
        for j, tok in enumerate(path_tokens, start=1):
            target_id = head.draft_to_target(torch.tensor([[tok]]))
            visible = torch.ones(1, 1, kk.shape[2], dtype=torch.bool)
            hidden, k, v = head.chain_rows(target_id, hidden, torch.tensor([[p + j]]), kk, vv, visible)
            kk, vv = torch.cat((kk, k), 2), torch.cat((vv, v), 2)
        return hidden[0, 0]

    pool = []  # (draft-id path, score)
    lp, ids0 = torch.log_softmax(logits0[0].float(), -1).topk(topk)
    beam = [((int(i),), float(s)) for s, i in zip(lp, ids0)]
    pool += beam
    for _ in range(2, head.num_levels + 1):
        children = []
        for path, score in beam:
            lp = torch.log_softmax(head.logits(row_output(path)).float(), -1)
            top_lp, top_ids = lp.topk(topk)
            children += [(path + (int(i),), score + float(s)) for s, i in zip(top_lp, top_ids)]
        pool += children
        beam = sorted(children, key=lambda c: -c[1])[:topk]
    return pool


@pytest.mark.parametrize("seed,topk", [(0, 3), (3, 2)])
def test_draft_candidates_equal_a_path_by_path_rederivation(seed, topk):
    target = tiny_target(seed=seed)
    head = _eagle3(target, draft_length=3, draft_vocab=48, seed=seed + 2)
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, 9, 3 * head.config.target_hidden_size, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (1, 9), generator=g)
    with torch.no_grad():
        cands = head.draft_candidates(aux, ids, head.new_cache(1), topk)
        expected = _candidates_by_hand(head, aux, ids, topk)
    assert cands.tokens.shape[0] == topk + (head.num_levels - 1) * topk * topk == len(expected)
    shallow = head.draft_candidates(aux, ids, head.new_cache(1), topk, levels=2)
    assert shallow.tokens.shape[0] == topk + topk * topk and int(shallow.depths.max()) == 2
    assert torch.equal(shallow.tokens, cands.tokens[: topk + topk * topk])  # the same first two levels
    # rebuild each candidate's draft-id path from the parent pointers (target ids -> draft ids: d2t = i)
    paths = []
    for i in range(cands.tokens.shape[0]):
        parent = int(cands.parents[i])
        tok = int(cands.tokens[i]) // 2 if head.config.draft_vocab_size < head.config.vocab_size else int(
            cands.tokens[i])
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
        assert int(cands.depths[i]) == len(paths[-1])
    got = sorted(zip(paths, cands.scores.tolist()))
    want = sorted(expected)
    assert [p for p, _ in got] == [p for p, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=1e-4)


def test_select_draft_tree_keeps_the_best_nodes_parents_first():
    from dart_core.eagle3 import DraftCandidates

    # pool: 3 roots' children, then children; scores never exceed the parent's; a tie between parent and child
    cands = DraftCandidates(tokens=torch.tensor([10, 11, 12, 20, 21, 22, 30]),
                            parents=torch.tensor([-1, -1, -1, 0, 0, 1, 3]),
                            depths=torch.tensor([1, 1, 1, 2, 2, 2, 3]),
                            scores=torch.tensor([-0.1, -1.0, -3.0, -0.1, -0.5, -2.0, -0.9]))
    tree = select_draft_tree(cands, torch.tensor(5), 5)
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21, 30]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert set(tree.paths()) == {(10,), (11,), (10, 20), (10, 21), (10, 20, 30)}
    small = select_draft_tree(cands, torch.tensor(5), 2)  # the tie: parent (earlier) before child
    assert small.tokens.tolist() == [5, 10, 20] and small.parents.tolist() == [-1, 0, 1]


@pytest.mark.parametrize("draft_vocab,topk,nodes,depth", [(None, 4, 12, None), (48, 3, 5, 2), (None, 1, 1, None)])
def test_greedy_with_the_eagle3_drafter_equals_plain_greedy(draft_vocab, topk, nodes, depth):
    from dart_core import TreeConfig

    target = dart_hf.enable(tiny_target(seed=4), False)
    head = _eagle3(target, draft_length=3, draft_vocab=draft_vocab)
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=40)
    plain = target.generate(prompt, **kw)
    spec = target.generate(prompt, dart_head=head,
                           dart_tree_config=TreeConfig(topk=topk, remain_total=nodes, max_depth=depth), **kw)
    assert torch.equal(plain, spec)
    stats = target.dart_stats
    assert stats.new_tokens == 40 and stats.tree_nodes <= nodes + 1 and stats.head_time > 0


def test_eagle3_drafter_of_the_right_tokens_is_accepted():
    """A drafter whose every level is forced to the target's continuation gets whole chains accepted."""
    from dart_core import TreeConfig

    target = dart_hf.enable(tiny_target(seed=5), False)
    prompt_len = 6
    prompt = torch.randint(0, 96, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24)
    reference = target.generate(prompt, **kw)[0, prompt_len:]

    class Oracle(Eagle3Head):
        def forward(self, aux, ids, cache=None, lengths=None):
            # level 1 predicts the token after the last real row's: index (rows after this call) + 1 - prompt
            self.next_index = int(cache.lengths[0]) + ids.shape[1] + 1 - prompt_len
            return super().forward(aux, ids, cache, lengths)

        def logits(self, hidden):  # one call per level (topk=1): the reference token gets all the mass
            out = torch.full((*hidden.shape[:-1], self.config.draft_vocab_size), -30.0)
            out[..., int(reference[min(self.next_index, reference.shape[0] - 1)])] = 30.0
            self.next_index += 1
            return out

    base = _eagle3(target, draft_length=3)
    head = Oracle(base.config)
    head.load_state_dict(base.state_dict())
    head.set_input_embeddings(target.get_input_embeddings())
    out = target.generate(prompt, dart_head=head, dart_tree_config=TreeConfig(topk=1, remain_total=4), **kw)
    assert torch.equal(out[0, prompt_len:], reference)
    assert target.dart_stats.tau > 3.5  # 4 levels + the bonus token per verify step, bar the last steps


def test_save_load_round_trip_and_refusals(tmp_path):
    target = tiny_target()
    head = _eagle3(target)
    head.save_pretrained(tmp_path / "e3")
    loaded = Eagle3Head.from_pretrained(tmp_path / "e3")
    assert json.loads((tmp_path / "e3" / "config.json").read_text())["architectures"] == ["Eagle3Head"]
    a, b = head.state_dict(), loaded.state_dict()
    assert "midlayer.mask_rep" not in a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="EAGLE3-style drafter, not a DART head"):
        DartHead.from_pretrained(tmp_path / "e3")
    random_head(target).save_pretrained(tmp_path / "dart")
    with pytest.raises(ValueError, match="not an EAGLE3-style drafter"):
        Eagle3Head.from_pretrained(tmp_path / "dart")
    model = dart_hf.enable(target, False)
    prompt = torch.tensor([[1, 2, 3]])
    # the assisted loop takes every drafter through the same interface (its best full-depth path) and stays exact
    common = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, assistant_model=head, **common), model.generate(prompt, **common))


def test_trainer_eagle3_mode_learns_and_starts_from_a_dart_head(tiny_run, tmp_path):
    root, target = tiny_run
    cfg = tiny_train_config(root, tmp_path / "e3", mode="eagle3", steps=40, lr=1e-2, warmup_steps=4, eval_every=40)
    summary = train(cfg, model=target)
    losses = summary["losses"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3])
    head = Eagle3Head.from_pretrained(tmp_path / "e3" / "head")
    assert head.tree_config.topk == 10
    # warm start from a DART head: same weights but the mask rows
    from dart_train.trainer import Trainer

    dart = random_head(target, draft_length=3, draft_vocab=48)
    dart.save_pretrained(tmp_path / "dart-head")
    warm = Trainer(tiny_train_config(root, tmp_path / "warm", mode="eagle3", init_from=str(tmp_path / "dart-head")),
                   model=target).head.state_dict()
    assert torch.equal(warm["fc.weight"], dart.state_dict()["fc.weight"]) and "midlayer.mask_rep" not in warm


def test_from_dart_head_takes_the_drafter_defaults_not_the_dart_tree_settings():
    from dart_core import TreeConfig

    target = tiny_target()
    dart = random_head(target)
    dart.tree_config = TreeConfig(topk=25, remain_total=8, eos_token_id=3)
    dart.ngram = object()
    eagle = Eagle3Head.from_dart_head(dart.half())
    assert eagle.tree_config == TreeConfig(topk=10, remain_total=60, eos_token_id=3) and eagle.ngram is None
    assert eagle.fc.weight.dtype == torch.float16 and eagle.inv_freq.dtype == torch.float32


def test_drafting_across_cached_calls_equals_one_call_on_the_whole_prefix():
    """Chain rows live in the cache's scratch space: the next call's real rows must overwrite them."""
    target = tiny_target(seed=7)
    head = _eagle3(target, draft_length=3, draft_vocab=48, seed=3)
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(1, 12, 3 * head.config.target_hidden_size, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (1, 12), generator=g)
    cache = head.new_cache(1, capacity=4)  # small: the scratch space forces growth
    for lo, hi in ((0, 5), (5, 6), (6, 12)):
        stepwise = head.draft_candidates(aux[:, lo:hi], ids[:, lo:hi], cache, 3)
    whole = head.draft_candidates(aux, ids, head.new_cache(1), 3)
    assert torch.equal(stepwise.tokens, whole.tokens) and torch.equal(stepwise.parents, whole.parents)
    torch.testing.assert_close(stepwise.scores, whole.scores, atol=1e-5, rtol=0)
