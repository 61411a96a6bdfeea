"""DART tree decoding as a `generate(custom_generate=...)` callable: per sequence of the batch, draft a tree; verify
all trees in one target forward."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import threading
import warnings
import weakref
from typing import Optional

import torch

from dart_core import (DartHead, DraftTreeBatch, Drafter, OutputStore, TreeConfig, draft_context_length, verify_greedy,
                       verify_tree)
from dart_core.verify import BatchedProcessor, choose_at_roots
from dart_core.acceptance import accepted_within, tau_of
from dart_runtime.cuda_graph import cached_graph
from dart_core.context import SOURCE_HEAD, SOURCE_NGRAM, SOURCE_STORE, ContextDrafter, ContextProposals
from dart_core.model_free import check_model_free_tree
from dart_core.step_policy import (LAST_TOKEN, PLAIN, FixedTree, LastTokenStep, StepDecision, StepPolicy,
                                   TreeStep)
from dart_core.errors import DartInputError
from dart_core.head import id_outside_vocab
from dart_runtime.matmul import few_row_linears, trial_products
from dart_runtime.sync import synchronize
from dart_runtime.timing import now
from dart_core.tree import score_ranks
from dart_hf.compat import cache_from_caller, supports_logits_to_keep
from dart_hf.processors import batch_processor, processor_refusal
from dart_hf.stopping import Stopper, pad_token
from dart_hf.target import (AttentionLayout, TargetPlan, attention_layout, check_architecture, check_attention,
                            check_cache, check_ngram_fits, check_tree_fits, crop_cache, hidden_state_request,
                            keep_accepted_path, plan_for, prompt_positions, sliding_dropped, tapped_hidden_states,
                            tree_attention_mask, tree_forward, tree_settings, verify_kernels, whole_sliding_layers)


@dataclasses.dataclass
class DartStats:
    """Per-call statistics of DART decoding.

    accepted_lengths: accepted draft tokens of each sequence at each verify step (the bonus token not counted); one
        entry per sequence still decoding, `batch_rows` says whose.
    batch_rows: the caller's batch row of each entry of `accepted_lengths`.
    forwards: target forwards over trees (one per verify step, whatever the batch size).
    tree_sizes: the draft nodes (`remain_total`) each target forward was given; 0 for a plain step (the roots alone:
        one token per sequence, as a plain `generate()` step decides it; the step-size controller takes them to
        measure plain decoding or to finish a call plain, `dart_hf.controller`).
    tree_nodes: the largest tree drafted (nodes, the root included).
    accepted_head, accepted_context, accepted_both: accepted draft tokens whose node the head's search proposed
        alone, the model-free sources alone (the row's own context, earlier outputs or the n-gram table;
        docs/DESIGN.md §2.6-2.7), or both; they sum to the accepted draft tokens of the tree loop's steps.
    accepted_store, accepted_ngram: of those, the tokens whose node an earlier output (`OutputStore`) proposed, and
        those the n-gram table proposed (model-free drafting where nothing else matched).
    accepted_ranks: for each entry of `accepted_lengths`, the selection rank of each accepted node
        (`dart_core.tree.score_ranks`: 0-based position among the tree's draft nodes by score). A tree of R nodes
        built from the same candidates holds exactly the nodes of rank < R, so under greedy decoding it would have
        accepted the leading ranks < R (`accepted_within`, `tau_at`; see `dart_hf.calibration`). Filled by the tree
        loop only.
    tau: mean tokens produced per sequence and verify step, bonus included (before stopping criteria cut the last
        block).
    Times are wall-clock seconds: set-up (checks and preparation before the prefill), prefill (the target on the
    prompt, and on a cached prefix whose head state must be rebuilt), the first draft (the head's pass over the prompt
    and the first tree search; also counted in head / tree times), the whole call, head forwards (an `Eagle3Head`: all
    its draft levels with their top-k expansions), tree searches (an `Eagle3Head`: the final node selection), verify
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
    tree_sizes: list[int] = dataclasses.field(default_factory=list)
    tree_nodes: int = 0
    accepted_head: int = 0
    accepted_context: int = 0
    accepted_both: int = 0
    accepted_store: int = 0
    accepted_ngram: int = 0
    setup_time: float = 0.0
    prefill_time: float = 0.0
    first_draft_time: float = 0.0
    total_time: float = 0.0
    head_time: float = 0.0
    tree_time: float = 0.0
    verify_time: float = 0.0
    mask_time: float = 0.0
    target_time: float = 0.0
    accept_time: float = 0.0
    compact_time: float = 0.0
    sync_timing: bool = False

    def record(self, decision: StepDecision, outcome: "StepOutcome") -> None:
        """Add one verified step, which `decision` asked for (a last-token step is nobody's choice: no tree size)."""
        if not isinstance(decision, LastTokenStep):
            self.tree_sizes.append(decision.nodes if isinstance(decision, TreeStep) else 0)
        phases = outcome.phases
        if outcome.drafted:  # a step with a drafted tree (a lone root accepts nothing by construction)
            self.accepted_lengths += outcome.accepted
            self.batch_rows += outcome.rows
            self.accepted_ranks += outcome.ranks
            for i, name in enumerate(SOURCE_COUNTS):
                field = f"accepted_{name}"
                setattr(self, field, getattr(self, field) + sum(row[i] for row in outcome.sources))
            self.tree_nodes = max(self.tree_nodes, outcome.nodes)
            if not self.forwards:
                self.first_draft_time = outcome.drafting_seconds
        self.forwards += 1
        for phase in ("head", "tree", "mask", "target", "accept", "compact"):
            setattr(self, f"{phase}_time", getattr(self, f"{phase}_time") + phases.get(phase, 0.0))
        self.verify_time += sum(phases.get(phase, 0.0) for phase in VERIFY_PHASES)

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        return tau_of(sum(self.accepted_lengths), self.steps)

    @property
    def plain_steps(self) -> int:
        """Target forwards over the roots alone that a controller chose (`tree_sizes` 0)."""
        return self.tree_sizes.count(0)

    def merge(self, other: "DartStats") -> "DartStats":
        """Add `other`'s calls to this object (every list extended, every count and time summed, the larger tree
        kept): the statistics of several calls as one. Returns self."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, list):
                mine.extend(theirs)
            elif field.name == "tree_nodes":
                self.tree_nodes = max(mine, theirs)
            elif isinstance(mine, bool):
                setattr(self, field.name, mine or theirs)
            else:
                setattr(self, field.name, mine + theirs)
        return self

    def tau_by_row(self) -> dict[int, float]:
        """tau of each batch row."""
        out: dict[int, list[int]] = {}
        for row, accepted in zip(self.batch_rows, self.accepted_lengths):
            out.setdefault(row, []).append(accepted)
        return {row: tau_of(sum(a), len(a)) for row, a in sorted(out.items())}

    def accepted_within(self, remain_total: int) -> list[int]:
        """Per verify step: draft tokens a tree of `remain_total` nodes would have accepted from the same state
        (greedy), i.e. the leading accepted nodes of rank < remain_total (`dart_core.acceptance.accepted_within`)."""
        return [accepted_within(ranks, remain_total) for ranks in self.accepted_ranks]

    def tau_at(self, remain_total: int) -> float:
        """Estimated tau of a tree of `remain_total` draft nodes: 1 + mean of `accepted_within(remain_total)`."""
        counts = self.accepted_within(remain_total)
        return tau_of(sum(counts), len(counts))

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


SOURCE_COUNTS = ("head", "context", "both", "store", "ngram")  # `source_counts`' columns, `DartStats.accepted_*`
VERIFY_PHASES = ("mask", "target", "accept", "compact", "next")  # the phases of `verify_step`


class PhaseClock:
    """The phases of one step (or the prefill), timed in one place: `mark(phase)` adds the seconds since the previous
    mark to `phases[phase]`; with `sync` each reading waits for `device` first (an accelerator's phases are then its
    own, at the cost of those synchronisations). `kernel_trials`: whether few-row kernel trials ran since the start."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.device, self.sync = device, sync
        self.phases: dict[str, float] = {}
        self.trials = trial_products()
        self.start = self.last = self.read()

    def read(self) -> float:
        if self.sync:
            synchronize(self.device)
        return now()

    def mark(self, phase: str) -> None:
        t = self.read()
        self.phases[phase] = self.phases.get(phase, 0.0) + t - self.last
        self.last = t

    @property
    def seconds(self) -> float:
        """From the start to the last mark."""
        return self.last - self.start

    @property
    def kernel_trials(self) -> bool:
        """Whether some products since the start were few-row kernel trials (`dart_runtime.matmul.trial_product`):
        one-off work of this process in the seconds, not what such a step costs."""
        return trial_products() != self.trials


# ---- the statistics of each call, per thread ---------------------------------------------------------------------
_LAST_CALL = threading.local()  # .stats: WeakKeyDictionary model -> the DartStats of this thread's last call on it


def last_stats(model) -> Optional[DartStats]:
    """The statistics of the calling thread's last DART call on `model` (`model.dart_stats` on an enabled model):
    None before one, and after a call that DART refused or ran as plain generate()."""
    table = getattr(_LAST_CALL, "stats", None)
    return None if table is None else table.get(model)


def _record_stats(model, stats: Optional[DartStats]) -> None:
    table = getattr(_LAST_CALL, "stats", None)
    if table is None:
        table = _LAST_CALL.stats = weakref.WeakKeyDictionary()
    table[model] = stats


ENABLED_MARKER = "_dart_original"  # the class attribute of a model class `dart_hf.enable` made (the original class)


def is_enabled(model) -> bool:
    """Whether `dart_hf.enable` gave `model` DART generation (its generate() takes `dart_head=`)."""
    return hasattr(type(model), ENABLED_MARKER)


class NotApplicable(DartInputError):
    """DART cannot decode this call as plain generate() would (raised before any work): an explicit `dart_head=`
    reports it; a head attached with `dart_hf.enable(model, head)` runs plain generate() instead."""


@dataclasses.dataclass(frozen=True)
class DartOptions:
    """The DART settings of one generate() call (or the defaults `dart_hf.enable` attaches): the drafter (a head or
    `dart_core.ModelFreeDrafter`), and optionally an n-gram and tree settings that override its own, and the store of
    earlier outputs it matches. Each field is generate()'s `dart_<field>` argument."""

    head: Drafter
    ngram: object = None
    tree_config: Optional[TreeConfig] = None
    sync_timing: bool = False
    cuda_graph: bool = False
    stateless_processors: bool = False  # the caller declares its own logits processors stateless (dart_hf.processors)
    context_draft: Optional[bool] = None  # the row's own context as a draft source (None: the tree settings' choice)
    store: object = None  # an `OutputStore` of earlier outputs matched like the context; None or False: none

    def __post_init__(self) -> None:
        from dart_core.ngram import NGramModel

        if not isinstance(self.head, Drafter):
            raise TypeError(f"dart_head must be a dart_core.DartHead or ModelFreeDrafter, got "
                            f"{type(self.head).__name__}")
        if self.ngram is not None and not isinstance(self.ngram, NGramModel):
            raise TypeError(f"dart_ngram must be a dart_core.NGramModel (or None for the head's own), got "
                            f"{type(self.ngram).__name__}")
        if self.tree_config is not None and not isinstance(self.tree_config, TreeConfig):
            raise TypeError(f"dart_tree_config must be a dart_core.TreeConfig (or None for the head's own), got "
                            f"{type(self.tree_config).__name__}")
        for name in ("sync_timing", "cuda_graph", "stateless_processors"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"dart_{name} must be True or False, got {getattr(self, name)!r}")
        if self.context_draft is not None and not isinstance(self.context_draft, bool):
            raise TypeError(f"dart_context_draft must be True, False or None, got {self.context_draft!r}")
        if self.store is not None and self.store is not False and not isinstance(self.store, OutputStore):
            raise TypeError(f"dart_store must be a dart_core.OutputStore or False, got {type(self.store).__name__}")
        if not self.head.reads_hidden_states:  # model-free drafting: what it cannot serve, refused here
            check_model_free_tree(self.tree_config)
            if self.context_draft is False:
                raise DartInputError("model-free drafting proposes paths from the context alone: "
                                     "dart_context_draft=False leaves it nothing to draft")
            if self.cuda_graph:
                raise DartInputError("dart_cuda_graph=True replays a head's drafting pass; model-free drafting has "
                                     "none (its trees are built on the host)")

    @property
    def output_store(self) -> Optional[OutputStore]:
        """The store of earlier outputs the call matches (None: none)."""
        return self.store if isinstance(self.store, OutputStore) else None

    def with_call(self, asked: dict) -> "DartOptions":
        """These settings with a call's `dart_*` arguments (`asked`, without `dart_head`) taking precedence."""
        given = {name[len("dart_"):]: value for name, value in asked.items() if value is not None}
        return dataclasses.replace(self, **given)


# generate()'s DART arguments: `dart_` + each DartOptions field (dart_head, dart_ngram, dart_tree_config, ...)
DART_ARGUMENTS = tuple(f"dart_{field.name}" for field in dataclasses.fields(DartOptions))
# what `dart_hf.enable` binds for a call, which generate() does not pass a custom_generate callable (the streamer,
# the tokenizer, and the `StepPolicy` that chooses each step's tree when the call has no fixed tree)
BOUND_ARGUMENTS = ("dart_streamer", "dart_tokenizer", "dart_step_policy")


@dataclasses.dataclass
class Call:
    """One generate() call as DART decodes it: what generate() prepared, and the DART options."""

    model: object
    input_ids: torch.Tensor  # [B, T]
    logits_processor: object
    stopping_criteria: object
    generation_config: object
    synced_gpus: bool
    streamer: object
    tokenizer: object
    options: DartOptions
    model_kwargs: dict  # attention_mask, position_ids, past_key_values, ... as generate() prepared them
    policy: Optional[StepPolicy] = None  # decides each step (`dart_core.step_policy`); None: `options`' tree always

    @property
    def want_scores(self) -> bool:
        return bool(self.generation_config.return_dict_in_generate and self.generation_config.output_scores)

    @property
    def want_logits(self) -> bool:
        return bool(self.generation_config.return_dict_in_generate and self.generation_config.output_logits)


def _taking_dart_arguments(function):
    """`function` (whose DART arguments arrive in **kwargs) with a signature that names them: generate() passes a
    custom_generate callable only the arguments its signature names."""
    signature = inspect.signature(function)
    *fixed, rest = signature.parameters.values()
    named = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in DART_ARGUMENTS + BOUND_ARGUMENTS]
    function.__signature__ = signature.replace(parameters=[*fixed, *named, rest])
    return function


