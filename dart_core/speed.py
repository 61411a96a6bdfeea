"""The speed rule: which tree each DART step verifies, decided from what DART measures while it runs, so that DART is
never slower than plain decoding. Framework-free and without I/O: the estimates and the choice (`SpeedController`),
what one call asks of them (`dart_core.step_policy.CallPolicy`); what is learned is kept by the integration
(`dart_hf.learned`), and measured priors come from `dart_hf.calibration`.

What is estimated, per target, head and machine setting (device, dtype, threads):

- tau(R): the tokens a verify step yields per sequence with a tree of R draft nodes (the bonus token included). It
  depends on the head, the target and the text, not on the machine or the batch, so one estimate serves every regime
  (kept apart for greedy and sampled calls). A step verified with a tree of R nodes also tells what a tree of any
  r <= R would have accepted from the same state (the leading accepted nodes of selection rank < r,
  `dart_core.acceptance`), so every step updates tau(r) for all r <= R. Prior: the head's shipped acceptance curve,
  counted as `PRIOR_TAU_WEIGHT` steps; a head without one learns it from its own calls.
- Per regime, a (batch size, context length) bucket (`regime_key`): the seconds of one plain step (`Regime.plain`,
  from the calls' own plain steps and from plain `generate()` calls, timed per step), of one DART step at each tree
  size (`Regime.steps`) and of a DART step's drafting within it (`Regime.drafting`: the drafter's pass and the tree
  search, whatever the size). A tree size never timed in a regime is predicted from the line through the timed sizes'
  (rows verified, seconds), a batch of B verifying B x (R + 1) rows (`fit_line`; until two timed sizes span enough
  rows, through a tree of no nodes too: B rows at a plain step's seconds plus the drafting, which a DART step pays
  whatever its size, so that a small tree is not predicted as cheap as a plain step). Where a calibrated
  `MachineCost` exists, an untimed size is predicted as
  `Regime.scale` (observed over predicted) x (head + search + rest of a step + t_verify(B x (R + 1))), unless the
  timed sizes show that prediction's shape is wrong (a measurement taken under load is bent, not only scaled): then
  the line again.

Every estimate is a running mean whose older observations fade (`Mean`), so a machine whose load or speed changes is
followed within a few steps.

The choice (`choose_tree_size`): R* = argmax over tree sizes with known tau of tau(R) / t_step(R) (ties: the smaller
R); expected speedup over plain = tau(R*) x t_plain / t_step(R*). Small trees first: a regime's first DART steps take
the controller's `start_size` (for a head, at most `FIRST_ROWS` rows a sequence), and a size not yet timed there is
taken only up to `LADDER` times the rows of the largest timed one (`SpeedController.tryable`), so a call climbs to a
large tree through timed smaller ones and never pays for a large one an estimate merely extrapolated; steps take the
best of the sizes timed there, and an exploration step tries an untimed one at most once every `NEW_SIZE_EVERY` steps
of the regime. How a call explores, measures plain decoding and falls back: `dart_core.step_policy`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
import threading
import time
from typing import Iterable, Optional

from dart_core.acceptance import accepted_within
from dart_core.config import AcceptanceCurve, TreeConfig
from dart_core.cost import MachineCost, monotone

# ---- the constants of the rule -----------------------------------------------------------------------------------
# None of these encodes a machine fact: they set how fast estimates follow the machine and how much evidence a
# decision needs.
STEP_DECAY = 0.85  # step and plain-step seconds rest on about 1 / (1 - 0.85) = 7 recent observations
TAU_DECAY = 0.98  # tau(R) rests on about 50 recent sequence-steps (acceptance varies with the text step by step)
PRIOR_TAU_WEIGHT = 4.0  # the shipped acceptance curve counts as 4 sequence-steps: a call's own steps soon outweigh it
FIRST_PLAIN = 3  # a regime's plain cost starts as the median of its first 3 timed plain steps (one may be an outlier)
# ... unless they differ by more than `OUTLIER` times (a loaded machine's fast and slow spells): then it starts as the
# mean of its first 8 but the slowest, which spans the spells as a call's steps do where a median of 3 could hold one
# spell alone, and leaves out a lone outlier
MAX_FIRST_PLAIN = 8
MIN_PLAIN_WEIGHT = 1.0  # ... and DART steps start there once it has that first cost (or a timed plain call's)
MIN_TAU_WEIGHT = 3.0  # a tree size is chosen only once tau there rests on 3 sequence-steps (or the prior)
WINDOW = 4  # DART steps a call makes in a regime before the estimates may send it plain there
EXPLORE_EVERY = 8  # every 8th step of a regime tries a neighbouring tree size
PLAIN_EVERY = 64  # every 64th step of a regime (attached heads) is a plain step, refreshing plain's cost
# ... and, before that, one in every `EXPLORE_EVERY` (midway between explorations) while DART's expected gain there is
# below 1.25x: within what a slow spell of a few steps makes of plain's first measured cost, so a verdict resting on
# that one figure is checked against plain steps taken while the call runs
MARGINAL = 1.25
# A call finishes a regime plain once DART's expected and observed speedups there are both below 1.05x, not 1x: the
# size chosen is the one whose noisy estimates came out best, so its expected speedup errs high, and near 1x a call
# that keeps DART is as likely to lose as to gain. Later calls there run plain only below 1x (`WINDOW` steps decide).
CALL_MARGIN = 1.05
# An attached call stops drafting once its DART steps have taken more than 2% longer than plain steps would have for
# the tokens they yielded, measured against plain's cost of the tokens the call has produced (at least 64 a
# sequence): whatever the estimates say, exploring and a tree that loses cost a call little more than that. A loss
# within two standard deviations of what the steps' varying yields give by chance does not count (a tree that pays
# on average can lose over a few steps), a step's deviation taken as at least half a plain step's cost (a yield that
# varies by a token; a few steps that happened to yield alike show no spread).
LOSS_BUDGET = 0.02
BUDGET_TOKENS = 64
LOSS_CHANCE_SD = 2.0
MIN_STEP_SD = 0.5
SPENT_CALLS = 2  # two calls in a row that spend their budget in a regime send later calls there plain (a probe: one)
FIRST_PROBE_AFTER, MAX_PROBE_AFTER = 2, 64  # plain calls in a plain regime before DART is tried again (doubling)
OUTLIER = 2.0  # a step time above twice its estimate counts as twice (`Mean.add_robust`)
SHAPE_TOLERANCE = 1.3  # timed / predicted step ratios within 30% of each other: a calibrated cost's shape holds
MIN_FIT_SPAN = 1.5  # a line through timed steps needs verified row counts that differ by half
FIRST_ROWS = 4  # small trees first: a drafter that fills its trees starts a regime at <= 4 rows a sequence (3 nodes)
LADDER = 2.0  # a size not timed in a regime is tried only up to twice the rows a sequence of the largest one timed
# ... and only on an exploration step, at most once every 16 steps of the regime in a process: a size's first steps
# in a process cost one-off work (new shapes, the few-row kernels' trials, `dart_runtime.matmul`), so a call of 64
# tokens pays for two or three sizes, not for every size its first noisy estimates point to
NEW_SIZE_EVERY = 16
CONTEXT_BUCKET_MIN = 256  # contexts up to 256 positions share a regime; above, one regime per power of two
# no step of a decoding loop takes a day; no ratio of observed to predicted step time is beyond a million either way
MAX_STEP_S = 86400.0
SCALE_RANGE = (1e-6, 1e6)


def finite(value) -> Optional[float]:
    """`value` as a float when it is a finite real number (not a bool; not an int too large for a float), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def step_seconds_ok(seconds) -> bool:
    """Whether `seconds` can be a step's time: finite, > 0 and below `MAX_STEP_S` (a clock that stalls, is coarser
    than a step or steps back gives 0 or less: such a time is dropped, never learned)."""
    value = finite(seconds)
    return value is not None and 0.0 < value <= MAX_STEP_S


