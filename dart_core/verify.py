"""Verification of draft trees against the target model's logits (greedy and lossless sampling).

The target runs one forward over a `DraftTreeBatch` and yields `logits[b, i]`: its next-token distribution after
the path root..i of tree b. Verification walks each tree from the root, accepts a path of draft nodes and emits one
more token (the "bonus") that the target produces after the last accepted node.

* `verify_greedy` - the plain-argmax case, fully vectorised (fixed shapes, no host sync when `max_depth` is given and
  `validate=False`), so it can run inside a CUDA graph.
* `verify_tree` - the general entry point: HF-style logits processors applied per node with that node's exact
  prefix, and lossless multi-draft sampling (recursive rejection sampling with deterministic drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import torch

from dart_core.tree import DraftTreeBatch

# `proc(input_ids [1, T] int64, scores [1, V] float) -> scores [1, V]`, e.g. transformers' LogitsProcessorList.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ContextIds = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = ["VerifyResult", "verify_greedy", "verify_tree", "LogitsProcessor"]


@dataclasses.dataclass
class VerifyResult:
    """Outcome of verifying a batch of draft trees.

    accepted_nodes [B, max_depth+1] int64  node indices of the accepted path, root first, padded with -1
                                           (max_depth = deepest node of the tree batch)
    accept_length  [B] int64               number of accepted DRAFT nodes (the root is not counted)
    bonus_token    [B] int64               the token the target produces after the last accepted node
    """

    accepted_nodes: torch.Tensor
    accept_length: torch.Tensor
    bonus_token: torch.Tensor

    def accepted_tokens(self, trees: DraftTreeBatch) -> list[list[int]]:
        """Per row: the accepted draft tokens (root excluded) followed by the bonus token."""
        tokens = trees.tokens.tolist()
        nodes = self.accepted_nodes.tolist()
        lengths = self.accept_length.tolist()
        bonus = self.bonus_token.tolist()
        return [
            [tokens[b][nodes[b][d]] for d in range(1, lengths[b] + 1)] + [bonus[b]] for b in range(len(lengths))
        ]


# --------------------------------------------------------------------------------------------------- validation


def _check_logits(trees: DraftTreeBatch, logits: torch.Tensor) -> None:
    """Shape/dtype checks (metadata only, no device sync)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 3-D tensor [B, N, V], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    b, n = trees.tokens.shape
    if tuple(logits.shape[:2]) != (b, n):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the tree batch: expected [B={b}, N={n}, V]"
        )
    if logits.shape[2] == 0:
        raise ValueError("logits have an empty vocabulary dimension")


def _check_trees(trees: DraftTreeBatch, vocab_size: int, max_depth: Optional[int] = None) -> None:
    """Content checks of the tree batch (these read values back from the device)."""
    tokens, parents, depths, valid = trees.tokens, trees.parents, trees.depths, trees.valid
    b, n = tokens.shape
    if b == 0 or n == 0:
        return
    if not bool(valid[:, 0].all()):
        raise ValueError("every row of the tree batch needs a valid root at node 0")
    if n > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("valid nodes must come first in each row (padding after)")
    bad = valid & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad.any()):
        row, node = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(
            f"tree token {int(tokens[row, node])} at row {row}, node {node} is outside the vocabulary "
            f"[0, {vocab_size}) of the logits"
        )
    idx = torch.arange(n, device=tokens.device)
    nonroot = valid & (idx > 0)
    bad_parent = nonroot & ((parents < 0) | (parents >= idx))
    if bool(bad_parent.any()):
        row, node = (int(v) for v in torch.nonzero(bad_parent)[0])
        raise ValueError(f"node {node} of row {row} has parent {int(parents[row, node])}; parents must precede "
                         "their children")
    if bool((valid[:, 0] & ((parents[:, 0] != -1) | (depths[:, 0] != 0))).any()):
        raise ValueError("the root (node 0) must have parent -1 and depth 0")
    parent_depth = depths.gather(1, parents.clamp(min=0))
    bad_depth = nonroot & (depths != parent_depth + 1)
    if bool(bad_depth.any()):
        row, node = (int(v) for v in torch.nonzero(bad_depth)[0])
        raise ValueError(f"depth of node {node} in row {row} is not its parent's depth + 1")
    if max_depth is not None:
        actual = int(torch.where(valid, depths, 0).max())
        if max_depth < actual:
            raise ValueError(f"max_depth={max_depth} is smaller than the deepest node of the trees ({actual})")


