"""The speed rule (`dart_core.speed`, `dart_core.step_policy`): the choice, the estimates, the fallback to plain and
the probes, on synthetic machines (noisy, changing, loaded at the first measurement, one where no tree pays, batch
regimes) whose verdict is the same on every CPU."""

from typing import Optional

import pytest

from dart_core import AcceptanceCurve, TreeConfig
from dart_core.acceptance import accepted_within
from dart_core.cost import MachineCost
from dart_core import speed
from dart_core.speed import (BUDGET_TOKENS, CALL_MARGIN, FIRST_PROBE_AFTER, LADDER, LOSS_BUDGET, MAX_PROBE_AFTER,
                             NEW_SIZE_EVERY, SPENT_CALLS, WINDOW, CallLoss, Mean, SpeedController, choose_tree_size,
                             fit_line, regime_key)
from dart_core.step_policy import PLAIN, CallPolicy, FixedTree, TreeStep
from helpers.synthetic import (SIZES, Machine, best_fixed, controller, curve_of, nodes, prior_from, rate_over_calls,
                               run_call, verified)


def one_size_controller(tau: Optional[float], cost: Optional[MachineCost] = None
                        ) -> tuple[SpeedController, tuple[int, int]]:
    """A controller of 3-node trees whose curve claims `tau` there (None: no curve), with a calibrated `cost` if
    given, and its regime of one sequence and 100 positions, where a plain step is timed at 0.1 s."""
    curve = None if tau is None else AcceptanceCurve({3: tau}, steps=100, new_tokens=100, prompts=4)
    ctrl = SpeedController([3], cost, curve, start_size=3)
    key = regime_key(1, 100)
    ctrl.regime(1, 100)
    ctrl.observe_plain(key, 0.1, cold_ok=True)
    return ctrl, key


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


PRIORS = pytest.mark.parametrize("prior", [lambda machine: None, prior_from], ids=["learned", "calibrated"])


# ---- on synthetic machines ----------------------------------------------------------------------------------

@PRIORS
def test_it_converges_to_the_best_fixed_tree(prior):
    machine = Machine()
    best, best_rate = best_fixed(machine)
    assert best_rate * machine.plain_s > 1.2  # DART pays here
    ctrl = controller(machine, cost=prior(machine))
    rate_over_calls(ctrl, machine, 3)  # learning
    # (a size not timed yet is tried once every NEW_SIZE_EVERY steps: a machine that charges nothing for a size's
    # first steps, as this one, could be followed a little closer by trying sizes as soon as the estimates point there)
    assert rate_over_calls(ctrl, machine, 20) >= 0.94 * best_rate
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
    if regime.mode == "dart":  # the call went plain within CALL_MARGIN: the next one's steps give the verdict
        _, _, sizes = run_call(ctrl, slow, steps=64)
        assert max(i for i, s in enumerate(sizes) if s) < 2 * WINDOW
    assert regime.mode == "plain"
    assert rate_over_calls(ctrl, slow, 20) * slow.plain_s >= 0.95
    _, best_rate = best_fixed(fast)  # and fast again: a probe brings DART back (the first, or the next if the first's
    for _ in range(3 * regime.probe_after + 1):  # few steps happened to accept little)
        run_call(ctrl, fast)
        if regime.mode == "dart":
            break
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
    assert best >= 3 and ctrl.tau_of(False)[best] > ctrl.tau_of(False)[1] > 1.0


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
    assert {policy.decide(1, 10) for _ in range(20)} == {TreeStep(5)} and policy.max_tree_size == 5
    policy.observe(TreeStep(5), verified(1, 10, 0.2, [[0, 1]]))
    policy.observe(TreeStep(5), verified(1, 10, 0.2, [[0, 1]]))
    assert ctrl.regimes[regime_key(1, 10)].steps[5].value == pytest.approx(0.2)


