"""Context drafting in generate() (docs/DESIGN.md §2.6): greedy output token for token plain's at every batch size,
attached and `dart_head=`; sampling keeps the target distribution (a lossy control fails); the per-source counts."""

import pytest
import torch

import dart_hf
from dart_core import TreeConfig
from helpers.hf_models import left_padded, random_head, tiny_target
from helpers.sampling_checks import chi_square_pvalue, exact_two_token_distribution, lossy_verify

CONTEXT_TREE = TreeConfig(topk=4, beam_width=4, remain_total=12, context_draft=True, context_depth=8)


def copying_prompts(seed: int, rows: int) -> list[torch.Tensor]:
    """Prompts that repeat a random phrase (what a tiny random target then tends to go on copying)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        phrase = torch.randint(3, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        out.append(phrase.repeat(3))
    return out


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("how", ["dart_head", "attached"])
def test_greedy_with_context_paths_equals_plain(rows, how):
    model = dart_hf.enable(tiny_target(seed=rows), False)
    head = random_head(model)  # accepts next to nothing: what is accepted comes from the context
    ids, mask = left_padded(copying_prompts(rows, rows))
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, **common)
    if how == "attached":
        model = dart_hf.enable(model, head, tree_config=CONTEXT_TREE)  # fixed: DART whatever this machine's speed
        out = model.generate(ids, **common)
    else:
        out = model.generate(ids, **common, dart_head=head, dart_tree_config=CONTEXT_TREE)
    assert torch.equal(out, plain)
    stats = model.dart_stats
    assert stats is not None and stats.steps > 0
    assert stats.accepted_head + stats.accepted_context + stats.accepted_both == sum(stats.accepted_lengths)


def test_context_paths_are_accepted_and_switch_off():
    model = dart_hf.enable(tiny_target(seed=7), False)
    head = random_head(model)
    ids, mask = left_padded(copying_prompts(7, 3))
    common = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0, dart_head=head,
                  dart_tree_config=CONTEXT_TREE)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    on = model.generate(ids, **common)
    with_context = model.dart_stats
    off = model.generate(ids, **common, dart_context_draft=False)
    without = model.dart_stats
    assert torch.equal(on, plain) and torch.equal(off, plain)
    assert with_context.accepted_context + with_context.accepted_both > 0
    assert with_context.tau > without.tau
    assert without.accepted_context == without.accepted_both == 0
    with pytest.raises(TypeError, match="dart_context_draft must be True, False or None"):
        model.generate(ids, **common, dart_context_draft="yes")


def sample_pairs(model, head, prompt, tree, draws, seed):
    """Counts [V, V] of the first two sampled tokens over `draws` calls, and the draft tokens the context proposed
    (alone or with the head) that those calls accepted."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab)
    from_context = 0
    for _ in range(draws):
        out = model.generate(prompt, max_new_tokens=3, do_sample=True, top_k=0, dart_head=head,
                             dart_tree_config=tree)
        counts[out[0, -3], out[0, -2]] += 1
        from_context += model.dart_stats.accepted_context + model.dart_stats.accepted_both
    return counts, from_context


@pytest.mark.slow  # 3,500 generate() calls
def test_sampling_with_context_paths_keeps_the_distribution_and_a_lossy_control_fails(monkeypatch):
    model = dart_hf.enable(tiny_target(vocab=8, layers=4, hidden=16, seed=3), False)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]])
    tree = TreeConfig(topk=2, beam_width=2, remain_total=6, context_draft=True, context_min_match=1,
                      context_matches=4, context_depth=3)
    head = random_head(model, draft_length=2)
    exact = exact_two_token_distribution(model, prompt).flatten()
    counts, from_context = sample_pairs(model, head, prompt, tree, draws=2500, seed=0)
    assert chi_square_pvalue(counts.flatten(), exact) > 1e-3
    assert from_context > 0  # the context's paths were accepted while sampling: the test covers them

    monkeypatch.setattr(dart_hf.loop, "verify_tree", lossy_verify)
    control = sample_pairs(model, head, prompt, tree, draws=1000, seed=1)[0].flatten()
    assert chi_square_pvalue(control, exact) < 1e-6