@_taking_dart_arguments
@torch.no_grad()
def dart_decoding(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                  synced_gpus: bool = False, streamer=None, **kwargs):
    """Tree decoding loop for `model.generate(..., custom_generate=dart_decoding, dart_head=head)`: `prefill`, then
    `draft` and `verify_step` while a row still needs tokens (docs/DESIGN.md §1.3); the stopping criteria are called
    exactly as plain generate() calls them (`dart_hf.stopping`).

    A batch [B, T] must be left-padded (`attention_mask`); every sequence drafts its own tree and one target forward
    verifies all of them. Output is exactly what `generate()` returns without DART on the same batch (greedy: token
    for token; sampling: same distribution per sequence). A `past_key_values` cache that holds a prefix of the input
    (batch size 1) is continued as plain generate() continues it: a cache a DART call left carries the head's state;
    for another, the head's state is rebuilt with one target forward over the cached prefix.
    `dart_ngram` overrides `dart_head.ngram`; `dart_tree_config` overrides `dart_head.tree_config` (default: the
    reference settings with the target's EOS). An `Eagle3Head` (the EAGLE3-style baseline) drafts its tree
    autoregressively instead (`dart_core.eagle3`, batch size 1), with `topk` as its branching, `max_depth` as its
    number of levels and `remain_total` as its node count; `dart_ngram` does not apply to it. Statistics of the call
    are in the dict output's `dart_stats` and in `last_stats(model)` (`DartStats`; `dart_sync_timing=True` makes its
    per-phase times wait for the device). `dart_cuda_graph=True` replays the head's drafting pass, the tree search
    with the trees' ancestor masks and greedy acceptance from CUDA graphs (CUDA only; elsewhere, or for a drafter
    whose candidates are not plain tensors, they run eagerly). Checks that fail raise `NotApplicable` before any
    work.

    The call runs in a copy of the caller's `contextvars` context: the kernels it switches on for its own forwards
    (`tree_forwards`) never reach another thread or outlive the call, even when it is interrupted.
    """
    dart = {name: kwargs.pop(name) for name in DART_ARGUMENTS + BOUND_ARGUMENTS if name in kwargs}
    if dart.get("dart_head") is None:
        raise ValueError("dart_decoding needs dart_head=<DartHead>")
    options = DartOptions(dart.pop("dart_head")).with_call({name: dart.get(name) for name in DART_ARGUMENTS[1:]})
    streamer = dart["dart_streamer"] if dart.get("dart_streamer") is not None else streamer
    call = Call(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                dart.get("dart_tokenizer"), options, kwargs, dart.get("dart_step_policy"))
    return contextvars.copy_context().run(_decode, call)


