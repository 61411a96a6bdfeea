"""DART tree decoding as a `generate(custom_generate=...)` callable: per sequence of the batch, draft a tree; verify
all trees in one target forward."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Optional

import torch

from dart_core import DartHead, DraftTreeBatch, TreeConfig, verify_greedy, verify_tree
from dart_core.cuda_graph import cached_graph
from dart_core.errors import DartInputError
from dart_core.head import id_outside_vocab
from dart_core.matmul import few_row_linears
from dart_core.tree import score_ranks
from dart_hf.target import (TargetPlan, check_attention, check_cache, first_eos, keep_accepted_path, plan_for,
                            prompt_positions, tapped_hidden_states, tree_attention_mask, tree_forward,
                            tree_forwards)


@dataclasses.dataclass
class DartStats:
    """Per-call statistics of DART decoding.

    accepted_lengths: accepted draft tokens of each sequence at each verify step (the bonus token not counted); one
        entry per sequence still decoding, `batch_rows` says whose.
    batch_rows: the caller's batch row of each entry of `accepted_lengths`.
    forwards: target forwards over trees (one per verify step, whatever the batch size).
    accepted_ranks: for each entry of `accepted_lengths`, the selection rank of each accepted node
        (`dart_core.tree.score_ranks`: 0-based position among the tree's draft nodes by score). A tree of R nodes
        built from the same candidates holds exactly the nodes of rank < R, so under greedy decoding it would have
        accepted the leading ranks < R (`accepted_within`, `tau_at`; see `dart_hf.calibration`). Filled by the tree
        loop only.
    tau: mean tokens produced per sequence and verify step, bonus included (before stopping criteria cut the last
        block).
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
    batch_rows: list[int] = dataclasses.field(default_factory=list)
    accepted_ranks: list[list[int]] = dataclasses.field(default_factory=list)
    forwards: int = 0
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

    def tau_by_row(self) -> dict[int, float]:
        """tau of each batch row."""
        out: dict[int, list[int]] = {}
        for row, accepted in zip(self.batch_rows, self.accepted_lengths):
            out.setdefault(row, []).append(accepted)
        return {row: 1.0 + sum(a) / len(a) for row, a in sorted(out.items())}

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
                  dart_sync_timing: bool = False, dart_cuda_graph: bool = False, **model_kwargs):
    """Tree decoding loop for `model.generate(..., custom_generate=dart_decoding, dart_head=head)`: `prefill`, then
    `draft` and `verify_step` until a stopping criterion holds on an accepted prefix (docs/DESIGN.md §1.3).

    A batch [B, T] must be left-padded (`attention_mask`); every sequence drafts its own tree, one target forward
    verifies all of them, and a sequence that stops leaves the batch. Output is exactly what `generate()` returns
    without DART on the same batch (greedy: token for token; sampling: same distribution per sequence), finished
    sequences padded with `pad_token_id`.
    `dart_ngram` overrides `dart_head.ngram`; `dart_tree_config` overrides `dart_head.tree_config` (default: the
    reference settings with the target's EOS). An `Eagle3Head` (the EAGLE3-style baseline) drafts its tree
    autoregressively instead (`dart_core.eagle3`, batch size 1), with `topk` as its branching, `max_depth` as its
    number of levels and `remain_total` as its node count; `dart_ngram` does not apply to it. Statistics of the call
    land in `model.dart_stats` (`DartStats`; `dart_sync_timing=True` makes its per-phase times wait for the device).
    `dart_cuda_graph=True` replays the head's drafting pass, the tree search with the trees' ancestor masks and
    greedy acceptance from CUDA graphs (CUDA only; elsewhere, or for a drafter whose candidates are not plain
    tensors, they run eagerly).
    """
    head = dart_head
    if head is None:
        raise ValueError("dart_decoding needs dart_head=<DartHead>")
    streamer = dart_streamer if dart_streamer is not None else streamer
    want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    plan, attention_mask = _prepare(model, head, input_ids, generation_config, model_kwargs, dart_tokenizer, streamer,
                                    want_scores or want_logits, stopping_criteria, logits_processor)
    cache = model_kwargs["past_key_values"]
    ngram = dart_ngram if dart_ngram is not None else head.ngram
    tree_config = dart_tree_config or head.tree_config or head.default_tree_config(first_eos(generation_config))
    verifier = _Verifier(model, plan, cache, logits_processor, bool(generation_config.do_sample))
    context_len = max(ngram.order - 1, 1) if ngram is not None else 1
    depth = tree_config.draft_levels(head.draft_length + 1)  # deepest draft node
    search = TreeSearch(head, ngram, tree_config)
    greedy_paths = functools.partial(accepted_greedy_paths, max_depth=depth)
    graphs = bool(dart_cuda_graph) and input_ids.device.type == "cuda"
    if dart_cuda_graph and not graphs:
        warnings.warn(f"dart_cuda_graph=True applies on CUDA only; on {input_ids.device.type} the drafting pass, tree "
                      "search and acceptance run eagerly", stacklevel=3)
    if graphs:  # kept with the head: later calls replay the graphs earlier ones captured
        search = cached_graph(head.cuda_graphs, (ngram, tree_config), search)
        greedy_paths = cached_graph(head.cuda_graphs, ("greedy_paths", depth), greedy_paths)
    verifier.greedy_paths = greedy_paths
    host_stops = HostStops.of(stopping_criteria)
    scores, raw_logits = [], []
    stats = DartStats(prompt_tokens=int(attention_mask.sum()), sync_timing=bool(dart_sync_timing))
    model.dart_stats = stats
    if streamer is not None:
        streamer.put(input_ids.cpu())

    batch, step = prefill(verifier, input_ids, attention_mask, context_len, stats)
    head_cache = head.new_cache(input_ids.shape[0])
    sequences = list(input_ids.split(1))  # [1, L_b] per caller's row, its left padding included
    with tree_forwards(model), few_row_linears(head):  # entered once: it walks the modules
        while True:
            finished = []
            for i, row in enumerate(batch.rows):
                new_tokens = step.new_ids[i, : len(step.tokens[i])]  # [a+1]
                emitted, done = _emit(sequences[row], new_tokens, step.tokens[i], stopping_criteria, host_stops)
                if want_scores or want_logits:
                    _record_scores(scores, raw_logits, sequences[row], new_tokens[:emitted],
                                   step.logits[i, step.nodes[i, :emitted]], verifier.processors, want_scores,
                                   want_logits)
                sequences[row] = torch.cat((sequences[row], new_tokens[None, :emitted]), dim=1)
                stats.new_tokens += emitted
                if streamer is not None:
                    streamer.put(torch.tensor(step.tokens[i][:emitted]))  # from the host: no device read
                if done:
                    finished.append(i)
            if len(finished) == len(batch.rows):
                break
            if finished:
                keep = [i for i in range(len(batch.rows)) if i not in finished]
                batch, step = _drop_finished(batch, step, head_cache, cache, keep)
            trees, ancestors = draft(head, search, step, head_cache, batch, tree_config, graphs, stats)
            step = verify_step(verifier, trees, ancestors, batch, [sequences[row] for row in batch.rows], stats)

    if streamer is not None:
        streamer.end()
    output = _padded(sequences, generation_config)
    if generation_config.return_dict_in_generate:
        from dart_hf.outputs import DartGenerateOutput

        # with several sequences the cache lost the finished ones' rows: it is not returned
        returned_cache = cache if generation_config.use_cache and input_ids.shape[0] == 1 else None
        return DartGenerateOutput(sequences=output, scores=tuple(scores) if want_scores else None,
                                  logits=tuple(raw_logits) if want_logits else None,
                                  past_key_values=returned_cache, dart_stats=stats)
    return output


