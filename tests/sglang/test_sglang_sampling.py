"""DART's token choice inside SGLang's verify (`dart_sglang.sampling`, `dart_sglang.verify`): exact per-node
penalties against a dense re-derivation, and sampled trees keeping the target distribution on SGLang's own batch
structures, with controls that must fail."""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch

from dart_sglang.sampling import Penalties, node_penalties, path_tokens, tree_parents
from helpers.sampling_checks import chi_square_pvalue
from helpers.sglang_env import import_sglang

# one tree of Q = 6 nodes: the root, children 1 and 2, node 3 under 1, nodes 4 and 5 under 3
PARENTS = [-1, 0, 0, 1, 3, 3]
NEXT_TOKEN = [1, 3, -1, 4, -1, -1]  # first child
NEXT_SIBLING = [-1, 2, -1, -1, 5, -1]


def test_tree_parents_from_the_retrieve_arrays():
    got = tree_parents(torch.tensor([NEXT_TOKEN, [-1] * 6]), torch.tensor([NEXT_SIBLING, [-1] * 6]))
    assert got.tolist() == [PARENTS, [-1] * 6]


def dense_penalised(logits, prefix_output, rule: Penalties):
    """The plain server's penalisers on one row, from the whole output before the predicted token (re-derived
    densely: counts over the vocabulary, one rule after the other in `rule.order`)."""
    out = logits.clone()
    counts = torch.bincount(torch.tensor(prefix_output, dtype=torch.long), minlength=out.shape[0]).float() \
        if prefix_output else torch.zeros(out.shape[0])
    for name in rule.order:
        if name == "frequency":
            out -= rule.frequency * counts
        elif name == "presence":
            out -= rule.presence * (counts > 0).float()
        elif name == "repetition":
            factor = torch.where(counts > 0, torch.tensor(rule.repetition), torch.tensor(1.0))
            out = torch.where(out < 0, out * factor, out / factor)
        elif name == "min_new_tokens" and len(prefix_output) < rule.min_new_tokens:
            out[sorted(rule.stop_ids)] = float("-inf")
    return out


