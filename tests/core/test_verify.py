"""Tests of draft-tree verification (`dart_core.verify`): the chosen-token walk, greedy, processors, and lossless
sampling."""

from __future__ import annotations

import random

import pytest
import torch

from dart_core.tree import DraftTree, DraftTreeBatch
from dart_core.verify import (BatchedProcessor, VerifyResult, _one_row_at_a_time, accept_chosen, choose_at_roots,
                              verify_greedy, verify_sampled, verify_tree)
from helpers.sampling_checks import chi_square_pvalue

# ------------------------------------------------------------------------------------------------------ helpers


def make_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    n = len(tokens)
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        torch.zeros(n, dtype=torch.float32),
    )


def onehot_logits(argmaxes: list[int], vocab: int) -> torch.Tensor:
    """[N, V] logits whose argmax at node i is argmaxes[i]."""
    out = torch.zeros(len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        out[i, a] = 1.0
    return out


def pad_logits(rows: list[torch.Tensor], n: int, fill: float = 0.0) -> torch.Tensor:
    v = rows[0].shape[-1]
    out = torch.full((len(rows), n, v), fill)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def first_argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda v: row[v])  # Python's max keeps the first maximal item


def path_tokens(node: int, tokens: list[int], parents: list[int]) -> list[int]:
    out = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def ref_deepest_correct(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """Recursive walk: deepest node whose whole path matches the per-node argmax (ties: smallest index)."""
    children: list[list[int]] = [[] for _ in tokens]
    for j in range(1, len(tokens)):
        children[parents[j]].append(j)
    best = (0, 0)  # (depth, -node)

    def rec(node: int, depth: int) -> None:
        nonlocal best
        best = max(best, (depth, -node))
        for c in children[node]:
            if tokens[c] == argmax[node]:
                rec(c, depth + 1)

    rec(0, 0)
    node = -best[1]
    nodes = [node]
    while nodes[-1] > 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1], argmax[node]


def check_result(res: VerifyResult, b: int, nodes: list[int], bonus: int) -> None:
    width = res.accepted_nodes.shape[1]
    assert res.accepted_nodes[b].tolist() == nodes + [-1] * (width - len(nodes))
    assert int(res.accept_length[b]) == len(nodes) - 1
    assert int(res.bonus_token[b]) == bonus


def assert_same(a: VerifyResult, b: VerifyResult) -> None:
    assert torch.equal(a.accepted_nodes, b.accepted_nodes)
    assert torch.equal(a.accept_length, b.accept_length)
    assert torch.equal(a.bonus_token, b.bonus_token)


def rep_penalty(input_ids: torch.Tensor, scores: torch.Tensor, penalty: float = 1.3) -> torch.Tensor:
    """Repetition-penalty-like processor: tokens present in the prefix get their score pushed down."""
    out = scores.clone()
    present = torch.unique(input_ids[0])
    vals = out[0, present]
    out[0, present] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def test_chi_square_helper_matches_known_values() -> None:
    # chi-square survival function at df=1, x=3.841458820694124 is 0.05; df=15, x=30.577914 is 0.01
    half_width = 0.5 * 3.841458820694124**0.5 * 10
    p = chi_square_pvalue(torch.tensor([50.0 + half_width, 50.0 - half_width]), torch.tensor([0.5, 0.5]))
    assert abs(p - 0.05) < 1e-6
    sf = float(torch.special.gammaincc(torch.tensor(7.5, dtype=torch.float64),
                                       torch.tensor(30.577914 / 2, dtype=torch.float64)))
    assert abs(sf - 0.01) < 1e-5


# ---------------------------------------------------------------------------------------- greedy, hand-worked

V = 5


def test_greedy_right_child_deep() -> None:
    # root -> 1 (wrong), 2 (right); 2 -> 3 (right) -> 4 (wrong)
    tree = make_tree([4, 1, 2, 3, 0], [-1, 0, 0, 2, 3])
    logits = onehot_logits([2, 0, 3, 4, 1], V)[None]
    res = verify_greedy(DraftTreeBatch.stack([tree]), logits)
    assert res.accepted_nodes.shape == (1, 4)  # max depth 3
    check_result(res, 0, [0, 2, 3], bonus=4)
    assert res.accepted_tokens(DraftTreeBatch.stack([tree])) == [[2, 3, 4]]


def test_greedy_nothing_accepted() -> None:
    tree = make_tree([4, 1, 2, 3], [-1, 0, 0, 1])
    logits = onehot_logits([0, 3, 1, 1], V)[None]
    trees = DraftTreeBatch.stack([tree])
    res = verify_greedy(trees, logits)
    check_result(res, 0, [0], bonus=0)
    assert res.accepted_tokens(trees) == [[0]]