def _decode(call: Call):
    """`dart_decoding`'s body: prepare (every check), prefill, then steps (emit, decide, draft, verify) until done."""
    from dart_hf.calibration import load_kernel_choices, save_kernel_choices  # (calibration imports this module)

    t_start = now()
    _record_stats(call.model, None)
    run = _start(call)
    run.stats.setup_time = now() - t_start
    head, cache = call.options.head, run.verifier.cache
    with whole_sliding_layers(cache):  # sliding-window layers are compacted as full ones, then trimmed
        carried = _take_carried(cache, head, run.prepared.past)
        batch, step, head_cache = prefill(run.verifier, head, run.input_ids, run.prepared.attention_mask,
                                          run.prepared.positions, run.prepared.past, carried, run.context_len,
                                          run.stats)
        load_kernel_choices()  # what earlier processes measured here (once per process)
        while (producing := run.emit(batch, step, head_cache)) is not None:
            batch, step = producing
            clock = PhaseClock(batch.contexts.device, run.stats.sync_timing)
            decision = run.decide(batch, clock)
            trees, ancestors, pending, decision = run.draft(decision, batch, step, head_cache, clock)
            step = run.verify(decision, trees, ancestors, batch, pending, clock)
        output = run.finish(step, head_cache)
    run.stats.total_time = now() - t_start
    save_kernel_choices()  # what this call measured, for later processes on this machine
    return run.result(output)


def _start(call: Call) -> "Run":
    """Every check (`NotApplicable` before any work) and the call's settings, verifier, stopper and statistics."""
    head, config = call.options.head, call.generation_config
    try:
        prepared = _prepare(call)
        tree_config = tree_settings(head, config, call.options.tree_config, call.options.context_draft)
        check_tree_fits(head, tree_config)  # the head drafts this tree's top-k (refused before any work)
    except DartInputError as err:
        raise NotApplicable(str(err)) from None
    input_ids = call.input_ids.long()  # generate()'s output is int64 whatever integer type the prompt had
    ngram = call.options.ngram if call.options.ngram is not None else head.ngram
    policy = call.policy if call.policy is not None else FixedTree(tree_config.remain_total)
    policy.begin(bool(config.do_sample))
    largest = policy.max_tree_size
    depth = dataclasses.replace(tree_config, remain_total=largest).tree_depth(head.draft_length + 1)  # deepest node
    greedy_paths = functools.partial(accepted_greedy_paths, max_depth=depth)
    graphs = call.options.cuda_graph and input_ids.device.type == "cuda"
    if call.options.cuda_graph and not graphs:
        warnings.warn(f"dart_cuda_graph=True applies on CUDA only; on {input_ids.device.type} the drafting pass, tree "
                      "search and acceptance run eagerly", stacklevel=5)
    if graphs:  # kept with the head: later calls replay the graphs earlier ones captured
        greedy_paths = cached_graph(head.cuda_graphs, ("greedy_paths", depth), greedy_paths)
    verifier = _Verifier(call.model, prepared.plan, prepared.layout, prepared.cache, call.logits_processor,
                         bool(config.do_sample), greedy_paths, pad_token(config))
    stats = DartStats(prompt_tokens=int(prepared.attention_mask.sum()), sync_timing=call.options.sync_timing)
    _record_stats(call.model, stats)
    scores = [] if call.want_scores else None
    context = None
    if tree_config.context_draft:  # each row's prompt without its padding; the first new token joins at `emit`
        mask = prepared.attention_mask.bool()
        context = head.context_drafter([ids[keep] for ids, keep in zip(input_ids, mask)], tree_config,
                                       call.options.output_store, ngram)
    run = Run(call, prepared, input_ids, tree_config, policy, ngram, graphs, draft_context_length(ngram), verifier,
              Stopper(input_ids, call.stopping_criteria, config, scores), stats, scores,
              [] if call.want_logits else None, context=context)
    if call.streamer is not None:
        call.streamer.put(input_ids.cpu())
    return run