# ---- running estimates ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Mean:
    """A running mean whose observations fade: adding one with `decay` multiplies the weight of the older ones by it."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, decay: float, weight: float = 1.0) -> None:
        if finite(value) is None or finite(weight) is None:  # NaN or infinity would poison the mean for good
            return
        self.total = self.total * decay + value * weight
        self.weight = self.weight * decay + weight

    def add_robust(self, value: float, decay: float) -> None:
        """`add`, an observation above `OUTLIER` times the mean counting as that (one slow spell of the machine moves
        the estimate by a bounded step; a lasting change is followed within a few observations)."""
        mean = self.value
        self.add(value if mean is None or self.weight < 1.0 else min(value, OUTLIER * mean), decay)

    @property
    def value(self) -> Optional[float]:
        return self.total / self.weight if self.weight > 0 else None

    def to_list(self) -> list[float]:
        return [self.total, self.weight]


def fit_line(points: list[tuple[float, float, float]]) -> Optional[tuple[float, float]]:
    """(a, b) of the weighted least-squares line y = a + b x with b >= 0 through `points` [(x, y, weight)], or None
    unless the xs span `MIN_FIT_SPAN` (a ratio of largest to smallest x: two close sizes say little of a slope)."""
    if len(points) < 2 or max(x for x, _, _ in points) < MIN_FIT_SPAN * min(x for x, _, _ in points):
        return None
    w = sum(p[2] for p in points)
    mx, my = (sum(p[i] * p[2] for p in points) / w for i in (0, 1))
    sxx = sum(wt * (x - mx) ** 2 for x, _, wt in points)
    b = max(sum(wt * (x - mx) * (y - my) for x, y, wt in points) / sxx, 0.0)
    return my - b * mx, b


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= n (at least `minimum`)."""
    out = minimum
    while out < n:
        out *= 2
    return out


