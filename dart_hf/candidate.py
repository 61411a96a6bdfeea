"""`DartCandidateGenerator`: DART as a transformers `CandidateGenerator` for the stock assisted-decoding loop."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from dart_core import DartHead, draft_context_length
from dart_runtime.timing import now
from dart_hf.loop import DartStats
from dart_hf.target import plan_for, tapped_hidden_states, tree_settings


class DartCandidateGenerator(CandidateGenerator):
    """Drafts the best full-depth path of the drafter's tree as a linear chain.

    transformers' assisted loop verifies one chain per step (batch size 1), so this route accepts fewer tokens per
    step than `generate(dart_head=...)`, which verifies the whole tree; it exists for code that goes through the
    stock loop (`assistant_model=head`). The target's hidden states at the taps arrive through
    `requires_model_outputs` / `model_kwargs_overrides`.
    """

    requires_model_outputs = True

    def __init__(self, model, head: DartHead, generation_config) -> None:
        self.plan = plan_for(model, head)
        self.head = head
        self.ngram = head.ngram
        self.tree_config = tree_settings(head, generation_config)
        self.max_length = generation_config.max_length
        # keep every hidden state when the user asked for them (a layer list would leave None holes in the output)
        wanted = True if generation_config.output_hidden_states else list(self.plan.layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.context_len = draft_context_length(self.ngram)
        self.head_cache = None
        self.rows = 0  # sequence positions whose hidden states the head has consumed
        self.stats = DartStats()

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0):
        """input_ids [1, L] -> (input_ids + chain [1, L+k], None); k = 0 on the first call (the target prefills)."""
        if is_first_iteration:
            self.head_cache, self.rows = self.head.new_cache(1), 0
            self.stats.prompt_tokens = int(input_ids.shape[1])
            return input_ids, None
        cur = input_ids.shape[1]
        # the last target forward started at position `rows`; its first cur-1-rows positions are now final
        new_rows = cur - 1 - self.rows
        aux = tapped_hidden_states(model_outputs, self.plan.layer_ids)[:, :new_rows]
        t0 = now()
        candidates = self.head.draft(aux, input_ids[:, self.rows + 1 : cur], None, self.head_cache,
                                     self.tree_config)
        t1 = now()
        self.rows = cur - 1
        tree = self.head.build_tree(candidates, input_ids[:, -self.context_len:], self.ngram, self.tree_config)[0]
        chain = best_full_depth_path(tree.tokens, tree.parents, tree.depths, tree.scores)
        self.stats.head_time += t1 - t0
        self.stats.tree_time += now() - t1
        budget = self.max_length - cur - 1
        if budget <= 0:
            return input_ids, None
        chain = chain[:budget].to(input_ids.device)
        return torch.cat((input_ids, chain[None]), dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self.stats.accepted_lengths.append(int(num_matches))


def best_full_depth_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                         scores: torch.Tensor) -> torch.Tensor:
    """Tokens [d] of the root-to-node path (root excluded) to the best-scoring node among the deepest ones."""
    deepest = depths == depths.max()
    node = int(torch.where(deepest, scores, torch.finfo(scores.dtype).min).argmax())
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return torch.tensor(path[::-1], dtype=torch.long)