def test_small_trees_first_a_larger_tree_only_once_a_smaller_one_is_timed():
    """However good the priors say a large tree is, a size not timed in a regime is tried only up to twice the rows
    of the largest size timed, and only once every `NEW_SIZE_EVERY` steps there (a size's first steps in a process
    cost one-off work): the calls climb 3 -> 4 -> 6 ... while the timed steps show it pays."""
    machine = Machine(verify=lambda k: 0.060 + 0.0005 * k)  # large trees nearly free: the best is the largest
    ctrl = controller(machine, start=3)
    sizes = []
    for _ in range(12):
        sizes += run_call(ctrl, machine, steps=64)[2]
    assert [s for s in sizes if s][0] == 3 and max(SIZES) in sizes
    new = [i for i, s in enumerate(sizes) if s and s not in sizes[:i]]  # the step that tried each size first
    assert len(new) >= 5 and min(b - a for a, b in zip(new, new[1:])) >= NEW_SIZE_EVERY
    assert len([i for i in new if i < 64]) <= 64 // NEW_SIZE_EVERY  # what a first call of 64 steps pays for
    for i in new[1:]:  # each within twice the rows of the largest timed before it
        assert sizes[i] + 1 <= LADDER * (max(sizes[:i]) + 1)


def test_one_slow_plain_step_at_a_regimes_start_does_not_set_plains_cost():
    """A regime's first plain steps carry one-off costs (new shapes, a slow spell): plain's cost starts as the median
    of the first three timed ones where they agree within `OUTLIER` times, not their mean, so one slower step cannot
    make DART look faster than it is; where they do not, as the mean of the first `MAX_FIRST_PLAIN` but the slowest."""
    ctrl = SpeedController(SIZES, None, None, 3)
    key = regime_key(8, 100)
    ctrl.regime(8, 100)
    for seconds in (9.0, 0.15, 0.10, 0.11):  # the first is cold (dropped), then a slower one and two true ones
        ctrl.observe_plain(key, seconds)
    assert ctrl.plain_s(key) == pytest.approx(0.11)
    assert ctrl.regimes[key].plain.weight == pytest.approx(1.0)
    ctrl.observe_plain(key, 0.12)  # then a running mean
    assert 0.11 < ctrl.plain_s(key) < 0.12

    other = regime_key(4, 100)
    ctrl.regime(4, 100)
    for seconds in (9.0, 0.30, 0.10, 0.11):  # an outlier three times the others: more steps before plain's cost starts
        ctrl.observe_plain(other, seconds)
    assert ctrl.plain_s(other) is None
    for seconds in (0.10, 0.12, 0.09, 0.10, 0.11):
        ctrl.observe_plain(other, seconds)
    assert ctrl.plain_s(other) == pytest.approx((0.10 + 0.11 + 0.10 + 0.12 + 0.09 + 0.10 + 0.11) / 7)


def test_a_loaded_machines_spells_both_start_plains_cost():
    """Plain steps that alternate fast and slow spells (another process on the cores): plain's cost starts as their
    mean (0.14 s), where the median of the first three would take the slow spell alone (0.23 s)."""
    ctrl = SpeedController(SIZES, None, None, 3)
    key = regime_key(1, 100)
    ctrl.regime(1, 100)
    for seconds in (1.0, 0.07, 0.23, 0.23, 0.07, 0.23, 0.07, 0.07, 0.23):
        ctrl.observe_plain(key, seconds)
    assert ctrl.plain_s(key) == pytest.approx((4 * 0.07 + 3 * 0.23) / 7)


def test_a_slow_spell_at_a_regimes_start_does_not_keep_a_losing_tree():
    """A first call (nothing calibrated) whose first plain steps ran in a slow spell (1.3x): by them alone a tree that
    loses 9% looks 1.18x faster than plain. While the verdict is that close, plain steps during the call measure plain's
    cost again, and the call finishes plain once they show DART loses."""
    machine = Machine(verify=lambda k: 0.100 + 0.004 * k, spell=(4, 1.3))
    assert 0.85 < best_fixed(machine)[1] * machine.plain_s < 0.95
    ctrl = controller(machine, cost=None)
    tokens, seconds, sizes = run_call(ctrl, machine, steps=64)
    assert sizes[-1] == 0
    plain_seconds = 64 * machine.plain_s + 4 * 0.3 * machine.plain_s  # plain decoding through the same spell
    assert tokens / seconds >= 0.95 * 64 / plain_seconds
    regime = ctrl.regimes[regime_key(1, 100)]
    if regime.mode == "dart":  # the call went plain within CALL_MARGIN: the next one's steps give the verdict
        assert run_call(ctrl, machine, steps=64)[2][-1] == 0
    assert regime.mode == "plain"


