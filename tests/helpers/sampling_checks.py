"""What the sampling tests share: the exact distribution of two sampled tokens, one chi-square test of counts against
probabilities, and a lossy verifier that a test of losslessness must catch (its control)."""

from __future__ import annotations

import torch

from dart_core import TreeConfig, VerifyResult, verify_tree

SMALL_TREE = TreeConfig(topk=4, beam_width=4, remain_total=8)  # the sampling tests' tree


def exact_two_token_distribution(model, prompt):
    """p(t1, t2) = softmax(target after prompt)[t1] * softmax(target after prompt + t1)[t2], as [V, V]."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        batch = torch.cat((prompt.expand(vocab, -1), torch.arange(vocab)[:, None]), dim=1)
        p2 = torch.softmax(model(batch).logits[:, -1].double(), -1)
    return p1[:, None] * p2


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of `counts` [V] to `probs` [V] (normalised) over the cells with an
    expected count >= 5, the rest pooled into one. A count where `probs` is 0 fails at once (AssertionError naming
    the support): no p-value can excuse a draw the target never makes."""
    assert counts[probs == 0].sum() == 0, "a token outside the support was emitted"
    probs = probs.double() / probs.double().sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None])).double()
    exp = torch.cat((expected[big], expected[~big].sum()[None])).double()
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def lossy_verify(trees, logits, context_ids=None, logits_processor=None, do_sample=False, generator=None):
    """A wrong verifier: a row that accepted nothing accepts the root's first child (the head's favourite) anyway."""
    result = verify_tree(trees, logits, context_ids, logits_processor, do_sample, generator)
    if trees.num_nodes == 1:
        return result
    nodes, lengths, bonus = result.accepted_nodes.clone(), result.accept_length.clone(), result.bonus_token.clone()
    for b in range(trees.batch_size):
        if int(lengths[b]) == 0:
            nodes[b] = -1
            nodes[b, :2] = torch.tensor([0, 1])
            lengths[b] = 1
            bonus[b] = torch.multinomial(torch.softmax(logits[b, 1], -1), 1)[0]
    return VerifyResult(nodes, lengths, bonus)
