"""What each verify step of a call does, as a typed decision (`TreeStep`, `PLAIN`, `LAST_TOKEN`), and the policies
that decide it (`StepPolicy`): a fixed tree (`FixedTree`) or the speed rule (`CallPolicy`, over a
`dart_core.speed.SpeedController`). Framework-free: a decoding loop asks `decide` before every step and hands the
step's outcome to `observe`.

How a call uses the speed rule (`CallPolicy`): each step takes the best tree R* of its regime among the sizes timed
there (the controller's start size until one is), except that every `EXPLORE_EVERY`-th step of a regime tries a
neighbouring size (up and down in turn: a larger tree also measures tau above R*); one not timed there only once every
`NEW_SIZE_EVERY` steps of the regime, and then until a step of it is timed (`dart_core.speed`). For an attached head, a
regime's first steps (until plain's cost there starts from its first timed plain steps, `dart_core.speed.first_plain_s`)
and every `PLAIN_EVERY`-th one are plain steps, which measure plain decoding there; so is one in every `EXPLORE_EVERY`
of a regime's first `PLAIN_EVERY` steps in a process while DART's expected gain there is below `MARGINAL`
(`remeasures_plain`), so that a verdict that could go either way follows plain's cost as the call finds it, not as a
slow or fast spell at the regime's start made it.

Falling back, for an attached head (`dart_hf.enable(model, head)`): once a call has made `WINDOW` DART steps in a
regime, whenever the expected speedup there by the sizes timed there is below 1 and so is the rate of the call's last
`WINDOW` steps, the call finishes that regime plain (the roots alone, one token per sequence and step, exactly as plain
decoding decides it), and later calls that start in the regime run as plain `generate()`, with one `DartFallbackWarning`
per regime and the numbers. Where both speedups are below `CALL_MARGIN` but not both below 1, the call alone finishes
the regime plain (a gain that small is within the estimates' error); later calls there run DART as before. Whatever the
estimates say, a call stops drafting once its DART steps' loss against plain spends its budget
(`dart_core.speed.CallLoss`); that call's steps there may give the verdict as above (its observed speedup standing for
the expected one while the estimates have none), and so does a probe or the `SPENT_CALLS`-th call in a row that spends
its budget in the regime. A step that ran one-off work of the process (`VerifiedStep.one_off`: the few-row kernels'
trials) is not timed for the estimates (its time says nothing of later steps), so the sizes timed in a regime show
DART slower only by steps without it; it counts in its call's loss and in the rate of the call's last steps as any
step does (a call pays for it). After `FIRST_PROBE_AFTER` plain calls (doubling after every probe that loses, up to
`MAX_PROBE_AFTER`) a call in the regime runs DART again (a probe): steps timed on a loaded machine switch DART off only
until then. The verdict follows the latest evidence of any call: a call with `dart_head=` (which decodes with DART
whatever the estimates say; its tree sizes still adapt) or with a fixed tree that shows DART pays in a plain regime,
by a tree size timed there, sends later attached calls there back to DART, and one that shows it loses sends them
plain."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Union

from dart_core.acceptance import tau_of
from dart_core.speed import (CALL_MARGIN, EXPLORE_EVERY, MARGINAL, MIN_PLAIN_WEIGHT, NEW_SIZE_EVERY, PLAIN_EVERY,
                             SPENT_CALLS, WINDOW, CallLoss, Mode, SpeedController, chosen_row, regime_key,
                             step_seconds_ok)


@dataclasses.dataclass(frozen=True)
class TreeStep:
    """Verify a drafted tree of `nodes` draft nodes."""

    nodes: int

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"a tree step needs >= 1 draft nodes, got {self.nodes!r}")


@dataclasses.dataclass(frozen=True)
class PlainStep:
    """Verify the roots alone: one token per sequence, as a plain generate() step decides it."""


@dataclasses.dataclass(frozen=True)
class LastTokenStep:
    """Every sequence needs one token more: the roots alone, which nobody chose (not reported to a policy)."""


PLAIN, LAST_TOKEN = PlainStep(), LastTokenStep()
StepDecision = Union[TreeStep, PlainStep, LastTokenStep]


class VerifiedStep(Protocol):
    """What a policy reads of a verified step (the loop's step outcome)."""

    batch_size: int  # sequences the step verified
    context_length: int  # cache positions before the step
    seconds: float  # the whole step: drafting, verification, bookkeeping
    drafting_seconds: float  # of those, the drafter's pass and the tree search (0 for a plain step)
    one_off: bool  # the step ran one-off work of the process (few-row kernel trials): its seconds are not its cost
    ranks: list[list[int]]  # per sequence, the selection rank of each accepted draft node (empty for a plain step)


class StepPolicy(Protocol):
    """What decides each verify step: the loop asks `decide` before every step and gives `observe` its outcome."""

    max_tree_size: int  # the largest tree `decide` answers (valid once `begin` has run)

    def begin(self, sampled: bool) -> None:
        """The call starts decoding, its checks passed (sampled: whether it samples)."""

    def decide(self, batch_size: int, context_length: int) -> Union[TreeStep, PlainStep]:
        """The next step of `batch_size` sequences over a cache of `context_length` positions."""

    def observe(self, decision: Union[TreeStep, PlainStep], step: VerifiedStep) -> None:
        """The step `decision` asked for has been verified (a tree step whose drafter proposed nothing is reported as
        `PLAIN`)."""


@dataclasses.dataclass
class FixedTree:
    """Every step verifies a tree of `nodes`; nothing is learned."""

    nodes: int

    @property
    def max_tree_size(self) -> int:
        return self.nodes

    def begin(self, sampled: bool) -> None:
        pass

    def decide(self, batch_size: int, context_length: int) -> TreeStep:
        return TreeStep(self.nodes)

    def observe(self, decision, step: VerifiedStep) -> None:
        pass


def remeasures_plain(count: int, best: tuple[int, list[dict]]) -> bool:
    """Whether the step after a regime's `count` steps re-measures plain decoding before `PLAIN_EVERY` does: one in
    every `EXPLORE_EVERY` (midway between explorations) of a regime's first `PLAIN_EVERY` while the best tree's
    expected speedup (`best`: `SpeedController.best`) is known and below `MARGINAL`."""
    if count >= PLAIN_EVERY or count % EXPLORE_EVERY != EXPLORE_EVERY // 2 - 1:
        return False
    speedup = chosen_row(best)["speedup"]
    return speedup is not None and speedup < MARGINAL


class CallPolicy:
    """The speed rule's policy for one call: asks the controller for each step's tree and teaches it what the step
    cost and accepted. `controller`: a function that gives the controller, called when the call starts decoding
    (after its checks: a call DART does not decode makes none); `may_go_plain`: an attached head's call, which may
    take plain steps and finish plain; `probe`: the call tries DART in regimes that run plain; `fixed`: every step
    takes that tree. Every call teaches the estimates and the regimes' verdicts. `warnings`: the fallback messages
    the call produced (the caller gives them)."""

    def __init__(self, controller: Callable[[], SpeedController], *, may_go_plain: bool, probe: bool = False,
                 fixed: Optional[int] = None) -> None:
        self._resolve, self.may_go_plain, self.probe, self.fixed = controller, may_go_plain, probe, fixed
        self.controller: Optional[SpeedController] = None
        self.max_tree_size = fixed or 0
        self.sampled = False
        self.dart_steps: dict[tuple[int, int], int] = {}  # DART steps of this call per regime
        self.recent: dict[tuple[int, int], list[tuple[float, float]]] = {}  # regime -> last WINDOW (tokens, seconds)
        self.plain_here: set[tuple[int, int]] = set()  # regimes this call finishes plain
        self.tokens = 0.0  # tokens a sequence the call's steps have produced
        self.loss = CallLoss()  # what its DART steps took beyond plain's cost of the tokens they yielded
        self.spent = False  # the loss spent the call's budget: it finishes plain
        self.warnings: list[str] = []

    def begin(self, sampled: bool) -> None:
        self.controller = self._resolve()
        self.sampled = sampled
        if self.fixed is None:
            self.max_tree_size = self.controller.max_size

    def decide(self, batch_size: int, context_length: int) -> Union[TreeStep, PlainStep]:
        if self.fixed is not None:
            return TreeStep(self.fixed)
        ctrl = self.controller
        with ctrl.lock:
            key = regime_key(batch_size, context_length)
            regime = ctrl.regime(batch_size, context_length)
            if self.may_go_plain:
                if self.spent or key in self.plain_here:
                    return PLAIN
                if regime.mode == Mode.PLAIN and not self.probe:
                    self.plain_here.add(key)
                    message = ctrl.fallback_message(key, self.sampled)
                    if message is not None:
                        self.warnings.append(message)
                    return PLAIN
                if regime.plain.weight < MIN_PLAIN_WEIGHT or regime.count % PLAIN_EVERY == PLAIN_EVERY - 1:
                    return PLAIN  # measure plain decoding here (nothing rests on a prior alone)
            best = ctrl.best(key, self.sampled)
            if self.may_go_plain and best is not None and remeasures_plain(regime.count, best):
                return PLAIN  # plain's cost again: a marginal verdict must not rest on one slow spell
            if regime.new_size is not None and regime.new_size not in regime.timed():
                return TreeStep(regime.new_size)  # a size's first step in a process is not timed: until one is
            chosen = ctrl.best(key, self.sampled, timed=True)
            if chosen is None:  # no tree timed here yet: the start size, or the one what trees cost elsewhere favours
                return TreeStep(ctrl.start_size if best is None else best[0])
            size = chosen[0]
            if regime.count % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                size = self._neighbour(key, regime, size, up=(regime.count // EXPLORE_EVERY) % 2 == 0)
            return TreeStep(size)

    def _neighbour(self, key: tuple[int, int], regime, size: int, up: bool) -> int:
        """The size next to `size` (up or down, else the other way) among those the regime may take
        (`SpeedController.tryable`), one not timed there only `NEW_SIZE_EVERY` steps after the last such; else
        `size`."""
        sizes, timed = self.controller.tryable(key), regime.timed()
        i = sizes.index(size) if size in sizes else 0
        for j in ((i + 1, i - 1) if up else (i - 1, i + 1)):
            if not 0 <= j < len(sizes):
                continue
            if sizes[j] in timed:
                return sizes[j]
            if regime.count - regime.new_size_at >= NEW_SIZE_EVERY:
                regime.new_size, regime.new_size_at = sizes[j], regime.count
                return sizes[j]
        return size

    def observe(self, decision: Union[TreeStep, PlainStep], step: VerifiedStep) -> None:
        ctrl = self.controller
        key = regime_key(step.batch_size, step.context_length)
        with ctrl.lock:
            regime = ctrl.regime(step.batch_size, step.context_length)
            regime.count += 1
            if not isinstance(decision, TreeStep):
                if not step.one_off:
                    ctrl.observe_plain(key, step.seconds)
                self.tokens += 1.0
                return
            ctrl.observe_step(key, decision.nodes, step.seconds, step.ranks, self.sampled, step.drafting_seconds,
                              one_off=step.one_off)
            self.dart_steps[key] = self.dart_steps.get(key, 0) + 1
            tokens = tau_of(sum(map(len, step.ranks)), len(step.ranks))
            self.tokens += tokens
            plain = ctrl.plain_s(key)
            recent = self.recent.setdefault(key, [])
            if step_seconds_ok(step.seconds):  # a clock that stalled or stepped back times nothing
                recent.append((tokens, step.seconds))
                del recent[:-WINDOW]
                if plain is not None:
                    self.loss.add(step.seconds - tokens * plain)
            spent_here = False  # this step ends the call's drafting (its loss passed the budget)
            if self.may_go_plain and plain is not None and not self.spent:
                spent_here = self.spent = self.loss.spent(plain, self.tokens)
            if spent_here:
                regime.spent_calls += 1
            elif self.dart_steps[key] == WINDOW:
                regime.spent_calls = 0
            if (self.dart_steps[key] < WINDOW and not spent_here) or not recent or plain is None:
                return
            observed = sum(t for t, _ in recent) / sum(s for _, s in recent) * plain
            expected = ctrl.expected(key, self.sampled)
            shown = ctrl.expected(key, self.sampled, timed=True)  # by the sizes timed here alone, no size's prior
            # the verdict for later calls follows the latest evidence of any call: plain where DART is slower both by
            # the sizes timed here and over this call's last WINDOW steps here, or where a call spent its budget here
            # as a probe, the SPENT_CALLS-th in a row, or before the estimates have a figure (`lost`); DART again
            # where neither holds and a size is timed here (steps that ran trials time none), unless the call spent
            # its budget
            lost = spent_here and (expected is None or self.probe or regime.spent_calls >= SPENT_CALLS)
            if expected is None and not lost:
                return
            if self.may_go_plain and expected is not None and max(expected, observed) < CALL_MARGIN:
                self.plain_here.add(key)  # this call alone: below CALL_MARGIN by both measures
            if lost or (shown is not None and shown < 1.0 and observed < 1.0):
                if not self.may_go_plain:  # a call that must decode with DART: later attached calls run plain here
                    if regime.mode == Mode.DART:
                        ctrl.set_plain(key, probing=False)
                    return
                if regime.mode == Mode.DART or self.probe:
                    ctrl.set_plain(key, probing=self.probe)
                message = ctrl.fallback_message(key, self.sampled, lost=lost)
                if message is not None:
                    self.warnings.append(message)
            elif regime.mode == Mode.PLAIN and not spent_here and shown is not None:
                ctrl.set_dart(key)  # DART pays here again by a timed size (a probe, or a dart_head= call)
