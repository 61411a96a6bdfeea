"""Draft trees: the data (`DraftTree`, `DraftTreeBatch`) and the beam search with the n-gram prior that builds them,
merged with the context's own continuations (`dart_core.context`) when given."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from dart_core.config import TreeConfig
from dart_core.context import SOURCE_HEAD, ContextProposals
from dart_core.errors import DartInputError


def _default_sources(parents: torch.Tensor) -> torch.Tensor:
    """SOURCE_HEAD for every node with a parent, 0 for roots and padding."""
    return torch.where(parents >= 0, SOURCE_HEAD, 0).to(torch.long)


@dataclasses.dataclass
class DraftTree:
    """One draft tree. Node 0 is the root (the last token already decided); every parent precedes its children.

    tokens  [N] target token ids           parents [N] parent node index (-1 for the root)
    depths  [N] root 0, its children 1...  scores  [N] search score of each node (root 0)
    sources [N] which searches proposed the node: bits `dart_core.context.SOURCE_HEAD` / `SOURCE_CONTEXT` (root 0;
            default: SOURCE_HEAD for every draft node)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    sources: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = _default_sources(self.parents)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: `mask[i, j]` is True when node j is node i or one of its ancestors."""
        return ancestor_mask(self.parents[None])[0]

    def paths(self) -> list[tuple[int, ...]]:
        """The token path (root excluded) of every node but the root, in node order."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        out: list[tuple[int, ...]] = [()]
        for i in range(1, len(tokens)):
            out.append(out[parents[i]] + (tokens[i],))
        return out[1:]


@dataclasses.dataclass
class DraftTreeBatch:
    """B draft trees padded to a common node count N. Valid nodes come first in each row, padding after.

    tokens/parents/depths [B, N] int64, scores [B, N] float32, valid [B, N] bool, sources [B, N] int64 (bits
    `SOURCE_HEAD` = 1: the head's search proposed the node, `SOURCE_CONTEXT` = 2: the row's context did; 0 for roots
    and padding; default: SOURCE_HEAD for every draft node). Padding nodes have token 0, parent -1, depth 0 and
    score -inf.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    sources: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.sources is None:
            self.sources = _default_sources(self.parents)

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool: node j is node i or an ancestor of it (padding rows see only themselves)."""
        return ancestor_mask(self.parents)

    def __len__(self) -> int:
        return self.batch_size

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (`DraftTreeBatch(*batch.tensors())` rebuilds the batch)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def to(self, device: torch.device) -> "DraftTreeBatch":
        return DraftTreeBatch(*(t.to(device) for t in self.tensors()))

    def __getitem__(self, b: int) -> DraftTree:
        n = int(self.valid[b].sum())
        return DraftTree(self.tokens[b, :n], self.parents[b, :n], self.depths[b, :n], self.scores[b, :n],
                         self.sources[b, :n])

    @classmethod
    def stack(cls, trees: list[DraftTree], num_nodes: int | None = None) -> "DraftTreeBatch":
        """Pad single trees to `num_nodes` (default: the largest) and stack them."""
        n = num_nodes or max(t.num_nodes for t in trees)
        b = len(trees)
        device = trees[0].tokens.device
        tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        parents = torch.full((b, n), -1, dtype=torch.long, device=device)
        depths = torch.zeros(b, n, dtype=torch.long, device=device)
        scores = torch.full((b, n), float("-inf"), dtype=torch.float32, device=device)
        valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        sources = torch.zeros(b, n, dtype=torch.long, device=device)
        for i, t in enumerate(trees):
            m = t.num_nodes
            if m > n:
                raise ValueError(f"tree {i} has {m} nodes, more than num_nodes={n}")
            tokens[i, :m], parents[i, :m], depths[i, :m] = t.tokens, t.parents, t.depths
            scores[i, :m], valid[i, :m], sources[i, :m] = t.scores, True, t.sources
        return cls(tokens, parents, depths, scores, valid, sources)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents -> [B, N, N] bool, True where column j is row i or one of its ancestors.

    Transitive closure of the parent relation by repeated squaring: ceil(log2 N) batched matmuls, the same
    operators whatever the trees hold and no host synchronisation."""
    b, n = parents.shape
    device = parents.device
    cols = torch.arange(n, device=device)
    reach = ((cols == parents[..., None]) | (cols == cols[:, None])).float()  # [B, N, N] self or parent
    for _ in range(max(n - 1, 1).bit_length()):  # after s squarings: ancestors up to 2^s levels up
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


# ---- the beam search (docs/DESIGN.md §2.3) ---------------------------------------------------------------------------

LOG_EPS = 1e-10  # added to probabilities before the log, as in the reference


def topk_draft_tokens(logits: torch.Tensor, k: int, d2t: torch.Tensor | None = None):
    """Per-level candidates from head logits.

    logits [..., L, Vd] -> (tokens [..., L, K] target ids, probs [..., L, K] softmax over the K top values only).
    """
    if k > logits.shape[-1]:
        raise DartInputError(f"topk={k} is larger than the draft vocabulary ({logits.shape[-1]})")
    values, ids = torch.topk(logits.float(), k, dim=-1)
    if d2t is not None:
        ids = ids + d2t[ids]
    return ids, torch.softmax(values, dim=-1)


def build_draft_tree(topk_tokens: torch.Tensor, topk_probs: torch.Tensor, context, ngram=None,
                     config: TreeConfig | None = None, proposals: ContextProposals | None = None) -> DraftTree:
    """One draft tree from per-level candidates [L, K] (target ids and probs) and the context ending with the root;
    `proposals`: the row's context paths (`ContextProposals` of batch size 1), when context drafting is on."""
    if topk_tokens.dim() != 2:
        raise ValueError(f"topk_tokens must be [L, K], got {list(topk_tokens.shape)}")
    context = torch.as_tensor(context, dtype=torch.long, device=topk_tokens.device).reshape(-1)
    if context.numel() == 0:
        raise ValueError("context must hold at least the root token")
    batch = build_draft_trees(topk_tokens[None], topk_probs[None], context[None], ngram, config, context=proposals)
    return batch[0]