def regime_key(batch_size: int, context_length: int) -> tuple[int, int]:
    """(batch bucket, context bucket): a step of `batch_size` sequences over `context_length` cache positions."""
    return bucket(max(batch_size, 1)), bucket(context_length, CONTEXT_BUCKET_MIN)


class Mode(str, enum.Enum):
    """How a regime's attached calls run: DART, PLAIN (plain generate() until a probe), or, for one call, PROBE (DART
    again in a plain regime)."""

    DART = "dart"
    PLAIN = "plain"
    PROBE = "probe"


@dataclasses.dataclass
class Regime:
    """What steps cost in one regime on this machine, and whether DART runs there."""

    plain: Mean = dataclasses.field(default_factory=Mean)  # seconds of one plain step
    drafting: Mean = dataclasses.field(default_factory=Mean)  # seconds of a DART step's drafting (any tree size)
    steps: dict = dataclasses.field(default_factory=dict)  # tree size -> Mean of seconds of one DART step
    scale: Mean = dataclasses.field(default_factory=Mean)  # observed / predicted DART step time
    mode: Mode = Mode.DART  # DART, or PLAIN: attached calls starting here run plain until a probe
    probe_after: int = FIRST_PROBE_AFTER  # plain calls before the next probe
    plain_calls: int = 0  # plain calls since the last probe
    updated: float = 0.0  # wall-clock time of the last change (merging keeps the newer regime)
    count: int = 0  # steps seen here in this process (the exploration schedule; not saved)
    first_plain: list = dataclasses.field(default_factory=list)  # timed plain steps before `plain` has any (not saved)
    spent_calls: int = 0  # calls in a row that spent their loss budget here (`CallLoss`; not saved)
    new_size: Optional[int] = None  # the size not timed here that steps try until it is (`NEW_SIZE_EVERY`; not saved)
    new_size_at: int = 0  # `count` when it was first tried (not saved)

    def keep_process_state(self, other: "Regime") -> None:
        """Take `other`'s state of this process, which is not saved (`PROCESS_STATE`): a regime another process saved
        later replaces `other` without resetting this process's exploration schedule or its calls' record."""
        for name in PROCESS_STATE:
            setattr(self, name, getattr(other, name))

    def timed(self) -> dict:
        """{tree size: Mean of its step seconds} for the sizes with a timed DART step here."""
        return {r: m for r, m in self.steps.items() if m.weight > 0}


PROCESS_STATE = ("count", "first_plain", "spent_calls", "new_size", "new_size_at")  # a `Regime`'s fields not saved


# ---- the rule ---------------------------------------------------------------------------------------------------