@dataclasses.dataclass
class Batch:
    """The sequences still decoding and their rows of the target's KV cache (row i of every tensor = rows[i])."""

    rows: list[int]  # the caller's batch row of each sequence
    columns: torch.Tensor  # [B, S] bool: cache columns holding the sequence's tokens (not padding, not holes)
    lengths: torch.Tensor  # [B] int64: tokens of each sequence in the cache = the root's position id
    contexts: torch.Tensor  # [B, C] the last C tokens of each sequence, ending with the root (left-padded with -1)

    def select(self, keep: torch.Tensor) -> "Batch":
        return Batch([self.rows[i] for i in keep.tolist()], self.columns[keep], self.lengths[keep],
                     self.contexts[keep])


@dataclasses.dataclass
class Step:
    """What the prefill or a verify step hands to emission and the next draft, row i for sequence `Batch.rows[i]`."""

    tokens: list[list[int]]  # new tokens of each sequence, on the host: accepted draft tokens + the bonus token
    new_ids: torch.Tensor  # [B, k] those tokens, right-padded (k = the longest)
    nodes: torch.Tensor  # [B, k] the node of each token's logits in `logits` (the path, root first)
    logits: torch.Tensor  # [B, N, V] the target logits of the verified tree's nodes (the prompt's last: N = 1)
    aux_rows: torch.Tensor  # [B, R, 3*Ht] the target's tapped hidden states of the head's new rows
    head_ids: torch.Tensor  # [B, R] the token each of those rows embeds (the next one, docs/DESIGN.md §2.1)
    head_lengths: torch.Tensor  # [B] how many of the R rows are real

    def select(self, keep: torch.Tensor) -> "Step":
        return Step([self.tokens[i] for i in keep.tolist()], self.new_ids[keep], self.nodes[keep], self.logits[keep],
                    self.aux_rows[keep], self.head_ids[keep], self.head_lengths[keep])