@dataclasses.dataclass
class Run:
    """A DART call under way: its settings and what it has produced so far."""

    call: Call
    prepared: "Prepared"
    input_ids: torch.Tensor  # [B, T] int64
    tree_config: TreeConfig  # the search settings; each step's `remain_total` is the policy's
    policy: StepPolicy  # decides each step (`dart_core.step_policy`)
    ngram: object  # the n-gram prior of the search (None: none)
    graphs: bool
    context_len: int  # tokens of context the n-gram prior reads
    verifier: "_Verifier"
    stopper: Stopper
    stats: DartStats
    scores: Optional[list]  # processed scores of each step (output_scores), else None
    raw_logits: Optional[list]  # raw logits of each step (output_logits), else None
    sequences: Optional[list] = None  # per caller's row, its tokens so far (left padding included), when read
    searches: dict = dataclasses.field(default_factory=dict)  # remain_total -> its `TreeSearch` (CUDA-graphed or not)
    context: Optional[ContextDrafter] = None  # the rows' own tokens as a draft source (docs/DESIGN.md §2.6), or None

    def __post_init__(self) -> None:
        if self.verifier.needs_prefixes or self.scores is not None or self.raw_logits is not None:
            self.sequences = list(self.input_ids.split(1))

    def emit(self, batch: "Batch", step: "Step", head_cache) -> Optional[tuple["Batch", "Step"]]:
        """Hand every row's new tokens to the stopper (and scores, prefixes, streamer) -> the batch and step of the
        rows that need more tokens (the others dropped from both caches), or None when the call is done."""
        for i, row in enumerate(batch.rows):
            tokens = step.tokens[i]
            if self.scores is not None or self.raw_logits is not None:
                _record_scores(self.scores, self.raw_logits, self.sequences[row], step.new_ids[i, : len(tokens)],
                               step.logits[i, step.nodes[i, : len(tokens)]], self.verifier.processors)
            if self.sequences is not None:
                self.sequences[row] = torch.cat((self.sequences[row], step.new_ids[i : i + 1, : len(tokens)]), dim=1)
            self.stopper.add(row, tokens)
        if self.context is not None:
            self.context.extend(step.tokens)
        decided = self.stopper.decide()
        if self.call.streamer is not None and decided[0]:
            self.call.streamer.put(torch.tensor(decided[0]))  # from the host: no device read
        if self.stopper.done:
            return None
        keep = [i for i, row in enumerate(batch.rows) if self.stopper.producing(row)]
        if len(keep) == len(batch.rows):
            return batch, step
        if self.context is not None:
            self.context.select(keep)
        return _drop_rows(batch, step, head_cache, self.verifier.cache, keep)

    def decide(self, batch: "Batch", clock: PhaseClock) -> StepDecision:
        """The next step: `LAST_TOKEN` when every row needs one token more, else the policy's decision (phase
        "decide" on `clock`, counted in the step's seconds, in no phase of the statistics)."""
        if all(self.stopper.remaining(row) == 1 for row in batch.rows):
            decision = LAST_TOKEN
        else:
            decision = self.policy.decide(len(batch.rows), self.verifier.cache.get_seq_length())
        clock.mark("decide")
        return decision

    def draft(self, decision: StepDecision, batch: "Batch", step: "Step", head_cache, clock: PhaseClock):
        """The trees `decision` asks for -> (trees, ancestors, the step with the head's pending rows consumed, the
        decision the trees carry out). A plain or last-token step verifies the roots alone (no head pass: the head's
        rows wait for the next draft; phase "roots" on `clock`), as plain decoding decides one token; a tree step
        whose drafter proposed nothing is a plain step."""
        if not isinstance(decision, TreeStep):
            trees, ancestors = root_trees(batch.contexts[:, -1:])
            clock.mark("roots")
            return trees, ancestors, step, decision
        tree_config = dataclasses.replace(self.tree_config, remain_total=decision.nodes)
        proposals = None if self.context is None else self.context.propose(batch.contexts.device,
                                                                           budget=decision.nodes)
        trees, ancestors = draft(self.call.options.head, self.search(tree_config), step, head_cache, batch,
                                 tree_config, self.graphs, clock, proposals)
        consumed = dataclasses.replace(step, head_rows=step.head_rows.consumed())
        return trees, ancestors, consumed, decision if trees.num_nodes > 1 else PLAIN

    def search(self, tree_config: TreeConfig):
        """The tree search with `tree_config` (replayed from a CUDA graph kept with the head where `graphs`)."""
        search = self.searches.get(tree_config.remain_total)
        if search is None:
            search = TreeSearch(self.call.options.head, self.ngram, tree_config)
            if self.graphs:  # kept with the head: later calls replay the graphs earlier ones captured
                search = cached_graph(self.call.options.head.cuda_graphs, (self.ngram, tree_config), search)
            self.searches[tree_config.remain_total] = search
        return search

    def verify(self, decision: StepDecision, trees: DraftTreeBatch, ancestors: torch.Tensor, batch: "Batch",
               pending: "Step", clock: PhaseClock) -> "Step":
        """Verify the trees (`verify_step`) and hand the outcome to the statistics and to the policy (a last-token
        step is nobody's choice: not reported) -> the next step."""
        outcome = verify_step(self.verifier, trees, ancestors, batch, self.sequences, pending, clock)
        self.stats.record(decision, outcome)
        if not isinstance(decision, LastTokenStep):
            self.policy.observe(decision, outcome)
        return outcome.step

    def finish(self, step: "Step", head_cache) -> torch.Tensor:
        """The output [B, T + steps]; a batch-of-one cache cropped as plain leaves it, carrying the head's state."""
        if self.call.streamer is not None:
            self.call.streamer.end()
        output = self.stopper.output()
        self.stats.new_tokens = self.stopper.new_tokens
        for kept in (self.scores, self.raw_logits):
            if kept is not None:
                del kept[self.stopper.steps:]
        cache = self.verifier.cache
        if self.input_ids.shape[0] == 1 and self.call.generation_config.use_cache:
            excess = cache.get_seq_length() - (output.shape[1] - 1)
            if excess > 0:  # what plain generate() leaves: every token but the last
                crop_cache(cache, excess)
            _carry(cache, self.call.options.head, head_cache, step, output.shape[1] - 1,
                   self.prepared.attention_mask)
        return output

    def result(self, output: torch.Tensor):
        """What generate() returns: the output, or with return_dict_in_generate a `DartGenerateOutput`."""
        if not self.call.generation_config.return_dict_in_generate:
            return output
        from dart_hf.outputs import DartGenerateOutput

        # with several sequences the cache lost the finished ones' rows: it is not returned
        batch_of_one = self.input_ids.shape[0] == 1 and self.call.generation_config.use_cache
        return DartGenerateOutput(sequences=output, scores=None if self.scores is None else tuple(self.scores),
                                  logits=None if self.raw_logits is None else tuple(self.raw_logits),
                                  past_key_values=self.verifier.cache if batch_of_one else None,
                                  dart_stats=self.stats)


