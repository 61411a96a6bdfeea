"""`dart-spec demo`: the core pipeline (head -> tree search with n-gram -> verification) on embedded random weights."""

from __future__ import annotations

import time

import torch

from dart_core import DartConfig, DartHead, NGramModel, TreeConfig, build_draft_trees, topk_draft_tokens, verify_greedy

# A small head shape; the weights are random (seeded) because no trained head ships yet.
DEMO_CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512, draft_vocab_size=256, draft_length=8, target_hidden_size=48)


def demo_head(seed: int) -> DartHead:
    torch.manual_seed(seed)
    head = DartHead(DartConfig(**DEMO_CONFIG))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5)
        head.d2t.copy_(torch.arange(head.config.draft_vocab_size))  # draft id i -> target id 2i
    head.set_input_embeddings(torch.nn.Embedding(head.config.vocab_size, head.config.hidden_size))
    return head


def core_demo(seed: int = 0, batch_size: int = 4, remain_total: int = 60, prompt_len: int = 32) -> dict:
    """Draft `batch_size` trees from random target states, verify them against a synthetic target, print a report."""
    head = demo_head(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = head.config.vocab_size
    stream = torch.randint(0, vocab // 8, (20000,), generator=gen)  # a repetitive corpus for the n-gram prior
    t0 = time.perf_counter()
    ngram = NGramModel.build([stream], order=3, vocab_size=vocab)
    t_ngram = time.perf_counter() - t0
    cfg = TreeConfig(remain_total=remain_total)

    aux = torch.randn(batch_size, prompt_len, 3 * head.config.target_hidden_size, generator=gen)
    ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = head(aux, ids)  # [B, D+1, Vd]
        t_head = time.perf_counter() - t0
        tokens, probs = topk_draft_tokens(logits, cfg.topk, head.d2t)
        t0 = time.perf_counter()
        trees = build_draft_trees(tokens, probs, ids[:, -3:], ngram, cfg)
        t_tree = time.perf_counter() - t0
    # a synthetic target that agrees with the deepest root-to-leaf path of each tree
    n, v = trees.num_nodes, vocab
    target_logits = torch.randn(batch_size, n, v, generator=gen)
    for b in range(batch_size):
        path = max(trees[b].leaf_paths(), key=len)
        for parent, child in zip(path, path[1:]):
            target_logits[b, parent, trees.tokens[b, child]] = 100.0
    result = verify_greedy(trees, target_logits)

    print(f"dart-spec demo: random head (D={head.config.draft_length}, draft vocab {head.config.draft_vocab_size}), "
          f"n-gram of {ngram.num_nodes} nodes ({ngram.nbytes / ngram.num_nodes:.0f} B/node, built in "
          f"{t_ngram * 1e3:.0f} ms)")
    print(f"head forward for {batch_size} rows x {prompt_len} tokens: {t_head * 1e3:.1f} ms; "
          f"{batch_size} trees of {n} nodes: {t_tree * 1e3:.1f} ms")
    tree0 = trees[0]
    print("tree 0 (first 12 nodes: token <- parent @ depth):")
    for i in range(min(12, tree0.num_nodes)):
        print(f"  node {i:2d}: token {int(tree0.tokens[i]):4d} <- {int(tree0.parents[i]):3d} @ {int(tree0.depths[i])}")
    for b in range(batch_size):
        accepted = result.accept_length[b].item()
        print(f"row {b}: accepted {accepted} draft tokens + bonus {int(result.bonus_token[b])} "
              f"({accepted + 1} tokens from one verify step)")
    return {"trees": trees, "verify": result}