@dataclasses.dataclass
class _Verifier:
    """The target side of a call: model, taps, KV cache and how tokens are chosen (processors, sampling)."""

    model: object
    plan: TargetPlan
    cache: object
    processors: object
    do_sample: bool

    greedy_paths: object = None  # `accepted_greedy_paths` with the depth bound (CUDA-graphed or not)

    def __post_init__(self) -> None:
        if self.processors is not None and not len(self.processors):
            self.processors = None

    def accept(self, trees: DraftTreeBatch, logits: torch.Tensor, ancestors: torch.Tensor,
               sequences: list[torch.Tensor]) -> "Paths":
        """The accepted path of every tree: logits [B, N, V] of its nodes, ancestors [B, N, N], `sequences` [1, L_b]
        ending with the roots. Greedy without processors runs on the device without a host synchronisation."""
        if self.processors is None and not self.do_sample and trees.num_nodes > 1:
            return Paths(*self.greedy_paths(trees.tensors(), logits, ancestors))
        result = verify_tree(trees, logits, context_ids=[s[0] for s in sequences], logits_processor=self.processors,
                             do_sample=self.do_sample)
        return Paths(*path_summary(trees, result))


@dataclasses.dataclass
class Paths:
    """The accepted path of every tree of a batch, on the device."""

    accept_length: torch.Tensor  # [B] accepted draft nodes
    bonus: torch.Tensor  # [B] the token after the last accepted node
    nodes: torch.Tensor  # [B, d+1] the path's nodes, root first; past the path: the root
    tokens: torch.Tensor  # [B, d+1] their tokens
    ranks: torch.Tensor  # [B, d] selection rank of each path node after the root (`score_ranks`)


def path_summary(trees: DraftTreeBatch, result) -> tuple[torch.Tensor, ...]:
    """`Paths`' fields from a `VerifyResult` of `trees`."""
    nodes = result.accepted_nodes.clamp(min=0)  # [B, d+1]
    return (result.accept_length, result.bonus_token, nodes, trees.tokens.gather(1, nodes),
            score_ranks(trees.scores, nodes[:, 1:]))


def accepted_greedy_paths(tree_tensors: tuple[torch.Tensor, ...], logits: torch.Tensor, ancestors: torch.Tensor,
                          max_depth: int) -> tuple[torch.Tensor, ...]:
    """Greedy acceptance of the trees (`DraftTreeBatch` fields) and `Paths`' fields: fixed operators, no host
    synchronisation (what `dart_cuda_graph` replays)."""
    trees = DraftTreeBatch(*tree_tensors)
    result = verify_greedy(trees, logits, ancestors=ancestors, max_depth=max_depth, validate=False)
    return path_summary(trees, result)