def build_draft_trees(topk_tokens: torch.Tensor, topk_probs: torch.Tensor, contexts: torch.Tensor, ngram=None,
                      config: TreeConfig | None = None, check_inputs: bool = True,
                      context: ContextProposals | None = None) -> DraftTreeBatch:
    """B draft trees at once, each with exactly min(remain_total, pool size) + 1 nodes.

    topk_tokens [B, L, K] int64 target ids, topk_probs [B, L, K] float, contexts [B, C] int64: the last C tokens of
    each sequence ending with the root token, left-padded with -1 where a sequence is shorter. The n-gram term uses
    the last `ngram.order - 1` tokens of context + path; `ngram=None` or `ngram_weight=0` drops it.
    `context`: the rows' own continuations (`dart_core.context.ContextDrafter.propose`, [B, P] on the same device),
    merged into the same node budget when `config.context_draft` is on (docs/DESIGN.md §2.6; ignored otherwise):
    the pool size is still the head's, so the node count does not change.
    `check_inputs=False` skips the value checks (they read back from the device); shapes are always checked.
    The operators run do not depend on the values: no host synchronisation.
    """
    cfg = config or TreeConfig()
    _check_search_shapes(topk_tokens, topk_probs, contexts, cfg)
    if context is not None and (not cfg.context_draft or context.width == 0):
        context = None
    if context is not None:
        _check_context_shapes(context, topk_tokens)
    if check_inputs:
        _check_search_values(topk_tokens, topk_probs, contexts)
        if context is not None:
            _check_context_values(context)
    b, levels, k = topk_tokens.shape
    device = topk_tokens.device
    use_ngram = ngram is not None and cfg.ngram_weight > 0
    plan = _search_plan(cfg, levels, k, device)
    f32 = dict(dtype=torch.float32, device=device)
    logit_term = torch.log(topk_probs.float() + LOG_EPS) * plan.logit_weights[:, None]  # [B, L, K]
    eos_penalty = None
    if cfg.eos_token_id is not None:
        # EOS extensions sort after every other one when the next beam is chosen
        eos_penalty = (topk_tokens == cfg.eos_token_id).to(torch.float64) * 1e6  # [B, L, K]

    beam_scores = torch.zeros(b, 1, **f32)  # [B, nb]
    beam_state = ngram.context_state(contexts)[:, None] if use_ngram else None  # [B, nb, S]
    beam_parents = [torch.full((b, 1), -1, dtype=torch.long, device=device)]  # per level: pool id of each beam
    pool_scores = []
    offset = 0
    for level in range(levels):
        nb = beam_scores.shape[1]
        tokens = topk_tokens[:, level]  # [B, K]
        term = logit_term[:, level, None, :]  # [B, 1, K]
        if use_ngram and level > 0:
            q = ngram.batch_probability(beam_state.reshape(b * nb, -1),
                                        tokens[:, None, :].expand(b, nb, k).reshape(b * nb, k), validate=False)
            term = term + torch.log(q.view(b, nb, k) + LOG_EPS) * cfg.ngram_weight
        # [B, nb*K], index = beam*K + token
        cand = (beam_scores[:, :, None] + plan.level_weights[level] * term).reshape(b, nb * k)
        pool_scores.append(cand)
        if level + 1 < levels:
            key = cand if eos_penalty is None else cand.double() - eos_penalty[:, level].repeat(1, nb)
            order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, : cfg.beam_width]  # [B, nb']
            beam_scores = torch.gather(cand, 1, order)
            if use_ngram:
                parent_state = torch.gather(beam_state, 1, (order // k)[..., None].expand(-1, -1, beam_state.shape[-1]))
                new_tok = torch.gather(tokens, 1, order % k)
                beam_state = ngram.advance_state(parent_state.reshape(-1, parent_state.shape[-1]),
                                                 new_tok.reshape(-1)).view(b, order.shape[1], -1)
            beam_parents.append(offset + order)
        offset += nb * k
    if context is not None:
        return _select_merged(torch.cat(pool_scores, dim=1), plan, beam_parents, topk_tokens, contexts[:, -1],
                              cfg.remain_total, context, cfg.context_path_depth())
    return _select_nodes(torch.cat(pool_scores, dim=1), plan, beam_parents, topk_tokens, contexts[:, -1],
                         cfg.remain_total)


@dataclasses.dataclass(frozen=True)
class _SearchPlan:
    """The search's constants for one (config, levels, K, device): made once, so the search itself creates no
    tensor from host data (a CUDA graph can capture it)."""

    level_weights: torch.Tensor  # [L] lw(l)
    logit_weights: torch.Tensor  # [L] ow(l)
    level_of: torch.Tensor  # [P] level of each pool entry
    level_start: torch.Tensor  # [L] first pool id of each level
    beam_start: torch.Tensor  # [L] first beam of each level in the concatenated beam parents
    token_index: torch.Tensor  # [P] each pool entry's token in the flattened [L*K] candidates
    beam_index: torch.Tensor  # [P] each pool entry's beam (its parent) in the concatenated beam parents
    beam_rank: torch.Tensor  # [sum of beams of levels 1..L-1] each beam's index within its level


def beams_per_level(cfg: TreeConfig, levels: int, k: int) -> list[int]:
    """Beams the search extends at each of `levels` levels with `k` candidates per beam: 1, then
    min(beam_width, previous * k)."""
    beams = [1]
    for _ in range(levels - 1):
        beams.append(min(cfg.beam_width, beams[-1] * k))
    return beams


def tree_node_count(cfg: TreeConfig, levels: int, k: int) -> int:
    """Nodes (root included) of every tree `build_draft_trees` builds over `levels` levels of `k` candidates:
    min(remain_total, pool size) + 1, the pool holding k candidates per beam and level."""
    return min(cfg.remain_total, sum(beams * k for beams in beams_per_level(cfg, levels, k))) + 1


@functools.cache  # never evicted: a captured CUDA graph of the search reads these tensors
def _search_plan(cfg: TreeConfig, levels: int, k: int, device: torch.device) -> _SearchPlan:
    beams = beams_per_level(cfg, levels, k)  # beams extended at each level
    f32 = dict(dtype=torch.float32, device=device)
    sizes = torch.tensor([nb * k for nb in beams], device=device)  # [L] pool entries of each level
    level_of = torch.repeat_interleave(torch.arange(levels, device=device), sizes)
    level_start = torch.cumsum(sizes, 0) - sizes
    beam_start = torch.tensor([0] + beams[:-1], device=device).cumsum(0)
    within = torch.arange(int(sizes.sum()), device=device) - level_start[level_of]
    return _SearchPlan(
        level_weights=torch.tensor([cfg.level_weight(level) for level in range(levels)], **f32),
        logit_weights=torch.tensor([cfg.logit_weight(level) for level in range(levels)], **f32),
        level_of=level_of,
        level_start=level_start,
        beam_start=beam_start,
        token_index=level_of * k + within % k,
        beam_index=beam_start[level_of] + within // k,
        beam_rank=torch.cat([torch.arange(nb, device=device) for nb in beams[1:]] or
                            [torch.zeros(0, dtype=torch.long, device=device)]),
    )


def _select_nodes(scores: torch.Tensor, plan: _SearchPlan, beam_parents: list[torch.Tensor],
                  topk_tokens: torch.Tensor, root: torch.Tensor, remain_total: int) -> DraftTreeBatch:
    """The best `remain_total` pool entries as a tree.

    scores [B, P] pool scores, level-major (entry j of level l = beam j // K of that level extended by token j % K);
    beam_parents[l] [B, nb_l] pool id of each beam of level l (-1 = root); root [B] root tokens.
    """
    b, p = scores.shape
    levels, k = topk_tokens.shape[1], topk_tokens.shape[2]
    device = scores.device
    level_of, level_start, beam_start = plan.level_of, plan.level_start, plan.beam_start
    r = min(remain_total, p)
    # stable sort: equal scores keep pool order, so a parent (earlier level) precedes an equal-scored child
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :r]  # [B, R]
    nodes = torch.gather(best, 1, torch.sort(level_of[best], dim=1, stable=True).indices)  # depth-major node order
    level = level_of[nodes]  # [B, R]
    within = nodes - level_start[level]
    tokens = torch.gather(topk_tokens.reshape(b, levels * k), 1, level * k + within % k)
    parent_pool = torch.gather(torch.cat(beam_parents, dim=1), 1, beam_start[level] + within // k)  # -1 = root
    node_of_pool = torch.zeros(b, p + 1, dtype=torch.long, device=device)  # slot 0 stands for the root
    node_of_pool.scatter_(1, nodes + 1, torch.arange(1, r + 1, device=device).expand(b, r))
    minus1 = torch.full((b, 1), -1, dtype=torch.long, device=device)
    return DraftTreeBatch(
        tokens=torch.cat((root[:, None], tokens), dim=1),
        parents=torch.cat((minus1, torch.gather(node_of_pool, 1, parent_pool + 1)), dim=1),
        depths=torch.cat((torch.zeros_like(minus1), level + 1), dim=1),
        scores=torch.cat((torch.zeros(b, 1, dtype=scores.dtype, device=device), torch.gather(scores, 1, nodes)), 1),
        valid=torch.ones(b, r + 1, dtype=torch.bool, device=device),
        sources=torch.cat((torch.zeros_like(minus1), torch.full_like(nodes, SOURCE_HEAD)), dim=1),
    )


def _select_merged(scores: torch.Tensor, plan: _SearchPlan, beam_parents: list[torch.Tensor],
                   topk_tokens: torch.Tensor, root: torch.Tensor, remain_total: int, context: ContextProposals,
                   max_context_depth: int) -> DraftTreeBatch:
    """`_select_nodes` over the head's pool merged with the context paths (docs/DESIGN.md §2.6).

    A context entry whose token path is a head pool entry's merges into it (score: the larger of the two; sources:
    the head's bit and the entry's); the others join the pool after the head's entries. The tree is the best min(remain_total, P) of the
    merged pool by score, ties by depth, then head entries before context entries, then pool order. Context entries
    deeper than `max_context_depth` are left out. Fixed operators, no host synchronisation."""
    b, p = scores.shape
    levels, k = topk_tokens.shape[1], topk_tokens.shape[2]
    device = scores.device
    long = dict(dtype=torch.long, device=device)
    c = context.width
    ctx_tokens, ctx_parents, ctx_depths = (t.to(device=device, dtype=torch.long) for t in context.tensors()[:3])
    ctx_sources = context.sources.to(device=device, dtype=torch.long)
    usable = (ctx_depths >= 1) & (ctx_depths <= max_context_depth)  # [B, C]
    ctx_scores = torch.where(usable, context.scores.to(device=device, dtype=scores.dtype), float("-inf"))

    # every head pool entry's token, parent (pool id, -1 = root) and depth
    head_tokens = topk_tokens.reshape(b, levels * k)[:, plan.token_index]  # [B, P]
    head_parents = torch.cat(beam_parents, dim=1)[:, plan.beam_index]  # [B, P]
    head_depths = (plan.level_of + 1).expand(b, p)
    # beam_of[e + 1]: the index among the next level's beams of pool entry e (-1: not extended); beam_of[0] = 0, the
    # root being the one beam of level 0
    beam_of = torch.full((b, p + 1), -1, **long)
    beam_of[:, 0] = 0
    if levels > 1:
        beam_of.scatter_(1, torch.cat(beam_parents[1:], dim=1) + 1, plan.beam_rank.expand(b, -1))

    # match[e]: the head pool entry with the same token path as context entry e (valid where `matched`)
    match = torch.zeros(b, c, **long)
    matched = torch.zeros(b, c, dtype=torch.bool, device=device)
    parent_at = ctx_parents.clamp(min=0)
    top = ctx_parents < 0
    for depth in range(1, min(levels, max_context_depth) + 1):
        parent_ok = top | torch.gather(matched, 1, parent_at)
        slot = torch.where(top, 0, torch.gather(match, 1, parent_at) + 1)
        beam = torch.gather(beam_of, 1, slot)  # [B, C] the beam the entry would extend at level depth - 1
        same = ctx_tokens[:, :, None] == topk_tokens[:, depth - 1, None, :]  # [B, C, K]
        hit = usable & (ctx_depths == depth) & parent_ok & (beam >= 0) & same.any(dim=-1)
        pool_id = plan.level_start[depth - 1] + beam.clamp(min=0) * k + same.to(torch.int32).argmax(dim=-1)
        match = torch.where(hit, pool_id, match)
        matched = matched | hit

    neg_inf = torch.full((b, p + 1), float("-inf"), dtype=scores.dtype, device=device)
    target = torch.where(matched, match + 1, 0)  # unmatched entries write -inf / False into slot 0
    lift = neg_inf.scatter(1, target, torch.where(matched, ctx_scores, float("-inf")))[:, 1:]
    lifted_sources = torch.zeros(b, p + 1, **long).scatter(1, target, torch.where(matched, ctx_sources, 0))[:, 1:]
    parent_matched = torch.gather(matched, 1, parent_at)
    ctx_pool_parents = torch.where(top, -1, torch.where(parent_matched, torch.gather(match, 1, parent_at),
                                                        p + ctx_parents))
    all_scores = torch.cat((torch.maximum(scores, lift), torch.where(matched, float("-inf"), ctx_scores)), dim=1)
    all_depths = torch.cat((head_depths, ctx_depths), dim=1)  # [B, P + C]
    all_tokens = torch.cat((head_tokens, ctx_tokens), dim=1)
    all_parents = torch.cat((head_parents, ctx_pool_parents), dim=1)
    all_sources = torch.cat((SOURCE_HEAD | lifted_sources, ctx_sources), dim=1)

    r = min(remain_total, p)  # the head's pool alone has p distinct paths: the count never depends on the context
    by_depth = torch.sort(all_depths, dim=1, stable=True).indices  # ties by depth, then pool order
    order = torch.sort(torch.gather(all_scores, 1, by_depth), dim=1, descending=True, stable=True).indices[:, :r]
    best = torch.gather(by_depth, 1, order)  # [B, R] in selection order
    nodes = torch.gather(best, 1, torch.sort(torch.gather(all_depths, 1, best), dim=1, stable=True).indices)
    node_of_pool = torch.zeros(b, p + c + 1, **long)  # slot 0 stands for the root
    node_of_pool.scatter_(1, nodes + 1, torch.arange(1, r + 1, device=device).expand(b, r))
    minus1 = torch.full((b, 1), -1, **long)
    zero = torch.zeros_like(minus1)
    return DraftTreeBatch(
        tokens=torch.cat((root[:, None], torch.gather(all_tokens, 1, nodes)), dim=1),
        parents=torch.cat((minus1, torch.gather(node_of_pool, 1, torch.gather(all_parents, 1, nodes) + 1)), dim=1),
        depths=torch.cat((zero, torch.gather(all_depths, 1, nodes)), dim=1),
        scores=torch.cat((torch.zeros(b, 1, dtype=scores.dtype, device=device), torch.gather(all_scores, 1, nodes)),
                         dim=1),
        valid=torch.ones(b, r + 1, dtype=torch.bool, device=device),
        sources=torch.cat((zero, torch.gather(all_sources, 1, nodes)), dim=1),
    )


def proposal_trees(context: ContextProposals, roots: torch.Tensor, remain_total: int,
                   max_depth: int) -> DraftTreeBatch:
    """B draft trees from proposed paths alone (model-free drafting, docs/DESIGN.md §2.7): per row the best
    min(remain_total, its usable entries) entries by score, shallower first on ties, then entry order; entries deeper
    than `max_depth` are left out. N = 1 + the most any row keeps (rows with fewer nodes are padded; a batch where
    nothing is proposed gives the roots alone). context [B, P] on the roots' device, roots [B]. Reads the entry
    counts back to the host (the node count depends on them)."""
    b, device = roots.shape[0], roots.device
    long = dict(dtype=torch.long, device=device)
    tokens, parents, depths, scores, sources = (t.to(device) for t in context.tensors())
    usable = (depths >= 1) & (depths <= max_depth) & torch.isfinite(scores)  # [B, P]
    r = min(remain_total, int(usable.sum(dim=1).max())) if context.width else 0
    minus1 = torch.full((b, 1), -1, **long)
    if r == 0:
        return DraftTreeBatch(roots[:, None], minus1, torch.zeros_like(minus1), torch.zeros(b, 1, device=device),
                              torch.ones(b, 1, dtype=torch.bool, device=device))
    depth_key = torch.where(usable, depths, MAX_TREE_DEPTH_KEY)  # unusable entries after every usable one
    by_depth = torch.sort(depth_key, dim=1, stable=True).indices
    ranked = torch.where(usable, scores.float(), float("-inf"))
    order = torch.sort(torch.gather(ranked, 1, by_depth), dim=1, descending=True, stable=True).indices[:, :r]
    best = torch.gather(by_depth, 1, order)  # [B, R] in selection order
    nodes = torch.gather(best, 1, torch.sort(torch.gather(depth_key, 1, best), dim=1, stable=True).indices)
    valid = torch.gather(usable, 1, nodes)  # [B, R]: a row with fewer entries ends in padding
    node_of_entry = torch.zeros(b, context.width + 1, **long)  # slot 0 stands for the root
    node_of_entry.scatter_(1, nodes + 1, torch.arange(1, r + 1, device=device).expand(b, r))
    new_parents = torch.gather(node_of_entry, 1, torch.gather(parents, 1, nodes) + 1)
    true = torch.ones(b, 1, dtype=torch.bool, device=device)
    return DraftTreeBatch(
        tokens=torch.cat((roots[:, None], torch.where(valid, torch.gather(tokens, 1, nodes), 0)), dim=1),
        parents=torch.cat((minus1, torch.where(valid, new_parents, -1)), dim=1),
        depths=torch.cat((torch.zeros_like(minus1), torch.where(valid, torch.gather(depths, 1, nodes), 0)), dim=1),
        scores=torch.cat((torch.zeros(b, 1, device=device),
                          torch.where(valid, torch.gather(scores.float(), 1, nodes), float("-inf"))), dim=1),
        valid=torch.cat((true, valid), dim=1),
        sources=torch.cat((torch.zeros_like(minus1), torch.where(valid, torch.gather(sources, 1, nodes), 0)), dim=1),
    )


MAX_TREE_DEPTH_KEY = 1 << 30  # sorts after every real depth


def _check_context_shapes(context: ContextProposals, tokens: torch.Tensor) -> None:
    shape = tuple(context.tokens.shape)
    if len(shape) != 2 or shape[0] != tokens.shape[0]:
        raise ValueError(f"context proposals must be [B={tokens.shape[0]}, P], got {list(shape)}")
    if any(tuple(t.shape) != shape for t in context.tensors()):
        raise ValueError(f"context proposals' fields must share one shape {list(shape)}, got "
                         f"{[list(t.shape) for t in context.tensors()]}")
    if any(t.device != tokens.device for t in context.tensors()):
        raise ValueError(f"context proposals must be on the candidates' device {tokens.device}")


def _check_context_values(context: ContextProposals) -> None:
    tokens, parents, depths = context.tokens, context.parents, context.depths
    used = depths > 0
    index = torch.arange(context.width, device=tokens.device)
    if bool((used & (tokens < 0)).any()):
        raise ValueError("context proposals hold negative token ids")
    if bool((used & (parents >= index)).any()):
        raise ValueError("context proposals: every parent must precede its child")
    parent_depth = torch.where(parents >= 0, torch.gather(depths, 1, parents.clamp(min=0)), 0)
    if bool((used & (depths != parent_depth + 1)).any()):
        raise ValueError("context proposals: a depth is not its parent's depth + 1")


def _check_search_shapes(tokens: torch.Tensor, probs: torch.Tensor, contexts: torch.Tensor, cfg: TreeConfig) -> None:
    if tokens.dim() != 3:
        raise ValueError(f"topk_tokens must be [B, L, K], got {list(tokens.shape)}")
    if tuple(probs.shape) != tuple(tokens.shape):
        raise ValueError(f"topk_probs shape {list(probs.shape)} != topk_tokens shape {list(tokens.shape)}")
    if tokens.dtype not in (torch.long, torch.int32) or not probs.is_floating_point():
        raise ValueError(f"topk_tokens must be integer and topk_probs float, got {tokens.dtype} and {probs.dtype}")
    if tokens.shape[1] == 0 or tokens.shape[2] == 0:
        raise ValueError(f"need at least one level and one candidate, got {list(tokens.shape)}")
    if contexts.dim() != 2 or contexts.shape[0] != tokens.shape[0] or contexts.shape[1] == 0:
        raise ValueError(f"contexts must be [B={tokens.shape[0]}, C>=1], got {list(contexts.shape)}")
    if cfg.topk != tokens.shape[2]:
        raise ValueError(f"TreeConfig.topk={cfg.topk} but the candidates have K={tokens.shape[2]} per level")


def _check_search_values(tokens: torch.Tensor, probs: torch.Tensor, contexts: torch.Tensor) -> None:
    if bool((tokens < 0).any()):
        raise ValueError(f"topk_tokens hold negative token ids (min {int(tokens.min())})")
    if not bool((torch.isfinite(probs) & (probs >= 0)).all()):
        raise ValueError("topk_probs must be probabilities (finite, >= 0); got NaN or negative values")
    if bool((contexts[:, -1] < 0).any()):
        raise ValueError("the last context column must be the root token of every row (got -1 padding there)")


def score_ranks(scores: torch.Tensor, nodes: torch.Tensor | None = None) -> torch.Tensor:
    """Selection rank of draft nodes: their 0-based position among the tree's draft nodes (root excluded) sorted by
    score descending, ties by node order.

    This is the order in which `build_draft_trees` keeps pool entries (stable sort by score; equal scores keep pool
    order, which node order preserves: depth-major, and within a depth by that same sort). So the tree built with
    `remain_total=R` from the same candidates holds exactly the nodes of rank < R, and ranks increase from a node to
    its children (scores never increase along a path; a tied child comes after its parent).

    scores [..., N] node scores (node 0 = root); nodes [..., a] node indices >= 1 (default: every draft node)
    -> [..., a] int64.
    """
    n = scores.shape[-1]
    draft = scores[..., None, 1:]  # [..., 1, N-1]
    index = torch.arange(1, n, device=scores.device)
    if nodes is None:
        nodes = index.expand(*scores.shape[:-1], n - 1)
    nodes = nodes.to(scores.device)
    own = scores.gather(-1, nodes)[..., None]  # [..., a, 1]
    before = (draft > own) | ((draft == own) & (index < nodes[..., None]))  # [..., a, N-1]
    return before.sum(dim=-1)