@dataclasses.dataclass
class Batch:
    """The sequences still decoding and their rows of the target's KV cache (row i of every tensor = rows[i])."""

    rows: list[int]  # the caller's batch row of each sequence
    columns: torch.Tensor  # [B, S] bool: cache columns holding the sequence's tokens (not padding, not holes)
    root_positions: torch.Tensor  # [B] int64: the position id of each sequence's root (the token after the cache)
    contexts: torch.Tensor  # [B, C] the last C tokens of each sequence, ending with the root (left-padded with -1)
    dense: bool  # known on the host: every cache column of every row holds a token (no padding, no hole)

    def select(self, keep: torch.Tensor) -> "Batch":
        return Batch([self.rows[i] for i in keep.tolist()], self.columns[keep], self.root_positions[keep],
                     self.contexts[keep], self.dense)


@dataclasses.dataclass
class Step:
    """What the prefill or a verify step hands to emission and the next draft, row i for sequence `Batch.rows[i]`."""

    tokens: list[list[int]]  # new tokens of each sequence, on the host: accepted draft tokens + the bonus token
    new_ids: torch.Tensor  # [B, k] those tokens, right-padded (k = the longest)
    nodes: torch.Tensor  # [B, k] the node of each token's logits in `logits` (the path, root first)
    logits: torch.Tensor  # [B, N, V] the target logits of the verified tree's nodes (the prompt's last: N = 1)
    head_rows: "PendingRows"  # the rows the head has not consumed yet

    def select(self, keep: torch.Tensor) -> "Step":
        return Step([self.tokens[i] for i in keep.tolist()], self.new_ids[keep], self.nodes[keep], self.logits[keep],
                    self.head_rows.select(keep))