def prefill(verifier: _Verifier, input_ids: torch.Tensor, attention_mask: torch.Tensor, context_len: int,
            stats: DartStats) -> tuple[Batch, Step]:
    """The target over the left-padded prompts [B, T]; each last position picks the first token, verified as a
    one-node tree so that logits processors and sampling apply exactly as in every later step."""
    device = input_ids.device
    t0 = stats.clock(device)
    b, t = input_ids.shape
    out = verifier.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=prompt_positions(attention_mask), past_key_values=verifier.cache,
                         use_cache=True, output_hidden_states=list(verifier.plan.layer_ids))
    roots = DraftTreeBatch(input_ids[:, -1:], torch.full((b, 1), -1, device=device),
                           torch.zeros(b, 1, dtype=torch.long, device=device),
                           torch.zeros(b, 1, device=device), torch.ones(b, 1, dtype=torch.bool, device=device))
    logits = out.logits[:, -1:].float()  # [B, 1, V]
    first = verifier.accept(roots, logits, torch.ones(b, 1, 1, dtype=torch.bool, device=device),
                            list(input_ids.split(1))).bonus  # [B]
    # the head reads each prompt's real rows from its first one: left-align them (R = the longest prompt)
    real = attention_mask.sum(dim=1)  # [B]
    rows = int(real.max())
    index = (t - real[:, None] + torch.arange(rows, device=device)).clamp(max=t - 1)  # [B, R]
    shifted = torch.cat((input_ids[:, 1:], first[:, None]), dim=1)  # [B, T] column c: the token after c
    aux = tapped_hidden_states(out, verifier.plan.layer_ids)
    tokens = torch.where(attention_mask.bool(), input_ids, -1)
    contexts = torch.cat((torch.full((b, context_len), -1, device=device), tokens, first[:, None]), dim=1)
    batch = Batch(list(range(b)), attention_mask.bool(), real, contexts[:, -context_len:])
    step = Step([[t] for t in first.tolist()], first[:, None], torch.zeros(b, 1, dtype=torch.long, device=device),
                logits, aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1])), shifted.gather(1, index), real)
    stats.prefill_time = stats.clock(device) - t0
    return batch, step


@dataclasses.dataclass
class TreeSearch:
    """The drafter's tree search and the trees' ancestor masks: (candidates, contexts [B, C]) -> (trees,
    ancestors [B, N, N]). Fixed shapes, no host synchronisation: what `dart_cuda_graph` replays."""

    head: DartHead
    ngram: object
    tree_config: TreeConfig

    def __call__(self, candidates, contexts: torch.Tensor) -> tuple[DraftTreeBatch, torch.Tensor]:
        trees = self.head.build_tree(candidates, contexts, self.ngram, self.tree_config)
        return trees, trees.ancestor_mask()


def draft(head: DartHead, search, step: Step, head_cache, batch: Batch, tree_config: TreeConfig, cuda_graph: bool,
          stats: DartStats) -> tuple[DraftTreeBatch, torch.Tensor]:
    """One drafting pass over every sequence's new rows (a DART head: one forward with its mask rows) and the tree
    search (`TreeSearch`; the drafter interface, docs/DESIGN.md §1.2) -> (trees, ancestors [B, N, N])."""
    device = batch.contexts.device
    t0 = stats.clock(device)
    candidates = head.draft(step.aux_rows, step.head_ids, step.head_lengths, head_cache, tree_config,
                            cuda_graph=cuda_graph)
    t1 = stats.clock(device)
    trees, ancestors = search(candidates, batch.contexts)
    stats.head_time += t1 - t0
    stats.tree_time += stats.clock(device) - t1
    stats.tree_nodes = trees.num_nodes
    return trees, ancestors