@PRIORS
def test_the_verdict_follows_the_latest_evidence_of_any_call(prior):
    """dart_head= calls that show DART pays lift a plain verdict, so the next attached call decodes with DART; ones
    that show it loses make later attached calls plain (the explicit call itself still decodes with DART)."""
    machine, slow = Machine(), Machine(verify=lambda k: 0.200 + 0.010 * k)
    ctrl = controller(machine, cost=prior(machine))
    key = regime_key(1, 100)
    for _ in range(SPENT_CALLS):  # attached calls on a loaded machine, each stopped by its loss budget: plain then
        run_call(ctrl, slow)
        if ctrl.regimes[key].mode == "plain":
            break
    assert ctrl.regimes[key].mode == "plain" and run_call(ctrl, machine)[2] == []
    run_call(ctrl, machine, attached=False)  # dart_head= on the machine as it is now
    assert ctrl.regimes[key].mode == "dart"
    assert all(run_call(ctrl, machine)[2][:WINDOW])  # the next attached call decodes with DART
    _, _, sizes = run_call(ctrl, slow, attached=False)
    assert 0 not in sizes and ctrl.regimes[key].mode == "plain"
    assert run_call(ctrl, slow)[2] == []  # the next attached call runs as plain generate()




def test_a_fixed_tree_decides_every_step_alike_and_a_tree_step_needs_nodes():
    policy = FixedTree(7)
    policy.begin(True)
    assert policy.max_tree_size == 7 and {policy.decide(b, c) for b in (1, 8) for c in (10, 5000)} == {TreeStep(7)}
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="draft nodes"):
            TreeStep(bad)


def test_a_regimes_first_tree_is_chosen_from_what_trees_cost_in_another():
    """Batch 1 timed its trees (a drafted row adds 10 ms); at batch 8, with only plain steps timed, a step is predicted
    as plain's plus what its 8 x R drafted rows add, so the first tree there is the cheapest that pays, not the start
    size, the best at batch 1 (8 x 3 rows would cost 240 ms more for a tau of 2.6)."""
    curve = AcceptanceCurve(tau={1: 1.6, 2: 2.2, 3: 2.6}, steps=100, new_tokens=100, prompts=1)
    ctrl = SpeedController([1, 2, 3], None, curve, start_size=3)
    one, eight = regime_key(1, 100), regime_key(8, 100)
    for key, plain in ((one, 0.050), (eight, 0.080)):
        ctrl.regime(key[0], 100)
        for _ in range(5):
            ctrl.observe_plain(key, plain)
    assert ctrl.step_s(eight, 1) is None  # nothing timed anywhere: no prediction (the start size is taken)
    for size in (1, 3):
        for _ in range(3):
            ctrl.observe_step(one, size, 0.050 + 0.010 * size + 0.002, [], False)  # timed only: tau stays
    assert ctrl.step_s(eight, 1) == pytest.approx(0.080 + 0.002 + 0.010 * 8)
    assert ctrl.step_s(eight, 3) == pytest.approx(0.080 + 0.002 + 0.010 * 24)
    assert ctrl.best(eight, False)[0] == 1 and ctrl.best(one, False)[0] == 3
    policy = CallPolicy(lambda: ctrl, may_go_plain=True)
    policy.begin(False)
    assert policy.decide(8, 100) == TreeStep(1) and policy.decide(1, 100) == TreeStep(3)