def test_greedy_all_accepted_to_leaf() -> None:
    tree = make_tree([4, 1, 2, 3], [-1, 0, 1, 2])
    logits = onehot_logits([1, 2, 3, 0], V)[None]
    trees = DraftTreeBatch.stack([tree])
    res = verify_greedy(trees, logits)
    check_result(res, 0, [0, 1, 2, 3], bonus=0)
    assert res.accepted_tokens(trees) == [[1, 2, 3, 0]]


def test_greedy_root_only_tree() -> None:
    trees = DraftTreeBatch.stack([make_tree([3], [-1])])
    res = verify_greedy(trees, onehot_logits([2], V)[None])
    assert res.accepted_nodes.tolist() == [[0]]
    check_result(res, 0, [0], bonus=2)


def test_greedy_padding_rows_and_independence() -> None:
    # row 0: small tree whose root argmax is 0 == the padding token (padding must never be accepted)
    t0 = make_tree([4, 3], [-1, 0])
    l0 = onehot_logits([0, 1], V)
    # row 1: larger tree, accepts depth 2
    t1 = make_tree([2, 1, 3, 4, 0, 2], [-1, 0, 0, 2, 3, 1])
    l1 = onehot_logits([3, 0, 4, 1, 2, 3], V)
    # row 2: medium tree, accepts depth 1 via the second child
    t2 = make_tree([0, 2, 0, 1], [-1, 0, 0, 1])
    l2 = onehot_logits([0, 4, 4, 4], V)
    trees = DraftTreeBatch.stack([t0, t1, t2], num_nodes=8)
    logits = pad_logits([l0, l1, l2], 8)  # padding logits all zero: argmax 0 == padding token
    res = verify_greedy(trees, logits)
    assert res.accepted_nodes.shape == (3, 4)
    check_result(res, 0, [0], bonus=0)
    check_result(res, 1, [0, 2, 3], bonus=1)
    check_result(res, 2, [0, 2], bonus=4)
    # every row gives the same answer alone (different N, different width) as in the batch
    for b, (t, l) in enumerate([(t0, l0), (t1, l1), (t2, l2)]):
        alone = verify_greedy(DraftTreeBatch.stack([t]), l[None])
        n = int(alone.accept_length[0]) + 1
        assert alone.accepted_nodes[0, :n].tolist() == res.accepted_nodes[b, :n].tolist()
        assert int(alone.accept_length[0]) == int(res.accept_length[b])
        assert int(alone.bonus_token[0]) == int(res.bonus_token[b])
    assert res.accepted_tokens(trees) == [[0], [3, 4, 1], [0, 4]]


def test_greedy_depth_tie_smallest_index_and_duplicate_siblings() -> None:
    # two correct depth-1 nodes (duplicate tokens): the smaller index wins
    tree = make_tree([4, 2, 2, 1], [-1, 0, 0, 0])
    res = verify_greedy(DraftTreeBatch.stack([tree]), onehot_logits([2, 3, 0, 0], V)[None])
    check_result(res, 0, [0, 1], bonus=3)
    # duplicate siblings, only the second has a correct continuation: the deeper path wins
    tree = make_tree([4, 2, 2, 3, 1], [-1, 0, 0, 2, 1])
    logits = onehot_logits([2, 0, 3, 1, 0], V)[None]
    trees = DraftTreeBatch.stack([tree])
    res = verify_greedy(trees, logits)
    check_result(res, 0, [0, 2, 3], bonus=1)
    # the processor path agrees (an identity processor is a no-op)
    ctx = torch.tensor([[0, 4]])
    assert_same(verify_tree(trees, logits, ctx, logits_processor=lambda ids, s: s), res)


@pytest.mark.parametrize("length", [2, 3, 5, 9, 10, 17, 18, 33])
def test_greedy_long_chain_with_one_wrong_edge(length: int) -> None:
    """A chain whose only wrong edge sits anywhere: nodes below it look locally correct but must be rejected."""
    argmax = [(3 * i + 1) % V for i in range(length)]
    for wrong in range(1, length):
        tokens = [0] + [argmax[i - 1] for i in range(1, length)]
        tokens[wrong] = (argmax[wrong - 1] + 1) % V
        trees = DraftTreeBatch.stack([make_tree(tokens, [-1] + list(range(length - 1)))])
        logits = onehot_logits(argmax, V)[None]
        expected = (list(range(wrong)), argmax[wrong - 1])
        for res in (verify_greedy(trees, logits), verify_greedy(trees, logits, ancestors=trees.ancestor_mask())):
            check_result(res, 0, *expected)


