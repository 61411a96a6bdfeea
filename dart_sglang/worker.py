"""The DART speculative worker on SGLang's EAGLE v2 machinery.

Per decode round, for every request of the batch at once: the per-level top-k candidates carried in the batch's
draft input -> `dart_core.build_draft_trees` (beam search + n-gram prior) -> EAGLE tree ABI -> SGLang's tree build,
target verify and KV compaction (`EAGLEWorkerV2.verify`) -> one DART head pass over all requests of the round:
their newly accepted rows packed (written to the draft KV pool), each request's last row plus D mask rows attending
over its own cached rows (padded to the round's longest, `dart_sglang.batching`) -> the next round's candidates.
Prefill does the same over the prompts' rows. No multi-step draft decode, no draft attention backends, no draft
CUDA graphs.

Under `--tp-size N` every rank runs this worker: the head's layer is sharded (`models.llama_dart`) and its logits
gathered, so every rank holds the same candidates; the tree search is deterministic and runs on every rank from
those identical inputs (no broadcast per round); sampled verification commits rank 0's draws (`verify`).
`DART_CHECK_TP_TREES=1` compares every round's trees across the ranks.
"""

from __future__ import annotations

import os

import torch

from dart_core import NGramModel, TreeConfig, build_draft_trees, draft_context_length
from dart_core.context import ContextDrafter, ContextRow
from dart_core.tree import topk_draft_tokens
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative import eagle_worker_v2 as eagle_v2
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_utils import _eagle_prefill_tail_tokens, default_tree_mask_mode
from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from .batching import (accepted_rows, gather_padded, last_rows, packed_positions, packed_slots, padded_slots,
                       shift_within)
from .models.llama_dart import LlamaForCausalLMDart
from .head_format import SGLANG_ARCHITECTURE
from .settings import DartServeSettings
from .tree_abi import encode_eagle_trees

def recent_tokens(req, length: int) -> list[int]:
    """The last `length` tokens of a request's prompt + output."""
    out = list(req.output_ids[-length:])
    if len(out) < length:
        out = list(req.origin_input_ids[len(out) - length:]) + out
    return out


CONTEXT_ROW = "_dart_context_row"  # the request attribute holding its `ContextRow` (docs/DESIGN.md §2.6)


def context_row(req, tree: TreeConfig) -> ContextRow:
    """The request's `ContextRow` (kept on it across rounds), extended by the tokens its prompt + output gained since
    the last round: a round never rescans the prompt."""
    prompt, output = req.origin_input_ids, req.output_ids
    row = getattr(req, CONTEXT_ROW, None)
    if row is None or len(row) > len(prompt) + len(output):  # new, or its output was cut back (a retracted request)
        row = ContextRow((), tree.context_min_match, tree.context_max_match)
        setattr(req, CONTEXT_ROW, row)
    seen = len(row)
    if seen < len(prompt):
        row.extend(list(prompt[seen:]) + list(output))
    else:
        row.extend(list(output[seen - len(prompt):]))
    return row


def draft_contexts(tails: list[list[int]], roots: list[int], length: int) -> torch.Tensor:
    """Each request's last `length` tokens ending with its tree root -> [B, length] int64, left-padded with -1.

    `tails[b]` ends with the request's last token, which is the root (SGLang appends the bonus token to the
    output before the next draft); where it is not, the context is the root alone (the n-gram prior sees less)."""
    rows = []
    for tail, root in zip(tails, roots):
        tail = list(tail[-length:]) if tail and tail[-1] == root else [root]
        rows.append([-1] * (length - len(tail)) + tail)
    return torch.tensor(rows, dtype=torch.long)


CHECK_RANKS_ENV = "DART_CHECK_TP_TREES"  # "1": compare every round's trees across the TP ranks (a debugging aid)


def check_same_trees(trees) -> None:
    """Raise when the TP ranks built different trees this round (they would write different KV entries)."""
    group = get_parallel().tp_group
    mine = torch.stack((trees.tokens, trees.parents)).to(torch.long)  # [2, B, N]
    gathered = group.all_gather(mine[None].contiguous(), dim=0)  # [world, 2, B, N]
    if not bool((gathered == mine[None]).all()):
        raise RuntimeError(f"DART: tensor-parallel ranks built different draft trees (rank {group.rank_in_group})")


