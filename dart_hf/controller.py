"""Which tree each DART step verifies, decided from what DART measures while it runs, so that DART is never slower
than plain decoding (`SpeedController`; the loop asks a `CallPolicy` before every step). No call runs a timing run of
its own: every estimate comes from the calls' own steps, from timed plain calls, and from a machine cost only where
one was measured on request (`calibrate`, `dart-spec calibrate`).

What is estimated, per target, head and machine setting (device, dtype, threads):

- tau(R): the tokens a verify step yields per sequence with a tree of R draft nodes (the bonus token included). It
  depends on the head, the target and the text, not on the machine or the batch, so one estimate serves every regime
  (kept apart for greedy and sampled calls). A step verified with a tree of R nodes also tells what a tree of any
  r <= R would have accepted from the same state (the leading accepted nodes of selection rank < r,
  `dart_hf.calibration`), so every step updates tau(r) for all r <= R. Prior: the head's shipped acceptance curve,
  counted as `PRIOR_TAU_WEIGHT` steps; a head without one learns it from its own calls.
- Per regime, a (batch size, context length) bucket (`regime_key`): the seconds of one plain step (`Regime.plain`,
  from the calls' own plain steps and from plain `generate()` calls, timed per step) and of one DART step at each
  tree size (`Regime.steps`). A tree size never timed in a regime is predicted from the line through the timed sizes'
  (rows verified, seconds), a batch of B verifying B x (R + 1) rows (`fit_line`; until two timed sizes span enough
  rows, through the plain step too). Where a calibrated `MachineCost` exists, an untimed size is predicted as
  `Regime.scale` (observed over predicted) x (head + search + rest of a step + t_verify(B x (R + 1))), unless the
  timed sizes show that prediction's shape is wrong (a measurement taken under load is bent, not only scaled): then
  the line again.

Every estimate is a running mean whose older observations fade (`Mean`), so a machine whose load or speed changes is
followed within a few steps.

The choice (`choose_tree_size`): R* = argmax over tree sizes with known tau of tau(R) / t_step(R) (ties: the smaller
R); expected speedup over plain = tau(R*) x t_plain / t_step(R*). Small trees first: a regime's first DART steps take
`first_size` (for a head, at most `FIRST_ROWS` rows a sequence), and a size not yet timed there is taken only up to
`LADDER` times the rows of the largest timed one (`SpeedController.tryable`), so a call climbs to a large tree through
timed smaller ones and never pays for a large one an estimate merely extrapolated. Each step takes R*, except that
every `EXPLORE_EVERY`-th step of a regime tries a neighbouring size (up and down in turn: a larger tree also measures
tau above R*), and, for an attached head, a regime's first steps (until plain's cost there starts, as the median of
`FIRST_PLAIN` timed plain steps) and every `PLAIN_EVERY`-th one are plain steps, which measure plain decoding there.

Falling back, for an attached head (`dart_hf.enable(model, head)`): once a call has made `WINDOW` DART steps in a
regime, whenever the expected speedup there is below 1 and so is the rate of the call's last `WINDOW` steps, the call
finishes that regime plain (the roots alone, one token per sequence and step, exactly as plain decoding decides it),
and later calls that start in the regime run as plain `generate()`, with one `DartFallbackWarning` per regime and the
numbers. After `FIRST_PROBE_AFTER` plain calls (doubling after every probe that loses, up to `MAX_PROBE_AFTER`) a call
in the regime runs DART again (a probe): steps timed on a loaded machine switch DART off only until then. The verdict
follows the latest evidence of any call: a call with `dart_head=` (which decodes with DART whatever the estimates say;
its tree sizes still adapt) or with a fixed tree (`dart_tree_config=`, `enable(..., tree_config=...)`) that shows DART
pays in a plain regime sends later attached calls there back to DART, and one that shows it loses sends them plain.

What is learned is kept beside the machine cost, under the same key (`<key>.learned.json` in
`$DART_SPEC_CACHE/machine/`), merged entry by entry with what other processes wrote (the newer entry wins, under a file
lock) at most every `SAVE_EVERY_S` seconds and at exit; a cache that cannot be written keeps it in memory, and a save
never raises out of a call. Every value read back is checked (`parse_learned`: a finite number in its range, a tree
size among this controller's, a regime key that is a bucket): an entry that is not is ignored with one
`DartCacheWarning` per controller, the rest kept. A step time that is not finite and > 0 (a clock that stalls, is
coarser than a step or steps back) is never learned (`step_seconds_ok`).

    choice = dart_hf.tree_choice(model, head)        # the best tree by the estimates at batch 1 (None: none yet)
    tree = dart_hf.calibrate(model, tokenizer, head) # measure the acceptance curve and the machine cost now
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import statistics
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from transformers import StoppingCriteria

from dart_core import AcceptanceCurve, DartHead, TreeConfig
from dart_core.acceptance import accepted_within, tau_of
from dart_core.config import MAX_TREE_NODES
from dart_core.errors import DartInputError
from dart_hf.calibration import (CANDIDATES, NO_FILE, DartCacheWarning, MachineCost, base_tree_config,
                                 cached_machine_cost, cost_path, identity, machine_cost, measure_acceptance, monotone,
                                 read_cache_file, write_cache_file)
from dart_hf.target import context_drafting
from dart_runtime.timing import now

# ---- the constants of the controller ----------------------------------------------------------------------------
# None of these encodes a machine fact: they set how fast estimates follow the machine and how much evidence a
# decision needs.
STEP_DECAY = 0.85  # step and plain-step seconds rest on about 1 / (1 - 0.85) = 7 recent observations
TAU_DECAY = 0.98  # tau(R) rests on about 50 recent sequence-steps (acceptance varies with the text step by step)
PRIOR_TAU_WEIGHT = 4.0  # the shipped acceptance curve counts as 4 sequence-steps: a call's own steps soon outweigh it
FIRST_PLAIN = 3  # a regime's plain cost starts as the median of its first 3 timed plain steps (one may be an outlier)
MIN_PLAIN_WEIGHT = 1.0  # ... and DART steps start there once it has that median (or a timed plain call's)
MIN_TAU_WEIGHT = 3.0  # a tree size is chosen only once tau there rests on 3 sequence-steps (or the prior)
WINDOW = 4  # DART steps a call makes in a regime before the estimates may send it plain there
EXPLORE_EVERY = 8  # every 8th step of a regime tries a neighbouring tree size
PLAIN_EVERY = 64  # every 64th step of a regime (attached heads) is a plain step, refreshing plain's cost
FIRST_PROBE_AFTER, MAX_PROBE_AFTER = 2, 64  # plain calls in a plain regime before DART is tried again (doubling)
OUTLIER = 2.0  # a step time above twice its estimate counts as twice (`Mean.add_robust`)
SAVE_EVERY_S = 10.0  # the learned state reaches the disk at most this often (and at exit)
LEARNED_VERSION = 1
SHAPE_TOLERANCE = 1.3  # timed / predicted step ratios within 30% of each other: a calibrated cost's shape holds
MIN_FIT_SPAN = 1.5  # a line through timed steps needs verified row counts that differ by half
FIRST_ROWS = 4  # small trees first: a drafter that fills its trees starts a regime at <= 4 rows a sequence (3 nodes)
LADDER = 2.0  # a size not timed in a regime is tried only up to twice the rows a sequence of the largest one timed
CONTEXT_BUCKET_MIN = 256  # contexts up to 256 positions share a regime; above, one regime per power of two
# what a learned-state file may hold (anything else is ignored): no step of a decoding loop takes a day, no ratio of
# observed to predicted step time is beyond a million either way, no regime buckets more than 2**40 rows or positions,
# and no entry was updated more than a day ahead of this clock (it would win every merge for ever)
MAX_STEP_S = 86400.0
SCALE_RANGE = (1e-6, 1e6)
MAX_BUCKET = 2 ** 40
FUTURE_SLACK_S = 86400.0


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

    @classmethod
    def from_list(cls, raw, name: str, minimum: float, maximum: float = math.inf,
                  max_weight: float = math.inf) -> "Mean":
        """From [total, weight] with 0 <= weight <= `max_weight` and, when it is > 0, `minimum` <= mean <=
        `maximum`; DartInputError otherwise."""
        values = [finite(x) for x in raw] if isinstance(raw, list) and len(raw) == 2 else [None]
        if None in values:
            raise DartInputError(f"{name} is {_shown(raw)}, not [total, weight] of two finite numbers")
        mean = cls(*values)
        if not 0 <= mean.weight <= max_weight or (mean.weight > 0 and not minimum <= mean.value <= maximum):
            raise DartInputError(f"{name} is {_shown(raw)}: the weight must be in 0..{max_weight:g} and the mean in "
                                 f"{minimum:g}..{maximum:g}")
        return mean


def _shown(raw) -> str:
    """`raw` for a message, cut short (a hostile file's value may be huge or deeply nested)."""
    try:
        text = json.dumps(raw)
    except (ValueError, TypeError, RecursionError):
        text = type(raw).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _int_key(raw: str, low: int, high: int) -> Optional[int]:
    """The integer a JSON object key spells when it is in `low`..`high`, else None."""
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return None
    return value if low <= value <= high else None


def _time_ok(value) -> Optional[float]:
    """A wall-clock time an entry was updated: finite, >= 0, and not ahead of this clock by more than a day."""
    out = finite(value)
    return out if out is not None and 0 <= out <= time.time() + FUTURE_SLACK_S else None


def _weight_limit(decay: float) -> float:
    """The most weight a `Mean` that fades by `decay` can hold (its observations' saturation, the prior on top)."""
    return 1.0 / (1.0 - decay) + PRIOR_TAU_WEIGHT


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


@dataclasses.dataclass
class Regime:
    """What steps cost in one regime on this machine, and whether DART runs there."""

    plain: Mean = dataclasses.field(default_factory=Mean)  # seconds of one plain step
    steps: dict = dataclasses.field(default_factory=dict)  # tree size -> Mean of seconds of one DART step
    scale: Mean = dataclasses.field(default_factory=Mean)  # observed / predicted DART step time
    mode: str = "dart"  # "dart", or "plain": calls starting here run as plain generate() until a probe
    probe_after: int = FIRST_PROBE_AFTER  # plain calls before the next probe
    plain_calls: int = 0  # plain calls since the last probe
    updated: float = 0.0  # wall-clock time of the last change (merging keeps the newer regime)
    count: int = 0  # steps seen here in this process (the exploration schedule; not saved)
    first_plain: list = dataclasses.field(default_factory=list)  # timed plain steps before `plain` has any (not saved)

    def timed(self) -> dict:
        """{tree size: Mean of its step seconds} for the sizes with a timed DART step here."""
        return {r: m for r, m in self.steps.items() if m.weight > 0}

    def to_dict(self) -> dict:
        return {"plain": self.plain.to_list(), "steps": {str(r): m.to_list() for r, m in sorted(self.steps.items())},
                "scale": self.scale.to_list(), "mode": self.mode, "probe_after": self.probe_after,
                "plain_calls": self.plain_calls, "updated": self.updated}

    @classmethod
    def from_dict(cls, raw, name: str, problems: list[str]) -> "Regime":
        """The regime a learned-state file holds. DartInputError where its own fields (mode, probe counts, update
        time) do not validate; an estimate that does not (a step time or ratio that is not a finite number in range,
        a tree size outside 1..`MAX_TREE_NODES`) is left out and named in `problems`."""
        if not isinstance(raw, dict):
            raise DartInputError(f"{name} is not an object")
        mode, probe_after, plain_calls = raw.get("mode"), raw.get("probe_after"), raw.get("plain_calls")
        if mode not in ("dart", "plain"):
            raise DartInputError(f"{name}.mode is {_shown(mode)}, not 'dart' or 'plain'")
        for field, value, low, high in (("probe_after", probe_after, 1, MAX_PROBE_AFTER),
                                        ("plain_calls", plain_calls, 0, 10**9)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise DartInputError(f"{name}.{field} is {_shown(value)}, not an integer in {low}..{high}")
        updated = _time_ok(raw.get("updated"))
        if updated is None:
            raise DartInputError(f"{name}.updated is {_shown(raw.get('updated'))}, not a time up to now")
        regime = cls(mode=mode, probe_after=probe_after, plain_calls=plain_calls, updated=updated)
        limit = _weight_limit(STEP_DECAY)
        for field, low, high in (("plain", 1e-9, MAX_STEP_S), ("scale", *SCALE_RANGE)):
            try:
                setattr(regime, field, Mean.from_list(raw.get(field), f"{name}.{field}", low, high, limit))
            except DartInputError as err:
                problems.append(str(err))
        steps = raw.get("steps")
        if not isinstance(steps, dict):
            problems.append(f"{name}.steps is not an object")
            steps = {}
        for r, m in steps.items():
            size = _int_key(r, 1, MAX_TREE_NODES)
            if size is None:
                problems.append(f"{name}.steps has a tree size {_shown(r)}, not 1..{MAX_TREE_NODES}")
                continue
            try:
                regime.steps[size] = Mean.from_list(m, f"{name}.steps[{r}]", 1e-9, MAX_STEP_S, limit)
            except DartInputError as err:
                problems.append(str(err))
        return regime


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
        row = next(r for r in self.rows if r["remain_total"] == self.remain_total)
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


# ---- the controller ---------------------------------------------------------------------------------------------

class SpeedController:
    """The estimates for one target, head and machine setting, and the choices made from them (thread-safe).

    `sizes`: the tree sizes it chooses among; `cost`: a calibrated `MachineCost` (None: untimed sizes are predicted
    from the timed ones); `curve`: the head's shipped acceptance curve (or None);
    `start_size`: a regime's first tree (`first_size`); `path`: where the learned state is kept (None: memory)."""

    def __init__(self, sizes: Iterable[int], cost: Optional[MachineCost], curve: Optional[AcceptanceCurve],
                 start_size: int, path: Optional[Path] = None, ident: Optional[dict] = None) -> None:
        self.sizes = sorted(set(int(r) for r in sizes))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError("a controller needs tree sizes >= 1")
        self.cost, self.path, self.ident = cost, path, ident or {}
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
        self.last_save = now()
        self.file_warned = False  # one DartCacheWarning about the learned-state file per controller
        if path is not None:
            self._load()

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
                regime.mode = "plain"
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
        rows: then the line through (rows verified, seconds) of the timed sizes (`fit_line`)."""
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
                line = fit_line(points + [(key[0], plain, regime.plain.weight)])
            return None if line is None else max(line[0] + line[1] * key[0] * (size + 1), 1e-9)
        ratios = [m.value / self.prior_step_s(key, r) for r, m in timed.items()]
        if len(ratios) >= 2 and max(ratios) > SHAPE_TOLERANCE * min(ratios):
            line = fit_line(points)
            if line is not None:
                return max(line[0] + line[1] * key[0] * (size + 1), 1e-9)
        return prior * (regime.scale.value or 1.0)

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

    def best(self, key: tuple[int, int], sampled: bool, anywhere: bool = False) -> Optional[tuple[int, list[dict]]]:
        """(R*, rows) in regime `key` (`choose_tree_size`) over the sizes it may take (`tryable`; `anywhere`: over
        every size), or None while no such size has both estimates."""
        tau = self.tau_of(sampled)
        sizes = set(self.sizes if anywhere else self.tryable(key))
        steps = {r: s for r in tau if r in sizes and (s := self.step_s(key, r)) is not None
                 and (finite(s) or 0.0) > 0.0}
        if not steps:
            return None
        return choose_tree_size(tau, steps, self.plain_s(key))

    def expected(self, key: tuple[int, int], sampled: bool, anywhere: bool = False) -> Optional[float]:
        """The expected speedup of the best tree over plain in regime `key` (`best`; None while either is unknown)."""
        best = self.best(key, sampled, anywhere)
        if best is None:
            return None
        return next(row for row in best[1] if row["remain_total"] == best[0])["speedup"]

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
            if regime.plain.weight == 0 and not cold_ok:  # the first single steps: their median (`FIRST_PLAIN`)
                regime.first_plain.append(seconds)
                if len(regime.first_plain) < FIRST_PLAIN:
                    return
                seconds = statistics.median(regime.first_plain)
                regime.first_plain.clear()
            regime.plain.add_robust(seconds, STEP_DECAY)
            regime.updated, self.dirty = time.time(), True

    def observe_step(self, key: tuple[int, int], size: int, seconds: float, ranks: list[list[int]],
                     sampled: bool) -> None:
        """A DART step at `size` took `seconds` and accepted nodes of `ranks` (per sequence); a time that is not a
        step's (`step_seconds_ok`: a clock that stalled or stepped back) is dropped, what the step accepted is not."""
        with self.lock:
            regime = self.regimes[key]
            if not self.cold(key, size) and step_seconds_ok(seconds):
                regime.steps.setdefault(size, Mean()).add_robust(seconds, STEP_DECAY)
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

    def call_mode(self, batch_size: int, context_length: int) -> tuple[str, Optional[str]]:
        """How an attached head's call that starts in this regime runs: ("dart" | "probe" | "plain", the warning to
        give for a plain call, once per regime, else None)."""
        with self.lock:
            key = regime_key(batch_size, context_length)
            regime = self.regime(batch_size, context_length)
            if regime.mode == "dart":
                return "dart", None
            regime.plain_calls += 1
            regime.updated, self.dirty = time.time(), True
            if regime.plain_calls >= regime.probe_after:
                regime.plain_calls = 0
                return "probe", None
            return "plain", self.fallback_message(key, False)

    def fallback_message(self, key: tuple[int, int], sampled: bool) -> Optional[str]:
        """The one warning of a regime where DART runs plain, with the numbers (None once given)."""
        if key in self.warned:
            return None
        self.warned.add(key)
        best = self.best(key, sampled)
        regime = self.regimes[key]
        where = f"batch <= {key[0]}, context <= {key[1]} positions"
        later = max(regime.probe_after - regime.plain_calls, 1)
        plain = self.plain_s(key)
        if best is None or plain is None:
            return f"DART is not expected to beat plain decoding on this machine ({where}); calls here run plain"
        row = next(r for r in best[1] if r["remain_total"] == best[0])
        return (f"DART does not beat plain decoding on this machine ({where}): its best tree, {best[0]} draft "
                f"nodes, is estimated at {row['tau']:.2f} tokens per {row['step_ms']:.1f} ms step against "
                f"{plain * 1e3:.1f} ms per plain token ({row['speedup']:.2f}x); calls here run plain, "
                f"and DART is tried again after {later} of them")

    def set_plain(self, key: tuple[int, int], probing: bool) -> None:
        """Attached calls that start in regime `key` run plain from now on, until a probe (a probe that lost, and so
        `probing`, waits twice as long before the next)."""
        regime = self.regimes[key]
        regime.probe_after = min(2 * regime.probe_after, MAX_PROBE_AFTER) if probing and regime.mode == "plain" \
            else FIRST_PROBE_AFTER
        regime.mode, regime.plain_calls = "plain", 0
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
            return TreeChoice(size, dataclasses.replace(base, remain_total=size),
                              next(r for r in rows if r["remain_total"] == size)["speedup"], rows, key,
                              None if plain is None else plain * 1e3, self.cost)

    # -- persistence --

    def state(self) -> dict:
        return {"version": LEARNED_VERSION, "identity": self.ident,
                "tau": {name: {"updated": self.tau_updated[s], "sizes": {str(r): m.to_list() for r, m in
                                                                       sorted(self.tau[s].items())}}
                        for name, s in (("greedy", False), ("sampled", True))},
                "regimes": {f"{b}x{c}": regime.to_dict() for (b, c), regime in sorted(self.regimes.items())}}

    def _adopt(self, raw, newer_only: bool) -> list[str]:
        """Take the entries of a saved state that validate and are newer than this one's (`parse_learned`: a state
        that is not this controller's raises DartInputError, whole); what was left out of it."""
        tau, regimes, problems = parse_learned(raw, self.ident, self.sizes)
        for sampled, (updated, table) in tau.items():
            if not newer_only or updated > self.tau_updated[sampled]:
                self.tau[sampled] = {**self.tau[sampled], **table} if not newer_only else table
                self.tau_updated[sampled] = updated
        for key, regime in regimes.items():
            mine = self.regimes.get(key)
            if mine is None or not newer_only or regime.updated > mine.updated:
                if mine is not None:
                    regime.count = mine.count
                self.regimes[key] = regime
        return problems

    def _warn_file(self, what: str) -> None:
        """The one `DartCacheWarning` of this controller about its learned-state file."""
        if not self.file_warned:
            self.file_warned = True
            warnings.warn(f"ignoring the learned speed estimates {self.path}{what}", DartCacheWarning, stacklevel=4)

    def _read(self, newer_only: bool) -> None:
        """Adopt what the file holds (`_adopt`), warning once about anything in it left out."""
        try:
            raw = read_cache_file(self.path)
            problems = [] if raw is NO_FILE else self._adopt(raw, newer_only)
        except (ValueError, DartInputError) as err:  # malformed JSON, nested too deeply, another state
            self._warn_file(f": {err}; " + ("this process's replace them" if newer_only else "they are learned again"))
            return
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            self._warn_file(f" that do not validate ({'; '.join(problems[:3])}{more}); the rest is kept")

    def _load(self) -> None:
        self._read(newer_only=False)

    def save(self, force: bool = False) -> None:
        """Merge with what is on disk (newer entries win) and write, when something changed and `SAVE_EVERY_S` has
        passed (`force`: whenever something changed). Never raises: a file that does not validate is replaced by
        this state, one that cannot be written leaves it in memory (`write_cache_file`), and any other failure
        keeps it to be written by a later save (each with one `DartCacheWarning` per controller)."""
        with self.lock:
            if self.path is None or not self.dirty or (not force and now() - self.last_save < SAVE_EVERY_S):
                return
            try:
                with _file_lock(self.path):
                    self._read(newer_only=True)
                    write_cache_file(self.path, self.state())
                self.dirty = False
            except Exception as err:  # noqa: BLE001 -- a call's output is never lost to its save
                self._warn_file(f" could not be saved ({type(err).__name__}: {err}); they are kept in memory")
            self.last_save = now()


def parse_learned(raw, ident: dict, sizes: Iterable[int] = range(1, MAX_TREE_NODES + 1)
                  ) -> tuple[dict, dict, list[str]]:
    """({sampled: (updated, {size: Mean})}, {regime key: Regime}, problems) from a learned-state file: DartInputError
    naming what is wrong where it is not a learned state of this `ident` (not an object, another version or
    identity); otherwise every entry that does not validate (a value that is not a finite number in its range, a
    tree size not among `sizes` (tau) or not in 1..`MAX_TREE_NODES` (step times), a regime key that is not a
    bucket) is left out, and `problems` names each."""
    if not isinstance(raw, dict):
        raise DartInputError(f"not a learned state (a JSON {type(raw).__name__}, not an object)")
    if raw.get("version") != LEARNED_VERSION:
        raise DartInputError(f"format version {_shown(raw.get('version'))}, not {LEARNED_VERSION}")
    if raw.get("identity") != ident:
        raise DartInputError("it was learned for another target, head or machine setting")
    sizes = set(sizes)
    problems: list[str] = []
    tau = {}
    tables = raw.get("tau") if isinstance(raw.get("tau"), dict) else {}
    for name, sampled in (("greedy", False), ("sampled", True)):
        entry = tables.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("sizes"), dict):
            problems.append(f"tau.{name} is not an object of sizes")
            continue
        updated = _time_ok(entry.get("updated"))
        if updated is None:
            problems.append(f"tau.{name}.updated is {_shown(entry.get('updated'))}, not a time up to now")
            continue
        table = {}
        for r, m in entry["sizes"].items():
            size = _int_key(r, 1, MAX_TREE_NODES)
            if size not in sizes:
                problems.append(f"tau.{name} has tree size {_shown(r)}, not one of this controller's tree sizes "
                                f"({min(sizes)}..{max(sizes)})")
                continue
            try:  # a tree of R nodes yields at most R + 1 tokens a step (the mean's rounding aside)
                table[size] = Mean.from_list(m, f"tau.{name}[{r}]", 1.0, (size + 1.0) * (1 + 1e-9),
                                             _weight_limit(TAU_DECAY))
            except DartInputError as err:
                problems.append(str(err))
        tau[sampled] = (updated, table)
    regimes = {}
    entries = raw.get("regimes")
    if not isinstance(entries, dict):
        problems.append("regimes is not an object")
        entries = {}
    for name, regime in entries.items():
        parts = name.split("x")
        b, c = (_int_key(x, 1, MAX_BUCKET) for x in parts) if len(parts) == 2 else (None, None)
        if b is None or c is None or (b, c) != regime_key(b, c):
            problems.append(f"regime {_shown(name)} is not a (batch, context) bucket")
            continue
        try:
            regimes[(b, c)] = Regime.from_dict(regime, f"regimes[{name}]", problems)
        except DartInputError as err:
            problems.append(str(err))
    return tau, regimes, problems


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on `path` + '.lock' among processes, where the file system allows one (else no lock: the
    write is still atomic, only a concurrent update may be lost)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(str(path) + ".lock", "a")
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()


# ---- one call ---------------------------------------------------------------------------------------------------

class CallPolicy:
    """The `dart_hf.loop.StepPolicy` of one generate() call: asks the controller for each step's tree and teaches it
    what the step cost. `controller`: a function that gives the controller, called when the call starts decoding
    (after its checks: a call DART does not decode makes none);
    `may_go_plain`: an attached head's call, which may take plain steps and finish plain; `probe`: the call tries
    DART in regimes that run plain; `fixed`: every step takes that tree. Every call teaches the estimates and the
    regimes' verdicts. `warnings`: the
    `DartFallbackWarning` messages the call produced (the caller gives them)."""

    def __init__(self, controller: Callable[[], SpeedController], *, may_go_plain: bool, probe: bool = False,
                 fixed: Optional[int] = None) -> None:
        self._resolve, self.may_go_plain, self.probe, self.fixed = controller, may_go_plain, probe, fixed
        self.controller: Optional[SpeedController] = None
        self.max_tree_size = fixed or 0
        self.sampled = False
        self.dart_steps: dict[tuple[int, int], int] = {}  # DART steps of this call per regime
        self.recent: dict[tuple[int, int], list[tuple[float, float]]] = {}  # regime -> last WINDOW (tokens, seconds)
        self.plain_here: set[tuple[int, int]] = set()  # regimes this call finishes plain
        self.warnings: list[str] = []

    def begin(self, sampled: bool) -> None:
        self.controller = self._resolve()
        self.sampled = sampled
        if self.fixed is None:
            self.max_tree_size = self.controller.max_size

    def save(self) -> None:
        """Let the controller keep what the call taught it (`SpeedController.save`)."""
        if self.controller is not None:
            self.controller.save()

    def tree_size(self, batch_size: int, context_length: int) -> int:
        if self.fixed is not None:
            return self.fixed
        ctrl = self.controller
        with ctrl.lock:
            key = regime_key(batch_size, context_length)
            regime = ctrl.regime(batch_size, context_length)
            if self.may_go_plain:
                if key in self.plain_here:
                    return 0
                if regime.mode == "plain" and not self.probe:
                    self.plain_here.add(key)
                    message = ctrl.fallback_message(key, self.sampled)
                    if message is not None:
                        self.warnings.append(message)
                    return 0
                if regime.plain.weight < MIN_PLAIN_WEIGHT or regime.count % PLAIN_EVERY == PLAIN_EVERY - 1:
                    return 0  # measure plain decoding here (nothing rests on a prior alone)
            best = ctrl.best(key, self.sampled)
            if best is None:  # nothing timed here yet
                return ctrl.start_size
            size = best[0]
            if regime.count % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                size = self._neighbour(key, size, up=(regime.count // EXPLORE_EVERY) % 2 == 0)
            return size

    def _neighbour(self, key: tuple[int, int], size: int, up: bool) -> int:
        """The size next to `size` (up or down) among those the regime may take (`SpeedController.tryable`)."""
        sizes = self.controller.tryable(key)
        i = sizes.index(size) if size in sizes else 0
        j = i + 1 if (up and i + 1 < len(sizes)) or i == 0 else i - 1
        return sizes[min(max(j, 0), len(sizes) - 1)]

    def observe(self, tree_size: int, batch_size: int, context_length: int, seconds: float,
                accepted_ranks: list[list[int]]) -> None:
        ctrl = self.controller
        key = regime_key(batch_size, context_length)
        with ctrl.lock:
            regime = ctrl.regime(batch_size, context_length)
            regime.count += 1
            if tree_size == 0:
                ctrl.observe_plain(key, seconds)
                return
            ctrl.observe_step(key, tree_size, seconds, accepted_ranks, self.sampled)
            self.dart_steps[key] = self.dart_steps.get(key, 0) + 1
            tokens = tau_of(sum(map(len, accepted_ranks)), len(accepted_ranks))
            recent = self.recent.setdefault(key, [])
            if step_seconds_ok(seconds):  # a clock that stalled or stepped back times nothing
                recent.append((tokens, seconds))
                del recent[:-WINDOW]
            if self.dart_steps[key] < WINDOW or not recent:
                return
            expected, plain = ctrl.expected(key, self.sampled), ctrl.plain_s(key)
            if expected is None or plain is None:
                return
            # the verdict follows the latest evidence of any call: slower than plain both by the estimates and over
            # this call's last WINDOW steps here, or not
            observed = sum(t for t, _ in recent) / sum(s for _, s in recent) * plain
            if expected < 1.0 and observed < 1.0:
                if not self.may_go_plain:  # a call that must decode with DART: later attached calls run plain here
                    if regime.mode == "dart":
                        ctrl.set_plain(key, probing=False)
                    return
                self.plain_here.add(key)
                if regime.mode == "dart" or self.probe:
                    ctrl.set_plain(key, probing=self.probe)
                message = ctrl.fallback_message(key, self.sampled)
                if message is not None:
                    self.warnings.append(message)
            elif regime.mode == "plain":  # DART pays here again (a probe, or a call that decodes with DART anyway)
                regime.mode, regime.probe_after, regime.plain_calls = "dart", FIRST_PROBE_AFTER, 0
                regime.updated, ctrl.dirty = time.time(), True


class PlainClock(StoppingCriteria):
    """A stopping criterion that never stops: it notes when plain `generate()` finishes each step, so that the
    controller learns what a plain step costs (`report`)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int, int]] = []  # (time, batch size, sequence length)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.marks.append((now(), int(input_ids.shape[0]), int(input_ids.shape[1])))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def report(self, controller: SpeedController) -> None:
        """Give the controller the median step time of each regime the call went through."""
        by_regime: dict[tuple[int, int], list[float]] = {}
        for (t0, _, _), (t1, batch, length) in zip(self.marks, self.marks[1:]):
            by_regime.setdefault(regime_key(batch, length - 1), []).append(t1 - t0)
        for key, times in by_regime.items():
            seconds = statistics.median(times)
            if not step_seconds_ok(seconds):  # a clock coarser than a step: the mean over the regime's steps
                seconds = sum(times) / len(times)
            controller.observe_plain(key, seconds, cold_ok=len(times) >= 3)  # a time <= 0 is dropped there


# ---- one controller per target, head and machine setting ---------------------------------------------------------

# per head: {(target id, dtype, device, threads, acceptance id, search settings): SpeedController}
_CONTROLLERS: "weakref.WeakKeyDictionary[DartHead, dict]" = weakref.WeakKeyDictionary()
_CONTROLLERS_LOCK = threading.Lock()
_LIVE: "weakref.WeakSet[SpeedController]" = weakref.WeakSet()


def _key(model, head: DartHead, context: Optional[bool], store: bool = False) -> tuple:
    """The controller's key; `context` None: the head's own tree settings decide (`context_drafting`); `store`: the
    calls match a store of earlier outputs (with context drafting only)."""
    context = context_drafting(head) if context is None else context
    param = next(model.parameters())
    base = dataclasses.replace(base_tree_config(model, head), remain_total=1)
    return (id(model), param.dtype, param.device, torch.get_num_threads(), id(head.acceptance), base,
            "store" if context and store else context)


def learned_path(ident: dict, sources) -> Path:
    """Where the learned state of a controller of identity `ident` is kept, apart for calls without context drafting,
    with it (`sources` True) and with a store of earlier outputs too ("store"; `_key`'s last field)."""
    return cost_path(ident).with_suffix({"store": ".store-learned.json", True: ".context-learned.json",
                                         False: ".learned.json"}[sources])


def existing_controller(model, head: DartHead, context: Optional[bool] = None,
                        store: bool = False) -> Optional[SpeedController]:
    """The controller of `head` on `model` here, for calls with context drafting on or off (`context`; None: as the
    head's tree settings say) and with or without a store, if a call made one (no measurement)."""
    with _CONTROLLERS_LOCK:
        return _CONTROLLERS.get(head, {}).get(_key(model, head, context, store))


def controller_for(model, head: DartHead, context: Optional[bool] = None, store: bool = False) -> SpeedController:
    """The controller of `head` on `model` with this machine setting, for calls with context drafting on or off and
    with or without a store of earlier outputs (`context`, `store`: the trees, and so what they accept, differ; None:
    as the head's tree settings say): made at the first call, from the head's acceptance curve, a machine cost that
    `calibrate` measured here (cached; a call never measures one) and what earlier calls learned."""
    key = _key(model, head, context, store)
    with _CONTROLLERS_LOCK:
        found = _CONTROLLERS.get(head, {}).get(key)
        if found is not None:
            return found
        cost = cached_machine_cost(model, head)
        base = base_tree_config(model, head)
        curve = head.acceptance
        largest = max(curve.tau) if curve is not None else base.remain_total
        sizes = [r for r in CANDIDATES if r <= largest] + ([largest] if largest not in CANDIDATES else [])
        ident = identity(model, head)
        path = learned_path(ident, key[-1])
        controller = SpeedController(sizes, cost, curve, start_size=first_size(head, base, sizes), path=path,
                                     ident=ident)
        _CONTROLLERS.setdefault(head, {})[key] = controller
        _LIVE.add(controller)
        return controller


def first_size(head: DartHead, base: TreeConfig, sizes: list[int]) -> int:
    """The tree a regime's first DART steps verify: for a drafter that fills its trees (`Drafter.fills_tree`: a larger
    tree is a larger forward) the largest of `sizes` within `FIRST_ROWS` rows a sequence, and larger ones only as
    timed steps reach them (`SpeedController.tryable`); for one whose trees hold only what it proposes, its budget
    (`base.remain_total`)."""
    if not head.fills_tree:
        return base.remain_total
    return min(base.remain_total, max([r for r in sizes if r + 1 <= FIRST_ROWS] or [sizes[0]]))


@atexit.register
def _save_all() -> None:
    for controller in list(_LIVE):
        with contextlib.suppress(Exception):  # at exit, a cache that cannot be written has warned already
            controller.save(force=True)


def tree_choice(model, head: DartHead, batch_size: int = 1, context_length: int = 1) -> Optional[TreeChoice]:
    """The tree size the controller would choose now for `head` on `model` (a batch of `batch_size` over
    `context_length` positions), from the head's acceptance curve, this machine's cost and what calls taught it;
    None while nothing is known of the head's acceptance."""
    controller = controller_for(model, head)
    return controller.choice(base_tree_config(model, head), batch_size, context_length)


def prior_choice(curve: AcceptanceCurve, cost: MachineCost, base: TreeConfig) -> TreeChoice:
    """The choice the priors alone give at batch 1 on the cost's context (before any call teaches a controller):
    `curve`'s sizes, `base`'s other search settings."""
    controller = SpeedController(curve.tau, cost, curve, start_size=base.remain_total)
    return controller.choice(base, 1, cost.context_length)


def calibrate(model, tokenizer, head: DartHead, prompts: Optional[Iterable] = None, *, max_nodes: int = 60,
              candidates: Optional[Iterable[int]] = None, max_new_tokens: int = 64, context_length: int = 256,
              repeats: int = 3, progress: Optional[bool] = True) -> Optional[TreeChoice]:
    """Measure both priors now: the acceptance curve (set as `head.acceptance`; `head.save_pretrained` ships it) and
    this machine's cost (cached); returns the choice they give at batch 1."""
    head.acceptance = measure_acceptance(model, tokenizer, head, prompts, max_nodes=max_nodes, candidates=candidates,
                                         max_new_tokens=max_new_tokens, progress=progress)
    machine_cost(model, head, refresh=True, progress=progress, max_nodes=max(head.acceptance.tau),
                 context_length=context_length, repeats=repeats)
    return tree_choice(model, head)
