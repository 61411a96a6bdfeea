"""The step-size controller (`dart_hf.controller`): the rule, the estimates, the fallback to plain and the probes,
on synthetic machines (noisy, changing, loaded at the first measurement, one where no tree pays, batch regimes) whose
verdict is the same on every CPU; then the loop with a policy, on a tiny model: exact whatever each step's tree."""

import json
import random
import sys
import time
import warnings

import pytest
import torch

import dart_hf
from dart_core import AcceptanceCurve, TreeConfig
from dart_hf import DartCacheWarning, DartFallbackWarning
from dart_hf.calibration import MachineCost
from dart_core.acceptance import accepted_within
from dart_hf.controller import (FIRST_PROBE_AFTER, MAX_PROBE_AFTER, WINDOW, CallPolicy, Mean, SpeedController,
                                choose_tree_size, fit_line, regime_key)
from helpers.hf_models import oracle_head, tiny_target

controller_module = sys.modules["dart_hf.controller"]
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 60)


# ---- the rule ---------------------------------------------------------------------------------------------------

def test_the_choice_is_the_argmax_of_tokens_per_second_ties_to_the_smaller_tree():
    tau = {1: 1.6, 4: 2.2, 16: 2.8, 60: 3.0}
    step = {1: 0.10, 4: 0.11, 16: 0.12, 60: 0.30}
    best, rows = choose_tree_size(tau, step, plain_s=0.08)
    assert best == 16 and rows[2]["speedup"] == pytest.approx(2.8 / 0.12 * 0.08)
    assert choose_tree_size({1: 2.0, 4: 2.0}, {1: 0.1, 4: 0.1}, None)[0] == 1
    assert choose_tree_size({1: 2.0, 4: 2.0}, {1: 0.1, 4: 0.1}, None)[1][0]["speedup"] is None
    with pytest.raises(ValueError, match="no tree size"):
        choose_tree_size({1: 2.0}, {4: 0.1}, 0.1)


def test_accepted_within_counts_the_leading_ranks_below_the_size():
    assert accepted_within([0, 2, 5, 9], 1) == 1 and accepted_within([0, 2, 5, 9], 6) == 3
    assert accepted_within([3, 4], 3) == 0 and accepted_within([], 60) == 0


def test_running_means_fade_and_bound_outliers():
    mean = Mean()
    assert mean.value is None
    for _ in range(50):
        mean.add(1.0, 0.8)
    mean.add_robust(100.0, 0.8)  # one slow spell counts as twice the estimate
    assert mean.value == pytest.approx((4 * 1.0 + 2.0) / 5, rel=1e-3)  # weight 5 = 1 / (1 - 0.8), saturated
    for _ in range(12):  # a lasting change is followed
        mean.add_robust(5.0, 0.8)
    assert mean.value > 4.5


def test_the_line_of_timed_steps_is_a_weighted_fit_with_a_slope_never_negative():
    points = [(x, 0.5 + 2.0 * x, w) for x, w in ((1.0, 1.0), (2.0, 3.0), (4.0, 0.5))]
    assert fit_line(points) == pytest.approx((0.5, 2.0))
    assert fit_line([(1.0, 3.0, 1.0), (2.0, 1.0, 1.0)]) == pytest.approx((2.0, 0.0))  # a smaller tree is never dearer
    assert fit_line([(4.0, 1.0, 1.0), (5.0, 2.0, 1.0)]) is None  # too close to tell a slope
    assert fit_line([(1.0, 1.0, 1.0)]) is None


def test_regimes_bucket_batch_and_context():
    assert regime_key(1, 10) == (1, 256) and regime_key(3, 257) == (4, 512) and regime_key(8, 2000) == (8, 2048)


# ---- a synthetic machine ----------------------------------------------------------------------------------------

