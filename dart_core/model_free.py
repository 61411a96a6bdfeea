"""Model-free drafting (docs/DESIGN.md §2.7): draft trees from the row's own context, earlier calls' outputs and an
optional n-gram table, for any target, with no weights and no hidden states."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from dart_core.config import TreeConfig
from dart_core.context import ContextDrafter, ContextProposals
from dart_core.drafter import Drafter
from dart_core.errors import DartInputError
from dart_core.tree import DraftTreeBatch, proposal_trees

# the default search settings: deeper paths than a head's context source (a copy can run long), in at most 32 nodes
DEFAULT_TREE = TreeConfig(remain_total=32, context_depth=32, context_matches=4, context_min_match=2,
                          context_max_match=4)


class RowState:
    """A model-free drafter's per-row state: none beyond the row count (`lengths` [B] zeros)."""

    def __init__(self, batch_size: int) -> None:
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths[rows.cpu()]


class ModelFreeDrafter(Drafter):
    """Draft trees with no head (docs/DESIGN.md §2.7): each row's own context and an `OutputStore` of earlier outputs
    matched by suffix, and where neither matches, `ngram`'s likeliest continuations; the best `remain_total` nodes of
    those paths by one score. `ngram`: an `NGramModel` for the target's tokenizer (optional); `tree_config`: the
    search settings (default `DEFAULT_TREE`; `context_draft` must stay on)."""

    reads_hidden_states = False
    fills_tree = False

    def __init__(self, ngram=None, tree_config: Optional[TreeConfig] = None) -> None:
        super().__init__()
        from dart_core.ngram import NGramModel

        if ngram is not None and not isinstance(ngram, NGramModel):
            raise TypeError(f"ngram must be a dart_core.NGramModel, got {type(ngram).__name__}")
        check_model_free_tree(tree_config)
        self.ngram, self.tree_config = ngram, tree_config

    def extra_repr(self) -> str:
        return f"ngram={self.ngram!r}, tree_config={self.tree_config!r}"

    @property
    def draft_length(self) -> int:
        return 0

    def identity(self) -> dict:
        return {"kind": "model-free"}

    def default_tree_config(self, eos_token_id: Optional[int]) -> TreeConfig:
        return dataclasses.replace(DEFAULT_TREE, eos_token_id=eos_token_id)

    def new_cache(self, batch_size: int) -> RowState:
        return RowState(batch_size)

    def context_drafter(self, rows: Sequence, tree_config: TreeConfig, store, ngram) -> ContextDrafter:
        return ContextDrafter(rows, tree_config, store, ngram)

    def draft(self, aux_rows, new_ids, lengths, cache, tree_config: TreeConfig, cuda_graph: bool = False) -> None:
        """No drafting pass: every path comes from the rows' proposals."""
        return None

    def build_tree(self, candidates, contexts: torch.Tensor, ngram, tree_config: TreeConfig,
                   context: Optional[ContextProposals] = None) -> DraftTreeBatch:
        """The rows' proposed paths as trees (`dart_core.tree.proposal_trees`); `contexts` [B, C] end with the
        roots."""
        if context is None:
            context = ContextProposals.pack([[] for _ in range(contexts.shape[0])], 0, contexts.device)
        return proposal_trees(context, contexts[:, -1], tree_config.remain_total, tree_config.context_path_depth())


def check_model_free_tree(tree_config: Optional[TreeConfig]) -> None:
    """Tree settings a model-free drafter can draft with: context drafting on (its only source of paths)."""
    if tree_config is not None and not isinstance(tree_config, TreeConfig):
        raise TypeError(f"tree_config must be a dart_core.TreeConfig, got {type(tree_config).__name__}")
    if tree_config is not None and not tree_config.context_draft:
        raise DartInputError("model-free drafting proposes paths from the context alone: its tree settings need "
                             "context_draft=True")


__all__ = ["DEFAULT_TREE", "ModelFreeDrafter", "check_model_free_tree"]