def test_an_untimed_tree_is_predicted_with_the_drafting_every_dart_step_pays():
    """Plain steps of 60 ms; 3-node trees timed at 100 ms, 15 ms of them drafting (the drafter's pass and the tree
    search, paid whatever the size). A 1-node tree then costs 15 ms + the forward over 2 rows: the line through the
    timed size and a tree of no nodes (the plain step plus the drafting) gives that, where the line through the plain
    step alone would give a step nearly as cheap as a plain one. The control: a drafter that costs nothing."""
    def predicted(drafting: float) -> float:
        ctrl = SpeedController([1, 3], None, None, start_size=3)
        key = regime_key(1, 100)
        ctrl.regime(1, 100)
        ctrl.observe_plain(key, 0.060, cold_ok=True)
        for _ in range(3):  # the first is a cold step, not timed
            ctrl.observe_step(key, 3, 0.100, [[0]], False, drafting)
        return ctrl.step_s(key, 1)

    assert predicted(0.015) == pytest.approx(0.015 + 0.060 + (0.100 - 0.015 - 0.060) / 3)
    assert predicted(0.0) == pytest.approx(0.060 + (0.100 - 0.060) / 3)
    ctrl = SpeedController([3], None, None, start_size=3)
    ctrl.regime(1, 100)
    for drafting in (0.2, -0.01, float("nan")):  # outside 0..the step's seconds: not a drafting time
        ctrl.observe_step(regime_key(1, 100), 3, 0.100, [[0]], False, drafting)
    assert ctrl.regimes[regime_key(1, 100)].drafting.weight == 0


@pytest.mark.parametrize("drafting, finishes_plain", [(0.025, True), (0.0, False)], ids=["drafting", "control"])
def test_a_call_at_plains_speed_is_not_kept_drafting_by_a_smaller_tree_predicted_without_its_drafting(
        drafting, finishes_plain):
    """3-node trees at 105 ms (25 ms of it drafting) against 60 ms plain steps, yielding 1.8 tokens (1.03x, within
    `CALL_MARGIN` of plain): a 1-node tree, never timed, yields 1.4 tokens, and the line through the timed size and
    a tree of no nodes predicts it at 92 ms (0.92x), so the call finishes plain within a few steps of `WINDOW` DART
    steps. The control reports no drafting: the line through the plain step predicts the 1-node tree at 75 ms
    (1.12x, above `CALL_MARGIN`), and the call keeps drafting for no gain."""
    curve = AcceptanceCurve({1: 1.4, 3: 1.8}, steps=100, new_tokens=100, prompts=4)
    ctrl = SpeedController([1, 3], None, curve, start_size=3)
    key = regime_key(1, 100)
    ctrl.regime(1, 100)
    ctrl.observe_plain(key, 0.060, cold_ok=True)
    yields = [[0, 1], [], [0, 1], [], []]  # 2 steps in 5 accept two nodes: tau(3) 1.8, tau(1) 1.4
    policy = CallPolicy(lambda: ctrl, may_go_plain=True)
    policy.begin(False)
    sizes, trees = [], 0
    for _ in range(40):
        decision = policy.decide(1, 100)
        sizes.append(nodes(decision))
        if decision == PLAIN:
            policy.observe(decision, verified(1, 100, 0.060, [[]]))
            continue
        ranks = [r for r in yields[trees % len(yields)] if r < decision.nodes]
        trees += 1
        seconds = 0.105 if decision.nodes == 3 else 0.060 + 0.025 + (0.105 - 0.060 - 0.025) / 3
        policy.observe(decision, verified(1, 100, seconds, [ranks], drafting))
    assert (max(i for i, s in enumerate(sizes) if s) < 2 * WINDOW) == finishes_plain


@pytest.mark.parametrize("step_s, finishes_plain", [(0.15, True), (0.13, False)], ids=["1.02x", "1.18x"])
def test_a_call_within_the_margin_of_plain_finishes_plain_and_later_calls_keep_dart(step_s, finishes_plain):
    """A tree that yields 1.53 tokens per 0.15 s step against 0.1 s plain steps (1.02x by the estimates and by the
    call's own steps): the call finishes the regime plain after `WINDOW` DART steps, the regime's verdict stays DART
    (DART is not slower), and the next call tries DART again; the control, 0.13 s steps (1.18x), keeps DART."""
    ctrl, key = one_size_controller(1.53)
    accepts = iter([(i * 53) % 100 < 53 for i in range(1000)])  # 53 steps in 100 accept one node

    def call(steps: int) -> list[int]:
        policy = CallPolicy(lambda: ctrl, may_go_plain=True)
        policy.begin(False)
        sizes = []
        for _ in range(steps):
            decision = policy.decide(1, 100)
            tree = decision != PLAIN
            sizes.append(nodes(decision))
            policy.observe(decision, verified(1, 100, step_s if tree else 0.1, [[0] if tree and next(accepts) else []]))
        return sizes

    sizes = call(40)
    assert (max(i for i, s in enumerate(sizes) if s) < 2 * WINDOW) == finishes_plain
    assert ctrl.regimes[key].mode == "dart" and CALL_MARGIN > 1.0
    assert any(call(4))  # the next call drafts again


