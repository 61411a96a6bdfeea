"""dart_core: the DART decisions shared by every integration — draft head, n-gram prior, tree search, verification.

Pure torch/numpy; no transformers or sglang imports.
"""

from dart_core.config import AcceptanceCurve, DartConfig, TreeConfig, default_target_layer_ids
from dart_core.context import ContextDrafter, ContextProposals
from dart_core.drafter import Drafter
from dart_core.eagle3 import Eagle3Head
from dart_core.errors import DartInputError
from dart_core.head import DartHead, DartHeadCache
from dart_core.model_free import ModelFreeDrafter
from dart_core.ngram import NGramModel, draft_context_length
from dart_core.store import OutputStore
from dart_core.tree import DraftTree, DraftTreeBatch, build_draft_tree, build_draft_trees, topk_draft_tokens
from dart_core.verify import VerifyResult, accept_chosen, verify_greedy, verify_sampled, verify_tree

__all__ = [
    "AcceptanceCurve",
    "ContextDrafter",
    "ContextProposals",
    "draft_context_length",
    "DartConfig",
    "DartHead",
    "DartHeadCache",
    "DartInputError",
    "DraftTree",
    "Drafter",
    "DraftTreeBatch",
    "Eagle3Head",
    "ModelFreeDrafter",
    "NGramModel",
    "OutputStore",
    "TreeConfig",
    "VerifyResult",
    "accept_chosen",
    "build_draft_tree",
    "build_draft_trees",
    "default_target_layer_ids",
    "topk_draft_tokens",
    "verify_greedy",
    "verify_sampled",
    "verify_tree",
]
__version__ = "0.1.0"
