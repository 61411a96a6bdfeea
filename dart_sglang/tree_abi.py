"""DART draft trees -> EAGLE's tree ABI (the inputs of SGLang's `build_tree_kernel_efficient`). Pure torch.

EAGLE describes the non-root nodes of a tree by `top_scores_index` [N-1] (one "selected index" per node) and
`parent_list` [K*(L-1)+1]: node i's parent is the root when `top_scores_index[i-1] // K == 0`, else the node whose
selected index equals `parent_list[top_scores_index[i-1] // K]`. Any tree whose nodes have at most K children
and that has at most K*(L-1) internal non-root nodes fits: each internal node gets its own row r >= 1, its
children the selected indices r*K + rank.
"""

from __future__ import annotations

import torch

from dart_core.tree import DraftTreeBatch


def encode_eagle_trees(trees: DraftTreeBatch, topk: int, num_levels: int):
    """B trees of N nodes each (all valid) -> (parent_list [B, topk*(L-1)+1], top_scores_index [B, N-1],
    draft_tokens [B, N-1]) int64, on the trees' device. Unused parent rows hold -1."""
    if not bool(trees.valid.all()):
        raise ValueError("every tree must have the same number of nodes (no padding) to share one EAGLE tree width")
    b, n = trees.tokens.shape
    width = topk * max(num_levels - 1, 0) + 1
    parents, depths = trees.parents.tolist(), trees.depths.tolist()
    parent_list = [[-1] * width for _ in range(b)]
    selected = [[0] * (n - 1) for _ in range(b)]
    for row in range(b):
        if max(depths[row]) > num_levels:
            raise ValueError(f"tree {row} is {max(depths[row])} levels deep, more than num_levels={num_levels}")
        parent_row = {0: 0}  # node -> its row in parent_list (the root's children use row 0)
        children = [0] * n
        for node in range(1, n):
            parent = parents[row][node]
            if parent not in parent_row:
                parent_row[parent] = len(parent_row)
                if parent_row[parent] >= width:
                    raise ValueError(f"tree {row} has more internal nodes than topk * (num_levels - 1) = {width - 1}")
                parent_list[row][parent_row[parent]] = selected[row][parent - 1]
            if children[parent] >= topk:
                raise ValueError(f"tree {row}: node {parent} has more than topk={topk} children")
            selected[row][node - 1] = parent_row[parent] * topk + children[parent]
            children[parent] += 1
    device = trees.tokens.device
    as_long = dict(dtype=torch.long, device=device)
    return torch.tensor(parent_list, **as_long), torch.tensor(selected, **as_long), trees.tokens[:, 1:].clone()