class PendingRows:
    """The head's rows not consumed yet, per sequence: the target's tapped hidden states and the token each row embeds
    (the next one, docs/DESIGN.md §2.1), left-aligned, the first `lengths[b]` of `width` real. Held in buffers with
    room to grow, so that a run of steps without drafting (plain steps) appends each step's rows in place rather
    than copying every pending row again."""

    def __init__(self, aux: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, width: Optional[int] = None):
        """aux [B, C, 3*Ht], ids [B, C], lengths [B]; the first `width` (default C) columns are in use."""
        self._aux, self._ids, self.lengths = aux, ids, lengths
        self.width = aux.shape[1] if width is None else width

    @property
    def aux(self) -> torch.Tensor:
        """[B, width, 3*Ht] the hidden states (rows past a sequence's length are padding)."""
        return self._aux[:, : self.width]

    @property
    def ids(self) -> torch.Tensor:
        """[B, width] the token each row embeds."""
        return self._ids[:, : self.width]

    def append(self, aux: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> "PendingRows":
        """These rows with the first counts[b] rows of aux [B, k, 3*Ht] / ids [B, k] after sequence b's. The buffers
        are written in place (this object's rows stay as they were) and grow by doubling."""
        k = aux.shape[1]
        width = self.width + k
        aux_buffer, ids_buffer = self._aux, self._ids
        capacity = aux_buffer.shape[1]
        if width > capacity:
            grow = max(width, 2 * capacity) - capacity
            b, _, hidden = aux_buffer.shape
            aux_buffer = torch.cat((aux_buffer, aux_buffer.new_zeros(b, grow, hidden)), 1)
            ids_buffer = torch.cat((ids_buffer, ids_buffer.new_zeros(ids_buffer.shape[0], grow)), 1)
        # a sequence's rows go after its own; its padding rows land past its new length, where later rows overwrite
        index = self.lengths[:, None] + torch.arange(k, device=ids.device)  # [B, k], < width
        aux_buffer.scatter_(1, index[..., None].expand(-1, -1, aux.shape[2]), aux.to(aux_buffer.dtype))
        ids_buffer.scatter_(1, index, ids)
        return PendingRows(aux_buffer, ids_buffer, self.lengths + counts, width)

    def consumed(self) -> "PendingRows":
        """No rows pending (the head has read them all); the buffers are kept for the rows to come."""
        return PendingRows(self._aux, self._ids, torch.zeros_like(self.lengths), 0)

    def select(self, keep: torch.Tensor) -> "PendingRows":
        """The rows of sequences `keep` [B'] only."""
        return PendingRows(self.aux[keep], self.ids[keep], self.lengths[keep])


@dataclasses.dataclass
class _Verifier:
    """The target side of a call: model, taps, KV cache and how tokens are chosen (processors, sampling)."""

    model: object
    plan: TargetPlan
    layout: AttentionLayout
    cache: object
    processors: object
    do_sample: bool
    greedy_paths: object  # `accepted_greedy_paths` with the depth bound (CUDA-graphed or not)
    pad: Optional[int] = None  # generate()'s pad token: fills other rows' prefixes in the processors' batch

    def __post_init__(self) -> None:
        if self.processors is not None and not len(self.processors):
            self.processors = None

    @property
    def needs_prefixes(self) -> bool:
        """Whether acceptance reads each row's prefix (logits processors, sampling)."""
        return self.processors is not None or self.do_sample

    def accept(self, trees: DraftTreeBatch, logits: torch.Tensor, ancestors: torch.Tensor,
               sequences: Optional[list[torch.Tensor]], rows: list[int]) -> "Paths":
        """The accepted path of every tree: logits [B, N, V] of its nodes, ancestors [B, N, N]; tree b is the
        caller's row rows[b] and `sequences` holds every caller's row's tokens [1, L_r], ending with the roots (None
        when `needs_prefixes` is false). Greedy without processors runs on the device without a host
        synchronisation."""
        if trees.num_nodes == 1:  # lone roots: a plain generate() step's choice, no walk
            if not self.needs_prefixes:
                bonus = logits[:, 0].argmax(dim=-1)  # [B] generate()'s argmax
            else:
                bonus = torch.tensor(choose_at_roots(logits[:, 0], [sequences[row][0] for row in rows],
                                                     self._process(sequences, rows), self.do_sample),
                                     device=logits.device)
            b = bonus.shape[0]
            return Paths(bonus.new_zeros(b), bonus, bonus.new_zeros(b, 1), trees.tokens[:, :1], bonus.new_zeros(b, 0))
        if not self.needs_prefixes:
            return Paths(*self.greedy_paths(trees.tensors(), logits, ancestors))
        result = verify_tree(trees, logits, context_ids=[sequences[row][0] for row in rows],
                             logits_processor=self._process(sequences, rows), do_sample=self.do_sample)
        return Paths(*path_summary(trees, result))

    def _process(self, sequences: list[torch.Tensor], rows: list[int]) -> Optional[BatchedProcessor]:
        """The processors over tree rows `rows` of the caller's batch (`batch_processor`), or None without any."""
        return None if self.processors is None else batch_processor(self.processors, sequences, rows, self.pad)


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


def root_trees(roots: torch.Tensor) -> tuple[DraftTreeBatch, torch.Tensor]:
    """One-node trees of the roots [B, 1] (each row's last token): a step that decides the next token alone, as a
    plain generate() step does -> (trees, ancestors [B, 1, 1])."""
    b, device = roots.shape[0], roots.device
    trees = DraftTreeBatch(roots, torch.full((b, 1), -1, device=device),
                           torch.zeros(b, 1, dtype=torch.long, device=device), torch.zeros(b, 1, device=device),
                           torch.ones(b, 1, dtype=torch.bool, device=device))
    return trees, torch.ones(b, 1, 1, dtype=torch.bool, device=device)


@dataclasses.dataclass
class Carried:
    """The head's state for a cache a DART call left (batch size 1): the head cache of the rows it consumed and the
    target's tapped hidden states of the positions after them, up to the cache's length `past`."""

    head: "weakref.ref[DartHead]"
    head_cache: object  # the head's cache (`DartHead.new_cache`): rows 0..consumed-1
    aux: torch.Tensor  # [1, past - consumed, 3*Ht]
    past: int


CARRIED_ATTRIBUTE = "dart_head_state"  # where a DART call leaves `Carried` on the cache it continues


def _take_carried(cache, head: DartHead, past: int) -> Optional[Carried]:
    """The head's state `cache` carries for `head` at its current length, removed from it (None without one)."""
    carried = getattr(cache, CARRIED_ATTRIBUTE, None)
    if carried is None:
        return None
    setattr(cache, CARRIED_ATTRIBUTE, None)
    return carried if carried.head() is head and carried.past == past else None


def _carry(cache, head: DartHead, head_cache, step: "Step", past: int, attention_mask: torch.Tensor) -> None:
    """Leave on `cache` (cropped to `past` positions) what the head needs to continue from it (batch size 1, no
    padding): the pending rows of `step` up to position past-1."""
    if not bool(attention_mask.all()):
        return
    consumed = int(head_cache.lengths[0])
    pending = past - consumed
    if not 0 <= pending <= step.head_rows.width:
        return
    setattr(cache, CARRIED_ATTRIBUTE, Carried(weakref.ref(head), head_cache, step.head_rows.aux[:, :pending].clone(),
                                              past))


def prompt_rows(model, plan: TargetPlan, prefix: torch.Tensor) -> torch.Tensor:
    """The target's tapped hidden states [1, P, 3*Ht] of `prefix` [1, P], computed into a scratch cache: the head's
    rows of a cache that carries no head state."""
    from transformers import DynamicCache

    if not plan.layer_ids:  # a drafter that reads no hidden states: no forward
        return tapped_hidden_states(None, (), prefix)
    out = model(input_ids=prefix, past_key_values=DynamicCache(config=model.config), use_cache=True,
                output_hidden_states=list(plan.layer_ids), **_last_logits_only(model))
    return tapped_hidden_states(out, plan.layer_ids)


def _last_logits_only(model) -> dict:
    """The forward argument that keeps only the last position's logits, where the model has it."""
    return {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}


def prefill(verifier: _Verifier, head: DartHead, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            positions: torch.Tensor, past: int, carried: Optional[Carried], context_len: int,
            stats: DartStats) -> tuple[Batch, Step, object]:
    """The target over the left-padded prompts [B, T] (position ids `positions` [B, T]) after the `past` positions
    already in the cache (batch size 1 when past > 0); each row's later tokens take the positions after its last.
    Each last position picks the first token, verified as a one-node tree so that logits processors and sampling
    apply exactly as in every later step -> (batch, step, head cache). The step's head rows cover every
    position the head has not consumed: after `carried`'s, or from 0 (for a cache without it, the prefix's hidden
    states come from one more target forward)."""
    device = input_ids.device
    clock = PhaseClock(device, stats.sync_timing)
    b, t = input_ids.shape
    model, plan = verifier.model, verifier.plan
    padded = not bool(attention_mask.all())
    out = model(input_ids=input_ids[:, past:], attention_mask=attention_mask if padded else None,
                position_ids=positions[:, past:], past_key_values=verifier.cache,
                use_cache=True, output_hidden_states=hidden_state_request(plan.layer_ids), **_last_logits_only(model))
    logits = out.logits[:, -1:].float()  # [B, 1, V]
    roots, ancestors = root_trees(input_ids[:, -1:])
    first = verifier.accept(roots, logits, ancestors, list(input_ids.split(1)), list(range(b))).bonus  # [B]
    # the head reads each prompt's real rows from its first one: left-align them (R = the longest prompt)
    real = attention_mask.sum(dim=1) - past  # [B] new real positions
    rows = int(real.max())
    index = (t - past - real[:, None] + torch.arange(rows, device=device)).clamp(max=t - past - 1)  # [B, R]
    shifted = torch.cat((input_ids[:, past + 1:], first[:, None]), dim=1)  # [B, T-past] column c: the token after c
    aux = tapped_hidden_states(out, plan.layer_ids, input_ids[:, past:])
    aux_rows, head_ids = aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1])), shifted.gather(1, index)
    head_lengths = real
    if past:  # batch size 1: the rows from the head's last consumed one up to the cache's end come first
        if carried is not None:
            head_cache, start, before = carried.head_cache, past - carried.aux.shape[1], carried.aux
        else:
            head_cache, start, before = head.new_cache(1), 0, prompt_rows(model, plan, input_ids[:, :past])
        aux_rows = torch.cat((before.to(aux_rows.dtype), aux_rows), dim=1)
        head_ids = torch.cat((input_ids[:, start + 1 : past + 1], head_ids), dim=1)
        head_lengths = real + (past - start)
    else:
        head_cache = head.new_cache(b)
    tokens = torch.where(attention_mask.bool(), input_ids, -1)
    contexts = torch.cat((torch.full((b, context_len), -1, device=device), tokens, first[:, None]), dim=1)
    batch = Batch(list(range(b)), attention_mask.bool(), positions[:, -1] + 1, contexts[:, -context_len:],
                  not padded)
    step = Step([[x] for x in first.tolist()], first[:, None], torch.zeros(b, 1, dtype=torch.long, device=device),
                logits, PendingRows(aux_rows, head_ids, head_lengths))
    clock.mark("prefill")
    stats.prefill_time = clock.seconds
    return batch, step, head_cache


@dataclasses.dataclass
class TreeSearch:
    """The drafter's tree search and the trees' ancestor masks: (candidates, contexts [B, C]) -> (trees,
    ancestors [B, N, N]). Fixed shapes, no host synchronisation: what `dart_cuda_graph` replays."""

    head: DartHead
    ngram: object
    tree_config: TreeConfig

    def __call__(self, candidates, contexts: torch.Tensor,
                 proposals: tuple = ()) -> tuple[DraftTreeBatch, torch.Tensor]:
        """`proposals`: the `ContextProposals` tensors of the rows' context paths, or () without them."""
        context = ContextProposals(*proposals) if proposals else None
        trees = self.head.build_tree(candidates, contexts, self.ngram, self.tree_config, context=context)
        return trees, trees.ancestor_mask()