class Machine:
    """Seconds of plain and DART steps, and the accepted path of each step (selection ranks), with noise."""

    def __init__(self, plain_s=0.070, head_s=0.015, verify=None, noise=0.0, seed=0, depth_p=0.55):
        self.plain_s, self.head_s, self.noise = plain_s, head_s, noise
        # a CPU-like forward: 2-4 tokens cost less than 1.5 tokens' worth, then it grows
        self.verify = verify or (lambda k: 0.060 + 0.004 * k)
        self.rng = random.Random(seed)
        self.depth_p = depth_p

    def _noisy(self, seconds: float) -> float:
        return seconds * (self.rng.lognormvariate(0.0, self.noise) if self.noise else 1.0)

    def plain(self, batch: int) -> float:
        return self._noisy(self.plain_s * (1 + 0.05 * (batch - 1)))  # more rows cost a plain step little

    def step(self, size: int, batch: int) -> float:
        return self._noisy(self.head_s + self.verify(batch * (size + 1)))

    def path(self) -> list[int]:
        """The ranks of the nodes a 60-node tree would accept: each level kept with probability depth_p, at a rank
        that grows with the depth."""
        ranks, rank = [], -1
        while len(ranks) < 6 and self.rng.random() < self.depth_p:
            rank = rank + 1 + int(self.rng.expovariate(0.5))
            if rank >= 60:
                break
            ranks.append(rank)
        return ranks

    def expected_rate(self, size: int, batch: int = 1, samples: int = 4000) -> float:
        """Tokens per second of a fixed tree of `size` (per sequence), by simulation without noise."""
        rng_state = self.rng.getstate()
        tau = 1 + sum(accepted_within(self.path(), size) for _ in range(samples)) / samples
        self.rng.setstate(rng_state)
        return tau / (self.head_s + self.verify(batch * (size + 1)))


def prior_from(machine: Machine, scale: float = 1.0, plain_scale: float | None = None) -> MachineCost:
    """The first-call measurement of `machine` (times multiplied by `scale`, plain's by `plain_scale`)."""
    plain_scale = scale if plain_scale is None else plain_scale
    return MachineCost(verify_ms={k: machine.verify(k) * 1e3 * scale for k in (1, 2, 4, 8, 16, 32, 61)},
                       plain_ms=machine.plain_s * 1e3 * plain_scale, head_ms=machine.head_s * 1e3 * scale,
                       tree_ms=0.0, rest_ms=0.0, context_length=256, seconds=1.0)


def curve_of(machine: Machine, steps: int = 3000) -> AcceptanceCurve:
    paths = [machine.path() for _ in range(steps)]
    tau = {r: 1 + sum(accepted_within(p, r) for p in paths) / steps for r in SIZES}
    return AcceptanceCurve(tau=tau, steps=steps, new_tokens=steps, prompts=1)


