"""The drafter interface (docs/DESIGN.md §1.2): what decoding, calibration and the speed controller call to draft a
step's trees, whatever proposes them (a DART head, the EAGLE3-style baseline, or model-free drafting)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from dart_core.config import AcceptanceCurve, TreeConfig
from dart_core.context import ContextDrafter, ContextProposals

if TYPE_CHECKING:
    from dart_core.ngram import NGramModel
    from dart_core.store import OutputStore
    from dart_core.tree import DraftTreeBatch


class Drafter(nn.Module):
    """A source of draft trees. A module (it moves with `.to()`, pickles with an enabled model, and is keyed by
    identity), with these settings and methods:

    - `reads_hidden_states`: whether `draft` reads the target's hidden states (a head); without them the loop asks
      the target for none and passes empty rows ([B, T, 0]).
    - `fills_tree`: whether every tree it builds holds its budget's `remain_total` nodes (a head's beam search: a
      larger budget is a larger verify forward), so that the speed controller starts it with small trees; a drafter
      whose trees hold only what it proposes starts at its budget.
    - `draft_length`: the levels beyond the first a `draft` pass predicts (0: none).
    - `ngram`, `tree_config`, `acceptance`: the n-gram table, tree settings and acceptance curve it travels with.
    - `max_batch_size`: how many sequences one `draft` call takes (None: any).
    """

    DRAFTS_WITH_CONTEXT = True  # `build_tree` takes the rows' proposed paths (docs/DESIGN.md §2.6)
    reads_hidden_states = True
    fills_tree = True
    max_batch_size: Optional[int] = None

    def __init__(self) -> None:
        super().__init__()
        self.ngram: Optional["NGramModel"] = None
        self.tree_config: Optional[TreeConfig] = None
        self.acceptance: Optional[AcceptanceCurve] = None
        self.cuda_graphs: dict = {}  # the decoding loop's CUDA-graphed step parts, kept with the drafter

    @property
    def draft_length(self) -> int:
        raise NotImplementedError

    def identity(self) -> dict:
        """What tells this drafter's learned speed estimates apart from another's (JSON values)."""
        raise NotImplementedError

    def default_tree_config(self, eos_token_id: Optional[int]) -> TreeConfig:
        """The tree settings used when neither the caller nor the drafter's directory gives any."""
        return TreeConfig(eos_token_id=eos_token_id)

    def new_cache(self, batch_size: int):
        """The drafter's per-row state for a decoding batch (`lengths` [B], `select_rows(rows)`)."""
        raise NotImplementedError

    def context_drafter(self, rows: Sequence, tree_config: TreeConfig, store: Optional["OutputStore"],
                        ngram: Optional["NGramModel"]) -> ContextDrafter:
        """The rows' proposed paths for `build_tree` (docs/DESIGN.md §2.6-2.7): their own context and the store's;
        a head uses `ngram` as its search prior, not as a source of paths."""
        return ContextDrafter(rows, tree_config, store)

    def draft(self, aux_rows: torch.Tensor, new_ids: torch.Tensor, lengths: Optional[torch.Tensor], cache,
              tree_config: TreeConfig, cuda_graph: bool = False):
        """One drafting pass over the new rows of B sequences -> the candidates `build_tree` takes."""
        raise NotImplementedError

    def build_tree(self, candidates, contexts: torch.Tensor, ngram, tree_config: TreeConfig,
                   context: Optional[ContextProposals] = None) -> "DraftTreeBatch":
        """The B draft trees of one step; `contexts` [B, C] end with the roots."""
        raise NotImplementedError


__all__ = ["Drafter"]