def test_greedy_argmax_ties_take_first_max() -> None:
    tree = make_tree([0, 1, 3], [-1, 0, 0])
    logits = torch.tensor([[[0.0, 2.0, 1.0, 2.0, 0.0], [0.0] * 5, [0.0] * 5]])
    res = verify_greedy(DraftTreeBatch.stack([tree]), logits)
    check_result(res, 0, [0, 1], bonus=0)


# --------------------------------------------------------------------------------------- greedy, randomised


def random_case(rng: random.Random, vocab: int, integer_logits: bool):
    """A random tree batch + logits; about half the children copy their parent's argmax so paths get accepted."""
    trees, rows = [], []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 12)
        chainy = rng.random() < 0.3  # long chains stress the ancestor walk
        parents = [-1] + [j - 1 if chainy and rng.random() < 0.9 else rng.randint(0, j - 1) for j in range(1, n)]
        if integer_logits:  # many exact ties -> exercises first-max semantics
            logit_rows = [[float(rng.randint(0, 2)) for _ in range(vocab)] for _ in range(n)]
        else:
            logit_rows = [[rng.gauss(0.0, 1.0) for _ in range(vocab)] for _ in range(n)]
        argmax = [first_argmax(r) for r in logit_rows]
        tokens = [rng.randrange(vocab)]
        for j in range(1, n):
            tokens.append(argmax[parents[j]] if rng.random() < 0.6 else rng.randrange(vocab))
        trees.append((tokens, parents, argmax))
        rows.append(torch.tensor(logit_rows))
    num_nodes = max(len(t[0]) for t in trees) + rng.randint(0, 2)
    batch = DraftTreeBatch.stack([make_tree(t, p) for t, p, _ in trees], num_nodes=num_nodes)
    logits = pad_logits(rows, num_nodes)
    logits[~batch.valid] = torch.randn(int((~batch.valid).sum()), vocab)  # garbage at padding
    return trees, batch, logits


@pytest.mark.parametrize("integer_logits", [False, True])
def test_greedy_matches_recursive_reference(integer_logits: bool) -> None:
    rng = random.Random(1234 + integer_logits)
    accepted_depths = []
    for _ in range(300):
        trees, batch, logits = random_case(rng, 5, integer_logits)
        res = verify_greedy(batch, logits)
        res_anc = verify_greedy(batch, logits, ancestors=batch.ancestor_mask())
        res_fixed = verify_greedy(batch, logits, max_depth=int(batch.depths.max()), validate=False)
        assert_same(res, res_anc)
        assert_same(res, res_fixed)
        assert_same(res, verify_tree(batch, logits))  # delegation
        for b, (tokens, parents, argmax) in enumerate(trees):
            nodes, bonus = ref_deepest_correct(tokens, parents, argmax)
            check_result(res, b, nodes, bonus)
            accepted_depths.append(len(nodes) - 1)
    # the generator really produced a spread of outcomes
    assert min(accepted_depths) == 0 and max(accepted_depths) >= 4
    assert sum(d >= 2 for d in accepted_depths) > 50


def test_device_walks_have_no_host_sync_on_meta_device() -> None:
    """On the meta device every value read-back (.item(), bool(), nonzero) raises, so this proves the
    fixed-shape paths (greedy, sampled, given chosen tokens) never sync."""
    b, n, v = 3, 7, 11
    trees = DraftTreeBatch(
        tokens=torch.empty(b, n, dtype=torch.long, device="meta"),
        parents=torch.empty(b, n, dtype=torch.long, device="meta"),
        depths=torch.empty(b, n, dtype=torch.long, device="meta"),
        scores=torch.empty(b, n, device="meta"),
        valid=torch.empty(b, n, dtype=torch.bool, device="meta"),
    )
    logits = torch.empty(b, n, v, device="meta")
    chosen = torch.empty(b, n, dtype=torch.long, device="meta")
    for anc in (None, torch.empty(b, n, n, dtype=torch.bool, device="meta")):
        for res in (verify_greedy(trees, logits, ancestors=anc, max_depth=4, validate=False),
                    verify_sampled(trees, logits, ancestors=anc, max_depth=4, validate=False),
                    accept_chosen(trees, chosen, ancestors=anc, max_depth=4, validate=False)):
            assert res.accepted_nodes.shape == (b, 5) and res.accepted_nodes.dtype == torch.long
            assert res.accept_length.shape == (b,) and res.bonus_token.shape == (b,)


# ---------------------------------------------------------------------------------- greedy with a processor


