"""DART's tree verification inside SGLang's EAGLE verify step: `eagle_sample` with each node penalised for its own
prefix and the plain server's token choice per node (`dart_sglang.sampling`: the argmax, or a draw), walked by
SGLang's greedy tree kernel (`verify_tree_greedy_func`): the rule of `dart_core.verify` (docs/DESIGN.md §2.5). The
kernel follows the first child that carries its parent's chosen token; DART's trees hold one node per token path,
so that child is the only one. Sampling on CUDA keeps SGLang's own tree-sampling kernel (`tree_sampling_kernel`).
Installed as an AROUND hook by the plugin; other algorithms get SGLang's own function."""

from __future__ import annotations

import contextlib

import torch

from .sampling import Penalties, node_penalties, sample_nodes, tree_parents
from .spec import is_dart

# SGLang's penalizer classes -> the rule names of `sampling.Penalties.order`
PENALIZER_NAMES = {"BatchedFrequencyPenalizer": "frequency", "BatchedMinNewTokensPenalizer": "min_new_tokens",
                   "BatchedPresencePenalizer": "presence", "BatchedRepetitionPenalizer": "repetition"}


def tree_sampling_kernel(device) -> bool:
    """Whether SGLang's tree-sampling verify kernel runs on this device (CUDA, not ROCm): it is lossless for DART's
    deterministic drafts and is kept there; elsewhere `sampling.sample_nodes` samples."""
    return torch.device(device).type == "cuda" and torch.version.hip is None


def request_penalties(req, order: tuple) -> Penalties:
    """A request's penalties from its sampling parameters, with the stop ids min_new_tokens forbids (as SGLang's
    min-new-tokens penalizer gathers them)."""
    params = req.sampling_params
    tokenizer = getattr(req, "tokenizer", None)
    stop = set(params.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
    if tokenizer is not None:
        stop |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stop.add(tokenizer.eos_token_id)
    return Penalties(float(params.frequency_penalty), float(params.presence_penalty),
                     float(params.repetition_penalty), int(params.min_new_tokens or 0),
                     frozenset(i for i in stop if i is not None), order)


def penalizer_order(info) -> tuple:
    """The order in which this process's penalizers run (SGLang builds them from a set)."""
    orchestrator = getattr(info, "penalizer_orchestrator", None)
    names = [PENALIZER_NAMES.get(cls.__name__) for cls in getattr(orchestrator, "penalizers", {})]
    names = tuple(n for n in names if n)
    return names or Penalties().order


def _same_on_every_rank(tokens: torch.Tensor) -> torch.Tensor:
    """Under tensor parallelism, the draws of TP rank 0 (each rank draws from its own generator; they must commit
    the same tokens, as SGLang's own sampling verify ensures)."""
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group
    if group.world_size > 1:
        group.broadcast(tokens, src=0)
    return tokens


@contextlib.contextmanager
def _without_relaxed_penalties(info):
    """SGLang's own penalties hidden from its verify (the nodes already carry exact ones)."""
    saved = info.acc_additive_penalties, info.acc_scaling_penalties
    info.acc_additive_penalties = info.acc_scaling_penalties = None
    try:
        yield
    finally:
        info.acc_additive_penalties, info.acc_scaling_penalties = saved


def dart_eagle_sample(original, verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
    """`eagle_sample` for DART: (predict [B*Q], accept_lens [B], accept_index [B, depth]) as SGLang's, with each
    node penalised for its own prefix and, at temperature > 0, its token drawn from the plain server's sampling."""
    if not is_dart() or batch.forward_mode.is_idle():
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    info = batch.sampling_info
    logits = logits_output.next_token_logits  # [B*Q, V]
    q = verify_input.draft_token_num
    b = len(batch.reqs)
    tokens = verify_input.draft_token.view(b, q)
    order = penalizer_order(info)
    rules = [request_penalties(req, order) for req in batch.reqs]
    if any(rule.active for rule in rules):
        parents = tree_parents(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling)
        node_penalties(logits, [list(req.output_ids) for req in batch.reqs], rules, tokens.cpu(), parents)
    if not info.is_all_greedy and tree_sampling_kernel(logits.device):
        with _without_relaxed_penalties(info):
            return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    if info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(info.logit_bias, q, dim=0))
    if grammar_mask is not None:
        grammar_mask.apply(logits)
    if info.is_all_greedy:
        target = torch.argmax(logits, dim=-1)
    else:
        seeds = positions = None
        if info.sampling_seed is not None:
            seeds = torch.repeat_interleave(info.sampling_seed, q, dim=0)
            positions = verify_input.positions
        target = sample_nodes(logits, q, info.temperatures, info.top_ks, info.top_ps, info.min_ps,
                              info.need_min_p_sampling, top_k_top_p_min_p_sampling_from_probs_torch, seeds,
                              positions)
        target = _same_on_every_rank(target)
    device = logits.device
    predict = torch.zeros(b * q, dtype=torch.int32, device=device)
    accept_index = torch.full((b, verify_input.max_tree_depth), -1, dtype=torch.int32, device=device)
    accepted = torch.empty((b,), dtype=torch.int32, device=device)
    predict, accept_index, accepted = verify_tree_greedy_func(
        predicts=predict, accept_index=accept_index, accept_token_num=accepted, candidates=tokens,
        retrieve_index=verify_input.retrieve_index, retrieve_next_token=verify_input.retrieve_next_token,
        retrieve_next_sibling=verify_input.retrieve_next_sibling, target_predict=target.view(b, q),
        topk=verify_input.tree_topk)
    return predict, accepted + 1, accept_index