class DartDraftWorker(eagle_v2.EagleDraftWorker):
    """Loads the DART head (`head_format.SGLANG_ARCHITECTURE`) as SGLang's draft model and drafts DART trees."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.settings = DartServeSettings.from_draft_dir(server_args.speculative_draft_model_path)
        model = self.draft_runner.model
        if not isinstance(model, LlamaForCausalLMDart):
            raise TypeError(f"the DART draft model loaded as {type(model).__name__}, not {SGLANG_ARCHITECTURE}")
        self.ngram = NGramModel.load(self.settings.ngram_path, device=self.device) if self.settings.ngram_path else None
        self.context_length = draft_context_length(self.ngram)
        # every rank builds the trees itself from identical inputs (module docstring); this checks it each round
        self.check_ranks = os.environ.get(CHECK_RANKS_ENV) == "1" and get_parallel().tp_group.world_size > 1

    # ---- no multi-step draft decode: no draft attention backends, no draft CUDA graphs -------------------------
    def init_attention_backend(self):
        self.draft_attn_backend = None
        self.draft_extend_attn_backend = None
        self.tree_mask_mode = default_tree_mask_mode()

    def _capture_cuda_graphs(self):
        self.cuda_graph_runner = None
        self.cuda_graph_runner_for_draft_extend = None

    # ---- the head -----------------------------------------------------------------------------------------------
    @property
    def _attn(self):
        return self.draft_runner.model.layer.self_attn.attn

    def _write_rows(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        """Store the keys/values of N packed real rows of any requests (aux [N, 3*Ht], next_ids [N], positions [N])
        at their token slots [N] in the draft KV pool -> the rows' inputs (x [N, 2H], residual [N, H])."""
        x, residual, k, v = self.draft_runner.model.real_rows(aux, next_ids, positions)
        self.draft_runner.token_to_kv_pool.set_kv_buffer(self._attn, slots, k, v)
        return x, residual

    def _level_logits(self, x_last: torch.Tensor, res_last: torch.Tensor, lengths: torch.Tensor,
                      pool_indices: torch.Tensor) -> torch.Tensor:
        """[B, D+1, Vd] logits of B requests whose rows 0..lengths[b]-1 are in the pool (the last one's inputs are
        x_last [B, 2H], res_last [B, H]); pool_indices [B]: their rows of `req_to_token`."""
        pool = self.draft_runner.token_to_kv_pool
        slots, valid = padded_slots(self.req_to_token_pool.req_to_token, pool_indices, lengths)  # [B, S]
        layer_id = self._attn.layer_id
        past_k = gather_padded(pool.get_key_buffer(layer_id), slots, valid)  # [B, S, kv, hd]
        past_v = gather_padded(pool.get_value_buffer(layer_id), slots, valid)
        return self.draft_runner.model.draft_logits(x_last, res_last, lengths, past_k, past_v)

    def _head_pass(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   counts: torch.Tensor, pool_indices: torch.Tensor) -> torch.Tensor:
        """One head forward for all B requests of a round. Their new real rows packed: aux [N, 3*Ht], next_ids
        [N], positions [N], token slots [N]; request b owns counts[b] >= 1 consecutive rows and row pool_indices[b]
        of `req_to_token` -> logits [B, D+1, Vd] (one request's rows never see another's)."""
        x, residual = self._write_rows(aux, next_ids, positions, slots)
        last = last_rows(counts)  # [B]
        return self._level_logits(x[last], residual[last], positions[last] + 1, pool_indices)

    def _draft_input(self, logits: torch.Tensor | None, bonus_tokens: torch.Tensor) -> EagleDraftInput:
        """Logits [B, D+1, Vd] (None: no request) -> the draft input the next `draft` reads: topk_index/topk_p
        [B, L, K] (target ids; B may be 0)."""
        s = self.settings
        k = s.tree.topk  # <= the draft vocabulary (checked with the server arguments)
        if logits is not None and logits.shape[0]:
            ids, probs = topk_draft_tokens(logits[:, : s.head_levels].float(), k)
            if self.hot_token_id is not None:  # on the device since init_lm_head
                ids = self.hot_token_id[ids]
        else:
            ids = torch.zeros(0, s.head_levels, k, dtype=torch.long, device=self.device)
            probs = torch.zeros(0, s.head_levels, k, dtype=torch.float32, device=self.device)
        hidden = torch.zeros(ids.shape[0], self.draft_runner.model.config.hidden_size, device=self.device)
        return EagleDraftInput(topk_p=probs, topk_index=ids, hidden_states=hidden, bonus_tokens=bonus_tokens,
                               num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)

    # ---- prefill: the prompt's rows -----------------------------------------------------------------------------
    @torch.no_grad()
    def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids, mm_input_embeds=None,
                                  kv_loc_plan=None):
        if mm_input_embeds is not None:
            raise NotImplementedError("DART does not support multimodal inputs")
        if batch.forward_mode.is_idle():
            return self._draft_input(None, next_token_ids)
        tails = _eagle_prefill_tail_tokens(batch, next_token_ids)  # [B]
        # the prompts' rows, packed back to back as the target computed them: request b has extend_lens[b] rows
        # after its prefix_lens[b] cached ones
        n = int(sum(batch.extend_lens))
        counts = torch.as_tensor(batch.extend_lens, dtype=torch.long, device=self.device)  # [B]
        starts = torch.as_tensor(batch.prefix_lens, dtype=torch.long, device=self.device)  # [B]
        positions = packed_positions(starts, counts, n)  # [N]
        next_ids = shift_within(batch.input_ids[:n].long(), counts, tails.to(self.device))  # [N]
        logits = self._head_pass(target_hidden_states[:n], next_ids, positions, batch.out_cache_loc[:n], counts,
                                 batch.req_pool_indices)
        return self._draft_input(logits, next_token_ids)

    # ---- a decode round: trees, then the accepted rows ------------------------------------------------------------
    @torch.no_grad()
    def draft(self, batch, *, with_topology: bool = False):
        if with_topology:
            raise NotImplementedError("DART does not support pipeline parallelism")
        draft_input = batch.spec_info
        s = self.settings
        if batch.forward_mode.is_idle():
            empty = torch.empty(0, 0, dtype=torch.long, device=self.device)
            return build_eagle_verify_input(batch, draft_input, empty, empty, empty, None,
                                            target_worker=self.target_worker, topk=s.topk, num_steps=s.num_levels,
                                            num_draft_tokens=s.num_draft_tokens, tree_mask_mode=self.tree_mask_mode,
                                            device=self.device)
        roots = draft_input.bonus_tokens.tolist()
        tails = [recent_tokens(req, self.context_length) for req in batch.reqs]
        contexts = draft_contexts(tails, roots, self.context_length).to(draft_input.topk_index.device)
        proposals = None
        if s.tree.context_draft:
            proposals = ContextDrafter([context_row(req, s.tree) for req in batch.reqs], s.tree).propose(
                contexts.device, roots)
        trees = build_draft_trees(draft_input.topk_index, draft_input.topk_p, contexts, self.ngram, s.tree,
                                  context=proposals)
        if self.check_ranks:
            check_same_trees(trees)
        if trees.num_nodes != s.num_draft_tokens:
            raise RuntimeError(f"DART tree has {trees.num_nodes} nodes, the server was sized for {s.num_draft_tokens}")
        parent_list, top_scores_index, draft_tokens = encode_eagle_trees(trees, s.topk, s.num_levels)
        return build_eagle_verify_input(batch, draft_input, parent_list.to(self.device),
                                        top_scores_index.to(self.device), draft_tokens.to(self.device), None,
                                        target_worker=self.target_worker, topk=s.topk, num_steps=s.num_levels,
                                        num_draft_tokens=s.num_draft_tokens, tree_mask_mode=self.tree_mask_mode,
                                        device=self.device)

    @torch.no_grad()
    def _draft_extend_for_decode(self, batch, batch_result, *, kv_loc_plan=None):
        q = self.settings.num_draft_tokens
        hidden = batch_result.logits_output.hidden_states  # [B*Q, 3*Ht], accepted path first in each block
        next_ids = batch_result.next_token_ids.long()  # [B*Q], the token after each row
        counts = batch_result.accept_lens.to(self.device, torch.long)  # [B], root + accepted drafts
        lengths = batch_result.new_seq_lens.to(self.device, torch.long)  # [B], after them
        pool_indices = batch.req_pool_indices
        logits = None
        if counts.numel():
            n = int(counts.sum())
            rows = accepted_rows(counts, q, n)  # [N]: the accepted rows, packed
            positions = packed_positions(lengths - counts, counts, n)  # [N]
            slots = packed_slots(self.req_to_token_pool.req_to_token, pool_indices, positions, counts)  # [N]
            logits = self._head_pass(hidden[rows], next_ids[rows], positions, slots, counts, pool_indices)
        nxt = self._draft_input(logits, batch_result.next_draft_input.bonus_tokens)
        out = batch_result.next_draft_input
        out.topk_p, out.topk_index, out.hidden_states = nxt.topk_p, nxt.topk_index, nxt.hidden_states


