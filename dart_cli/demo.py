"""`dart-spec demo`: SmolLM2-135M-Instruct with the shipped DART head, streamed, then timed against plain `generate()`
(`model_demo`); `--core`: the core pipeline (head -> tree search with n-gram -> verification) on embedded random
weights, no model (`core_demo`)."""

from __future__ import annotations

import collections
import statistics
from typing import Optional

import torch

from dart_bench import DEMO_PROMPT, chat_ids, timed, timed_generate
from dart_core import DartConfig, DartHead, NGramModel, TreeConfig, build_draft_trees, topk_draft_tokens, verify_greedy

# A small head shape with random (seeded) weights: the core pipeline runs without a model or a trained head.
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
    ngram, t_ngram = timed(NGramModel.build, [stream], order=3, vocab_size=vocab)
    cfg = TreeConfig(remain_total=remain_total)

    aux = torch.randn(batch_size, prompt_len, 3 * head.config.target_hidden_size, generator=gen)
    ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen)
    with torch.no_grad():
        logits, t_head = timed(head, aux, ids)  # [B, D+1, Vd]
        tokens, probs = topk_draft_tokens(logits, cfg.topk, head.d2t)
        trees, t_tree = timed(build_draft_trees, tokens, probs, ids[:, -3:], ngram, cfg)
    # a synthetic target that agrees with the deepest root-to-leaf path of each tree
    n, v = trees.num_nodes, vocab
    target_logits = torch.randn(batch_size, n, v, generator=gen)
    deepest = trees.ancestor_mask()[torch.arange(batch_size), trees.depths.argmax(dim=1)]  # [B, N]: its path's nodes
    for b in range(batch_size):
        path = deepest[b].nonzero().flatten().tolist()  # root first: every parent precedes its children
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


DEFAULT_PROMPT = DEMO_PROMPT


def model_demo(prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 128, repeats: int = 3, calibrate: bool = False,
               head_dir: Optional[str] = None, remain_total: Optional[int] = None, dtype: str = "float32") -> dict:
    """The main job: `dart_hf.load_default()` in `dtype` with the head attached (`dart_hf.enable(model, head)`), a
    streamed greedy completion of `prompt` (chat template), then plain `generate()` and DART timed on it in
    alternation (`repeats` each, after the streamed run as warm-up; medians) and the outputs compared.

    Each DART step's tree is chosen by what DART measures while it runs (`dart_hf.controller`, from the calls' own
    steps); where no tree pays, the attached head decodes plain. `calibrate` measures the
    head's acceptance curve again first; `remain_total` fixes the tree instead. float32 output must equal plain's
    token for token; in bfloat16 / float16 a tree forward rounds differently from a one-token forward, so the first
    new token where the two part is reported. Returns the numbers it printed.
    """
    import dataclasses

    from transformers import TextStreamer

    import dart_hf
    from dart_bench import first_difference
    from dart_hf.calibration import base_tree_config

    model, tokenizer, head = dart_hf.load_default(head_dir, target_dtype=DEMO_DTYPES[dtype])
    if calibrate:
        print("dart-spec demo: measuring the head's acceptance and this machine's cost (about a minute)", flush=True)
        choice = dart_hf.calibrate(model, tokenizer, head, progress=True)
        if choice is not None:
            print(choice.format_table())
    fixed = None if remain_total is None else dataclasses.replace(base_tree_config(model, head),
                                                                  remain_total=remain_total)
    # no store of earlier outputs: the demo times the same prompt again and again, and a store would copy the earlier
    # answers (a repeated workload's speedup, not the head's)
    dart_hf.enable(model, head, tree_config=fixed, store=False)
    threads = torch.get_num_threads()
    device = next(model.parameters()).device
    trees = f"a fixed tree of {remain_total} draft nodes" if fixed is not None else \
        "each step's tree chosen by what DART measures here"
    print(f"dart-spec demo: SmolLM2-135M-Instruct ({dtype}, {device}, {threads} "
          f"thread{'s' if threads > 1 else ''}) + DART head ({str(head.fc.weight.dtype).replace('torch.', '')}, "
          f"D={head.config.draft_length}, draft vocab {head.config.draft_vocab_size}, "
          f"{'no n-gram' if head.ngram is None else f'{head.ngram.order}-gram'}); {trees}")
    ids = chat_ids(tokenizer, prompt, device)
    common = dict(max_new_tokens=max_new_tokens, do_sample=False)
    print(f"prompt: {prompt}\n")
    # the streamed run is DART's warm-up (its steps the controller's first estimates)
    streamed = model.generate(ids, attention_mask=torch.ones_like(ids),
                              streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True), **common)
    print(flush=True)
    timed_generate(model, ids, dart_head=False, **common)  # plain's warm-up
    rates: dict[str, list[float]] = {"plain": [], "dart": []}
    outputs, stats = {}, []
    for _ in range(repeats):  # alternated, so that a slow spell of the machine hits both alike
        for name, extra in (("plain", {"dart_head": False}), ("dart", {})):
            outputs[name], seconds = timed_generate(model, ids, **common, **extra)
            rates[name].append((outputs[name].shape[1] - ids.shape[1]) / seconds)
            if name == "dart":
                stats.append(model.dart_stats)
    plain, dart = outputs["plain"], outputs["dart"]
    parted = first_difference(plain[0, ids.shape[1]:], dart[0, ids.shape[1]:])
    identical = parted is None and torch.equal(dart, streamed)
    plain_rate, dart_rate = statistics.median(rates["plain"]), statistics.median(rates["dart"])
    new_tokens = plain.shape[1] - ids.shape[1]
    print(f"plain generate(): {plain_rate:6.1f} tokens/s (median of {repeats}, {new_tokens} tokens, greedy)")
    print(f"DART:             {dart_rate:6.1f} tokens/s ({describe_steps(stats)})")
    if identical:
        agreement = "identical (token for token)"
    elif dtype == "float32":
        agreement = "DIFFER (this is a bug; please report it)"
    else:
        agreement = (f"equal for the first {parted} of {new_tokens} new tokens (in {dtype} a tree forward rounds "
                     "differently from a one-token forward; near-ties can part, as with prompt lookup)")
    print(f"speedup {dart_rate / plain_rate:.2f}x; outputs {agreement}")
    last = next((s for s in reversed(stats) if s is not None), None)
    return {"plain_tokens_per_s": plain_rate, "dart_tokens_per_s": dart_rate, "speedup": dart_rate / plain_rate,
            "tau": None if last is None else last.tau,
            "tree_sizes": None if last is None else last.tree_sizes, "new_tokens": new_tokens,
            "identical": identical, "first_difference": parted, "dtype": dtype}


def describe_steps(stats: list) -> str:
    """What the timed DART calls did: tau and the tree sizes of their steps, or that they ran plain."""
    ran = [s for s in stats if s is not None]
    if not ran:
        return "every call ran as plain generate(): no tree beats plain decoding on this machine"
    sizes = [r for s in ran for r in s.tree_sizes]
    trees = collections.Counter(r for r in sizes if r)
    plain_steps = sizes.count(0)
    common = ", ".join(f"{r} nodes x{n}" for r, n in trees.most_common(3))
    tau = statistics.median(s.tau for s in ran if s.steps) if any(s.steps for s in ran) else 1.0
    parts = [f"tau {tau:.2f} tokens per verify step", f"trees: {common or 'none'}"]
    if plain_steps:
        parts.append(f"{plain_steps} plain steps of {len(sizes)}")
    if len(ran) < len(stats):
        parts.append(f"{len(stats) - len(ran)} of {len(stats)} calls ran plain")
    return "; ".join(parts)


DEMO_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