def run_call(controller: SpeedController, machine: Machine, steps: int = 64, batch: int = 1, context: int = 100,
             attached: bool = True) -> tuple[float, float, list[int]]:
    """One simulated generate() call as enable() runs it -> (tokens per sequence, seconds, tree sizes)."""
    mode, _ = controller.call_mode(batch, context) if attached else ("dart", None)
    if mode == "plain":  # plain generate(), its steps timed (`PlainClock`)
        seconds = [machine.plain(batch) for _ in range(steps)]
        controller.observe_plain(regime_key(batch, context), sorted(seconds)[len(seconds) // 2], cold_ok=True)
        return float(steps), sum(seconds), []
    policy = CallPolicy(lambda: controller, may_go_plain=attached, probe=mode == "probe")
    policy.begin(False)
    tokens, total, sizes = 0.0, 0.0, []
    for _ in range(steps):
        size = policy.tree_size(batch, context)
        if size == 0:
            seconds, ranks, gained = machine.plain(batch), [[] for _ in range(batch)], 1.0
        else:
            paths = [machine.path() for _ in range(batch)]
            ranks = [p[:accepted_within(p, size)] for p in paths]
            seconds, gained = machine.step(size, batch), 1 + sum(map(len, ranks)) / batch
        policy.observe(size, batch, context, seconds, ranks)
        tokens, total = tokens + gained, total + seconds
        sizes.append(size)
    return tokens, total, sizes


def controller(machine: Machine, cost: MachineCost | None = "same", curve: AcceptanceCurve | None = "same",
               start: int = 3) -> SpeedController:
    cost = prior_from(machine) if cost == "same" else cost
    curve = curve_of(machine) if curve == "same" else curve
    return SpeedController(SIZES, cost, curve, start_size=start)


# a controller learns step costs from its calls alone, or starts from a measured cost (`dart-spec calibrate`)
PRIORS = pytest.mark.parametrize("prior", [lambda machine: None, prior_from], ids=["learned", "calibrated"])


def rate_over_calls(ctrl, machine, calls: int, **kwargs) -> float:
    tokens = seconds = 0.0
    for _ in range(calls):
        t, s, _ = run_call(ctrl, machine, **kwargs)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds


def best_fixed(machine: Machine, batch: int = 1) -> tuple[int, float]:
    rates = {r: machine.expected_rate(r, batch) for r in SIZES}
    best = max(rates, key=rates.get)
    return best, rates[best]


# ---- on synthetic machines ----------------------------------------------------------------------------------

@PRIORS
def test_it_converges_to_the_best_fixed_tree(prior):
    machine = Machine()
    best, best_rate = best_fixed(machine)
    assert best_rate * machine.plain_s > 1.2  # DART pays here
    ctrl = controller(machine, cost=prior(machine))
    rate_over_calls(ctrl, machine, 3)  # learning
    assert rate_over_calls(ctrl, machine, 20) >= 0.95 * best_rate
    assert machine.expected_rate(ctrl.choice(TreeConfig(), 1, 100).remain_total) >= 0.93 * best_rate


@PRIORS
def test_a_noisy_machine_keeps_dart_where_it_pays_and_a_good_tree(prior):
    machine = Machine(noise=0.3, seed=3)
    _, best_rate = best_fixed(Machine())
    ctrl = controller(Machine(), cost=prior(Machine()))
    rate_over_calls(ctrl, machine, 3)
    rate = rate_over_calls(ctrl, machine, 30)
    # every step time 30% noisy: learned from the steps alone, the sizes it settles on are a little further from the
    # best than with a calibrated cost, and it stays well above plain (the best tree is > 1.2x plain here)
    assert rate >= (0.9 if ctrl.cost is not None else 0.85) * best_rate and rate * machine.plain_s > 1.0
    assert ctrl.regimes[regime_key(1, 100)].mode == "dart"


@PRIORS
def test_a_machine_where_no_tree_pays_stays_plain_and_probes_less_and_less(prior):
    machine = Machine(verify=lambda k: 0.150 + 0.004 * k)  # every tree forward costs twice a plain step
    assert best_fixed(machine)[1] * machine.plain_s < 0.8
    ctrl = controller(machine, cost=prior(machine))
    if ctrl.cost is not None:
        assert ctrl.regime(1, 100).mode == "plain"  # a calibrated cost already says so
    gaps, since = [], 0
    for _ in range(200):
        _, _, sizes = run_call(ctrl, machine, steps=32)
        if sizes:
            gaps.append(since)
            since = 0
            assert sizes.count(0) >= 32 - 2 * WINDOW  # a probe that loses finishes plain within a few steps
        else:
            since += 1
    if ctrl.cost is None:  # nothing says so before the first call's own steps
        assert gaps[0] == 0
        gaps = gaps[1:]
    assert [g + 1 for g in gaps[:5]] == [FIRST_PROBE_AFTER, 4, 8, 16, 32] and max(gaps) + 1 == MAX_PROBE_AFTER
    rate = rate_over_calls(ctrl, machine, 64, steps=32)
    assert rate * machine.plain_s >= 0.97


@PRIORS
def test_a_head_that_cannot_pay_is_caught_whatever_its_curve_claims(prior):
    """A random head (tau 1) shipped with a curve that claims tau 2: the first call's steps show the truth."""
    machine = Machine(verify=lambda k: 0.080 + 0.004 * k, depth_p=0.0)
    ctrl = controller(machine, cost=prior(machine), curve=curve_of(Machine()))
    _, _, sizes = run_call(ctrl, machine, steps=64)
    dart_steps = [s for s in sizes if s]
    assert len(dart_steps) <= 2 * WINDOW and sizes[-1] == 0
    assert ctrl.regimes[regime_key(1, 100)].mode == "plain"
    assert rate_over_calls(ctrl, machine, 40) * machine.plain_s >= 0.97


@PRIORS
def test_a_changing_machine_is_followed_both_ways(prior):
    fast = Machine()
    slow = Machine(verify=lambda k: 0.200 + 0.010 * k)
    ctrl = controller(fast, cost=prior(fast))
    rate_over_calls(ctrl, fast, 5)
    assert ctrl.regimes[regime_key(1, 100)].mode == "dart"
    _, _, sizes = run_call(ctrl, slow, steps=64)  # the machine turns slow in the middle of the work
    assert max(i for i, s in enumerate(sizes) if s) < 3 * WINDOW  # then plain to the end of the call
    regime = ctrl.regimes[regime_key(1, 100)]
    assert regime.mode == "plain"
    assert rate_over_calls(ctrl, slow, 20) * slow.plain_s >= 0.95
    _, best_rate = best_fixed(fast)  # and fast again: the next probe brings DART back
    for _ in range(regime.probe_after + 1):
        run_call(ctrl, fast)
    assert ctrl.regimes[regime_key(1, 100)].mode == "dart"
    assert rate_over_calls(ctrl, fast, 10) >= 0.9 * best_rate


def test_a_first_measurement_on_a_loaded_machine_neither_switches_dart_off_for_good():
    machine = Machine()
    ctrl = controller(machine, cost=prior_from(machine, scale=4.0, plain_scale=1.0))  # tree forwards timed under load
    assert ctrl.regime(1, 100).mode == "plain"
    rate_over_calls(ctrl, machine, FIRST_PROBE_AFTER + 2)
    assert ctrl.regimes[regime_key(1, 100)].mode == "dart"
    assert rate_over_calls(ctrl, machine, 10) >= 0.9 * best_fixed(machine)[1]


def test_nor_keeps_a_losing_tree():
    machine = Machine(verify=lambda k: 0.150 + 0.004 * k)
    ctrl = controller(machine, cost=prior_from(machine, scale=1.0, plain_scale=5.0))  # plain timed under load
    assert ctrl.regime(1, 100).mode == "dart"
    _, _, sizes = run_call(ctrl, machine, steps=64)
    assert sizes[0] == 0  # plain is measured in the call before anything rests on the prior
    assert sum(1 for s in sizes if s) <= 2 * WINDOW and sizes[-1] == 0
    assert ctrl.regimes[regime_key(1, 100)].mode == "plain"


def test_nor_keeps_the_wrong_tree_when_load_bent_the_first_measurement():
    """Load inflated the fixed part of each forward, not the per-token part: the prior says a large tree costs about
    what a small one does. The timed steps of two sizes show the real slope, and the choice walks back."""
    machine = Machine(verify=lambda k: 0.040 + 0.008 * k)
    best, best_rate = best_fixed(machine)
    assert best <= 4
    loaded = prior_from(Machine(verify=lambda k: 4 * 0.040 + 0.008 * k, head_s=4 * machine.head_s,
                                plain_s=4 * machine.plain_s))
    ctrl = controller(machine, cost=loaded, curve=curve_of(machine))
    key = regime_key(1, 100)
    ctrl.regime(1, 100)
    prior = {r: ctrl.prior_step_s(key, r) for r in SIZES}
    assert choose_tree_size(ctrl.tau_of(False), prior, None)[0] > 2 * best  # what the bent prior alone says
    rate_over_calls(ctrl, machine, 3)
    assert rate_over_calls(ctrl, machine, 10) >= 0.93 * best_rate
    assert ctrl.choice(TreeConfig(), 1, 100).remain_total <= 2 * best


@pytest.mark.parametrize("bend", [lambda k: 4.0 if k <= 8 else 1.5, lambda k: 1.5 if k <= 8 else 4.0])
def test_nor_when_load_bent_the_measurement_either_way(bend):
    """Load inflated small forwards more than large ones (or the reverse): the timed steps contradict the prior's
    shape, and the choice follows what the steps measure."""
    machine = Machine(verify=lambda k: 0.040 + 0.008 * k)
    best, best_rate = best_fixed(machine)
    cost = prior_from(machine)
    cost.verify_ms = {k: ms * bend(k) for k, ms in cost.verify_ms.items()}
    cost.plain_ms *= 4.0
    ctrl = controller(machine, cost=cost, curve=curve_of(machine))
    rate_over_calls(ctrl, machine, 4)
    assert rate_over_calls(ctrl, machine, 10) >= 0.9 * best_rate


def test_a_head_without_a_curve_learns_one_from_its_calls():
    machine = Machine()
    ctrl = controller(machine, curve=None)
    _, _, sizes = run_call(ctrl, machine, steps=64)
    assert [s for s in sizes if s][:2] == [3, 3]  # small trees first: the start size, then larger as they pay
    rate_over_calls(ctrl, machine, 3)
    assert rate_over_calls(ctrl, machine, 20) >= 0.93 * best_fixed(machine)[1]
    best = ctrl.choice(TreeConfig(), 1, 100).remain_total
    assert best > 3 and ctrl.tau_of(False)[best] > ctrl.tau_of(False)[1] > 1.0


@PRIORS
def test_batch_regimes_decide_apart(prior):
    """A batch of 8 verifies 8 x (R + 1) rows: on a machine where that costs too much, batch 8 decodes plain while
    batch 1 keeps DART."""
    machine = Machine(verify=lambda k: 0.050 + 0.006 * k)
    ctrl = controller(machine, cost=prior(machine))
    for _ in range(6):
        run_call(ctrl, machine, batch=1)
        run_call(ctrl, machine, batch=8)
    assert ctrl.regimes[regime_key(1, 100)].mode == "dart"
    assert ctrl.regimes[regime_key(8, 100)].mode == "plain"
    plain_rate = 1 / machine.plain(8)
    assert rate_over_calls(ctrl, machine, 10, batch=8) >= 0.97 * plain_rate
    assert rate_over_calls(ctrl, machine, 10, batch=1) >= 0.9 * best_fixed(machine)[1]


def test_a_call_with_dart_head_never_goes_plain_and_a_fixed_tree_only_teaches():
    machine = Machine(verify=lambda k: 0.150 + 0.004 * k)
    ctrl = controller(machine)
    _, _, sizes = run_call(ctrl, machine, attached=False)
    assert 0 not in sizes and len(set(sizes)) >= 2  # it still adapts its tree
    policy = CallPolicy(lambda: ctrl, may_go_plain=False, fixed=5)
    policy.begin(False)
    assert {policy.tree_size(1, 10) for _ in range(20)} == {5} and policy.max_tree_size == 5
    policy.observe(5, 1, 10, 0.2, [[0, 1]])
    policy.observe(5, 1, 10, 0.2, [[0, 1]])
    assert ctrl.regimes[regime_key(1, 10)].steps[5].value == pytest.approx(0.2)


def test_small_trees_first_a_larger_tree_only_once_a_smaller_one_is_timed():
    """However good the priors say a large tree is, an untimed size is tried only up to twice the rows of the
    largest size timed: the first call climbs 3 -> 6 -> 12 ... while the timed steps show it pays."""
    machine = Machine(verify=lambda k: 0.060 + 0.0005 * k)  # large trees nearly free: the best is the largest
    ctrl = controller(machine, start=3)
    _, _, sizes = run_call(ctrl, machine, steps=64)
    dart = [s for s in sizes if s]
    assert dart[0] == 3 and max(SIZES) in dart
    for before, after in zip(dart, dart[1:]):  # each new size within twice the rows of the largest timed before
        assert after + 1 <= 2 * (max(dart[:dart.index(after)] or [3]) + 1) or after in dart[:dart.index(after)]


def test_one_slow_plain_step_at_a_regimes_start_does_not_set_plains_cost():
    """A regime's first plain steps carry one-off costs (new shapes, a slow spell): plain's cost starts as the median
    of the first three timed ones, not their mean, so one outlier cannot make DART look faster than it is."""
    ctrl = SpeedController(SIZES, None, None, 3)
    key = regime_key(8, 100)
    ctrl.regime(8, 100)
    for seconds in (9.0, 0.30, 0.10, 0.11):  # the first is cold (dropped), then an outlier and two true ones
        ctrl.observe_plain(key, seconds)
    assert ctrl.plain_s(key) == pytest.approx(0.11)
    assert ctrl.regimes[key].plain.weight == pytest.approx(1.0)
    ctrl.observe_plain(key, 0.12)  # then a running mean
    assert 0.11 < ctrl.plain_s(key) < 0.12


@PRIORS
def test_the_verdict_follows_the_latest_evidence_of_any_call(prior):
    """dart_head= calls that show DART pays lift a plain verdict, so the next attached call decodes with DART; ones
    that show it loses make later attached calls plain (the explicit call itself still decodes with DART)."""
    machine, slow = Machine(), Machine(verify=lambda k: 0.200 + 0.010 * k)
    ctrl = controller(machine, cost=prior(machine))
    key = regime_key(1, 100)
    run_call(ctrl, slow)  # an attached call on a loaded machine: plain from then on
    assert ctrl.regimes[key].mode == "plain" and run_call(ctrl, machine)[2] == []
    run_call(ctrl, machine, attached=False)  # dart_head= on the machine as it is now
    assert ctrl.regimes[key].mode == "dart"
    assert run_call(ctrl, machine)[2].count(0) < 16  # the next attached call decodes with DART
    _, _, sizes = run_call(ctrl, slow, attached=False)
    assert 0 not in sizes and ctrl.regimes[key].mode == "plain"
    assert run_call(ctrl, slow)[2] == []  # the next attached call runs as plain generate()


# ---- what is learned is kept ------------------------------------------------------------------------------------

def test_the_learned_state_is_saved_loaded_and_merged_newest_first(tmp_path):
    machine = Machine()
    path = tmp_path / "x.learned.json"
    first = SpeedController(SIZES, prior_from(machine), None, 3, path=path, ident={"k": 1})
    rate_over_calls(first, machine, 3)
    first.save(force=True)
    raw = json.loads(path.read_text())
    assert raw["identity"] == {"k": 1} and "1x256" in raw["regimes"]
    second = SpeedController(SIZES, prior_from(machine), None, 3, path=path, ident={"k": 1})
    assert second.tau_of(False) == pytest.approx(first.tau_of(False))
    assert second.regimes[(1, 256)].steps.keys() == first.regimes[(1, 256)].steps.keys()
    # another process learns batch 8 later; this one's batch-1 regime is newer than the disk's: both survive
    other = SpeedController(SIZES, prior_from(machine), None, 3, path=path, ident={"k": 1})
    run_call(other, machine, batch=8)
    time.sleep(0.01)
    run_call(second, machine, batch=1)
    other.save(force=True)
    second.save(force=True)
    merged = json.loads(path.read_text())["regimes"]
    assert set(merged) == {"1x256", "8x256"}
    assert merged["1x256"]["updated"] == second.regimes[(1, 256)].updated


@pytest.mark.parametrize("damage", ["text", "list", "version", "identity", "tau", "mode", "probe", "negative",
                                    "nan"])
def test_a_damaged_learned_state_is_ignored_with_one_warning(tmp_path, damage):
    machine = Machine()
    path = tmp_path / "x.learned.json"
    ctrl = SpeedController(SIZES, prior_from(machine), None, 3, path=path, ident={"k": 1})
    rate_over_calls(ctrl, machine, 2)
    ctrl.save(force=True)
    raw = json.loads(path.read_text())
    regime = raw["regimes"]["1x256"]
    if damage == "text":
        path.write_text("{nope")
    else:
        if damage == "list":
            raw = [raw]
        elif damage == "version":
            raw["version"] = 0
        elif damage == "identity":
            raw["identity"] = {"k": 2}
        elif damage == "tau":
            raw["tau"]["greedy"]["sizes"]["3"] = [1.0, 5.0]  # a mean below 1 token per step
        elif damage == "mode":
            regime["mode"] = "fast"
        elif damage == "probe":
            regime["probe_after"] = 10 ** 6
        elif damage == "negative":
            regime["plain"] = [-1.0, 2.0]
        elif damage == "nan":
            regime["scale"] = [float("nan"), 1.0]
        path.write_text(json.dumps(raw))
    with pytest.warns(DartCacheWarning, match="ignoring the learned speed estimates"):
        fresh = SpeedController(SIZES, prior_from(machine), None, 3, path=path, ident={"k": 1})
    if damage in ("text", "list", "version", "identity"):  # not this controller's state: ignored whole
        assert fresh.regimes == {}
    else:  # the bad entry alone is ignored (tests/hf/test_controller_state.py)
        assert fresh.regimes.get((1, 256)) != ctrl.regimes[(1, 256)] or 3 not in fresh.tau[False]
    fresh.regime(1, 100)
    fresh.dirty = True
    fresh.save(force=True)  # a damaged file is replaced
    assert json.loads(path.read_text())["identity"] == {"k": 1}


# ---- in the decoding loop, on a tiny model ------------------------------------------------------------------------

PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])