def draft(head: DartHead, search, step: Step, head_cache, batch: Batch, tree_config: TreeConfig, cuda_graph: bool,
          clock: PhaseClock, proposals: Optional[ContextProposals] = None) -> tuple[DraftTreeBatch, torch.Tensor]:
    """One drafting pass over every sequence's pending head rows (a DART head: one forward with its mask rows) and
    the tree search (`TreeSearch`; the drafter interface, docs/DESIGN.md §1.2) with the rows' context paths
    `proposals` where given -> (trees, ancestors [B, N, N]); phases "head" and "tree" on `clock`."""
    rows = step.head_rows
    with few_row_linears(head):
        candidates = head.draft(rows.aux, rows.ids, rows.lengths, head_cache, tree_config, cuda_graph=cuda_graph)
    clock.mark("head")
    trees, ancestors = search(candidates, batch.contexts, () if proposals is None else proposals.tensors())
    clock.mark("tree")
    return trees, ancestors


@dataclasses.dataclass
class StepOutcome:
    """What one verify step did, handed to the statistics (`DartStats.record`) and to the policy
    (`dart_core.step_policy.VerifiedStep`); row i is sequence `rows[i]`."""

    step: Step  # the next step: each sequence's new tokens and the head's pending rows
    rows: list[int]  # the caller's batch row of each sequence
    accepted: list[int]  # accepted draft tokens of each sequence (the bonus not counted)
    ranks: list[list[int]]  # the selection rank of each accepted node (`dart_core.tree.score_ranks`)
    sources: list[list[int]]  # per sequence, its accepted tokens by source (`source_counts`, `SOURCE_COUNTS`)
    nodes: int  # the trees' nodes, the root included (1: the roots alone)
    context_length: int  # cache positions before the step
    seconds: float  # the whole step, drafting included
    phases: dict[str, float]  # seconds by phase (`PhaseClock`)
    one_off: bool  # the step ran few-row kernel trials: its seconds hold one-off work (`PhaseClock.kernel_trials`)

    @property
    def drafted(self) -> bool:
        """Whether the step verified a drafted tree (a lone root accepts nothing by construction)."""
        return self.nodes > 1

    @property
    def drafting_seconds(self) -> float:
        """Seconds of the step's drafting: the drafter's pass and the tree search (0 for the roots alone)."""
        return self.phases.get("head", 0.0) + self.phases.get("tree", 0.0)

    @property
    def batch_size(self) -> int:
        return len(self.rows)


def verify_step(verifier: _Verifier, trees: DraftTreeBatch, ancestors: torch.Tensor, batch: Batch,
                sequences: Optional[list[torch.Tensor]], pending: Step, clock: PhaseClock) -> StepOutcome:
    """One target forward over all trees, acceptance, and the KV cache compacted to the accepted paths (rows that
    accepted fewer tokens than the longest leave masked holes); phases "mask", "target", "accept", "compact" and
    "next" (the next step's rows) on `clock`. One host synchronisation: the accepted paths. The new step's head rows
    follow the rows of `pending` the head has not consumed yet."""
    device = batch.contexts.device
    dtype = next(verifier.model.parameters()).dtype
    past = verifier.cache.get_seq_length()
    if trees.num_nodes == 1 and len(batch.rows) == 1 and batch.dense and verifier.layout.window is None:
        mask = None  # one token over a whole cache: plain's own step, the model's own (causal) mask
    else:
        mask = tree_attention_mask(ancestors, batch.columns, dtype, trees.depths, verifier.layout,
                                   sliding_dropped(verifier.cache, past))
    clock.mark("mask")
    with verify_kernels(verifier.model, trees.tokens.numel()):
        out = tree_forward(verifier.model, trees.tokens, batch.root_positions[:, None] + trees.depths, mask,
                           verifier.cache, verifier.plan.layer_ids)
    clock.mark("target")
    logits = out.logits.float()  # [B, N, V]
    paths = verifier.accept(trees, logits, ancestors, sequences, batch.rows)
    d = paths.ranks.shape[1]
    sources = source_counts(trees, paths.nodes, paths.accept_length)  # [B, 5]
    # the step's one synchronisation: per row [a, ranks (d), nodes (d+1), tokens (d+1), bonus, sources (5)]
    host = torch.cat((paths.accept_length[:, None], paths.ranks, paths.nodes, paths.tokens, paths.bonus[:, None],
                      sources), dim=1).tolist()
    accepted = [row[0] for row in host]
    ranks = [row[1 : 1 + a] for row, a in zip(host, accepted)]
    path_nodes = [row[1 + d : 2 + d + a] for row, a in zip(host, accepted)]  # root first
    new_tokens = [row[3 + 2 * d : 3 + 2 * d + a] + [row[-6]] for row, a in zip(host, accepted)]  # drafts, bonus
    k = max(accepted) + 1
    clock.mark("accept")
    if trees.num_nodes > 1:  # a lone root's position is kept: nothing to drop
        at_front = all(nodes == list(range(len(nodes))) for nodes in path_nodes)
        keep_accepted_path(verifier.cache, past, paths.nodes[:, :k], at_front)
    clock.mark("compact")
    real = torch.arange(k, device=device) <= paths.accept_length[:, None]  # [B, k]
    new_ids = torch.cat((paths.tokens[:, 1:k], paths.tokens[:, :1]), dim=1).scatter(
        1, paths.accept_length[:, None], paths.bonus[:, None])  # [B, k] accepted tokens, bonus, padding
    counts = paths.accept_length + 1
    batch.columns = torch.cat((batch.columns, real), dim=1)
    batch.dense = batch.dense and min(accepted) == max(accepted)  # a shorter path leaves a hole
    batch.root_positions = batch.root_positions + counts
    batch.contexts = torch.cat((batch.contexts, new_ids), dim=1).gather(
        1, counts[:, None] + torch.arange(batch.contexts.shape[1], device=device))
    aux = tapped_hidden_states(out, verifier.plan.layer_ids, trees.tokens)  # [B, N, 3*Ht]
    if trees.num_nodes > 1:
        aux = aux.gather(1, paths.nodes[:, :k, None].expand(-1, -1, aux.shape[-1]))  # [B, k, 3*Ht] the paths' rows
    step = Step(new_tokens, new_ids, paths.nodes[:, :k], logits, pending.head_rows.append(aux, new_ids, counts))
    clock.mark("next")
    return StepOutcome(step, batch.rows, accepted, ranks, [row[len(row) - len(SOURCE_COUNTS):] for row in host],
                       trees.num_nodes, past, clock.seconds, clock.phases, clock.kernel_trials)