def _context_rows(context_ids: Optional[ContextIds], batch: int) -> Optional[list[torch.Tensor]]:
    if context_ids is None:
        return None
    if isinstance(context_ids, torch.Tensor):
        if context_ids.dim() != 2:
            raise ValueError(f"context_ids must be a [B, T] tensor, got shape {tuple(context_ids.shape)}")
        rows = list(context_ids.unbind(0))
    else:
        rows = list(context_ids)
        if any(not isinstance(r, torch.Tensor) or r.dim() != 1 for r in rows):
            raise ValueError("context_ids given as a sequence must hold 1-D tensors")
    if len(rows) != batch:
        raise ValueError(f"context_ids has batch size {len(rows)} but the tree batch has {batch} rows")
    for r in rows:
        if r.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
            raise ValueError(f"context_ids must hold integer token ids, got dtype {r.dtype}")
    return rows


# ------------------------------------------------------------------------------------------------------- greedy


def verify_greedy(
    trees: DraftTreeBatch,
    logits: torch.Tensor,
    *,
    ancestors: Optional[torch.Tensor] = None,
    max_depth: Optional[int] = None,
    validate: bool = True,
) -> VerifyResult:
    """Greedy verification, fully vectorised.

    Node j >= 1 is correct when `tokens[j] == argmax(logits[parent[j]])` (first maximum, like HF greedy). The
    accepted node is the deepest valid node whose whole path is correct (ties in depth: smallest node index); the
    bonus token is the argmax at that node.

    ancestors  optional precomputed [B, N, N] bool mask (`DraftTreeBatch.ancestor_mask()`, e.g. the one built for
               the tree attention); without it path correctness comes from pointer doubling over `parents`.
    max_depth  width of `accepted_nodes` minus one; must be >= the deepest node. None: read from `trees.depths`
               (one host sync).
    validate   check tree contents (token range, parent order, depths); this reads values back to the host.
               With `max_depth` given and `validate=False` the function does no host sync at all.
    """
    _check_logits(trees, logits)
    if ancestors is not None and tuple(ancestors.shape) != (trees.batch_size, trees.num_nodes, trees.num_nodes):
        raise ValueError(f"ancestors must be [B, N, N], got {tuple(ancestors.shape)}")
    if validate:
        _check_trees(trees, logits.shape[-1], max_depth)
    device = logits.device
    tokens = trees.tokens.to(device)
    parents = trees.parents.to(device).clamp(min=0)  # root and padding point at the root
    depths = trees.depths.to(device)
    valid = trees.valid.to(device)
    b, n = tokens.shape
    if max_depth is None:
        max_depth = int(torch.where(valid, depths, 0).max()) if tokens.numel() else 0

    target = logits.argmax(dim=-1)  # [B, N] greedy next token after each node
    idx = torch.arange(n, device=device)
    correct = valid & (tokens == target.gather(1, parents))
    correct = torch.where(idx == 0, True, correct)  # the root is on every path and always "correct"

    if ancestors is not None:
        path_ok = ~(ancestors.to(device) & ~correct[:, None, :]).any(dim=-1)
    else:
        # after k rounds path_ok[i] covers node i and its 2^k - 1 nearest ancestors (the root self-loops)
        path_ok, up = correct, parents
        for _ in range(max(n - 1, 0).bit_length()):
            path_ok = path_ok & path_ok.gather(1, up)
            up = up.gather(1, up)
    path_ok = path_ok & valid

    # deepest first, then smallest index; keys of different depths never overlap
    key = torch.where(path_ok, depths * n + (n - 1 - idx), -1)
    sel = key.argmax(dim=-1)  # [B]; the root always qualifies
    accept_length = depths.gather(1, sel[:, None])[:, 0]
    bonus = target.gather(1, sel[:, None])[:, 0]

    # chain[:, k] = k-th ancestor of the accepted node; column d of the path holds ancestor number length - d
    chain = [sel]
    for _ in range(max_depth):
        chain.append(parents.gather(1, chain[-1][:, None])[:, 0])
    chain_t = torch.stack(chain, dim=1)  # [B, max_depth+1]
    d = torch.arange(max_depth + 1, device=device)
    nodes = chain_t.gather(1, (accept_length[:, None] - d).clamp(min=0))
    accepted_nodes = torch.where(d <= accept_length[:, None], nodes, -1)
    return VerifyResult(accepted_nodes.long(), accept_length.long(), bonus.long())


