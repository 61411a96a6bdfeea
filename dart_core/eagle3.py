"""The EAGLE3-style baseline drafter: DART's one-layer head without mask rows, drafting one level per forward.

Where a DART head predicts D+1 positions in one forward (mask rows), this drafter feeds its own output back:

- step 0 (`Eagle3Head.forward`): the real rows exactly as in `DartHead` (input cat(input_layernorm(embed(x[p+1])),
  hidden_norm(fc(aux[p]))), residual fc(aux[p]), causal attention, cached); the last real row's output `h` gives the
  logits for the first draft level.
- step j >= 1 (`Eagle3Head.chain_rows`): a row for a drafted token y with the output `h` of the row that predicted
  it: input cat(input_layernorm(embed(y)), hidden_norm(h)), residual h, RoPE position one past its parent's. It sees
  the cached real rows, the rows of its own ancestors and itself; it is never cached.

`draft_candidates` + `select_draft_tree` build an EAGLE-2/3 dynamic tree from that (`TreeConfig.topk` = branching
and beam per level, `TreeConfig.remain_total` = draft nodes kept, `TreeConfig.max_depth` levels, default D+1); the result is a `DraftTree` that the
same verification as DART's consumes. Training (`Eagle3Head.training_forward`) unrolls the same D+1
steps with the teacher's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from dart_core.config import DartConfig, TreeConfig
from dart_core import head_math
from dart_core.head import EAGLE3_ARCHITECTURE, DartHead, DartHeadCache
from dart_core.tree import DraftTree, DraftTreeBatch


class Eagle3Head(DartHead):
    """EAGLE3-style drafter with DartHead's weights minus `midlayer.mask_rep` (module docstring).

    `head(aux, shifted_ids, cache)` returns (logits [B, Vd], hidden [B, H]) of the last real row.
    """

    ARCHITECTURE = EAGLE3_ARCHITECTURE

    def __init__(self, config: DartConfig) -> None:
        super().__init__(config)
        del self.midlayer.mask_rep

    @classmethod
    def from_dart_head(cls, head: DartHead) -> "Eagle3Head":
        """A drafter starting from a DART head's weights (the mask rows dropped), on its device and dtype, sharing
        its embedding table; tree settings are this drafter's defaults (with the head's EOS), no n-gram."""
        out = cls(head.config)
        state = {k: v for k, v in head.state_dict().items() if k != "midlayer.mask_rep"}
        out.load_state_dict(state, strict=True)
        out.to(device=head.fc.weight.device, dtype=head.fc.weight.dtype)
        if head.get_input_embeddings() is not None:
            out.set_input_embeddings(head.get_input_embeddings(), save_with_head=head._embedding_from_checkpoint)
        out.tree_config = out.default_tree_config(head.tree_config.eos_token_id if head.tree_config else None)
        return out

    def default_tree_config(self, eos_token_id: Optional[int]) -> TreeConfig:
        """EAGLE-2/3's defaults: 10 children per expanded node and a beam of 10, 60 draft nodes kept."""
        return TreeConfig(topk=10, remain_total=60, eos_token_id=eos_token_id)

    @property
    def num_levels(self) -> int:
        """Draft levels (= forwards per draft): D+1, the positions a DART head of the same config predicts."""
        return self.config.draft_length + 1

    # ---- step 0: real rows ----------------------------------------------------------------------------------
    def real_rows(self, aux_hidden: torch.Tensor, shifted_ids: torch.Tensor, cache: Optional[DartHeadCache] = None,
                  lengths: Optional[torch.Tensor] = None):
        """aux [B, T, 3Ht], ids [B, T] -> (h [B, T, H] layer outputs, k/v [B, kv, T, hd], lengths [B]) of every
        real row (not cached here)."""
        self._check_inputs(aux_hidden, shifted_ids, cache, lengths)
        lengths = self._lengths(shifted_ids, lengths)
        parts = self.parts()
        x, residual = head_math.real_inputs(parts, aux_hidden, shifted_ids)  # [B, T, 2H], [B, T, H]
        h, k, v = head_math.attend_new_rows(parts, x, residual, lengths, *self._past(cache, aux_hidden), 0)
        return head_math.finish(parts, h), k, v, lengths

    def forward(self, aux_hidden: torch.Tensor, shifted_ids: torch.Tensor, cache: Optional[DartHeadCache] = None,
                lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0: -> (logits [B, Vd], hidden [B, H]) of each batch row's last real row; real rows join `cache`."""
        h, k, v, lengths = self.real_rows(aux_hidden, shifted_ids, cache, lengths)
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]  # [B, H]
        if cache is not None:
            cache.append(k, v, lengths)
        return self.logits(last), last

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer outputs [..., H] -> draft-vocab logits [..., Vd] (the reference's double final norm)."""
        return head_math.logits(self.parts(), hidden)

    # ---- steps >= 1: chain rows -----------------------------------------------------------------------------
    def chain_rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   context_keys: torch.Tensor, context_values: torch.Tensor, context_visible: torch.Tensor):
        """One autoregressive step for K rows.

        tokens [B, K] target ids, hidden [B, K, H] outputs of the rows that predicted them, positions [B, K];
        context k/v [B, kv, S, hd] of earlier rows with context_visible [B, K, S] bool; each new row also sees
        itself (and no other new row). -> (hidden [B, K, H], k/v [B, kv, K, hd]).
        """
        hidden = hidden.to(self.fc.weight.dtype)
        q, k, v = self._chain_qkv(tokens, hidden, positions)
        see = torch.cat((context_visible, _self_only(tokens.shape[0], tokens.shape[1], tokens.device)), dim=-1)
        keys, values = torch.cat((context_keys, k), dim=2), torch.cat((context_values, v), dim=2)
        return self._chain_output(hidden, q, keys, values, see), k, v

    def _chain_qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Chain rows' input cat(input_layernorm(embed(y)), hidden_norm(h)) -> q, k, v (RoPE applied)."""
        parts = self.parts()
        return parts.qkv(head_math.layer_input(parts, parts.embed(tokens).to(hidden.dtype), hidden), positions)

    def _chain_output(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      see: torch.Tensor) -> torch.Tensor:
        """Attention over keys/values [B, kv, S, hd] where see [B, K, S] (residual: the fed hidden), then the MLP."""
        parts = self.parts()
        return head_math.finish(parts, hidden + parts.o_proj(head_math.attention(q, keys, values, see, parts.scale)))

    # ---- the drafter interface (`DartHead`'s, with this drafter's mechanics) ----------------------------------
    max_batch_size = 1  # the chain rows of one sequence fill the cache's scratch space

    def draft(self, aux_rows: torch.Tensor, new_ids: torch.Tensor, lengths: Optional[torch.Tensor],
              cache: DartHeadCache, tree_config: TreeConfig, cuda_graph: bool = False) -> "DraftCandidates":
        """D+1 (or `tree_config.max_depth`) autoregressive levels with `tree_config.topk` as branching and beam, for
        one sequence whose T new rows are all real (`lengths` is None or [T]). Runs eagerly (its shapes change with
        the levels), whatever `cuda_graph` says."""
        return self.draft_candidates(aux_rows, new_ids, cache, tree_config.topk, tree_config.max_depth)

    DRAFTS_WITH_CONTEXT = False  # its tree is its own expansion's: no context paths (docs/DESIGN.md §2.6)

    def build_tree(self, candidates: "DraftCandidates", contexts: torch.Tensor, ngram,
                   tree_config: TreeConfig, context=None) -> DraftTreeBatch:
        """The `tree_config.remain_total` best candidates (no n-gram prior: `ngram` is ignored; no context paths:
        `context` is ignored), as a batch of one."""
        tree = select_draft_tree(candidates, contexts[0, -1], tree_config.remain_total)
        return DraftTreeBatch.stack([tree]).to(contexts.device)

    def training_forward(self, aux: torch.Tensor, shifted_ids: torch.Tensor,
                         anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The EAGLE3-style drafter unrolled over its D+1 steps with the teacher's tokens ("training-time test").

        Same inputs and outputs as `DartHead.training_forward`: real_logits [B, N, Vd] (step 0 at every real row) and
        block_logits [B, A, D, Vd], where entry [b, a, j-1] is step j for anchor p = anchors[b, a]: the chain row of
        token x[p+1+j] (= shifted_ids[p+j]) fed the step j-1 output of the same anchor, at RoPE position p+j, seeing real
        rows <= p and the anchor's chain rows 1..j. It predicts x[p+2+j], like mask row j of a DART head, so
        `dart_loss` applies unchanged. Equal to `Eagle3Head` inference on each prefix (tests/hf/test_eagle3.py).
        """
        self._require_embeddings()
        b, n = shifted_ids.shape
        a = anchors.shape[1]
        h_real, k_real, v_real, _ = self.real_rows(aux, shifted_ids)  # [B, N, H], [B, kv, N, hd]
        rows = torch.arange(b, device=anchors.device)[:, None]
        see_real = torch.arange(n, device=anchors.device)[None, None, :] <= anchors[:, :, None]  # [B, A, N]
        same_anchor = torch.eye(a, dtype=torch.bool, device=anchors.device).expand(b, a, a)
        keys, values, visible = k_real, v_real, see_real
        hidden = h_real[rows, anchors]  # [B, A, H] step 0 output at each anchor
        steps = []
        for j in range(1, self.config.draft_length + 1):
            tokens = shifted_ids[rows, (anchors + j).clamp(max=n - 1)]  # beyond the sequence: never eligible
            hidden, k, v = self.chain_rows(tokens, hidden, anchors + j, keys, values, visible)
            steps.append(hidden)
            keys, values = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
            visible = torch.cat((visible, same_anchor), dim=-1)
        return self.logits(h_real), self.logits(torch.stack(steps, dim=2))

    # ---- drafting a tree (batch size 1) ---------------------------------------------------------------------
    @torch.no_grad()
    def draft_candidates(self, aux_hidden: torch.Tensor, shifted_ids: torch.Tensor, cache: DartHeadCache,
                         topk: int, levels: Optional[int] = None) -> "DraftCandidates":
        """Run `levels` (default and at most D+1) draft levels for one sequence (B=1); every expanded candidate.

        Level 1: the top-`topk` tokens of the last real row. Level l > 1: each of the `topk` best nodes of level l-1
        (the beam, by cumulative log-probability) gets one chain row and contributes its top-`topk` children.
        """
        if shifted_ids.shape[0] != 1:
            raise ValueError(f"Eagle3Head drafts one sequence at a time, got batch size {shifted_ids.shape[0]}")
        levels = self.num_levels if levels is None else min(int(levels), self.num_levels)
        logits, hidden = self(aux_hidden, shifted_ids, cache)  # [1, Vd], [1, H]
        device = logits.device
        k = min(int(topk), self.config.draft_vocab_size)
        log_probs, ids = torch.log_softmax(logits[0].float(), dim=-1).topk(k)  # [k]
        tokens, parents, scores = [self.draft_to_target(ids)], [torch.full((k,), -1, device=device)], [log_probs]
        depths = [torch.ones(k, dtype=torch.long, device=device)]
        beam_tokens, beam_scores = tokens[0], log_probs  # [k] the nodes that get a chain row next
        beam = torch.arange(k, device=device)  # their pool indices
        beam_hidden = hidden.expand(k, -1)  # [k, H] outputs of the rows that predicted the beam tokens
        # chain rows go into the cache's scratch space past the real rows (never committed: the next append
        # overwrites them), so no level copies the context
        filled = int(cache.lengths[0])
        cache.reserve(filled + (levels - 1) * k)
        visible = torch.ones(k, filled, dtype=torch.bool, device=device)  # [k, S] per beam node
        base = filled - 1  # position of the last real row
        pool_size = k
        for level in range(2, levels + 1):
            positions = torch.full((1, k), base + level - 1, dtype=torch.long, device=device)
            q, new_k, new_v = self._chain_qkv(beam_tokens[None], beam_hidden[None], positions)
            cache.keys[:, :, filled: filled + k], cache.values[:, :, filled: filled + k] = new_k, new_v
            see = torch.cat((visible, torch.eye(k, dtype=torch.bool, device=device)), dim=1)  # [k, S+k]
            h = self._chain_output(beam_hidden[None], q, cache.keys[:, :, : filled + k],
                                   cache.values[:, :, : filled + k], see[None])[0]  # [k, H]
            filled += k
            step_log_probs = torch.log_softmax(self.logits(h).float(), dim=-1)  # [k, Vd]
            child_lp, child_ids = step_log_probs.topk(k, dim=-1)  # [k, k]
            cum = (beam_scores[:, None] + child_lp).reshape(-1)  # [k*k]
            tokens.append(self.draft_to_target(child_ids.reshape(-1)))
            parents.append(beam.repeat_interleave(k))
            scores.append(cum)
            depths.append(torch.full((k * k,), level, dtype=torch.long, device=device))
            if level == levels:
                break
            # next beam: the best children; each sees its parent's context plus the parent's own row
            best = cum.topk(k).indices  # [k] indices into this level's k*k children
            parent_row = best // k
            own_row = torch.zeros(k, k, dtype=torch.bool, device=device)
            own_row[torch.arange(k, device=device), parent_row] = True
            visible = torch.cat((see[parent_row, :-k], own_row), dim=1)
            beam_tokens, beam_scores, beam_hidden = tokens[-1][best], cum[best], h[parent_row]
            beam = pool_size + best
            pool_size += k * k
        return DraftCandidates(torch.cat(tokens), torch.cat(parents).long(), torch.cat(depths), torch.cat(scores))


def _self_only(b: int, k: int, device) -> torch.Tensor:
    """[B, K, K] bool: each of K new rows sees itself only."""
    return torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)


@dataclasses.dataclass
class DraftCandidates:
    """Every node `Eagle3Head.draft_candidates` expanded, parents before children.

    tokens [P] target ids, parents [P] pool index (-1: child of the root), depths [P] (1 = child of the root),
    scores [P] cumulative log-probabilities (never larger than the parent's).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor


def select_draft_tree(candidates: DraftCandidates, root_token: torch.Tensor, num_nodes: int) -> DraftTree:
    """The `num_nodes` best candidates by score (ties: earlier first, so every kept node's parent is kept) as a
    `DraftTree` rooted at `root_token` (a 0-d or [1] tensor), nodes ordered by depth then score."""
    count = min(int(num_nodes), int(candidates.tokens.shape[0]))
    order = torch.sort(-candidates.scores, stable=True).indices[:count]  # pool indices, best first
    # depth-major order keeps parents before children; the stable sort keeps score order within a depth
    keep = order[torch.argsort(candidates.depths[order], stable=True)]
    node_of = torch.full((candidates.tokens.shape[0],), -1, dtype=torch.long, device=keep.device)
    node_of[keep] = torch.arange(1, count + 1, device=keep.device)
    parent_pool = candidates.parents[keep]
    parents = torch.where(parent_pool < 0, torch.zeros_like(parent_pool), node_of[parent_pool.clamp(min=0)])
    if bool((parents < 0).any()):
        raise AssertionError("selected candidates are not closed under taking parents")
    root = root_token.reshape(1).to(candidates.tokens)
    return DraftTree(
        tokens=torch.cat((root, candidates.tokens[keep])).cpu(),
        parents=torch.cat((torch.tensor([-1]), parents.cpu())),
        depths=torch.cat((torch.tensor([0]), candidates.depths[keep].cpu())),
        scores=torch.cat((torch.zeros(1), candidates.scores[keep].float().cpu())),
    )