class RandomSizes:
    """A policy that answers a random tree size, plain steps included (the loop's exactness must not depend on the
    sizes)."""

    def __init__(self, seed: int, sizes=(0, 1, 2, 5, 9, 30)) -> None:
        self.rng, self.sizes, self.max_tree_size, self.seen = random.Random(seed), sizes, max(sizes), []

    def begin(self, sampled):
        pass

    def tree_size(self, batch_size, context_length):
        return self.rng.choice(self.sizes)

    def observe(self, tree_size, batch_size, context_length, seconds, accepted_ranks):
        self.seen.append((tree_size, batch_size, len(accepted_ranks)))


@pytest.mark.parametrize("seed", range(4))
def test_the_loop_is_exact_whatever_each_steps_tree(seed):
    from dart_hf.loop import dart_decoding

    model = tiny_target()  # not enabled: the loop as a custom_generate callable, with a policy of its own
    batch = torch.tensor([[5, 17, 33, 2, 9, 41, 12], [0, 0, 8, 3, 3, 60, 1], [0, 0, 0, 0, 7, 7, 70]])
    mask = (torch.arange(7)[None] >= torch.tensor([[0], [2], [4]])).long()
    plain = model.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    head = oracle_head(model, plain[0], wrong_every=3)
    policy = RandomSizes(seed)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         custom_generate=dart_decoding, dart_head=head, dart_step_policy=policy)
    assert torch.equal(out, plain)
    stats = dart_hf.last_stats(model)
    assert stats.tree_sizes == [s for s, _, _ in policy.seen] and 0 in stats.tree_sizes
    assert all(rows == n for _, rows, n in policy.seen)  # one ranks list per sequence of the step