class DartWorker(eagle_v2.EAGLEWorkerV2):
    """`EAGLEWorkerV2` with the DART draft worker (verify, bookkeeping and scheduling are EAGLE's)."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        # EAGLEWorkerV2.__init__ is not called: it builds an EagleDraftWorker (a second load of the draft model, with
        # attention backends and CUDA graphs DART never uses). Its attributes are set here instead, attribute by
        # attribute; tests/sglang/test_sglang.py fails when SGLang's constructor sets one this does not.
        eagle_v2.BaseSpecWorker.__init__(self)
        spec = eagle_v2.get_spec()
        self.server_args = server_args
        self.topk = spec.speculative_eagle_topk
        self.speculative_num_steps = spec.speculative_num_steps
        self.speculative_num_draft_tokens = spec.speculative_num_draft_tokens
        self.gpu_id = gpu_id
        self.device = eagle_v2.get_device().device
        self._target_worker = target_worker
        self.page_size = eagle_v2.get_schedule().page_size
        self.speculative_algorithm = SpeculativeAlgorithm.from_string(spec.speculative_algorithm)
        self.enable_dp_spec_prefill_coordination = False
        self._hosts_draft = True
        self._draft_worker = DartDraftWorker(server_args, gpu_id, nccl_port, target_worker)
        self.adaptive_controller = None
        self.num_new_pages_per_topk = torch.empty((), dtype=torch.int64, device=self.device)
        self.extend_lens = torch.empty((), dtype=torch.int64, device=self.device)
        self.plan_stream, self.plan_stream_ctx = eagle_v2.get_plan_stream(self.device)

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self._target_worker.model_runner.attn_backend, self._draft_worker.draft_runner.attn_backend)
