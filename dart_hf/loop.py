"""DART tree decoding as a `generate(custom_generate=...)` callable: draft a tree, verify it in one target forward."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from dart_core import DartHead, DraftTreeBatch, TreeConfig, verify_tree
from dart_core.head import id_outside_vocab
from dart_core.matmul import few_row_linears
from dart_core.tree import DraftTree, score_ranks
from dart_hf.target import (TargetPlan, check_attention, check_cache, first_eos, keep_accepted_path, plan_for,
                            tapped_hidden_states, tree_attention_mask, tree_forward)


@dataclasses.dataclass
class DartStats:
    """Per-call statistics of DART decoding.

    accepted_lengths: accepted draft tokens of each verify step (the bonus token not counted).
    accepted_ranks: for each verify step, the selection rank of each accepted node (`dart_core.tree.score_ranks`:
        0-based position among the tree's draft nodes by score). A tree of R nodes built from the same candidates
        holds exactly the nodes of rank < R, so under greedy decoding it would have accepted the leading ranks < R
        (`accepted_within`, `tau_at`; see `dart_hf.calibration`). Filled by the tree loop only.
    tau: mean tokens produced per verify step, bonus included (before stopping criteria cut the last block).
    Times are wall-clock seconds: prefill (target + head on the prompt), head forwards (an `Eagle3Head`: all its
    draft levels with their top-k expansions), tree searches (an `Eagle3Head`: the final node selection), verify
    steps and, within those, the tree mask build, the target forwards, the acceptance and the KV compaction. With
    `dart_sync_timing=True` every clock read waits for the device first (per-phase times on an accelerator, at the
    cost of those synchronisations). The `assistant_model=` route fills prompt tokens, accepted lengths and head /
    tree times only.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = dataclasses.field(default_factory=list)
    accepted_ranks: list[list[int]] = dataclasses.field(default_factory=list)
    tree_nodes: int = 0
    prefill_time: float = 0.0
    head_time: float = 0.0
    tree_time: float = 0.0
    verify_time: float = 0.0
    mask_time: float = 0.0
    target_time: float = 0.0
    accept_time: float = 0.0
    compact_time: float = 0.0
    sync_timing: bool = False

    def clock(self, device: torch.device) -> float:
        """perf_counter seconds, after waiting for `device` when `sync_timing` is set."""
        if self.sync_timing and device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter()

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        return (sum(self.accepted_lengths) + self.steps) / self.steps if self.steps else 0.0

    def accepted_within(self, remain_total: int) -> list[int]:
        """Per verify step: draft tokens a tree of `remain_total` nodes would have accepted from the same state
        (greedy), i.e. the leading accepted nodes of rank < remain_total."""
        out = []
        for ranks in self.accepted_ranks:
            n = 0
            while n < len(ranks) and ranks[n] < remain_total:
                n += 1
            out.append(n)
        return out

    def tau_at(self, remain_total: int) -> float:
        """Estimated tau of a tree of `remain_total` draft nodes: 1 + mean of `accepted_within(remain_total)`."""
        counts = self.accepted_within(remain_total)
        return 1.0 + sum(counts) / len(counts) if counts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Fraction of steps that accepted at least k+1 draft tokens, for k = 0, 1, ..."""
        if not self.steps:
            return []
        deepest = max(self.accepted_lengths)
        return [sum(a > k for a in self.accepted_lengths) / self.steps for k in range(deepest)]

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(steps=self.steps, tau=self.tau, acceptance_by_position=self.acceptance_by_position())
        return out


@torch.no_grad()
def dart_decoding(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                  synced_gpus: bool = False, streamer=None, *, dart_head: Optional[DartHead] = None, dart_ngram=None,
                  dart_tree_config: Optional[TreeConfig] = None, dart_streamer=None, dart_tokenizer=None,
                  dart_sync_timing: bool = False, **model_kwargs):
    """Tree decoding loop for `model.generate(..., custom_generate=dart_decoding, dart_head=head)`: `prefill`, then
    `draft` and `verify_step` until a stopping criterion holds on an accepted prefix (docs/DESIGN.md §1.3).

    Output is exactly what `generate()` returns without DART (greedy: token for token; sampling: same distribution).
    An `Eagle3Head` (the EAGLE3-style baseline) drafts its tree autoregressively instead (`dart_core.eagle3`), with
    `topk` as its branching, `max_depth` as its number of levels and `remain_total` as its node count; `dart_ngram`
    does not apply to it.
    `dart_ngram` overrides `dart_head.ngram`; `dart_tree_config` overrides `dart_head.tree_config` (default: the
    reference settings with the target's EOS). Statistics of the call land in `model.dart_stats` (`DartStats`;
    `dart_sync_timing=True` makes its per-phase times wait for the device).
    """
    head = dart_head
    if head is None:
        raise ValueError("dart_decoding needs dart_head=<DartHead>")
    streamer = dart_streamer if dart_streamer is not None else streamer
    plan = _prepare(model, head, input_ids, generation_config, model_kwargs, dart_tokenizer)
    cache = model_kwargs["past_key_values"]
    ngram = dart_ngram if dart_ngram is not None else head.ngram
    tree_config = dart_tree_config or head.tree_config or head.default_tree_config(first_eos(generation_config))
    verifier = _Verifier(model, plan, cache, logits_processor, bool(generation_config.do_sample))
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores, raw_logits = [], []
    stats = DartStats(prompt_tokens=int(input_ids.shape[1]), sync_timing=bool(dart_sync_timing))
    model.dart_stats = stats
    if streamer is not None:
        streamer.put(input_ids.cpu())

    step = prefill(verifier, input_ids, stats)
    head_cache = head.new_cache(1)
    sequence = input_ids
    while True:
        emitted, finished = _emit(sequence, step.new_tokens, stopping_criteria)
        if want_scores or want_logits:
            _record_scores(scores, raw_logits, sequence, step.new_tokens[:emitted], step.path_logits,
                           verifier.processors, want_scores, want_logits)
        sequence = torch.cat((sequence, step.new_tokens[None, :emitted]), dim=1)
        stats.new_tokens += emitted
        if streamer is not None:
            streamer.put(step.new_tokens[:emitted].cpu())
        if finished:
            break
        tree = draft(head, step, head_cache, sequence, ngram, tree_config, stats)
        step = verify_step(verifier, tree, sequence, stats)

    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        from dart_hf.outputs import DartGenerateOutput

        return DartGenerateOutput(sequences=sequence, scores=tuple(scores) if want_scores else None,
                                  logits=tuple(raw_logits) if want_logits else None,
                                  past_key_values=cache if generation_config.use_cache else None, dart_stats=stats)
    return sequence


@dataclasses.dataclass
class Step:
    """What the prefill or a verify step hands to the next draft: the new tokens and the rows the head reads."""

    new_tokens: torch.Tensor  # [a+1] the accepted draft tokens and the bonus token
    path_logits: torch.Tensor  # [a+1, V] the target logits that chose them
    aux_rows: torch.Tensor  # [1, R, 3*Ht] the target's tapped hidden states of the head's new real rows
    head_input_ids: torch.Tensor  # [1, R] the token each of those rows embeds (the next one, docs/DESIGN.md §2.1)


@dataclasses.dataclass
class _Verifier:
    """The target side of a call: model, taps, KV cache and how tokens are chosen (processors, sampling)."""

    model: object
    plan: TargetPlan
    cache: object
    processors: object
    do_sample: bool

    def __post_init__(self) -> None:
        if self.processors is not None and not len(self.processors):
            self.processors = None

    def accept(self, tree: DraftTree, logits: torch.Tensor, sequence: torch.Tensor):
        """verify_tree on one tree: logits [1, N, V] of its nodes, `sequence` [1, L] ending with the root."""
        return verify_tree(DraftTreeBatch.stack([tree]), logits, context_ids=sequence,
                           logits_processor=self.processors, do_sample=self.do_sample)


def prefill(verifier: _Verifier, input_ids: torch.Tensor, stats: DartStats) -> Step:
    """The target over the prompt [1, n]; its last position picks the first token, verified as a one-node tree so
    that logits processors and sampling apply exactly as in every later step."""
    t0 = stats.clock(input_ids.device)
    n = input_ids.shape[1]
    out = verifier.model(input_ids=input_ids, position_ids=torch.arange(n, device=input_ids.device)[None],
                         past_key_values=verifier.cache, use_cache=True,
                         output_hidden_states=list(verifier.plan.layer_ids))
    root_only = DraftTree(input_ids[0, -1:], torch.tensor([-1]), torch.tensor([0]), torch.zeros(1))
    node_logits = out.logits[:, -1:].float()  # [1, 1, V]
    new_tokens = verifier.accept(root_only, node_logits, input_ids).bonus_token.to(input_ids.device)  # [1]
    stats.prefill_time = stats.clock(input_ids.device) - t0
    return Step(new_tokens, node_logits[0], tapped_hidden_states(out, verifier.plan.layer_ids),
                torch.cat((input_ids[:, 1:], new_tokens[None]), dim=1))


def draft(head: DartHead, step: Step, head_cache, sequence: torch.Tensor, ngram, tree_config: TreeConfig,
          stats: DartStats) -> DraftTree:
    """One drafting pass over the step's new rows (a DART head: one forward with its mask rows) and the tree search
    (the drafter interface, docs/DESIGN.md §1.2); `sequence` [1, L] ends with the root."""
    context_len = max(ngram.order - 1, 1) if ngram is not None else 1
    device = sequence.device
    t0 = stats.clock(device)
    with few_row_linears(head):
        candidates = head.draft(step.aux_rows, step.head_input_ids, head_cache, tree_config)
    t1 = stats.clock(device)
    tree = head.build_tree(candidates, sequence[0, -context_len:], ngram, tree_config)
    stats.head_time += t1 - t0
    stats.tree_time += stats.clock(device) - t1
    stats.tree_nodes = tree.num_nodes
    return tree


def verify_step(verifier: _Verifier, tree: DraftTree, sequence: torch.Tensor, stats: DartStats) -> Step:
    """One target forward over the tree, acceptance, and the KV cache compacted to the accepted path."""
    device = sequence.device
    t0 = stats.clock(device)
    dtype = next(verifier.model.parameters()).dtype
    past = verifier.cache.get_seq_length()
    mask = tree_attention_mask(tree.ancestor_mask(), past, dtype).to(device)
    t1 = stats.clock(device)
    out = tree_forward(verifier.model, tree.tokens[None].to(device), (past + tree.depths)[None].to(device), mask,
                       verifier.cache, verifier.plan.layer_ids)
    t2 = stats.clock(device)
    logits = out.logits.float()  # [1, N, V]
    result = verifier.accept(tree, logits, sequence)
    accepted = int(result.accept_length[0])
    path = result.accepted_nodes[0, : accepted + 1].to(device)  # root first
    t3 = stats.clock(device)
    keep_accepted_path(verifier.cache, past, path)
    t4 = stats.clock(device)
    stats.mask_time += t1 - t0
    stats.target_time += t2 - t1
    stats.accept_time += t3 - t2
    stats.compact_time += t4 - t3
    stats.accepted_lengths.append(accepted)
    stats.accepted_ranks.append(score_ranks(tree.scores, path[1:]).tolist() if accepted else [])
    new_tokens = torch.cat((tree.tokens[path[1:]].to(device), result.bonus_token.to(device)))  # [a+1]
    step = Step(new_tokens, logits[0, path], tapped_hidden_states(out, verifier.plan.layer_ids)[:, path],
                new_tokens[None])
    stats.verify_time += stats.clock(device) - t0
    return step


def _prepare(model, head: DartHead, input_ids, generation_config, model_kwargs, tokenizer) -> TargetPlan:
    """Every check that can fail, before any work."""
    if generation_config.num_beams != 1:
        raise ValueError(f"DART does not combine with beam search (num_beams={generation_config.num_beams})")
    if generation_config.num_return_sequences != 1:
        raise ValueError("DART returns one sequence per prompt (num_return_sequences must be 1)")
    if input_ids.shape[0] != 1:
        raise ValueError(f"DART tree decoding runs one sequence at a time (batch size 1); got batch size "
                         f"{input_ids.shape[0]}. Call generate once per prompt.")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        raise ValueError("output_attentions / output_hidden_states are not available with dart_head (the target "
                         "runs over draft trees, not one token per step)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("DART tree decoding does not support padded inputs (attention_mask with zeros). If the "
                         "prompt is not padded, generate() may have guessed padding from pad_token_id occurring in "
                         "it: pass attention_mask=torch.ones_like(input_ids)")
    if not generation_config.use_cache:
        raise ValueError("DART tree decoding needs use_cache=True")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    bad = id_outside_vocab(input_ids, vocab)
    if bad is not None:
        raise ValueError(f"input_ids hold token id {bad}, outside the target vocabulary 0..{vocab - 1}")
    check_attention(model)
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        raise ValueError("generate() prepared no cache; DART needs a DynamicCache")
    check_cache(cache)
    if cache.get_seq_length() != 0:
        raise ValueError("DART tree decoding starts from an empty cache (passing past_key_values is not supported)")
    return plan_for(model, head, tokenizer)


def _emit(sequence, new_tokens, stopping_criteria) -> tuple[int, bool]:
    """How many of `new_tokens` [k] to append: all, or up to the first prefix that meets a stopping criterion."""
    for i in range(new_tokens.shape[0]):
        if bool(stopping_criteria(torch.cat((sequence, new_tokens[None, : i + 1]), dim=1), None).any()):
            return i + 1, True
    return new_tokens.shape[0], False


def _record_scores(scores, raw_logits, sequence, new_tokens, path_logits, processors, want_scores,
                   want_logits) -> None:
    """For each new token i: the raw logits [1, V] that chose it and the scores processed with its own prefix."""
    for i in range(new_tokens.shape[0]):
        logits = path_logits[i : i + 1].clone()  # [1, V]
        if want_logits:
            raw_logits.append(logits)
        if want_scores:
            prefix = torch.cat((sequence, new_tokens[None, :i]), dim=1)
            scores.append(logits if processors is None else processors(prefix, logits.clone()))