def source_counts(trees: DraftTreeBatch, nodes: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """Per row, its accepted draft tokens proposed by the head's search alone, by the model-free sources alone
    (context, store, n-gram), by both, and of all those, by the store and by the n-gram table
    (`DraftTreeBatch.sources`) -> [B, 5] int64. nodes [B, d+1] the accepted path, root first; accept_length [B]."""
    accepted = nodes[:, 1:]
    source = trees.sources.gather(1, accepted)  # [B, d]
    real = torch.arange(accepted.shape[1], device=nodes.device) < accept_length[:, None]
    head, other = (source & SOURCE_HEAD) != 0, (source & ~SOURCE_HEAD) != 0
    kinds = torch.stack((head & ~other, other & ~head, head & other, (source & SOURCE_STORE) != 0,
                         (source & SOURCE_NGRAM) != 0), -1)
    return (kinds & real[..., None]).sum(dim=1)


def _drop_rows(batch: Batch, step: Step, head_cache, cache, keep: list[int]) -> tuple[Batch, Step]:
    """The batch without the sequences that need no more tokens: rows `keep` of the batch, the step and both
    caches."""
    index = torch.tensor(keep, device=batch.contexts.device)
    cache.batch_select_indices(index)
    head_cache.select_rows(index)
    return batch.select(index), step.select(index)


@dataclasses.dataclass
class Prepared:
    """What a call's checks establish before any work."""

    plan: TargetPlan
    layout: AttentionLayout
    attention_mask: torch.Tensor  # [B, T] int64: zeros (left padding) then ones
    positions: torch.Tensor  # [B, T] int64: the position id of each prompt token (generate()'s or the caller's)
    cache: object  # the target's KV cache
    past: int  # positions the cache already holds


def _prepare(call: Call) -> Prepared:
    """Every check that can fail, before any work."""
    model, head, input_ids, generation_config = call.model, call.options.head, call.input_ids, call.generation_config
    model_kwargs, streamer = call.model_kwargs, call.streamer
    want_scores = call.want_scores or call.want_logits
    mode = generation_config.get_generation_mode()
    if mode.value not in ("greedy_search", "sample"):
        raise DartInputError(f"DART decodes by greedy search or sampling; this call asks for {mode.value} "
                             f"({_mode_arguments(generation_config, mode.value)})")
    check_architecture(model)
    check_attention(model)
    layout = attention_layout(model)
    if generation_config.num_return_sequences != 1:
        raise DartInputError("DART returns one sequence per prompt (num_return_sequences must be 1)")
    if call.synced_gpus:
        raise DartInputError("synced_gpus (DeepSpeed ZeRO-3 / FSDP across devices) is not supported with DART")
    if model_kwargs.get("inputs_embeds") is not None:
        raise DartInputError("inputs_embeds is not supported with DART: the head and the n-gram read token ids; "
                             "pass input_ids")
    batch_size = input_ids.shape[0]
    if head.max_batch_size is not None and batch_size > head.max_batch_size:
        raise DartInputError(f"{type(head).__name__} drafts at most {head.max_batch_size} sequence(s) at a time; got "
                             f"batch size {batch_size}")
    pad = pad_token(generation_config)
    if batch_size > 1 and pad is not None and pad < 0:
        raise DartInputError(f"pad_token_id {pad} is not a token id: rows that finish early are padded with it, and "
                             "the target embeds it")
    if batch_size > 1 and streamer is not None:
        raise DartInputError("streamers take one sequence (batch size 1), as in transformers; got batch size "
                             f"{batch_size}")
    refusal = processor_refusal(call.logits_processor, call.options.stateless_processors)
    if refusal is not None:
        raise DartInputError(refusal)
    if batch_size > 1 and want_scores:
        raise DartInputError("output_scores / output_logits with dart_head need batch size 1 (sequences of a batch "
                             "advance by different numbers of tokens per step)")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        raise DartInputError("output_attentions / output_hidden_states are not available with dart_head (the target "
                             "runs over draft trees, not one token per step)")
    if not generation_config.use_cache:
        raise DartInputError("DART tree decoding needs use_cache=True")
    if input_ids.dtype not in (torch.int64, torch.int32):  # what an embedding takes
        raise DartInputError(f"input_ids must be int64 (or int32) token ids, got {input_ids.dtype}")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    _check_left_padding(attention_mask, input_ids)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = prompt_positions(attention_mask)
    elif positions.dim() != 2 or positions.shape[1] != input_ids.shape[1] or positions.shape[0] not in (1, batch_size):
        raise DartInputError(f"position_ids shape {list(positions.shape)} does not match input_ids "
                             f"{list(input_ids.shape)} (generate() makes position ids from the attention_mask: check "
                             "that it covers every token of input_ids)")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    bad = id_outside_vocab(input_ids, vocab)
    if bad is not None:
        raise DartInputError(f"input_ids hold token id {bad}, outside the target vocabulary 0..{vocab - 1}")
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        raise DartInputError("generate() prepared no cache; DART needs a DynamicCache")
    check_cache(cache)
    past = cache.get_seq_length()
    if batch_size > 1 and (past or cache_from_caller(cache)):
        raise DartInputError("a past_key_values cache passed in needs batch size 1 with DART (finished sequences "
                             "leave its cache)")
    if past and past >= input_ids.shape[1]:
        raise DartInputError(f"the cache holds {past} positions but input_ids only {input_ids.shape[1]}: pass the "
                             "whole sequence, the cached prefix included, and at least one new token")
    ngram = call.options.ngram if call.options.ngram is not None else head.ngram
    if ngram is not None:
        check_ngram_fits(ngram, model, call.tokenizer)
    return Prepared(plan_for(model, head, call.tokenizer), layout, attention_mask.long(),
                    positions.expand(batch_size, -1).long(), cache, past)


MODE_ARGUMENTS = {"beam_search": "num_beams", "beam_sample": "num_beams", "group_beam_search": "num_beam_groups",
                  "constrained_beam_search": "constraints / force_words_ids",
                  "contrastive_search": "penalty_alpha, top_k", "dola_generation": "dola_layers",
                  "assisted_generation": "assistant_early_exit / use_mtp"}


def _mode_arguments(generation_config, mode: str) -> str:
    """The generate() arguments that chose decoding `mode`, with their values where they are numbers."""
    names = MODE_ARGUMENTS.get(mode, "")
    if names in ("num_beams", "num_beam_groups"):
        return f"{names}={getattr(generation_config, names)}"
    return names


def _check_left_padding(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Each row of the [B, T] mask must be zeros (padding) then ones (tokens), with at least one token."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise DartInputError(f"attention_mask shape {list(attention_mask.shape)} does not match input_ids "
                             f"{list(input_ids.shape)}")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise DartInputError("attention_mask must hold 0 (padding) and 1 (token) only")
    mask = attention_mask.long()
    empty = (mask.sum(dim=1) == 0).nonzero()
    if empty.numel():
        raise DartInputError(f"row {int(empty[0])} of the batch is all padding (attention_mask all zeros)")
    bad = (mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()
    if bad.numel():
        raise DartInputError(f"row {int(bad[0])} has padding after a token: DART needs left padding (set "
                             "tokenizer.padding_side = 'left'). If the prompt is not padded, generate() may have "
                             "guessed padding from pad_token_id occurring in it: pass "
                             "attention_mask=torch.ones_like(input_ids)")


def _record_scores(scores: Optional[list], raw_logits: Optional[list], sequence, new_tokens, path_logits,
                   processors) -> None:
    """For each new token i: the raw logits [1, V] that chose it and the scores processed with its own prefix."""
    for i in range(new_tokens.shape[0]):
        logits = path_logits[i : i + 1].clone()  # [1, V]
        if raw_logits is not None:
            raw_logits.append(logits)
        if scores is not None:
            prefix = torch.cat((sequence, new_tokens[None, :i]), dim=1)
            scores.append(logits if processors is None else processors(prefix, logits.clone()))