def test_a_calls_loss_is_spent_past_its_budget_and_past_chance():
    """Budget: 2% of plain's cost of the call's tokens, at least 64 (0.128 s at 0.1 s a plain step); a loss that
    the steps' own spread explains within two standard deviations does not count."""
    plain = 0.1
    loss = CallLoss()
    loss.add(0.1)
    assert not loss.spent(plain, tokens=10)  # 0.1 s: within the budget
    loss.add(0.1)
    assert loss.spent(plain, tokens=10)  # 0.2 s, a plain step lost each time (a step's spread: half a plain step)
    assert not loss.spent(plain, tokens=100)  # a call of 100 tokens: 0.2 s
    one = CallLoss()
    one.add(0.2)
    assert one.spent(plain, tokens=10)
    varying = CallLoss()
    for seconds in (0.40, -0.30, 0.40, -0.30, 0.40):  # 0.6 s, about 0.8 standard deviations of such a total
        varying.add(seconds)
    assert not varying.spent(plain, tokens=10)


@pytest.mark.parametrize("budget", [LOSS_BUDGET, 1e9], ids=["budget", "control"])
def test_a_losing_tree_costs_each_call_its_budget_and_two_such_calls_send_the_regime_plain(budget, monkeypatch):
    """A curve that claims 4 tokens a step where the text gives one, trees at twice plain's cost: each call stops
    drafting once its DART steps have lost more than its budget (here after 2 steps, 0.2 s), before the estimates
    catch up, and the second such call sends later calls plain with a warning that says so. The control, without a
    budget, keeps drafting until its estimates give the verdict (`WINDOW` steps)."""
    monkeypatch.setattr(speed, "LOSS_BUDGET", budget)
    ctrl, key = one_size_controller(4.0)

    def call() -> tuple[float, list[int], list[str]]:
        policy = CallPolicy(lambda: ctrl, may_go_plain=True)
        policy.begin(False)
        seconds, sizes = 0.0, []
        for _ in range(64):
            decision = policy.decide(1, 100)
            step_s = 0.2 if decision != PLAIN else 0.1
            policy.observe(decision, verified(1, 100, step_s, [[]]))
            seconds, sizes = seconds + step_s, sizes + [nodes(decision)]
        return seconds - 64 * 0.1, sizes, policy.warnings

    lost, sizes, warnings = call()
    dart_steps = sum(1 for s in sizes if s)
    if budget == LOSS_BUDGET:
        assert dart_steps == 2 and lost <= LOSS_BUDGET * 0.1 * BUDGET_TOKENS + 0.1
        assert ctrl.regimes[key].mode == "dart" and not warnings  # one call's loss: later calls still try DART
        for _ in range(SPENT_CALLS - 1):
            lost, sizes, warnings = call()
        assert sum(1 for s in sizes if s) == 2 and ctrl.regimes[key].mode == "plain"
        assert len(warnings) == 1 and "lost time against plain decoding" in warnings[0]
    else:
        assert dart_steps >= WINDOW and lost > LOSS_BUDGET * 0.1 * BUDGET_TOKENS + 0.1