def test_greedy_processor_matches_prefix_reference() -> None:
    rng, gen = random.Random(99), torch.Generator().manual_seed(99)
    vocab = 5
    changed = 0
    total_accepted = 0
    for _ in range(120):
        trees, rows, ctxs, refs = [], [], [], []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 10)
            parents = [-1] + [rng.randint(0, j - 1) for j in range(1, n)]
            root = rng.randrange(vocab)
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))] + [root]
            logit_rows = torch.randn(n, vocab, generator=gen) * 0.7 + 0.3
            tokens = [root]
            proc_argmax = []
            for i in range(n):  # tokens[i] is fixed before node i's prefix is needed (parents precede children)
                if i > 0:
                    p = parents[i]
                    tokens.append(proc_argmax[p] if rng.random() < 0.6 else rng.randrange(vocab))
                prefix = torch.tensor(ctx + path_tokens(i, tokens, parents))[None]
                processed = rep_penalty(prefix, logit_rows[i][None].clone())[0]
                proc_argmax.append(first_argmax(processed.tolist()))
                changed += proc_argmax[-1] != first_argmax(logit_rows[i].tolist())
            trees.append(make_tree(tokens, parents))
            rows.append(logit_rows)
            ctxs.append(torch.tensor(ctx))
            refs.append(ref_deepest_correct(tokens, parents, proc_argmax))
        batch = DraftTreeBatch.stack(trees)
        logits = pad_logits(rows, batch.num_nodes)
        logits_before = logits.clone()
        res = verify_tree(batch, logits, ctxs, logits_processor=rep_penalty)
        assert torch.equal(logits, logits_before)  # processor output never written back
        for b, (nodes, bonus) in enumerate(refs):
            check_result(res, b, nodes, bonus)
            total_accepted += len(nodes) - 1
        # a [B, T] tensor works the same when rows have equal length
        if len({len(c) for c in ctxs}) == 1:
            assert_same(verify_tree(batch, logits, torch.stack(ctxs), logits_processor=rep_penalty), res)
    assert changed > 20  # the penalty really changed argmaxes, so the prefixes matter
    assert total_accepted > 100


def test_processor_sees_exact_prefixes_lazily() -> None:
    # root 0 -> 1 (tok 2), 2 (tok 3); 2 -> 3 (tok 1) -> 4 (tok 4); 1 -> 5 (tok 0)
    tree = make_tree([0, 2, 3, 1, 4, 0], [-1, 0, 0, 2, 3, 1])
    logits = onehot_logits([3, 0, 1, 4, 2, 0], 6)[None]
    calls = []

    def recorder(ids, scores):
        calls.append(ids[0].tolist())
        return scores

    trees = DraftTreeBatch.stack([tree])
    res = verify_tree(trees, logits, torch.tensor([[5, 5, 0]]), logits_processor=recorder)
    check_result(res, 0, [0, 2, 3, 4], bonus=2)
    assert sorted(calls) == sorted([[5, 5, 0], [5, 5, 0, 3], [5, 5, 0, 3, 1], [5, 5, 0, 3, 1, 4]])
    # sampling visits root..accepted node, with the same prefixes, one call per visited node
    calls.clear()
    onehot = torch.full((1, 6, 6), -1e4)
    for i, a in enumerate([3, 0, 1, 4, 2, 0]):
        onehot[0, i, a] = 0.0  # p == 1 at the target token: the draw is the greedy choice
    res = verify_tree(trees, onehot, torch.tensor([[5, 5, 0]]), logits_processor=recorder, do_sample=True,
                      generator=torch.Generator().manual_seed(0))
    check_result(res, 0, [0, 2, 3, 4], bonus=2)
    assert calls == [[5, 5, 0], [5, 5, 0, 3], [5, 5, 0, 3, 1], [5, 5, 0, 3, 1, 4]]


def test_a_length_key_merges_prefixes_of_different_lengths_into_one_call() -> None:
    """Rows whose prefix lengths share a `length_key` go to one call, left-padded with their own first token; a
    processor that reads the length against a threshold keeps its result when the key holds the threshold, and a key
    that does not (the control) changes it."""
    # three rows, contexts of 3, 4 and 6 tokens; each tree a root and one child carrying the target's choice
    contexts = [torch.tensor([7, 1, 2]), torch.tensor([8, 1, 2, 3]), torch.tensor([9, 1, 2, 3, 4, 2])]
    trees = DraftTreeBatch.stack([make_tree([int(c[-1]), 0], [-1, 0]) for c in contexts])
    logits = torch.zeros(3, 2, 6)
    logits[:, :, 0], logits[:, :, 5] = 2.0, 1.0  # token 0 first, token 5 next

    def processor(calls):
        def fn(rows, ids, scores):  # bans token 0 while the prefix is shorter than 5 tokens
            calls.append(ids.tolist())
            return torch.where((torch.arange(6) == 0) & (ids.shape[1] < 5), -float("inf"), scores)
        return fn

    per_length, merged, blind = [], [], []
    reference = verify_tree(trees, logits, contexts, BatchedProcessor(processor(per_length)))
    res = verify_tree(trees, logits, contexts, BatchedProcessor(processor(merged), length_key=lambda n: n < 5))
    assert_same(res, reference)
    # the roots: a call per length, or per key (banned, not banned); the child only where token 0 was chosen
    assert len(per_length) == 3 + 1 and len(merged) == 2 + 1
    assert merged[0] == [[7, 7, 1, 2], [8, 1, 2, 3]]  # the shorter prefix padded with its own first token
    wrong = verify_tree(trees, logits, contexts, BatchedProcessor(processor(blind), length_key=lambda n: ()))
    assert not torch.equal(wrong.bonus_token, reference.bonus_token)


