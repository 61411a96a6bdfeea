"""Verification of draft trees against the target model's logits (greedy and lossless sampling).

The target runs one forward over a `DraftTreeBatch` and yields `logits[b, i]`: its next-token distribution after
the path root..i of tree b. Verification follows one rule for greedy decoding and sampling alike: at each visited
node the target's token is CHOSEN (greedy: the argmax of the processed scores; sampling: one draw from the processed
distribution, one draw per distinct token path); the walk follows the children that carry the chosen token; the
accepted node is the deepest one reached (ties: smallest node index) and the bonus is the token chosen there. The
accepted tokens and the bonus are then the chain of chosen tokens itself, so sampled output is a draw from the target
(docs/DESIGN.md §2.5).

* `accept_chosen` - the walk on the device, given every node's chosen token.
* `verify_greedy` / `verify_sampled` - the argmax / one draw at every node, then `accept_chosen`: fixed shapes and
  no host sync when `max_depth` is given and `validate=False` (`verify_greedy` runs inside a CUDA graph).
* `verify_tree` - the general entry point: HF-style logits processors applied per node with that node's exact
  prefix, lazily at the nodes the walk visits (all rows a depth at a time: a `BatchedProcessor` takes the rows'
  nodes of one depth together).
* `choose_at_roots` - `verify_tree`'s choice for trees of a lone root (a plain step), without its input checks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Sequence, Union

import torch

from dart_core.tree import DraftTreeBatch

# `proc(input_ids [1, T] int64, scores [1, V] float) -> scores [1, V]`, e.g. transformers' LogitsProcessorList.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ContextIds = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class BatchedProcessor:
    """A logits processor that takes several tree rows' nodes at once: `fn(rows, input_ids [k, T] int64, scores
    [k, V] float32) -> [k, V]`, line j for a node of tree row rows[j] (distinct rows, prefixes of one length T, or
    left-padded to T as `length_key` allows). Line j of the result must be what processing that node alone gives.

    `length_key` (prefix length -> a hashable key), when given, lets rows whose prefix lengths share a key go to one
    call, each prefix left-padded with its own first token to the longest of them (T): only for processors whose
    result for a row is the same under that padding (e.g. ones that read the length only through a threshold the
    key holds). None: one call per prefix length."""

    fn: Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor]
    length_key: Optional[Callable[[int], Hashable]] = None


__all__ = ["VerifyResult", "accept_chosen", "verify_greedy", "verify_sampled", "verify_tree", "choose_at_roots",
           "LogitsProcessor", "BatchedProcessor"]


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


def _check_chosen(trees: DraftTreeBatch, chosen: torch.Tensor, ancestors: Optional[torch.Tensor]) -> None:
    """Shape/dtype checks of `accept_chosen`'s inputs (metadata only, no device sync)."""
    b, n = trees.tokens.shape
    if not isinstance(chosen, torch.Tensor) or tuple(chosen.shape) != (b, n):
        shape = tuple(chosen.shape) if isinstance(chosen, torch.Tensor) else type(chosen).__name__
        raise ValueError(f"chosen must be a [B={b}, N={n}] tensor, got {shape}")
    if chosen.is_floating_point() or chosen.dtype == torch.bool:
        raise ValueError(f"chosen must hold integer token ids, got dtype {chosen.dtype}")
    if ancestors is not None and tuple(ancestors.shape) != (b, n, n):
        raise ValueError(f"ancestors must be [B, N, N], got {tuple(ancestors.shape)}")


def _check_trees(trees: DraftTreeBatch, vocab_size: Optional[int], max_depth: Optional[int] = None) -> None:
    """Content checks of the tree batch, the token range when `vocab_size` is given (these read values back from the
    device)."""
    tokens, parents, depths, valid = trees.tokens, trees.parents, trees.depths, trees.valid
    b, n = tokens.shape
    if b == 0 or n == 0:
        return
    if not bool(valid[:, 0].all()):
        raise ValueError("every row of the tree batch needs a valid root at node 0")
    if n > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("valid nodes must come first in each row (padding after)")
    bad = valid & ((tokens < 0) | (tokens >= vocab_size)) if vocab_size is not None else None
    if bad is not None and bool(bad.any()):
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


# ------------------------------------------------------------------------------------------------------- device


def accept_chosen(
    trees: DraftTreeBatch,
    chosen: torch.Tensor,
    *,
    ancestors: Optional[torch.Tensor] = None,
    max_depth: Optional[int] = None,
    validate: bool = True,
) -> VerifyResult:
    """The chosen-token walk of every tree, fully vectorised: chosen [B, N] int64 is the target's token chosen after
    each node (greedy: its argmax; sampling: a draw).

    Node j >= 1 is correct when `tokens[j] == chosen[parent[j]]`. The accepted node is the deepest valid node whose
    whole path is correct (ties in depth: smallest node index); the bonus token is the one chosen at that node.

    ancestors  optional precomputed [B, N, N] bool mask (`DraftTreeBatch.ancestor_mask()`, e.g. the one built for
               the tree attention); without it path correctness comes from pointer doubling over `parents`.
    max_depth  width of `accepted_nodes` minus one; must be >= the deepest node. None: read from `trees.depths`
               (one host sync).
    validate   check tree contents (parent order, depths); this reads values back to the host. With `max_depth`
               given and `validate=False` the function does no host sync at all.
    """
    _check_chosen(trees, chosen, ancestors)
    if validate:
        _check_trees(trees, None, max_depth)
    device = chosen.device
    tokens = trees.tokens.to(device)
    parents = trees.parents.to(device).clamp(min=0)  # root and padding point at the root
    depths = trees.depths.to(device)
    valid = trees.valid.to(device)
    b, n = tokens.shape
    if max_depth is None:
        max_depth = _deepest(trees)

    idx = torch.arange(n, device=device)
    correct = valid & (tokens == chosen.gather(1, parents))
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
    bonus = chosen.gather(1, sel[:, None])[:, 0]

    # chain[:, k] = k-th ancestor of the accepted node; column d of the path holds ancestor number length - d
    chain = [sel]
    for _ in range(max_depth):
        chain.append(parents.gather(1, chain[-1][:, None])[:, 0])
    chain_t = torch.stack(chain, dim=1)  # [B, max_depth+1]
    d = torch.arange(max_depth + 1, device=device)
    nodes = chain_t.gather(1, (accept_length[:, None] - d).clamp(min=0))
    accepted_nodes = torch.where(d <= accept_length[:, None], nodes, -1)
    return VerifyResult(accepted_nodes.long(), accept_length.long(), bonus.long())


def verify_greedy(
    trees: DraftTreeBatch,
    logits: torch.Tensor,
    *,
    ancestors: Optional[torch.Tensor] = None,
    max_depth: Optional[int] = None,
    validate: bool = True,
) -> VerifyResult:
    """Greedy verification: `accept_chosen` with the argmax of `logits` [B, N, V] at every node (first maximum, like
    HF greedy). `ancestors`, `max_depth` and `validate` (which also checks the token range) as `accept_chosen`."""
    _check_logits(trees, logits)
    if validate:
        _check_trees(trees, logits.shape[-1], max_depth)
    return accept_chosen(trees, logits.argmax(dim=-1), ancestors=ancestors, max_depth=max_depth, validate=False)


def verify_sampled(
    trees: DraftTreeBatch,
    logits: torch.Tensor,
    *,
    generator: Optional[torch.Generator] = None,
    ancestors: Optional[torch.Tensor] = None,
    max_depth: Optional[int] = None,
    validate: bool = True,
) -> VerifyResult:
    """Lossless sampling: `accept_chosen` with one draw from softmax(`logits` [B, N, V]) per distinct token path of a
    tree (nodes with the same path, i.e. duplicate siblings and their subtrees, share the draw of the first of them).

    generator  the draws' generator (`torch.multinomial`; None: the global one); the draws are made on its device.
    `ancestors`, `max_depth` and `validate` as `accept_chosen`; `validate` also checks the token range and that every
    valid node's logits give a distribution (not all -inf, no NaN).
    """
    _check_logits(trees, logits)
    if validate:
        _check_trees(trees, logits.shape[-1], max_depth)
    if max_depth is None:
        max_depth = _deepest(trees)
    valid = trees.valid.to(logits.device)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, N, V]
    if validate:
        bad = valid & ~(probs.sum(dim=-1) > 0)  # NaN sums fail too
        if bool(bad.any()):
            row, node = (int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(f"logits at row {row}, node {node} give no valid distribution (all -inf or NaN)")
    probs.masked_fill_(~valid[..., None], 1.0)  # padding: any token, never read
    b, n, v = probs.shape
    draw_device = generator.device if generator is not None else probs.device
    draws = torch.multinomial(probs.view(b * n, v).to(draw_device), 1, generator=generator)
    draws = draws.view(b, n).to(logits.device)
    chosen = draws.gather(1, _first_with_same_path(trees, max_depth, logits.device))
    return accept_chosen(trees, chosen, ancestors=ancestors, max_depth=max_depth, validate=False)


def _deepest(trees: DraftTreeBatch) -> int:
    """The depth of the deepest valid node (one host sync)."""
    return int(torch.where(trees.valid, trees.depths, 0).max()) if trees.tokens.numel() else 0


def _first_with_same_path(trees: DraftTreeBatch, max_depth: int, device: torch.device) -> torch.Tensor:
    """[B, N] int64 on `device`: for each valid node the smallest node index with the same token path (itself for
    padding). No host sync; `max_depth` >= the deepest node."""
    tokens, depths, valid = (t.to(device) for t in (trees.tokens, trees.depths, trees.valid))
    parents = trees.parents.to(device).clamp(min=0)
    n = tokens.shape[1]
    idx = torch.arange(n, device=device)
    same = (valid[:, :, None] & valid[:, None, :] & (tokens[:, :, None] == tokens[:, None, :])
            & (depths[:, :, None] == depths[:, None, :])) | torch.eye(n, dtype=torch.bool, device=device)
    first = idx.expand_as(tokens)  # [B, N]
    for _ in range(max_depth):  # after round d every node of depth <= d has its answer (its parent's is final)
        up = first.gather(1, parents)
        first = torch.where(same & (up[:, :, None] == up[:, None, :]), idx, n).amin(dim=-1)
    return first


# ------------------------------------------------------------------------------------------------------ general


def verify_tree(
    trees: DraftTreeBatch,
    logits: torch.Tensor,
    context_ids: Optional[ContextIds] = None,
    logits_processor: Optional[LogitsProcessor | Sequence[LogitsProcessor] | BatchedProcessor] = None,
    do_sample: bool = False,
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """Verify draft trees, greedily or by lossless sampling, optionally through an HF-style logits processor.

    context_ids       [B, T] int64 (or a sequence of B 1-D tensors, for ragged rows): the full sequence up to and
                      INCLUDING the root token. The prefix seen by node i's logits is context + path tokens after
                      the root up to i. Required when a processor is given; each row must end with its root token.
    logits_processor  `proc(input_ids [1, T'], scores [1, V]) -> scores [1, V]`, applied lazily to float32 scores
                      at visited nodes only, with the node's exact prefix as `input_ids`; or a sequence of B such
                      processors, row b's for row b; or a `BatchedProcessor`, called once per depth of the walk and
                      prefix length (or `length_key`) with every row whose visited node has a prefix of that length
                      (a step that verifies the roots alone of equal-length rows: one call).
    do_sample         how the target's token is chosen at a visited node: False, the argmax of the processed
                      scores; True, one draw (`torch.multinomial` with `generator`) from their softmax, once per
                      distinct token path. The walk is the module's one rule, so without a processor this is exactly
                      `verify_greedy` / `verify_sampled`, and an identity processor leaves greedy results unchanged.
                      A visited node whose processed scores give no distribution (all -inf, NaN) is a ValueError
                      when sampling.
    """
    _check_logits(trees, logits)
    contexts = _context_rows(context_ids, trees.batch_size)
    if logits_processor is None:
        return verify_sampled(trees, logits, generator=generator) if do_sample else verify_greedy(trees, logits)
    vocab = logits.shape[-1]
    _check_trees(trees, vocab)
    if contexts is None:
        raise ValueError("a logits_processor needs context_ids (the sequence up to and including the root token)")
    roots = trees.tokens[:, 0].tolist()
    for b, ctx in enumerate(contexts):
        if ctx.numel() == 0 or int(ctx[-1]) != roots[b]:
            last = int(ctx[-1]) if ctx.numel() else None
            raise ValueError(
                f"context_ids row {b} must end with the root token {roots[b]} (got last token {last}); "
                "context_ids is the sequence up to and including the root"
            )

    process = _batched(logits_processor)
    counts = trees.valid.sum(dim=1).tolist()
    tokens = [row[:n] for row, n in zip(trees.tokens.tolist(), counts)]
    parents = [row[:n] for row, n in zip(trees.parents.tolist(), counts)]
    nodes, bonus = _processed_walk(tokens, parents, contexts, logits, process, do_sample, generator)
    device = logits.device
    accepted = torch.full((trees.batch_size, _deepest(trees) + 1), -1, dtype=torch.long)
    for b, path in enumerate(nodes):
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.long)
    return VerifyResult(accepted.to(device), torch.tensor([len(x) - 1 for x in nodes], dtype=torch.long, device=device),
                        torch.tensor(bonus, dtype=torch.long, device=device))


def choose_at_roots(logits: torch.Tensor, contexts: Sequence[torch.Tensor],
                    logits_processor: Optional[LogitsProcessor | Sequence[LogitsProcessor] | BatchedProcessor],
                    do_sample: bool = False, generator: Optional[torch.Generator] = None) -> list[int]:
    """The token `verify_tree` chooses after each row's lone root (trees of one node: nothing to accept, the bonus
    alone) -> [B] tokens, without its input checks: logits [B, V] of the roots; contexts[b] [L_b] row b's sequence up
    to and including its root; `logits_processor` as `verify_tree` takes it, called as the walk's first depth calls it
    (one call per prefix length or `length_key`), or None (the raw logits). The choice a plain generate() step makes."""
    rows = len(contexts)
    if logits_processor is None:
        process = BatchedProcessor(lambda _rows, _ids, scores: scores, length_key=lambda _length: None)
    else:
        process = _batched(logits_processor)
    chosen = _choose_at([[(0, [])] for _ in range(rows)], [[0] for _ in range(rows)] if do_sample else None,
                        [{} for _ in range(rows)], list(contexts), logits[:, None], process, do_sample, generator)
    return [tokens[0] for tokens in chosen]


def _batched(logits_processor) -> "BatchedProcessor":
    """`verify_tree`'s `logits_processor` (one, one per row, or a `BatchedProcessor`) as a `BatchedProcessor`."""
    if isinstance(logits_processor, BatchedProcessor):
        return logits_processor
    return BatchedProcessor(_one_row_at_a_time(logits_processor))


def _one_row_at_a_time(processor) -> Callable:
    """A `BatchedProcessor`'s function calling `processor` (one, or one per tree row) once per row, [1, T] / [1, V]."""
    def call(rows: list[int], ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = []
        for j, b in enumerate(rows):
            proc = processor[b] if isinstance(processor, (list, tuple)) else processor
            one = proc(ids[j : j + 1], scores[j : j + 1])
            if tuple(one.shape) != (1, scores.shape[-1]):
                raise ValueError(f"logits_processor returned shape {tuple(one.shape)}, expected "
                                 f"(1, {scores.shape[-1]})")
            out.append(one)
        return torch.cat(out)

    return call


def _processed_walk(tokens: list[list[int]], parents: list[list[int]], contexts: list[torch.Tensor],
                    logits: torch.Tensor, process: "BatchedProcessor", do_sample: bool,
                    generator: Optional[torch.Generator]) -> tuple[list[list[int]], list[int]]:
    """The chosen-token walk over every row's valid nodes (`accept_chosen`'s rule, lazily), all rows a depth at a
    time: the nodes of one depth whose parent's chosen token they carry are visited together, their processed scores
    computed in one `process` call per prefix length or `length_key` (each row once a call) -> per row (accepted path
    root first, bonus). Greedy chooses the argmax at every visited node; sampling one draw per distinct token path,
    made at the first node with that path (`_first_nodes`). The accepted node is the deepest reached, ties ->
    smallest index; with distinct siblings this visits exactly each row's accepted path."""
    rows = len(tokens)
    children = [[[] for _ in row] for row in tokens]
    for b, row in enumerate(parents):
        for j in range(1, len(row)):
            children[b][row[j]].append(j)
    first = [_first_nodes(t, p) for t, p in zip(tokens, parents)] if do_sample else None
    # per row, node -> the token chosen there (sampling: keyed by the first node with its path, which all share)
    chosen_at: list[dict[int, int]] = [{} for _ in range(rows)]
    frontier = [[(0, [])] for _ in range(rows)]  # per row, the (node, path after the root) visited at this depth
    best: list[tuple[int, int]] = [(0, -1)] * rows  # per row, (deepest node reached, the token chosen there)
    while any(frontier):
        chosen = _choose_at(frontier, first, chosen_at, contexts, logits, process, do_sample, generator)
        for b in range(rows):
            if frontier[b]:
                best[b] = min(zip((node for node, _ in frontier[b]), chosen[b]))  # the same depth: smallest index
        frontier = [[(c, path + [token]) for (node, path), token in zip(frontier[b], chosen[b])
                     for c in children[b][node] if tokens[b][c] == token] for b in range(rows)]
    paths = []
    for b, (node, _) in enumerate(best):
        path = [node]
        while path[-1] > 0:
            path.append(parents[b][path[-1]])
        paths.append(path[::-1])
    return paths, [token for _, token in best]


def _choose_at(frontier: list[list[tuple[int, list[int]]]], first: Optional[list[list[int]]],
               chosen_at: list[dict[int, int]], contexts: list[torch.Tensor], logits: torch.Tensor,
               process: "BatchedProcessor", do_sample: bool, generator: Optional[torch.Generator]) -> list[list[int]]:
    """The token chosen at each frontier node (per row, in frontier order), kept in `chosen_at` (per row, by node;
    sampling: by the first node with its path, so a path has one draw): rows' nodes not chosen yet go to `process` in
    rounds, each round one node per row and one prefix length (or `length_key`)."""
    vocab = logits.shape[-1]
    need = [[(first[b][node] if do_sample else node, path) for node, path in nodes] for b, nodes in enumerate(frontier)]
    todo = [[(key, path) for i, (key, path) in enumerate(nodes)
             if key not in chosen_at[b] and all(k != key for k, _ in nodes[:i])] for b, nodes in enumerate(need)]
    group_of = process.length_key or (lambda length: length)
    while any(todo):
        groups: dict[Hashable, list[int]] = {}
        for b, nodes in enumerate(todo):
            if nodes:
                groups.setdefault(group_of(contexts[b].shape[0] + len(nodes[0][1])), []).append(b)
        for rows in groups.values():
            picked = [todo[b].pop(0) for b in rows]
            ids = _left_padded([torch.cat((contexts[b].to(logits.device, torch.long),
                                           torch.tensor(path, dtype=torch.long, device=logits.device)))
                                for b, (_, path) in zip(rows, picked)])  # [k, T]
            # stacked, a copy: processors may work in place, and never on the caller's logits
            scores = torch.stack([logits[b, key] for b, (key, _) in zip(rows, picked)]).float()
            scores = process.fn(rows, ids, scores)
            if tuple(scores.shape) != (len(rows), vocab):
                raise ValueError(f"logits_processor returned shape {tuple(scores.shape)}, expected "
                                 f"({len(rows)}, {vocab})")
            tokens = _sample(scores, rows, [key for key, _ in picked], generator) if do_sample else \
                scores.argmax(dim=-1).tolist()
            for b, (key, _), token in zip(rows, picked, tokens):
                chosen_at[b][key] = token
    return [[chosen_at[b][key] for key, _ in nodes] for b, nodes in enumerate(need)]


def _left_padded(prefixes: list[torch.Tensor]) -> torch.Tensor:
    """k prefixes [L_j] -> [k, max L_j], each left-padded with its own first token."""
    longest = max(p.shape[0] for p in prefixes)
    return torch.stack([p if p.shape[0] == longest else torch.cat((p[:1].expand(longest - p.shape[0]), p))
                        for p in prefixes])


def _sample(scores: torch.Tensor, rows: list[int], nodes: list[int], generator: Optional[torch.Generator]) -> list[int]:
    """One draw from softmax(scores[j]) for each j (scores [k, V] of row rows[j]'s node nodes[j]), on `generator`'s
    device."""
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if generator is not None:
        p = p.to(generator.device)
    valid = (p.sum(dim=-1) > 0).tolist()  # all -inf (or NaN) scores give NaN
    if not all(valid):
        j = valid.index(False)
        raise ValueError(f"processed scores at row {rows[j]}, node {nodes[j]} give no valid distribution "
                         "(all -inf or NaN)")
    return torch.multinomial(p, 1, generator=generator)[:, 0].tolist()


def _first_nodes(tokens: list[int], parents: list[int]) -> list[int]:
    """For each node of one tree the smallest node index with the same token path (`_first_with_same_path`)."""
    paths: list[tuple[int, ...]] = []
    first: dict[tuple[int, ...], int] = {}
    for j, (token, parent) in enumerate(zip(tokens, parents)):
        paths.append(paths[parent] + (token,) if parent >= 0 else ())
        first.setdefault(paths[j], j)
    return [first[p] for p in paths]