@pytest.mark.parametrize("one_off", [True, False], ids=["trials", "control"])
def test_steps_that_ran_kernel_trials_are_no_tree_cost_and_give_no_verdict_by_themselves(one_off):
    """A call whose first tree steps run the few-row kernels' trials (1.45x plain's time) and accept nothing, as a
    prompt's first steps may: those steps cost the call (within its budget) but are not the tree's cost, so after
    `WINDOW` of them no size is timed to show DART slower, and the call drafts on at the steps' own cost (1.2x plain's
    time, 2 tokens each), which becomes the estimate. The control, the same steps not marked as one-off, times the
    tree at 1.45x, and the call finishes plain and sends later calls plain."""
    ctrl, key = one_size_controller(1.8)
    policy = CallPolicy(lambda: ctrl, may_go_plain=True)
    policy.begin(False)
    sizes = []
    for _ in range(32):
        decision = policy.decide(1, 100)
        trials = sum(1 for s in sizes if s) < WINDOW  # the first WINDOW tree steps run the trials
        tree_s, ranks = (0.145, []) if trials else (0.12, [0])
        policy.observe(decision, verified(1, 100, tree_s if decision != PLAIN else 0.1,
                                          [ranks if decision != PLAIN else []], one_off=one_off and trials))
        sizes.append(nodes(decision))
    assert not policy.spent  # the trials' steps stay within the call's budget
    if one_off:
        assert all(sizes) and ctrl.regimes[key].mode == "dart"
        assert ctrl.step_s(key, 3) == pytest.approx(0.12)
    else:
        last_tree = max(i for i, size in enumerate(sizes) if size)
        assert sum(1 for size in sizes if size) == WINDOW and last_tree < 2 * WINDOW  # then plain to the end
        assert ctrl.regimes[key].mode == "plain" and ctrl.step_s(key, 3) == pytest.approx(0.145)


@pytest.mark.parametrize("one_off", [True, False], ids=["trials", "control"])
def test_a_probe_lifts_a_plain_verdict_only_by_a_timed_tree(one_off):
    """A probe in a plain regime, on a machine with a calibrated cost (so an untimed tree has an expected speedup),
    whose first 8 tree steps run the kernels' trials (so no tree is timed) and accept a node each at 1.2x plain's
    time: the regime stays plain through those steps, and DART's verdict returns with the first timed step. The
    control, the same steps not marked as one-off, lifts it after `WINDOW` tree steps."""
    ctrl, key = one_size_controller(1.8, prior_from(Machine()))
    assert ctrl.expected(key, False) is not None and ctrl.expected(key, False, timed=True) is None
    ctrl.set_plain(key, probing=False)
    policy = CallPolicy(lambda: ctrl, may_go_plain=True, probe=True)
    policy.begin(False)
    modes = []
    for _ in range(16):
        decision = policy.decide(1, 100)
        tree = decision != PLAIN
        trials = tree and one_off and sum(1 for mode, was_tree in modes if was_tree) < 8
        policy.observe(decision, verified(1, 100, 0.12 if tree else 0.1, [[0] if tree else []], one_off=trials))
        modes.append((ctrl.regimes[key].mode, tree))
    tree_modes = [mode for mode, was_tree in modes if was_tree]
    assert not policy.spent and len(tree_modes) > 9
    lifted = tree_modes.index("dart")
    assert lifted == (8 if one_off else WINDOW - 1)


@pytest.mark.parametrize("accepted, verdict", [([], "plain"), ([0, 1], "dart")], ids=["loses", "control"])
def test_a_call_that_spends_its_budget_before_any_estimate_gives_the_verdict(accepted, verdict):
    """A head without an acceptance curve whose trees, at twice plain's cost, accept nothing: the first call spends
    its budget in 2 steps, before tau rests on enough steps for an estimate, and its own steps send later calls plain.
    The control accepts 2 nodes a step (1.5x plain) and keeps DART."""
    ctrl, key = one_size_controller(None)
    policy = CallPolicy(lambda: ctrl, may_go_plain=True)
    policy.begin(False)
    sizes = []
    for _ in range(16):
        decision = policy.decide(1, 100)
        tree = decision != PLAIN
        policy.observe(decision, verified(1, 100, 0.2 if tree else 0.1, [accepted if tree else []]))
        sizes.append(nodes(decision))
    assert ctrl.regimes[key].mode == verdict
    assert (sizes[2:] == [0] * 14) == (verdict == "plain")