def slow_drafts(head, seconds: float):
    """`head` whose drafting pass takes `seconds` longer (a head that cannot pay on any CPU)."""
    draft = head.draft

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return draft(*args, **kwargs)

    head.draft = slow
    return head


def test_an_attached_head_that_cannot_pay_finishes_plain_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    head = slow_drafts(oracle_head(model, plain[0], wrong_every=2), 0.05)  # 50 ms a draft, ~5 ms a plain step
    attached = dart_hf.enable(tiny_target(), head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [attached.generate(PROMPT, max_new_tokens=40, do_sample=False) for _ in range(4)]
        stats = attached.dart_stats
    assert all(torch.equal(out, plain) for out in outputs)
    fallbacks = [w for w in caught if issubclass(w.category, DartFallbackWarning)]
    assert len(fallbacks) == 1 and "does not beat plain decoding" in str(fallbacks[0].message)
    assert fallbacks[0].filename == __file__  # it points at the caller's line
    regime = controller_module.existing_controller(attached, head, store=True).regimes[(1, 256)]
    assert regime.mode == "plain"
    assert stats is None or stats.plain_steps > 0  # the last call ran plain, or probed and finished plain
    # asked for by name, the head decodes with DART all the same (tree sizes still adapt)
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, dart_head=head)
    assert torch.equal(out, plain[:, :out.shape[1]]) and model.dart_stats.plain_steps == 0