def verify_step(verifier: _Verifier, trees: DraftTreeBatch, ancestors: torch.Tensor, batch: Batch,
                sequences: list[torch.Tensor], stats: DartStats) -> Step:
    """One target forward over all trees, acceptance, and the KV cache compacted to the accepted paths (rows that
    accepted fewer tokens than the longest leave masked holes). One host synchronisation: the accepted paths."""
    device = batch.contexts.device
    t0 = stats.clock(device)
    dtype = next(verifier.model.parameters()).dtype
    past = verifier.cache.get_seq_length()
    mask = tree_attention_mask(ancestors, batch.columns, dtype)
    t1 = stats.clock(device)
    out = tree_forward(verifier.model, trees.tokens, batch.lengths[:, None] + trees.depths, mask, verifier.cache,
                       verifier.plan.layer_ids)
    t2 = stats.clock(device)
    logits = out.logits.float()  # [B, N, V]
    paths = verifier.accept(trees, logits, ancestors, sequences)
    d = paths.ranks.shape[1]
    # the step's one synchronisation: per row [a, ranks (d), nodes (d+1), tokens (d+1), bonus]
    host = torch.cat((paths.accept_length[:, None], paths.ranks, paths.nodes, paths.tokens, paths.bonus[:, None]),
                     dim=1).tolist()
    accepted = [row[0] for row in host]
    ranks = [row[1 : 1 + a] for row, a in zip(host, accepted)]
    path_nodes = [row[1 + d : 2 + d + a] for row, a in zip(host, accepted)]  # root first
    new_tokens = [row[3 + 2 * d : 3 + 2 * d + a] + [row[-1]] for row, a in zip(host, accepted)]  # drafts, bonus
    k = max(accepted) + 1
    t3 = stats.clock(device)
    at_front = all(nodes == list(range(len(nodes))) for nodes in path_nodes)
    keep_accepted_path(verifier.cache, past, paths.nodes[:, :k], at_front)
    t4 = stats.clock(device)
    real = torch.arange(k, device=device) <= paths.accept_length[:, None]  # [B, k]
    new_ids = torch.cat((paths.tokens[:, 1:k], paths.tokens[:, :1]), dim=1).scatter(
        1, paths.accept_length[:, None], paths.bonus[:, None])  # [B, k] accepted tokens, bonus, padding
    counts = paths.accept_length + 1
    batch.columns = torch.cat((batch.columns, real), dim=1)
    batch.lengths = batch.lengths + counts
    batch.contexts = torch.cat((batch.contexts, new_ids), dim=1).gather(
        1, counts[:, None] + torch.arange(batch.contexts.shape[1], device=device))
    aux = tapped_hidden_states(out, verifier.plan.layer_ids)
    step = Step(new_tokens, new_ids, paths.nodes[:, :k], logits,
                aux.gather(1, paths.nodes[:, :k, None].expand(-1, -1, aux.shape[-1])), new_ids, counts)
    stats.forwards += 1
    stats.accepted_lengths += accepted
    stats.batch_rows += batch.rows
    stats.accepted_ranks += ranks
    stats.mask_time += t1 - t0
    stats.target_time += t2 - t1
    stats.accept_time += t3 - t2
    stats.compact_time += t4 - t3
    stats.verify_time += stats.clock(device) - t0
    return step


def _drop_finished(batch: Batch, step: Step, head_cache, cache, keep: list[int]) -> tuple[Batch, Step]:
    """The batch without its finished sequences: rows `keep` of the batch, the step and both caches."""
    index = torch.tensor(keep, device=batch.contexts.device)
    cache.batch_select_indices(index)
    head_cache.select_rows(index)
    return batch.select(index), step.select(index)


def _prepare(model, head: DartHead, input_ids, generation_config, model_kwargs, tokenizer, streamer,
             want_scores: bool, stopping_criteria, processors) -> tuple[TargetPlan, torch.Tensor]:
    """Every check that can fail, before any work -> the plan and the [B, T] attention mask (left padding)."""
    if generation_config.num_beams != 1:
        raise DartInputError(f"DART does not combine with beam search (num_beams={generation_config.num_beams})")
    if generation_config.num_return_sequences != 1:
        raise DartInputError("DART returns one sequence per prompt (num_return_sequences must be 1)")
    batch_size = input_ids.shape[0]
    if head.max_batch_size is not None and batch_size > head.max_batch_size:
        raise DartInputError(f"{type(head).__name__} drafts at most {head.max_batch_size} sequence(s) at a time; got "
                             f"batch size {batch_size}")
    if batch_size > 1 and streamer is not None:
        raise DartInputError("streamers take one sequence (batch size 1), as in transformers; got batch size "
                             f"{batch_size}")
    if batch_size > 1:
        _check_batch_semantics(stopping_criteria, processors)
    if batch_size > 1 and want_scores:
        raise DartInputError("output_scores / output_logits with dart_head need batch size 1 (sequences of a batch "
                             "advance by different numbers of tokens per step)")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        raise DartInputError("output_attentions / output_hidden_states are not available with dart_head (the target "
                             "runs over draft trees, not one token per step)")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _check_left_padding(attention_mask, input_ids)
    if not generation_config.use_cache:
        raise DartInputError("DART tree decoding needs use_cache=True")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    bad = id_outside_vocab(input_ids, vocab)
    if bad is not None:
        raise DartInputError(f"input_ids hold token id {bad}, outside the target vocabulary 0..{vocab - 1}")
    check_attention(model)
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        raise DartInputError("generate() prepared no cache; DART needs a DynamicCache")
    check_cache(cache)
    if cache.get_seq_length() != 0:
        raise DartInputError("DART tree decoding starts from an empty cache (passing past_key_values is not supported)")
    return plan_for(model, head, tokenizer), attention_mask