@pytest.mark.parametrize("seed", range(4))
def test_each_node_is_penalised_for_its_own_prefix(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, q = 12, 6
    outputs = [[3, 5, 5, 1], [7], [2, 2, 9]]
    rules = [Penalties(frequency=1.0, presence=0.5), Penalties(repetition=1.5, min_new_tokens=4, stop_ids=frozenset({0})),
             Penalties(frequency=0.3, presence=0.2, repetition=1.3, order=("repetition", "frequency", "presence"))]
    tokens = torch.randint(0, vocab, (3, q), generator=g)
    tokens[:, 0] = torch.tensor([o[-1] for o in outputs])  # the root is each request's last token
    parents = torch.tensor([PARENTS] * 3)
    logits = torch.randn(3 * q, vocab, generator=g) * 3
    got = logits.clone()
    node_penalties(got, outputs, rules, tokens, parents)
    for b in range(3):
        for node in range(q):
            prefix = outputs[b] + path_tokens(tokens[b].tolist(), PARENTS, node)[::-1]
            want = dense_penalised(logits[b * q + node], prefix, rules[b])
            assert torch.allclose(got[b * q + node], want, atol=1e-5), (b, node)
    # control: the relaxed version (every node penalised for the request's output only) differs at deeper nodes
    relaxed = torch.stack([dense_penalised(logits[b * q + n], outputs[b], rules[b]) for b in range(3)
                           for n in range(q)])
    assert not torch.allclose(relaxed, got, atol=1e-3)


# ---- sampled trees on SGLang's batch structures ---------------------------------------------------------------

VOCAB = 6
MARKOV = torch.tensor([[1.0, 0.8, 0.5, 0.2, 0.6, 0.4]]).repeat(VOCAB, 1) + torch.eye(VOCAB) * 0.5  # logits after t


def sglang_batch(b: int, temperature: float, top_p: float):
    """B copies of one request whose tree (PARENTS) drafts tokens 0, 1, 2, 0, 1, 2 after root token 3, as SGLang's
    verify input, batch and logits output (the target's logits at a node follow MARKOV of the node's token)."""
    q = len(PARENTS)
    node_tokens = torch.tensor([3, 0, 1, 0, 1, 2])
    params = types.SimpleNamespace(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                                   min_new_tokens=0, stop_token_ids=None)
    reqs = [types.SimpleNamespace(sampling_params=params, output_ids=[3], eos_token_ids=None, tokenizer=None)
            for _ in range(b)]
    info = types.SimpleNamespace(
        is_all_greedy=False, temperatures=torch.full((b, 1), temperature), top_ks=torch.full((b,), VOCAB),
        top_ps=torch.full((b,), top_p), min_ps=torch.zeros(b), need_min_p_sampling=False, sampling_seed=None,
        logit_bias=None, acc_additive_penalties=None, acc_scaling_penalties=None, penalizer_orchestrator=None)
    batch = types.SimpleNamespace(reqs=reqs, sampling_info=info,
                                  forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    verify_input = types.SimpleNamespace(
        draft_token=node_tokens.repeat(b), draft_token_num=q, max_tree_depth=4, tree_topk=2,
        retrieve_index=(torch.arange(b)[:, None] * q + torch.arange(q)).long(),
        retrieve_next_token=torch.tensor([NEXT_TOKEN] * b), retrieve_next_sibling=torch.tensor([NEXT_SIBLING] * b),
        positions=None)
    logits = types.SimpleNamespace(next_token_logits=MARKOV[node_tokens].repeat(b, 1).clone())
    return verify_input, batch, logits


def emitted(predict, accept_lens, accept_index) -> list[list[int]]:
    out = []
    for lens, index in zip(accept_lens.tolist(), accept_index.tolist()):
        out.append([int(predict[i]) for i in index[:lens]])
    return out


def reference_probs(token: int, temperature: float, top_p: float) -> torch.Tensor:
    """The plain server's distribution after `token` (temperature, then top-p as its torch sampler keeps)."""
    p = torch.softmax(MARKOV[token] / temperature, -1)
    sorted_p, idx = p.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) <= top_p
    out = torch.zeros_like(p)
    out[idx[keep]] = sorted_p[keep]
    return out / out.sum()


@pytest.fixture
def dart_sample(monkeypatch):
    import_sglang()
    from sglang.kernels.ops.speculative import spec_tree

    import dart_sglang.verify as verify

    monkeypatch.setattr(verify, "is_dart", lambda: True)
    monkeypatch.setattr(verify, "_same_on_every_rank", lambda tokens: tokens)  # one process, no TP group
    monkeypatch.setattr(spec_tree, "_is_cpu", False)  # SGLang's Triton tree walk (TRITON_INTERPRET), as in the
    monkeypatch.setattr(spec_tree, "_is_xpu", True)   # CPU test servers
    return lambda *args: verify.dart_eagle_sample(lambda *a, **k: pytest.fail("SGLang's verify ran"), *args)


@pytest.mark.slow  # SGLang's tree walk runs in Triton's interpreter here: about 8 s per 4000-request call
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.6)])
def test_sampled_trees_keep_the_target_distribution_and_a_lossy_control_fails(dart_sample, monkeypatch,
                                                                               temperature, top_p):
    import dart_sglang.verify as verify

    draws = 4000
    torch.manual_seed(0)
    rows = emitted(*dart_sample(*sglang_batch(draws, temperature, top_p)))
    first = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=VOCAB)
    assert chi_square_pvalue(first, reference_probs(3, temperature, top_p)) > 1e-3
    # after an accepted draft 0 (node 1), the next emitted token follows the target after 0
    second = torch.bincount(torch.tensor([r[1] for r in rows if r[0] == 0]), minlength=VOCAB)
    assert second.sum() > 500 and chi_square_pvalue(second, reference_probs(0, temperature, top_p)) > 1e-3
    assert max(len(r) for r in rows) >= 3  # deeper nodes were accepted too

    # control: a sampler that drops top-p (a setting not applied per node) must fail wherever top-p cuts
    real = verify.sample_nodes

    def without_top_p(logits, q, temperatures, top_ks, top_ps, *args):
        return real(logits, q, temperatures, top_ks, torch.ones_like(top_ps), *args)

    monkeypatch.setattr(verify, "sample_nodes", without_top_p)
    control = emitted(*dart_sample(*sglang_batch(draws, temperature, top_p)))
    first = torch.bincount(torch.tensor([r[0] for r in control]), minlength=VOCAB)
    if top_p < 1.0:
        with pytest.raises(AssertionError, match="outside the support"):
            chi_square_pvalue(first, reference_probs(3, temperature, top_p))
    else:  # control: accepting the first child whatever was drawn
        monkeypatch.setattr(verify, "sample_nodes", lambda logits, q, *a: torch.zeros(logits.shape[0], dtype=torch.long))
        control = emitted(*dart_sample(*sglang_batch(draws, temperature, top_p)))
        first = torch.bincount(torch.tensor([r[0] for r in control]), minlength=VOCAB)
        assert chi_square_pvalue(first, reference_probs(3, temperature, top_p)) < 1e-6


def test_greedy_trees_take_the_argmax_walk(dart_sample):
    verify_input, batch, logits = sglang_batch(3, 1.0, 1.0)
    batch.sampling_info.is_all_greedy = True
    rows = emitted(*dart_sample(verify_input, batch, logits))
    # argmax after 3 is 0 (node 1, accepted), after 0 it is 0 (node 3, accepted), after 0 again 0: no child has it
    assert rows == [[0, 0, 0]] * 3 and Counter(map(len, rows)) == {3: 3}
