"""DART serving settings read from an SGLang-flavour head directory (`dart_sglang.head_format`), and the SGLang
speculative arguments they imply. Pure Python: no SGLang import."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from dart_core.config import TreeConfig
from dart_core.tree import tree_node_count

from .head_format import read_sglang_dir


@dataclasses.dataclass(frozen=True)
class DartServeSettings:
    """What the DART worker needs from the head directory, and the EAGLE tree ABI sizes it implies.

    num_levels        deepest tree level (= `--speculative-num-steps`): `tree.tree_depth(D+1)`, at most N-1
    head_levels       levels of head candidates the search reads: `tree.draft_levels(D+1)` (= num_levels unless
                      context paths reach deeper, docs/DESIGN.md §2.6)
    topk              children rank range of the EAGLE encoding (= `--speculative-eagle-topk`)
    num_draft_tokens  nodes per tree including the root (= `--speculative-num-draft-tokens`)
    """

    tree: TreeConfig
    draft_length: int
    num_levels: int
    topk: int
    num_draft_tokens: int
    ngram_path: Optional[str]
    head_levels: int

    @classmethod
    def from_draft_dir(cls, path: str | os.PathLike) -> "DartServeSettings":
        """The settings of an SGLang-flavour head directory, checked (`head_format.read_sglang_dir`)."""
        config, tree, ngram_path = read_sglang_dir(path)
        return cls.for_tree(tree, config.draft_length, ngram_path)

    @classmethod
    def for_tree(cls, tree: TreeConfig, draft_length: int, ngram_path: Optional[str] = None) -> "DartServeSettings":
        levels = tree.draft_levels(draft_length + 1)
        nodes = tree_node_count(tree, levels, tree.topk)  # the worker's candidates are `topk` wide
        depth = tree.tree_depth(draft_length + 1)  # context paths may reach deeper than the head's levels
        return cls(tree, draft_length, depth, eagle_topk(tree, depth, nodes), nodes, ngram_path, levels)

    def server_args(self) -> dict:
        """The `--speculative-*` values SGLang must run with for these trees."""
        return {"speculative_num_steps": self.num_levels, "speculative_eagle_topk": self.topk,
                "speculative_num_draft_tokens": self.num_draft_tokens}


def eagle_topk(tree: TreeConfig, levels: int, nodes: int) -> int:
    """Smallest child-rank range K for which every tree fits EAGLE's ABI: a node has at most min(topk, nodes - 1)
    children (topk + context_matches with context paths: each followed occurrence may add one), and the internal
    non-root nodes (at most nodes - 2) need K * (levels - 1) parent rows."""
    children = min(tree.topk + (tree.context_matches if tree.context_draft else 0), nodes - 1)
    if levels <= 1:
        return max(children, 1)
    return max(children, math.ceil(max(nodes - 2, 0) / (levels - 1)), 1)