def _check_batch_semantics(stopping_criteria, processors) -> None:
    """What a batch needs so that each row can stop and be processed on its own, as plain `generate()` does."""
    from transformers import MaxLengthCriteria, MaxTimeCriteria, PrefixConstrainedLogitsProcessor

    criteria = list(stopping_criteria or [])
    has_eos = any(hasattr(c, "eos_token_id") for c in criteria)
    if not has_eos and any(not isinstance(c, (MaxLengthCriteria, MaxTimeCriteria)) for c in criteria):
        # plain generate() pads a stopped row only when an EOS criterion exists; otherwise it keeps decoding it
        raise DartInputError("with several sequences, stop strings and custom stopping criteria need an "
                             "eos_token_id in the generation config (without one, generate() keeps decoding a stopped "
                             "row); set eos_token_id, or generate one sequence at a time")
    if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in processors or []):
        raise DartInputError("prefix_allowed_tokens_fn needs batch size 1 with dart_head (it is called with each "
                             "row's batch index, which per-node verification does not have)")


def _check_left_padding(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Each row of the [B, T] mask must be zeros (padding) then ones (tokens), with at least one token."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise DartInputError(f"attention_mask shape {list(attention_mask.shape)} does not match input_ids "
                             f"{list(input_ids.shape)}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise DartInputError("attention_mask must hold 0 (padding) and 1 (token) only")
    empty = (mask.sum(dim=1) == 0).nonzero()
    if empty.numel():
        raise DartInputError(f"row {int(empty[0])} of the batch is all padding (attention_mask all zeros)")
    bad = (mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()
    if bad.numel():
        raise DartInputError(f"row {int(bad[0])} has padding after a token: DART needs left padding (set "
                             "tokenizer.padding_side = 'left'). If the prompt is not padded, generate() may have "
                             "guessed padding from pad_token_id occurring in it: pass "
                             "attention_mask=torch.ones_like(input_ids)")


@dataclasses.dataclass(frozen=True)
class HostStops:
    """Stopping criteria that the host decides from token ids alone: generate()'s own maximum-length and EOS
    criteria, what a call without custom criteria, stop strings or `max_time` has."""

    max_length: Optional[int]  # stop once the sequence (prompt and padding included) is this long
    eos: frozenset  # stop after any of these tokens

    @classmethod
    def of(cls, criteria) -> Optional["HostStops"]:
        """The host form of `criteria`, or None when one of them is another kind (or could warn on its own)."""
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        lengths, eos = [], set()
        for criterion in criteria or ():
            if type(criterion) is MaxLengthCriteria:
                if (criterion.max_position_embeddings is not None
                        and criterion.max_length > criterion.max_position_embeddings):
                    return None  # it warns once the sequence outgrows the model: leave that to it
                lengths.append(criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                eos.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
            else:
                return None
        return cls(min(lengths, default=None), frozenset(eos))

    def emitted(self, length: int, tokens: list[int]) -> tuple[int, bool]:
        """`_emit`'s answer for a sequence of `length` tokens and new `tokens`."""
        for i, token in enumerate(tokens):
            if token in self.eos or (self.max_length is not None and length + i + 1 >= self.max_length):
                return i + 1, True
        return len(tokens), False


def _emit(sequence, new_tokens, tokens: list[int], stopping_criteria,
          host_stops: Optional[HostStops]) -> tuple[int, bool]:
    """How many of `new_tokens` [k] (`tokens` on the host) to append to `sequence` [1, L]: all, or up to the first
    prefix that meets a stopping criterion. Every prefix is checked: on the host when `host_stops` stands for the
    criteria, else by calling them (one host synchronisation per prefix)."""
    if host_stops is not None:
        return host_stops.emitted(sequence.shape[1], tokens)
    for i in range(new_tokens.shape[0]):
        if bool(stopping_criteria(torch.cat((sequence, new_tokens[None, : i + 1]), dim=1), None).any()):
            return i + 1, True
    return new_tokens.shape[0], False


def _padded(sequences: list[torch.Tensor], generation_config) -> torch.Tensor:
    """The sequences [1, L_b] as one [B, max L_b] tensor, shorter ones right-padded with `pad_token_id` as
    `generate()` pads sequences that finished early."""
    width = max(s.shape[1] for s in sequences)
    if all(s.shape[1] == width for s in sequences):
        return torch.cat(sequences)
    pad = getattr(generation_config, "_pad_token_tensor", None)  # generate() sets it (EOS when no pad is given)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.flatten()[0].item() if pad.numel() else None
    elif isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        raise DartInputError("sequences finished at different lengths and the generation config has no pad_token_id "
                             "to pad them with")
    return torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=int(pad)) for s in sequences])


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