def choose_tree_size(tau: dict[int, float], step_s: dict[int, float], plain_s: Optional[float]
                     ) -> tuple[int, list[dict]]:
    """R* = argmax_R tau(R) / step_s(R) over the sizes both know (ties: the smaller R) -> (R*, one row per such R:
    {remain_total, tau, step_ms, tokens_per_s, speedup}); speedup = tau x plain_s / step_s (None without plain_s).
    tau {R: tokens per sequence and step}; step_s {R: seconds of one step}; plain_s: seconds of one plain step.
    A size whose tau is not a finite number or whose step time is not finite and > 0 is no estimate (left out); a
    plain time that is not is unknown (None)."""
    rows = []
    if not (finite(plain_s) or 0.0) > 0.0:
        plain_s = None
    for r in sorted(set(tau) & set(step_s)):
        if finite(tau[r]) is None or not (finite(step_s[r]) or 0.0) > 0.0:
            continue
        rate = tau[r] / step_s[r]
        rows.append({"remain_total": r, "tau": tau[r], "step_ms": step_s[r] * 1e3, "tokens_per_s": rate,
                     "speedup": None if plain_s is None else rate * plain_s})
    if not rows:
        raise ValueError("no tree size has both a tau and a step time")
    best = max(rows, key=lambda row: (row["tokens_per_s"], -row["remain_total"]))
    return best["remain_total"], rows


def first_plain_s(times: list[float]) -> Optional[float]:
    """A regime's first plain cost from its first timed plain steps `times` (seconds), or None while they are too few:
    the median of `FIRST_PLAIN` that agree within `OUTLIER` times, else the mean of `MAX_FIRST_PLAIN` but the
    slowest."""
    if len(times) < FIRST_PLAIN:
        return None
    if max(times) <= OUTLIER * min(times):
        return statistics.median(times)
    if len(times) < MAX_FIRST_PLAIN:
        return None
    kept = sorted(times)[:-1]
    return sum(kept) / len(kept)


@dataclasses.dataclass
class CallLoss:
    """Seconds a call's DART steps took beyond what plain steps would have taken for the tokens they yielded."""

    steps: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, seconds: float) -> None:
        self.steps, self.total, self.squares = self.steps + 1, self.total + seconds, self.squares + seconds * seconds

    def spent(self, plain_s: float, tokens: float) -> bool:
        """Whether the loss has spent the call's budget: above `LOSS_BUDGET` of plain's cost (`plain_s` a step) of
        the call's `tokens` a sequence (at least `BUDGET_TOKENS`), and above `LOSS_CHANCE_SD` standard deviations
        of a total of this many steps' losses (a step's at least `MIN_STEP_SD` plain steps)."""
        if self.total <= LOSS_BUDGET * plain_s * max(tokens, BUDGET_TOKENS):
            return False
        spread = 0.0 if self.steps < 2 else \
            max(self.squares - self.total * self.total / self.steps, 0.0) / (self.steps - 1)
        variance = max(spread, (MIN_STEP_SD * plain_s) ** 2)
        return self.total > LOSS_CHANCE_SD * math.sqrt(variance * self.steps)


def chosen_row(best: tuple[int, list[dict]]) -> dict:
    """The row of the chosen size in `choose_tree_size`'s (R*, rows)."""
    size, rows = best
    return next(row for row in rows if row["remain_total"] == size)