# ------------------------------------------------------------------------------------------------------ general


def verify_tree(
    trees: DraftTreeBatch,
    logits: torch.Tensor,
    context_ids: Optional[ContextIds] = None,
    logits_processor: Optional[LogitsProcessor | Sequence[LogitsProcessor]] = None,
    do_sample: bool = False,
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """Verify draft trees, greedily or by lossless sampling, optionally through an HF-style logits processor.

    context_ids       [B, T] int64 (or a sequence of B 1-D tensors, for ragged rows): the full sequence up to and
                      INCLUDING the root token. The prefix seen by node i's logits is context + path tokens after
                      the root up to i. Required when a processor is given; each row must end with its root token.
    logits_processor  `proc(input_ids [1, T'], scores [1, V]) -> scores [1, V]`, applied lazily to float32 scores
                      at visited nodes only, with the node's exact prefix as `input_ids`; or a sequence of B such
                      processors, row b's for row b.
    do_sample=False   greedy: at a visited node take the argmax of the processed scores and follow a child with
                      that token; the bonus is the argmax at the last accepted node. Without a processor this is
                      exactly `verify_greedy`. With a processor the semantics match `verify_greedy` too: when
                      several children carry the argmax token, the deepest fully-correct path wins (ties: smallest
                      node index), so an identity processor changes nothing.
    do_sample=True    lossless multi-draft rejection sampling with deterministic drafts: p = softmax(processed) at a
                      visited node; children are tried in node order (a token already tried at that node is
                      skipped); child x is accepted when u < p(x), u ~ U[0, 1) from `generator`; on rejection p(x)
                      is set to 0 and p renormalised. An accepted child is visited next; otherwise the bonus is drawn
                      from the current p with `torch.multinomial`. The emitted tokens follow the target exactly.
    """
    _check_logits(trees, logits)
    contexts = _context_rows(context_ids, trees.batch_size)
    if logits_processor is None and not do_sample:
        return verify_greedy(trees, logits)
    vocab = logits.shape[-1]
    _check_trees(trees, vocab)
    if logits_processor is not None and contexts is None:
        raise ValueError("a logits_processor needs context_ids (the sequence up to and including the root token)")
    if contexts is not None:
        roots = trees.tokens[:, 0].tolist()
        for b, ctx in enumerate(contexts):
            if ctx.numel() == 0 or int(ctx[-1]) != roots[b]:
                last = int(ctx[-1]) if ctx.numel() else None
                raise ValueError(
                    f"context_ids row {b} must end with the root token {roots[b]} (got last token {last}); "
                    "context_ids is the sequence up to and including the root"
                )

    device = logits.device
    max_depth = int(torch.where(trees.valid, trees.depths, 0).max()) if trees.tokens.numel() else 0
    counts = trees.valid.sum(dim=1).tolist()
    all_tokens = trees.tokens.tolist()
    all_parents = trees.parents.tolist()
    rows_nodes: list[list[int]] = []
    bonus_tokens: list[int] = []

    for b in range(trees.batch_size):
        n = counts[b]
        tokens, parents = all_tokens[b][:n], all_parents[b][:n]
        children: list[list[int]] = [[] for _ in range(n)]
        for j in range(1, n):
            children[parents[j]].append(j)
        ctx = contexts[b].to(device=device, dtype=torch.long) if contexts is not None else None
        proc = logits_processor[b] if isinstance(logits_processor, (list, tuple)) else logits_processor

        def scores_at(node: int, path: list[int], _b: int = b, _ctx: Optional[torch.Tensor] = ctx,
                      _proc: Optional[LogitsProcessor] = proc) -> torch.Tensor:
            # clone: processors may work in place and a float32 `.float()` would alias the caller's logits
            scores = logits[_b, node].to(torch.float32, copy=True)[None]
            if _proc is not None:
                ids = torch.cat([_ctx, torch.tensor(path, dtype=torch.long, device=device)])[None]
                scores = _proc(ids, scores)
                if tuple(scores.shape) != (1, vocab):
                    raise ValueError(f"logits_processor returned shape {tuple(scores.shape)}, expected (1, {vocab})")
            return scores[0]

        if do_sample:
            nodes, bonus = _sample_walk(tokens, children, scores_at, generator)
        else:
            nodes, bonus = _greedy_walk(tokens, parents, children, scores_at)
        rows_nodes.append(nodes)
        bonus_tokens.append(bonus)

    accepted = torch.full((trees.batch_size, max_depth + 1), -1, dtype=torch.long)
    for b, nodes in enumerate(rows_nodes):
        accepted[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
    return VerifyResult(
        accepted.to(device),
        torch.tensor([len(x) - 1 for x in rows_nodes], dtype=torch.long, device=device),
        torch.tensor(bonus_tokens, dtype=torch.long, device=device),
    )


def _greedy_walk(tokens, parents, children, scores_at) -> tuple[list[int], int]:
    """Depth-first over the children that carry the processed argmax; with distinct siblings this visits exactly
    the accepted path (depth + 1 processor calls). Result: deepest reached node, ties -> smallest index."""
    best, best_path, best_arg = 0, [], -1
    stack: list[tuple[int, list[int]]] = [(0, [])]
    while stack:
        node, path = stack.pop()
        a = int(scores_at(node, path).argmax())
        if len(path) > len(best_path) or (len(path) == len(best_path) and node <= best):
            best, best_path, best_arg = node, path, a
        stack.extend((c, path + [a]) for c in reversed(children[node]) if tokens[c] == a)
    nodes = [best]
    while nodes[-1] > 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1], best_arg


def _sample_walk(tokens, children, scores_at, generator) -> tuple[list[int], int]:
    gen_device = generator.device if generator is not None else None
    node, path, nodes = 0, [], [0]
    while True:
        p = torch.softmax(scores_at(node, path), dim=-1, dtype=torch.float32)
        if gen_device is not None:
            p = p.to(gen_device)
        total = float(p.sum())
        if not total > 0 or total != total:  # all -inf (or NaN) scores
            raise ValueError(f"processed scores at node {node} give no valid distribution (all -inf or NaN)")
        tried: set[int] = set()
        accepted = None
        for c in children[node]:
            x = tokens[c]
            if x in tried:
                continue
            tried.add(x)
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < float(p[x]):
                accepted = c
                break
            q = p.clone()
            q[x] = 0.0
            s = float(q.sum())
            if s > 0:  # always true after a genuine rejection (p(x) < 1); otherwise keep p as it was
                p = q / s
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return nodes, bonus
        node = accepted
        path.append(tokens[node])
        nodes.append(node)