def test_the_roots_choice_is_plain_decodings_and_verify_trees() -> None:
    """`choose_at_roots` (a plain step's choice) against the argmax of each row's processed root scores with its own
    prefix, and against `verify_tree` on one-node trees, over ragged prefixes with and without a `length_key`; the
    control: the raw argmax, which the prefix-dependent penalty changes."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    vocab = 6
    changed = 0
    for _ in range(80):
        rows = rng.randint(1, 4)
        contexts = [torch.tensor([rng.randrange(vocab) for _ in range(rng.randint(1, 5))]) for _ in range(rows)]
        logits = torch.randn(rows, vocab, generator=gen)
        expected = [first_argmax(rep_penalty(c[None], logits[b : b + 1].clone())[0].tolist())
                    for b, c in enumerate(contexts)]
        changed += expected != logits.argmax(-1).tolist()
        trees = DraftTreeBatch.stack([make_tree([int(c[-1])], [-1]) for c in contexts])
        # the length key pads the shorter prefixes with their own first token, which the penalty reads as present
        for process in (rep_penalty, BatchedProcessor(_one_row_at_a_time(rep_penalty), length_key=lambda n: n % 2)):
            got = choose_at_roots(logits, contexts, process)
            assert got == expected
            assert got == verify_tree(trees, logits[:, None], contexts, process).bonus_token.tolist()
        assert choose_at_roots(logits, contexts, None) == logits.argmax(-1).tolist()
    assert changed > 10  # the prefixes matter


@pytest.mark.parametrize("processor", [None, rep_penalty], ids=["raw", "rep_penalty"])
def test_the_roots_draw_is_verify_trees_draw(processor) -> None:
    """Sampling at lone roots: the draw `verify_tree` makes on one-node trees, from one generator state (so the same
    distribution, that of the processed scores: `test_sampling_temperature_top_k_first_token`); the control, another
    seed, draws differently."""
    rows = 64
    contexts = [torch.tensor([r % VS, (r * 7) % VS]) for r in range(rows)]
    logits = torch.randn(rows, VS, generator=torch.Generator().manual_seed(1))
    trees = DraftTreeBatch.stack([make_tree([int(c[-1])], [-1]) for c in contexts])

    def draw(seed: int) -> list[int]:
        return choose_at_roots(logits, contexts, processor, do_sample=True,
                               generator=torch.Generator().manual_seed(seed))

    tree_draw = verify_tree(trees, logits[:, None], contexts, processor or (lambda ids, s: s), do_sample=True,
                            generator=torch.Generator().manual_seed(9)).bonus_token.tolist()
    assert draw(9) == tree_draw
    assert draw(10) != tree_draw


# ------------------------------------------------------------------------------------- lossless sampling

VS = 4
# root 0 -> 1 (tok 1), 2 (tok 2), 3 (tok 1, duplicate of node 1); 1 -> 4 (tok 3), 5 (tok 0); 2 -> 6 (tok 2);
# 3 -> 7 (tok 3, under the duplicate: node 4's path)
TOY_TOKENS = [0, 1, 2, 1, 3, 0, 2, 3]
TOY_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 3]
TOY_CONTEXT = [3, 0]


def toy_logits(path: tuple[int, ...]) -> torch.Tensor:
    """Target logits after `path` (tokens after the root): a function of the token path only."""
    if path == ():
        return torch.tensor([0.15, 0.35, 0.3, 0.2]).log()
    seed = 1000 + sum(t * VS**k for k, t in enumerate(path)) + 97 * len(path)
    return torch.randn(VS, generator=torch.Generator().manual_seed(seed)) * 1.2


def target_probs(path: tuple[int, ...], processor) -> torch.Tensor:
    scores = toy_logits(path)[None]
    if processor is not None:
        scores = processor(torch.tensor(TOY_CONTEXT + list(path))[None], scores)
    return torch.softmax(scores[0].double(), -1)


def exact_pair_distribution(processor) -> torch.Tensor:
    p1 = target_probs((), processor)
    return torch.stack([p1[t] * target_probs((t,), processor) for t in range(VS)])  # [VS, VS]


def toy_batch(rows: int):
    tree = make_tree(TOY_TOKENS, TOY_PARENTS)
    paths = [tuple(path_tokens(i, TOY_TOKENS, TOY_PARENTS)) for i in range(len(TOY_TOKENS))]
    logits = torch.stack([toy_logits(p) for p in paths])[None].expand(rows, -1, -1)
    trees = DraftTreeBatch.stack([tree] * rows)
    return trees, logits, torch.tensor([TOY_CONTEXT] * rows)


def complete_pairs(emitted: list[list[int]], processor, gen: torch.Generator) -> torch.Tensor:
    """[VS, VS] counts of the first two tokens; a row that emitted one token gets its second token sampled from
    the target at that prefix (what the next decoding step would do)."""
    counts = torch.zeros(VS, VS)
    need: dict[int, int] = {}
    for toks in emitted:
        if len(toks) >= 2:
            counts[toks[0], toks[1]] += 1
        else:
            need[toks[0]] = need.get(toks[0], 0) + 1
    for t1, k in need.items():
        second = torch.multinomial(target_probs((t1,), processor).float(), k, replacement=True, generator=gen)
        counts[t1] += torch.bincount(second, minlength=VS).float()
    return counts


TOY_PATHS = {tuple(path_tokens(i, TOY_TOKENS, TOY_PARENTS)) for i in range(1, len(TOY_TOKENS))}


def reference_walk(processor, bug: str, draws: int, seed: int) -> list[list[int]]:
    """Emitted tokens of `draws` steps on the toy tree, re-derived independently (Python's `random`): the target
    draws the next token after the path so far, and the path grows while it stays a path of the tree; the last draw
    is the bonus. `bug` makes it a control that must fail:
    accept_unmatched  where no child carries the draw, a child (the smallest token) is accepted anyway;
    draw_per_node     duplicate siblings draw independently and the deeper walk wins (the walk looks at luckier
                      draws below the duplicates)."""
    rng = random.Random(seed)
    cache: dict[tuple[int, ...], list[float]] = {}

    def draw(path: tuple[int, ...]) -> int:
        if path not in cache:
            cache[path] = target_probs(path, processor).tolist()
        return rng.choices(range(VS), weights=cache[path])[0]

    children: list[list[int]] = [[] for _ in TOY_TOKENS]
    for j in range(1, len(TOY_TOKENS)):
        children[TOY_PARENTS[j]].append(j)

    def per_node(node: int, path: tuple[int, ...]) -> list[int]:  # tokens emitted after `node`, deepest walk
        x = draw(path)
        best = [x]
        for c in children[node]:
            if TOY_TOKENS[c] == x:
                below = [x] + per_node(c, path + (x,))
                best = below if len(below) > len(best) else best
        return best

    out = []
    for _ in range(draws):
        if bug == "draw_per_node":
            out.append(per_node(0, ()))
            continue
        path: tuple[int, ...] = ()
        while True:
            x = draw(path)
            if path + (x,) not in TOY_PATHS and bug == "accept_unmatched":
                x = next((p[-1] for p in sorted(TOY_PATHS) if p[:-1] == path), x)
            if path + (x,) not in TOY_PATHS:
                out.append(list(path) + [x])
                break
            path += (x,)
    return out


DRAWS = 20000


@pytest.mark.slow  # statistical: chi-square over many draws
@pytest.mark.parametrize("processor", [None, rep_penalty], ids=["raw", "rep_penalty"])
def test_sampling_is_lossless(processor) -> None:
    """The first two emitted tokens against their exact distribution (enumerated): on the device (no processor:
    `verify_sampled`) and in the lazy walk (a processor), on a tree with a duplicate sibling."""
    trees, logits, ctx = toy_batch(DRAWS)
    gen = torch.Generator().manual_seed(2024)
    res = verify_tree(trees, logits, ctx, logits_processor=processor, do_sample=True, generator=gen)
    emitted = res.accepted_tokens(trees)
    # the duplicate sibling (node 3) shares node 1's draws, so node 1's subtree always wins the tie
    assert not (res.accepted_nodes == 3).any() and not (res.accepted_nodes == 7).any()
    lengths = res.accept_length.bincount(minlength=3).tolist()
    assert all(k > 500 for k in lengths)  # bonus at the root, at depth 1, and full acceptance all happen
    counts = complete_pairs(emitted, processor, gen)
    exact = exact_pair_distribution(processor)
    assert chi_square_pvalue(counts, exact) > 1e-4
    # the same statistic has the power to reject a wrong walk
    for bug in ("accept_unmatched", "draw_per_node"):
        wrong = complete_pairs(reference_walk(processor, bug, DRAWS, seed=7), processor, gen)
        assert chi_square_pvalue(wrong, exact) < 1e-6, bug
    # and it accepts the control walk without the bug (the reference itself is right)
    right = complete_pairs(reference_walk(processor, "none", DRAWS, seed=7), processor, gen)
    assert chi_square_pvalue(right, exact) > 1e-4


def first_with_same_path(tokens: list[int], parents: list[int]) -> list[int]:
    """For each node the smallest node index with the same token path."""
    paths = [tuple(path_tokens(i, tokens, parents)) for i in range(len(tokens))]
    return [paths.index(p) for p in paths]


def test_lazy_and_device_walks_agree_on_chosen_tokens() -> None:
    """One rule: given every node's chosen token (logits whose only finite entry is it), the lazy walk of
    `verify_tree`, greedy or sampling, accepts what `accept_chosen` accepts; sampling takes one draw per distinct
    path, so duplicates follow the first node with their path."""
    rng = random.Random(11)
    vocab = 3  # a small vocabulary: many duplicate siblings and correct paths
    for _ in range(150):
        trees, rows, ctxs, chosen_rows = [], [], [], []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 12)
            parents = [-1] + [rng.randint(0, j - 1) for j in range(1, n)]
            tokens = [rng.randrange(vocab) for _ in range(n)]
            chosen = [rng.randrange(vocab) for _ in range(n)]
            logits = torch.full((n, vocab), float("-inf"))
            logits[torch.arange(n), torch.tensor(chosen)] = 0.0
            trees.append(make_tree(tokens, parents))
            rows.append(logits)
            ctxs.append(torch.tensor([tokens[0]]))
            first = first_with_same_path(tokens, parents)
            chosen_rows.append((chosen, [chosen[first[i]] for i in range(n)]))
        batch = DraftTreeBatch.stack(trees, num_nodes=max(t.num_nodes for t in trees) + 1)
        logits = pad_logits(rows, batch.num_nodes)
        per_node = torch.zeros(batch.tokens.shape, dtype=torch.long)
        per_path = torch.zeros(batch.tokens.shape, dtype=torch.long)
        for b, (chosen, shared) in enumerate(chosen_rows):
            per_node[b, : len(chosen)] = torch.tensor(chosen)
            per_path[b, : len(shared)] = torch.tensor(shared)
        identity = lambda ids, s: s  # noqa: E731 - takes the lazy walk
        assert_same(verify_tree(batch, logits, ctxs, identity), accept_chosen(batch, per_node))
        assert_same(verify_greedy(batch, logits), accept_chosen(batch, per_node))
        sampled = accept_chosen(batch, per_path)
        assert_same(verify_tree(batch, logits, ctxs, identity, do_sample=True), sampled)
        assert_same(verify_sampled(batch, logits), sampled)


def temperature_top_k(input_ids: torch.Tensor, scores: torch.Tensor, temperature=0.7, k=2) -> torch.Tensor:
    scores = scores / temperature
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


@pytest.mark.slow  # statistical: chi-square over many draws
def test_sampling_temperature_top_k_first_token() -> None:
    rows = DRAWS
    # root -> tok 3 (outside the top-2: probability 0), tok 1, tok 1 (duplicate), tok 2, tok 0 (probability 0)
    tree = make_tree([0, 3, 1, 1, 2, 0], [-1, 0, 0, 0, 0, 0])
    root_logits = torch.tensor([0.5, 1.0, 0.8, -0.3])
    logits = torch.randn(1, 6, VS).expand(rows, -1, -1).clone()
    logits[:, 0] = root_logits
    trees = DraftTreeBatch.stack([tree] * rows)
    res = verify_tree(trees, logits, torch.tensor([[0]] * rows), logits_processor=temperature_top_k,
                      do_sample=True, generator=torch.Generator().manual_seed(5))
    first = torch.tensor([t[0] for t in res.accepted_tokens(trees)])
    counts = torch.bincount(first, minlength=VS).float()
    expected = torch.softmax(temperature_top_k(None, root_logits[None])[0], -1)
    assert counts[0] == 0 and counts[3] == 0
    assert chi_square_pvalue(counts, expected) > 1e-4
    # accepted first tokens come from node 2 (first tok-1 child) or node 4, never nodes 1, 3 or 5
    assert set(res.accepted_nodes[:, 1].tolist()) <= {-1, 2, 4}
    # every draw at the root is in the top-2 {1, 2}, and both are children: a draft is always accepted
    assert int((res.accept_length == 0).sum()) == 0


@pytest.mark.parametrize("processor", [None, rep_penalty], ids=["raw", "rep_penalty"])
def test_sampling_is_reproducible_with_generator(processor) -> None:
    trees, logits, ctx = toy_batch(50)
    a = verify_tree(trees, logits, ctx, processor, do_sample=True, generator=torch.Generator().manual_seed(3))
    b = verify_tree(trees, logits, ctx, processor, do_sample=True, generator=torch.Generator().manual_seed(3))
    assert_same(a, b)
    assert a.accepted_nodes.shape == (50, 3)


def test_sampling_names_a_node_without_a_distribution() -> None:
    trees = DraftTreeBatch.stack([make_tree([1, 2, 3], [-1, 0, 1])])
    logits = torch.zeros(1, 3, VS)
    logits[0, 0] = torch.tensor([float("-inf"), float("-inf"), 0.0, float("-inf")])  # the root chooses 2: node 1
    for bad in (float("-inf"), float("nan")):
        broken = logits.clone()
        broken[0, 1] = bad
        with pytest.raises(ValueError, match="row 0, node 1 give no valid distribution"):
            verify_sampled(trees, broken)
        with pytest.raises(ValueError, match="row 0, node 1 give no valid distribution"):
            verify_tree(trees, broken, torch.tensor([[1]]), lambda ids, s: s, do_sample=True,
                        generator=torch.Generator().manual_seed(0))
    # greedy keeps HF's argmax of such scores (the first entry)
    broken = logits.clone()
    broken[0, 1] = float("-inf")
    check_result(verify_tree(trees, broken, torch.tensor([[1]]), lambda ids, s: s), 0, [0, 1], bonus=0)


def test_sampling_with_bf16_logits_and_degenerate_distribution() -> None:
    # a one-hot target: every draw is its token, so the draft carrying it is accepted
    tree = make_tree([1, 2, 3, 0], [-1, 0, 0, 2])
    logits = torch.full((1, 4, VS), -30.0, dtype=torch.bfloat16)
    logits[0, 0, 3] = 30.0
    logits[0, 2, 1] = 30.0
    logits[0, 3, 0] = 30.0
    trees = DraftTreeBatch.stack([tree])
    res = verify_tree(trees, logits, do_sample=True, generator=torch.Generator().manual_seed(0))
    check_result(res, 0, [0, 2], bonus=1)


# -------------------------------------------------------------------------------------------------- validation


def _small():
    trees = DraftTreeBatch.stack([make_tree([1, 2, 3], [-1, 0, 1])])
    return trees, torch.zeros(1, 3, VS)


@pytest.mark.parametrize("fn", ["greedy", "tree"])
def test_validation_errors(fn: str) -> None:
    call = (lambda t, l: verify_greedy(t, l)) if fn == "greedy" else (lambda t, l: verify_tree(t, l, do_sample=True))
    trees, logits = _small()
    with pytest.raises(ValueError, match="3-D"):
        call(trees, logits[0])
    with pytest.raises(ValueError, match="does not match"):
        call(trees, torch.zeros(2, 3, VS))
    with pytest.raises(ValueError, match="does not match"):
        call(trees, torch.zeros(1, 4, VS))
    with pytest.raises(ValueError, match="floating"):
        call(trees, torch.zeros(1, 3, VS, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        call(DraftTreeBatch.stack([make_tree([1, 2, VS], [-1, 0, 1])]), logits)
    bad = DraftTreeBatch.stack([make_tree([1, 2, 3], [-1, 0, 1])])
    bad.parents[0, 2] = 2
    with pytest.raises(ValueError, match="parents must precede"):
        call(bad, logits)
    bad = DraftTreeBatch.stack([make_tree([1, 2, 3], [-1, 0, 1])])
    bad.depths[0, 2] = 1
    with pytest.raises(ValueError, match="depth"):
        call(bad, logits)


def test_validation_errors_verify_tree_context() -> None:
    trees, logits = _small()
    with pytest.raises(ValueError, match="batch size"):
        verify_tree(trees, logits, torch.tensor([[1], [1]]), logits_processor=rep_penalty)
    with pytest.raises(ValueError, match="batch size"):
        verify_tree(trees, logits, torch.tensor([[1], [1]]))  # checked even on the delegating path
    with pytest.raises(ValueError, match="needs context_ids"):
        verify_tree(trees, logits, logits_processor=rep_penalty)
    with pytest.raises(ValueError, match="end with the root token"):
        verify_tree(trees, logits, torch.tensor([[1, 2]]), logits_processor=rep_penalty)
    with pytest.raises(ValueError, match="integer"):
        verify_tree(trees, logits, torch.tensor([[1.0]]), logits_processor=rep_penalty)
    with pytest.raises(ValueError, match="max_depth"):
        verify_greedy(trees, logits, max_depth=1)
    # ragged contexts are accepted as a list of 1-D tensors
    res = verify_tree(trees, logits, [torch.tensor([3, 3, 1])], logits_processor=rep_penalty)
    assert res.accepted_nodes.shape == (1, 3)