@dataclasses.dataclass
class TreeChoice:
    """The tree size the controller would choose now for one regime: `remain_total`, its `tree_config`, the
    `expected_speedup` over plain decoding (None while plain's cost there is unknown), one row per tree size
    (`choose_tree_size`), the regime (batch bucket, context bucket) and the calibrated cost, if any."""

    remain_total: int
    tree_config: TreeConfig
    expected_speedup: Optional[float]
    rows: list[dict]
    regime: tuple[int, int]
    plain_ms: Optional[float]
    cost: Optional[MachineCost]

    @property
    def pays(self) -> bool:
        """Whether DART is expected to beat plain decoding here (True while plain's cost is unknown)."""
        return self.expected_speedup is None or self.expected_speedup > 1.0

    def summary(self) -> str:
        """One line: the choice and the numbers behind it."""
        row = chosen_row((self.remain_total, self.rows))
        plain = "plain step not measured yet" if self.plain_ms is None else f"one plain step {self.plain_ms:.1f} ms"
        expected = "" if self.expected_speedup is None else f", expected {self.expected_speedup:.2f}x over plain"
        return (f"tree of {self.remain_total} draft nodes{expected} ({plain}; a step with this tree "
                f"{row['step_ms']:.1f} ms for tau {row['tau']:.2f}; batch <= {self.regime[0]}, context <= "
                f"{self.regime[1]})")

    def format_table(self) -> str:
        """A plain-text table: the calibrated latency curve (if any), then tau, step time and expected speedup per
        size."""
        lines = []
        cost = self.cost
        if cost is not None:
            lines += [f"target forward over k new tokens on a {cost.context_length}-token cache (median ms, first "
                      "call):", "  " + "  ".join(f"k={k}: {ms:.1f}" for k, ms in sorted(cost.verify_ms.items())),
                      f"plain 1-token forward {cost.plain_ms:.1f} ms; per step: head {cost.head_ms:.1f} ms, "
                      f"tree search {cost.tree_ms:.1f} ms, acceptance + KV compaction {cost.rest_ms:.1f} ms"]
        lines.append(f"{'nodes':>5} {'tau':>6} {'step ms':>8} {'tok/s':>7} {'speedup':>7}")
        for row in self.rows:
            mark = "  <- chosen" if row["remain_total"] == self.remain_total else ""
            speedup = "    n/a" if row["speedup"] is None else f"{row['speedup']:6.2f}x"
            lines.append(f"{row['remain_total']:5d} {row['tau']:6.3f} {row['step_ms']:8.1f} "
                         f"{row['tokens_per_s']:7.1f} {speedup}{mark}")
        return "\n".join(lines)


# ---- the controller  ---------------------------------------------------------------------------------------------

