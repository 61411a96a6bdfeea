"""Choosing each tree node's token as the plain server chooses the next token (no SGLang import: pure torch).

SGLang's EAGLE verify applies "a relaxed version of penalties for speculative decoding": every node of a tree gets
the penalties of the request's state before the tree, and that state counts only the last token of each verify
step. DART serves the plain server's output, so each node here is penalised for its own prefix: the request's output
so far plus the node's ancestors in the tree (`node_penalties`), with the plain server's frequency, presence,
repetition and min-new-tokens rules. Sampling (`sample_nodes`) is the server's adapter for choosing a node's token
in DART's one verification rule (`dart_core.verify`, docs/DESIGN.md §2.5): one draw per node from the target's
processed distribution (temperature, then the plain server's top-k / top-p / min-p), walked by SGLang's greedy tree
kernel as it walks argmaxes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Optional, Sequence

import torch


def tree_parents(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Each node's parent (-1 for the root) from EAGLE's retrieve arrays: next_token [B, Q] (first child, -1: none)
    and next_sibling [B, Q] (next child of the same parent, -1: none) -> parents [B, Q] int64."""
    first, sibling = next_token.tolist(), next_sibling.tolist()
    out = []
    for children_of, siblings in zip(first, sibling):
        parents = [-1] * len(children_of)
        for node, child in enumerate(children_of):
            while child != -1:
                parents[child] = node
                child = siblings[child]
        out.append(parents)
    return torch.tensor(out, dtype=torch.long)


@dataclasses.dataclass(frozen=True)
class Penalties:
    """One request's penalty settings as the plain server applies them, in the order its penalizers run."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_ids: frozenset = frozenset()  # what min_new_tokens forbids before the minimum
    order: tuple = ("frequency", "min_new_tokens", "presence", "repetition")

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.min_new_tokens > 0)


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens of `node` and its ancestors, the root excluded (its token is already the request's last)."""
    out = []
    while parents[node] != -1:
        out.append(tokens[node])
        node = parents[node]
    return out


def node_penalties(logits: torch.Tensor, outputs: Sequence[Sequence[int]], penalties: Sequence[Penalties],
                   tokens: torch.Tensor, parents: torch.Tensor) -> None:
    """Penalise, in place, the target logits [B*Q, V] of B trees of Q nodes for each node's own prefix.

    outputs[b]: request b's output tokens so far (its tree's root, the last of them, included); tokens / parents
    [B, Q]: each node's token and parent. A node at depth d counts outputs[b] plus the d tokens of its path; the rules
    are the plain server's: logits -= frequency * count, -= presence for counted tokens, repetition divides
    positive / multiplies negative logits of counted tokens, and min_new_tokens forbids the stop ids while fewer
    than that many tokens precede the predicted one."""
    b, q = tokens.shape
    tokens_l, parents_l = tokens.tolist(), parents.tolist()
    for row in range(b):
        rule = penalties[row]
        if not rule.active:
            continue
        base = Counter(outputs[row])
        for node in range(q):
            path = path_tokens(tokens_l[row], parents_l[row], node)
            counts = base + Counter(path)
            _penalise(logits[row * q + node], counts, len(outputs[row]) + len(path), rule)


def _penalise(logits: torch.Tensor, counts: Counter, produced: int, rule: Penalties) -> None:
    """One node's logits [V], the token counts of its prefix's output and the number of output tokens before the
    one it predicts."""
    tokens = sorted(counts)
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    for name in rule.order:
        if name == "frequency" and rule.frequency and ids.numel():
            n = torch.tensor([counts[i] for i in tokens], dtype=logits.dtype, device=logits.device)
            logits.index_add_(0, ids, -rule.frequency * n)
        elif name == "presence" and rule.presence and ids.numel():
            logits.index_add_(0, ids, torch.full((ids.numel(),), -rule.presence, dtype=logits.dtype,
                                                 device=logits.device))
        elif name == "repetition" and rule.repetition != 1.0 and ids.numel():
            picked = logits[ids]
            logits[ids] = torch.where(picked < 0, picked * rule.repetition, picked / rule.repetition)
        elif name == "min_new_tokens" and produced < rule.min_new_tokens and rule.stop_ids:
            stop = torch.tensor(sorted(rule.stop_ids), dtype=torch.long, device=logits.device)
            logits[stop[stop < logits.shape[0]]] = float("-inf")


def sample_nodes(logits: torch.Tensor, q: int, temperatures: torch.Tensor, top_ks: torch.Tensor,
                 top_ps: torch.Tensor, min_ps: torch.Tensor, need_min_p: bool, sample_fn,
                 seeds: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One draw per node from the plain server's sampling distribution: logits [B*Q, V] (penalised, masked), the
    per-request temperatures [B, 1], top_ks / top_ps / min_ps [B] (each request's, repeated over its Q nodes) ->
    [B*Q] token ids. `sample_fn` is the server's top-k / top-p / min-p sampler over probabilities (SGLang's
    `top_k_top_p_min_p_sampling_from_probs_torch`); `seeds` / `positions` [B*Q] its deterministic-sampling inputs."""
    def repeat(x):
        return None if x is None else torch.repeat_interleave(x, q, dim=0)

    probs = torch.softmax(logits / repeat(temperatures).view(-1, 1), dim=-1)
    return sample_fn(probs, repeat(top_ks), repeat(top_ps), repeat(min_ps), need_min_p, seeds, positions).long()