class SpeedController:
    """The estimates for one target, head and machine setting, and the choices made from them (thread-safe).

    `sizes`: the tree sizes it chooses among; `cost`: a calibrated `MachineCost` (None: untimed sizes are predicted
    from the timed ones); `curve`: the head's shipped acceptance curve (or None);
    `start_size`: a regime's first tree. `dirty`: something was learned since the state was last kept (persistence
    lives outside: `dart_hf.learned`)."""

    def __init__(self, sizes: Iterable[int], cost: Optional[MachineCost], curve: Optional[AcceptanceCurve],
                 start_size: int) -> None:
        self.sizes = sorted(set(int(r) for r in sizes))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError("a controller needs tree sizes >= 1")
        self.cost = cost
        self.start_size = min(max(start_size, 1), self.sizes[-1])
        self.lock = threading.RLock()
        self.tau: dict[bool, dict[int, Mean]] = {False: {}, True: {}}  # sampled -> size -> tokens per sequence-step
        self.tau_updated: dict[bool, float] = {False: 0.0, True: 0.0}
        if curve is not None:
            for sampled in (False, True):
                for r in self.sizes:
                    known = [s for s in curve.tau if s <= r]
                    if known:  # a size between the curve's sizes takes the tau of the largest size below it
                        self.tau[sampled][r] = Mean(curve.tau[max(known)] * PRIOR_TAU_WEIGHT, PRIOR_TAU_WEIGHT)
        self.regimes: dict[tuple[int, int], Regime] = {}
        self.warned: set[tuple[int, int]] = set()
        self.warm: set[tuple] = set()  # (regime key, size) timed once in this process (0: plain)
        self.dirty = False

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    # -- estimates --

    def regime(self, batch_size: int, context_length: int) -> Regime:
        """The regime of a step (where a calibrated cost says no tree pays, it starts plain)."""
        key = regime_key(batch_size, context_length)
        regime = self.regimes.get(key)
        if regime is None:
            regime = self.regimes[key] = Regime()
            expected = self.expected(key, False, anywhere=True)
            if expected is not None and expected < 1.0:
                regime.mode = Mode.PLAIN
        return regime

    def plain_s(self, key: tuple[int, int]) -> Optional[float]:
        """Seconds of one plain step in regime `key`: timed there, else a calibrated cost's where that is the regime
        it measured (until a real plain step is timed there), else None."""
        timed = self.regimes[key].plain.value
        if timed is not None or self.cost is None or key != regime_key(1, self.cost.context_length):
            return timed
        return self.cost.plain_ms / 1e3

    def prior_step_s(self, key: tuple[int, int], size: int) -> Optional[float]:
        """A calibrated cost's prediction of one DART step at `size` in regime `key` (None without one)."""
        if self.cost is None:
            return None
        return (self.cost.fixed_ms + self.cost.verify_at(key[0] * (size + 1))) / 1e3

    def step_s(self, key: tuple[int, int], size: int) -> Optional[float]:
        """Seconds of one DART step at `size` in regime `key`: timed there; else the prior times the regime's scale,
        unless the timed sizes show the prior's shape is wrong there (their timed / prior ratios differ by more than
        `SHAPE_TOLERANCE`: a measurement taken under load is bent, not only scaled) and span enough verified
        rows: then the line through (rows verified, seconds) of the timed sizes (`fit_line`). Without a calibrated cost,
        a regime where no size is timed yet predicts its plain step plus what the drafted rows add in another regime
        (`drafting_s`)."""
        regime = self.regimes[key]
        timed = regime.timed()
        if size in timed:
            return timed[size].value
        points = [(key[0] * (r + 1), m.value, m.weight) for r, m in timed.items()]  # (rows verified, seconds, weight)
        prior = self.prior_step_s(key, size)
        if prior is None:  # no measured cost: the line through the timed sizes (and the plain step, until two span)
            plain = regime.plain.value
            line = fit_line(points)
            if line is None and plain is not None:
                line = fit_line(points + [self.no_tree_point(key)])
            if line is None and not timed and plain is not None:  # nothing timed here: what drafting adds elsewhere
                extra = self.drafting_s(key, key[0] * size)
                return None if extra is None else max(plain + extra, 1e-9)
            return None if line is None else max(line[0] + line[1] * key[0] * (size + 1), 1e-9)
        ratios = [m.value / self.prior_step_s(key, r) for r, m in timed.items()]
        if len(ratios) >= 2 and max(ratios) > SHAPE_TOLERANCE * min(ratios):
            line = fit_line(points)
            if line is not None:
                return max(line[0] + line[1] * key[0] * (size + 1), 1e-9)
        return prior * (regime.scale.value or 1.0)

    def no_tree_point(self, key: tuple[int, int]) -> tuple[float, float, float]:
        """(rows verified, seconds, weight) of a DART step of no draft nodes in regime `key`, where its plain step is
        timed: its B rows at a plain step's seconds plus the drafting timed there for B sequences (none while no DART
        step is)."""
        regime = self.regimes[key]
        return key[0], regime.plain.value + (regime.drafting.value or 0.0), regime.plain.weight

    def drafting_s(self, key: tuple[int, int], draft_rows: int) -> Optional[float]:
        """Seconds that drafting and verifying `draft_rows` draft nodes add to a plain step, as measured in the other
        regime with the most timed DART steps (its line through (rows verified, seconds) of its timed sizes and its
        plain step, `fit_line`: the drafting spread over the rows, as it grows with the batch), or None where no other
        regime has such a line: a regime's first tree is chosen from what trees cost elsewhere, not taken blind."""
        others = [(sum(m.weight for m in r.timed().values()), k, r) for k, r in self.regimes.items()
                  if k != key and r.timed() and r.plain.value is not None]
        for _, other, regime in sorted(others, key=lambda x: (-x[0], x[1])):
            points = [(other[0] * (r + 1), m.value, m.weight) for r, m in regime.timed().items()]
            line = fit_line(points) or fit_line(points + [(other[0], regime.plain.value, regime.plain.weight)])
            if line is not None:  # a step of its own plain rows plus `draft_rows`, less its plain step
                return line[0] + line[1] * (other[0] + draft_rows) - regime.plain.value
        return None

    def tau_of(self, sampled: bool) -> dict[int, float]:
        """{size: tau} for the sizes whose estimate rests on enough evidence, made non-decreasing in the size (a
        larger tree holds every smaller one: a dip is noise)."""
        return monotone({r: m.value for r, m in self.tau[sampled].items() if m.weight >= MIN_TAU_WEIGHT})

    def tryable(self, key: tuple[int, int]) -> list[int]:
        """The tree sizes regime `key` may take (small trees first): those timed there, and untimed ones up to the
        start size until a DART step is timed there, then up to `LADDER` times the rows of the largest size timed."""
        timed = self.regimes[key].timed()
        reach = self.start_size if not timed else LADDER * (max(timed) + 1) - 1
        return [r for r in self.sizes if r <= reach or r in timed]

    def best(self, key: tuple[int, int], sampled: bool, anywhere: bool = False,
             timed: bool = False) -> Optional[tuple[int, list[dict]]]:
        """(R*, rows) in regime `key` (`choose_tree_size`) over the sizes it may take (`tryable`; `anywhere`: over
        every size; `timed`: over those timed there), or None while no such size has both estimates."""
        tau = self.tau_of(sampled)
        sizes = set(self.sizes if anywhere else self.regimes[key].timed() if timed else self.tryable(key))
        steps = {r: s for r in tau if r in sizes and (s := self.step_s(key, r)) is not None
                 and (finite(s) or 0.0) > 0.0}
        if not steps:
            return None
        return choose_tree_size(tau, steps, self.plain_s(key))

    def expected(self, key: tuple[int, int], sampled: bool, anywhere: bool = False,
                 timed: bool = False) -> Optional[float]:
        """The expected speedup of the best tree over plain in regime `key` (`best`; None while either is unknown)."""
        best = self.best(key, sampled, anywhere, timed)
        if best is None:
            return None
        return chosen_row(best)["speedup"]

    def cold(self, key: tuple[int, int], size: int) -> bool:
        """Whether this is the first step of `size` (0: plain) timed in regime `key` in this process: its time
        holds one-off costs (new shapes, the few-row kernels' trial) and is not taken."""
        if (key, size) in self.warm:
            return False
        self.warm.add((key, size))
        return True

    def observe_plain(self, key: tuple[int, int], seconds: float, cold_ok: bool = False) -> None:
        """A plain step took `seconds` in regime `key` (`cold_ok`: a median of several, no one-off costs); a time
        that is not a step's (`step_seconds_ok`: a clock that stalled or stepped back) is dropped."""
        with self.lock:
            regime = self.regimes[key] if key in self.regimes else self.regime(*key)
            if (self.cold(key, 0) and not cold_ok) or not step_seconds_ok(seconds):
                return
            if regime.plain.weight == 0 and not cold_ok:  # the first single steps (`first_plain_s`)
                regime.first_plain.append(seconds)
                start = first_plain_s(regime.first_plain)
                if start is None:
                    return
                seconds = start
                regime.first_plain.clear()
            regime.plain.add_robust(seconds, STEP_DECAY)
            regime.updated, self.dirty = time.time(), True

    def observe_step(self, key: tuple[int, int], size: int, seconds: float, ranks: list[list[int]],
                     sampled: bool, drafting: Optional[float] = None, one_off: bool = False) -> None:
        """A DART step at `size` took `seconds`, `drafting` of them in the drafter's pass and the tree search (None:
        not timed apart), and accepted nodes of `ranks` (per sequence); a time that is not a step's
        (`step_seconds_ok`: a clock that stalled or stepped back) is dropped, and so is a drafting time outside
        0..`seconds`, and the times of a step that ran one-off work (`one_off`: the few-row kernels' trials, slower
        products among them) or is the size's first here (`cold`); what the step accepted is kept."""
        with self.lock:
            regime = self.regimes[key]
            if not self.cold(key, size) and not one_off and step_seconds_ok(seconds):
                regime.steps.setdefault(size, Mean()).add_robust(seconds, STEP_DECAY)
                if finite(drafting) is not None and 0.0 <= drafting <= seconds:  # None: not timed apart
                    regime.drafting.add_robust(drafting, STEP_DECAY)
                prior = self.prior_step_s(key, size)
                ratio = None if prior is None else finite(seconds / prior)
                if ratio is not None and SCALE_RANGE[0] <= ratio <= SCALE_RANGE[1]:
                    regime.scale.add_robust(ratio, STEP_DECAY)
            table = self.tau[sampled]
            for row in ranks:
                for r in self.sizes:
                    if r > size:
                        break
                    table.setdefault(r, Mean()).add(1.0 + accepted_within(row, r), TAU_DECAY)
            regime.updated = self.tau_updated[sampled] = time.time()
            self.dirty = True

    # -- calls --

    def call_mode(self, batch_size: int, context_length: int) -> tuple[Mode, Optional[str]]:
        """How an attached head's call that starts in this regime runs: (DART | PROBE | PLAIN, the warning to
        give for a plain call, once per regime, else None)."""
        with self.lock:
            key = regime_key(batch_size, context_length)
            regime = self.regime(batch_size, context_length)
            if regime.mode == Mode.DART:
                return Mode.DART, None
            regime.plain_calls += 1
            regime.updated, self.dirty = time.time(), True
            if regime.plain_calls >= regime.probe_after:
                regime.plain_calls = 0
                return Mode.PROBE, None
            return Mode.PLAIN, self.fallback_message(key, False)

    def fallback_message(self, key: tuple[int, int], sampled: bool, lost: bool = False) -> Optional[str]:
        """The one warning of a regime where DART runs plain, with the numbers (None once given; `lost`: calls that
        spent their loss budget gave the verdict, `CallLoss`)."""
        if key in self.warned:
            return None
        self.warned.add(key)
        best = self.best(key, sampled)
        regime = self.regimes[key]
        where = f"batch <= {key[0]}, context <= {key[1]} positions"
        later = max(regime.probe_after - regime.plain_calls, 1)
        plain = self.plain_s(key)
        row = None if best is None or plain is None else chosen_row(best)
        if lost and (row is None or row["speedup"] >= 1.0):  # the verdict is the calls', not the estimates'
            estimate = "" if row is None else f", though its estimates give {row['speedup']:.2f}x"
            return (f"DART lost time against plain decoding in the latest calls on this machine ({where}){estimate}; "
                    f"calls here run plain, and DART is tried again after {later} of them")
        if row is None:
            return f"DART is not expected to beat plain decoding on this machine ({where}); calls here run plain"
        return (f"DART does not beat plain decoding on this machine ({where}): its best tree, {best[0]} draft "
                f"nodes, is estimated at {row['tau']:.2f} tokens per {row['step_ms']:.1f} ms step against "
                f"{plain * 1e3:.1f} ms per plain token ({row['speedup']:.2f}x); calls here run plain, "
                f"and DART is tried again after {later} of them")

    def set_plain(self, key: tuple[int, int], probing: bool) -> None:
        """Attached calls that start in regime `key` run plain from now on, until a probe (a probe that lost, and so
        `probing`, waits twice as long before the next)."""
        regime = self.regimes[key]
        regime.probe_after = min(2 * regime.probe_after, MAX_PROBE_AFTER) if probing and regime.mode == Mode.PLAIN \
            else FIRST_PROBE_AFTER
        regime.mode, regime.plain_calls = Mode.PLAIN, 0
        regime.updated, self.dirty = time.time(), True

    def set_dart(self, key: tuple[int, int]) -> None:
        """Attached calls that start in regime `key` run DART again (a call showed that DART pays there)."""
        regime = self.regimes[key]
        regime.mode, regime.probe_after, regime.plain_calls = Mode.DART, FIRST_PROBE_AFTER, 0
        regime.updated, self.dirty = time.time(), True

    def choice(self, base: TreeConfig, batch_size: int = 1, context_length: int = 1,
               sampled: bool = False) -> Optional[TreeChoice]:
        """The best tree by the estimates now in that regime, wherever it lies (a call reaches it through smaller
        trees first, `tryable`); None while no size has both estimates."""
        with self.lock:
            key = regime_key(batch_size, context_length)
            self.regime(batch_size, context_length)
            best = self.best(key, sampled, anywhere=True)
            if best is None:
                return None
            size, rows = best
            plain = self.plain_s(key)
            return TreeChoice(size, dataclasses.replace(base, remain_total=size), chosen_row(best)["speedup"], rows,
                              key, None if plain is None else plain * 1e3, self.cost)
