"""What the step-size controller reads and learns is checked (issue 55, items 3 and 4): hostile learned-state files
(numbers too large for a float, NaN, deep nesting, wrong types, negative sizes, sizes above the controller's range, a
file replaced under a running process, a file learned with larger trees) cost one `DartCacheWarning` and the bad
entries, never a traceback, the good entries or a call's output; a clock that stalls, is coarser than a step or steps
back teaches nothing; and a head whose draft vocabulary cannot fill the tree's top-k is refused before any work, at
`enable()` and per call."""

import json
import sys
import time
import types
import warnings

import pytest
import torch

import dart_hf
from dart_core import AcceptanceCurve, Eagle3Head, TreeConfig
from dart_core.config import MAX_TREE_NODES
from dart_core.errors import DartInputError
from dart_hf import DartCacheWarning, DartFallbackWarning
from dart_core.cost import MachineCost
from dart_core.speed import Mean, SpeedController, choose_tree_size, regime_key
from dart_core.step_policy import PLAIN, CallPolicy, TreeStep
from dart_hf.calibration import identity, save_machine_cost
from dart_hf.controller import PlainClock
from dart_hf.learned import LearnedFile
from dart_hf.loop import NotApplicable
from dart_hf.target import context_drafting
from helpers.hf_models import oracle_head, random_head, tiny_target

controller_module = sys.modules["dart_hf.controller"]
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 60)
PROMPT = torch.tensor([[5, 17, 33, 2, 9, 41, 12]])
IDENT = {"k": 1}


def cost(context_length: int = 256) -> MachineCost:
    """A first-call measurement: a plain step 10 ms, a step of R nodes about 12 + R / 10 ms."""
    return MachineCost(verify_ms={k: 10.0 + k / 10 for k in (1, 2, 4, 8, 16, 32, 61)}, plain_ms=10.0, head_ms=1.0,
                       tree_ms=0.5, rest_ms=0.5, context_length=context_length, seconds=1.0)


def cache_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, DartCacheWarning)]


def teach(ctrl: SpeedController, step_s: float = 0.004, plain_s: float = 0.010, size: int = 60) -> None:
    """Plain steps and DART steps of `size` nodes at batch 1 and 8, each accepting 5 nodes of ranks 0..4, a quarter of
    each DART step drafting."""
    for batch in (1, 8):
        key = regime_key(batch, 100)
        ctrl.regime(batch, 100)
        for _ in range(4):
            ctrl.observe_plain(key, plain_s, cold_ok=True)
            ctrl.observe_step(key, size, step_s, [[0, 1, 2, 3, 4]] * batch, False, step_s / 4)


def kept(path, sizes=SIZES, ident=IDENT) -> LearnedFile:
    """A new process's controller whose learned state lives in `path` (loaded now)."""
    learned = LearnedFile(SpeedController(sizes, cost(), None, 3), path, ident)
    learned.load()
    return learned


def learned_file(path, sizes=SIZES, ident=IDENT, **kwargs) -> dict:
    """Write a valid learned state to `path`; its JSON."""
    learned = kept(path, sizes, ident)
    teach(learned.controller, **kwargs)
    learned.save(force=True)
    return json.loads(path.read_text())


def load(path, sizes=SIZES) -> tuple[LearnedFile, list]:
    """A new process's controller on `path` -> (its file, the DartCacheWarnings its loading gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learned = kept(path, sizes)
    return learned, cache_warnings(caught)


# ---- hostile entries: each ignored alone, with one warning, the rest kept -----------------------------------------

HUGE = "@HUGE@"  # replaced by a JSON number literal too large for a float


def _damage(raw: dict, name: str):
    """`raw` with one entry damaged -> (raw, the tau size ignored or None, the regime key ignored or None, text
    replacements)."""
    tau, regimes = raw["tau"]["greedy"]["sizes"], raw["regimes"]
    if name == "huge int in a tau entry":
        tau["4"] = [10 ** 400, 5.0]
        return raw, 4, None
    if name == "huge float in a tau entry":
        tau["4"] = [HUGE, 5.0]
        return raw, 4, None
    if name == "nan in a tau entry":
        tau["4"] = [float("nan"), 5.0]
        return raw, 4, None
    if name == "infinite weight":
        tau["4"] = [5.0, float("inf")]
        return raw, 4, None
    if name == "tau entry of wrong type":
        tau["4"] = {"total": 5.0}
        return raw, 4, None
    if name == "tau entry nested":
        nested = [5.0, 2.0]
        for _ in range(60):
            nested = [nested]
        tau["4"] = nested
        return raw, 4, None
    if name == "tau above what a tree of that size can yield":
        tau["4"] = [600.0, 5.0]  # tau 120 from 4 draft nodes
        return raw, 4, None
    if name == "negative tau size":
        tau["-3"] = [25.0, 5.0]
        return raw, -3, None
    if name == "tau size above the controller's":
        tau["61"] = [25.0, 5.0]
        return raw, 61, None
    if name == "tau size between the controller's":
        tau["5"] = [25.0, 5.0]
        return raw, 5, None
    if name == "tau size not a number":
        tau["four"] = [5.0, 5.0]
        return raw, None, None
    if name == "huge tau updated":
        raw["tau"]["sampled"]["updated"] = 10 ** 400
        return raw, None, None
    regime = regimes["8x256"]
    if name == "negative step time":  # what a clock that stepped back left
        regime["steps"]["60"] = [-0.02, 5.0]
    elif name == "zero step time":
        regime["plain"] = [0.0, 5.0]
    elif name == "negative drafting time":
        regime["drafting"] = [-0.01, 5.0]
    elif name == "huge step time":
        regime["steps"]["60"] = [HUGE, 5.0]
    elif name == "negative step size":
        regime["steps"]["-3"] = [0.01, 5.0]
    elif name == "step size above any tree":
        regime["steps"][str(10 ** 9)] = [0.01, 5.0]
    elif name == "steps of wrong type":
        regime["steps"] = [[0.01, 5.0]]
    elif name == "mode of wrong type":
        regime["mode"] = 3
    elif name == "probe_after huge":
        regime["probe_after"] = 10 ** 400
    elif name == "updated nan":
        regime["updated"] = float("nan")
    elif name == "updated far in the future":  # would win every merge for ever
        regime["updated"] = 1e300
    elif name == "regime of wrong type":
        regimes["8x256"] = "plain"
    elif name == "negative regime key":
        regimes["-8x256"] = regimes.pop("8x256")
    elif name == "regime key not a bucket":
        regimes["3x256"] = regimes.pop("8x256")
    elif name == "regime key not a key":
        regimes["8 by 256"] = regimes.pop("8x256")
    else:
        raise ValueError(name)
    return raw, None, (8, 256)


DAMAGES = ["huge int in a tau entry", "huge float in a tau entry", "nan in a tau entry", "infinite weight",
           "tau entry of wrong type", "tau entry nested", "tau above what a tree of that size can yield",
           "negative tau size", "tau size above the controller's", "tau size between the controller's",
           "tau size not a number", "huge tau updated", "negative step time", "zero step time",
           "negative drafting time", "huge step time",
           "negative step size", "step size above any tree", "steps of wrong type", "mode of wrong type",
           "probe_after huge", "updated nan", "updated far in the future", "regime of wrong type",
           "negative regime key", "regime key not a bucket", "regime key not a key"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_bad_entry_is_ignored_with_one_warning_and_the_rest_is_kept(tmp_path, damage):
    path = tmp_path / "x.learned.json"
    raw = learned_file(path)
    good = load(path)[0].controller
    raw, bad_size, bad_regime = _damage(raw, damage)
    path.write_text(json.dumps(raw).replace(f'"{HUGE}"', "1e400"))
    learned, caught = load(path)
    ctrl = learned.controller
    assert len(caught) == 1 and "ignoring" in str(caught[0].message) and str(path) in str(caught[0].message)
    assert all(r in ctrl.sizes for table in ctrl.tau.values() for r in table)
    for sampled in (False, True):  # every good tau entry is kept
        for r, mean in good.tau[sampled].items():
            if r != bad_size and not (sampled and damage == "huge tau updated"):
                assert ctrl.tau[sampled][r] == mean
    assert ctrl.regimes[(1, 256)] == good.regimes[(1, 256)]  # and every good regime
    if bad_regime is not None:  # the damaged part is not taken: what is kept of the regime is valid
        kept = ctrl.regimes.get(bad_regime)
        if kept is not None:
            assert kept.mode in ("dart", "plain") and 0 <= kept.updated <= time.time()
            assert all(1 <= r <= MAX_TREE_NODES for r in kept.steps)
            assert all(m.value is None or 0 < m.value < 1 for m in (kept.plain, *kept.steps.values()))
            assert kept.drafting.value is None or 0 <= kept.drafting.value < 1
    for key in ctrl.regimes:  # and nothing read steers a choice out of range
        best = ctrl.best(key, False)
        assert best is None or best[0] in ctrl.sizes
    # what is saved again reads back without a warning
    ctrl.dirty = True
    learned.save(force=True)
    assert load(path)[1] == []


def test_the_drafting_time_is_kept_and_a_file_from_before_it_reads_whole(tmp_path):
    path = tmp_path / "x.learned.json"
    raw = learned_file(path)
    assert load(path)[0].controller.regimes[(1, 256)].drafting.value == pytest.approx(0.001)
    for regime in raw["regimes"].values():
        del regime["drafting"]
    path.write_text(json.dumps(raw))
    learned, caught = load(path)
    assert caught == [] and learned.controller.regimes[(1, 256)].drafting.weight == 0
    assert learned.controller.regimes[(1, 256)].steps[60].value == pytest.approx(0.004)


@pytest.mark.parametrize("text", ["[" * 100000 + "]" * 100000, '{"version": 1, "tau": ' + "[" * 100000])
def test_a_file_nested_too_deeply_to_read_is_ignored_with_one_warning(tmp_path, text):
    path = tmp_path / "x.learned.json"
    path.write_text(text)
    learned, caught = load(path)
    assert len(caught) == 1 and learned.controller.regimes == {}
    teach(learned.controller)
    learned.save(force=True)  # the file is replaced
    assert load(path)[1] == []


def test_a_file_learned_with_larger_trees_does_not_steer_a_smaller_controller(tmp_path):
    path = tmp_path / "x.learned.json"
    learned_file(path, step_s=0.001)  # 60-node trees, fast: tau(60) / step(60) beats every small tree
    large, caught = load(path)
    large = large.controller
    assert caught == [] and large.best((1, 256), False)[0] > 3
    small_file, caught = load(path, sizes=(1, 2, 3))
    small = small_file.controller
    assert len(caught) == 1 and "tree sizes" in str(caught[0].message)
    assert set(small.tau[False]) <= {1, 2, 3} and small.tau[False][3] == large.tau[False][3]
    assert small.best((1, 256), False)[0] in (1, 2, 3)
    small.observe_step((1, 256), 3, 0.002, [[0, 1]], False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small_file.save(force=True)  # its save merges the file without warning again
    assert cache_warnings(caught) == []


# ---- a save never raises --------------------------------------------------------------------------------------

def test_a_file_replaced_under_a_running_controller_is_replaced_again_by_its_save(tmp_path):
    path = tmp_path / "x.learned.json"
    learned_file(path)
    learned = load(path)[0]
    ctrl = learned.controller
    path.write_text("[" * 100000 + "]" * 100000)  # another process (or a person) wrote this meanwhile
    ctrl.observe_step((1, 256), 4, 0.003, [[0]], False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learned.save(force=True)
        ctrl.observe_step((1, 256), 4, 0.003, [[0]], False)
        path.write_text('{"version": 1, "identity": {"k": 1}, "tau": 7, "regimes": []}')
        learned.save(force=True)
    assert len(cache_warnings(caught)) == 1  # one warning for the controller's file
    assert load(path)[0].controller.regimes[(1, 256)] == ctrl.regimes[(1, 256)]


def test_a_save_that_fails_in_any_way_warns_once_and_keeps_the_state(tmp_path, monkeypatch):
    path = tmp_path / "x.learned.json"
    learned_file(path)
    learned = load(path)[0]
    ctrl = learned.controller

    def broken(*args, **kwargs):
        raise TypeError("not serialisable")

    monkeypatch.setattr(sys.modules["dart_hf.learned"], "write_cache_file", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ctrl.observe_step((1, 256), 4, 0.003, [[0]], False)
            learned.save(force=True)
    assert len(cache_warnings(caught)) == 1 and ctrl.dirty  # kept, to be written by a later save
    monkeypatch.undo()
    learned.save(force=True)
    assert not ctrl.dirty and load(path)[0].controller.regimes[(1, 256)] == ctrl.regimes[(1, 256)]


# ---- in generate(): what a file holds never fails a call -----------------------------------------------------------

def model_and_head(tmp_path, monkeypatch, remain_total=None):
    """A tiny target (not enabled), its plain greedy continuation of `PROMPT` (12 tokens) and a head that drafts the
    target's own continuation (deep trees are accepted), with its first-call cost in the cache (nothing measured)."""
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = tiny_target()
    reference = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    head = oracle_head(model, reference[0])
    if remain_total is not None:
        head.tree_config = TreeConfig(remain_total=remain_total)
    save_machine_cost(MachineCost(**{**cost().__dict__, "identity": identity(model, head)}))
    return model, head, reference[:, :PROMPT.shape[1] + 12]


def learned_path(model, head):
    return controller_module.learned_path(identity(model, head), "store" if context_drafting(head) else False)


def write_learned(model, head, damage=None, step_s=0.002) -> None:
    """A learned state for `head` on `model` (tau from 60-node trees), with one entry damaged."""
    path = learned_path(model, head)
    learned = kept(path, ident=identity(model, head))
    teach(learned.controller, step_s=step_s)
    learned.save(force=True)
    raw = json.loads(path.read_text())
    if damage == "huge int":
        raw["regimes"]["1x256"]["steps"]["60"] = [10 ** 400, 5.0]
    elif damage == "huge float":
        raw["tau"]["greedy"]["sizes"]["60"] = [HUGE, 5.0]
    elif damage == "size -3":
        raw["tau"]["greedy"]["sizes"]["-3"] = [500.0, 10.0]  # tau 50 for a "tree" of -3 nodes
    path.write_text(json.dumps(raw).replace(f'"{HUGE}"', "1e400"))


def generate_all(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, **kwargs)
    return out, caught


@pytest.mark.parametrize("how", ["explicit", "attached"])
@pytest.mark.parametrize("damage", ["huge int", "huge float"])
def test_numbers_too_large_for_a_float_never_fail_a_call(tmp_path, monkeypatch, how, damage):
    model, head, plain = model_and_head(tmp_path, monkeypatch)
    write_learned(model, head, damage)
    if how == "explicit":
        out, caught = generate_all(dart_hf.enable(model, False), dart_head=head)
    else:
        out, caught = generate_all(dart_hf.enable(model, head))
    assert torch.equal(out, plain) and len(cache_warnings(caught)) == 1
    ctrl = controller_module.existing_controller(model, head, store=True)
    assert ctrl.regimes[(8, 256)].steps[60].weight > 0  # the rest of the file is kept


def test_a_negative_size_never_fails_an_attached_call(tmp_path, monkeypatch):
    model, head, plain = model_and_head(tmp_path, monkeypatch)
    write_learned(model, head, "size -3", step_s=0.05)
    out, caught = generate_all(dart_hf.enable(model, head))
    assert torch.equal(out, plain) and len(cache_warnings(caught)) == 1
    assert all(size >= 0 for size in model.dart_stats.tree_sizes)


def test_a_file_from_larger_trees_never_steers_past_the_tree_cap(tmp_path, monkeypatch):
    model, head, plain = model_and_head(tmp_path, monkeypatch, remain_total=3)
    write_learned(model, head, step_s=0.0005)  # learned with 60-node trees (the identity ignores remain_total)
    out, caught = generate_all(dart_hf.enable(model, False), dart_head=head)
    assert torch.equal(out, plain) and len(cache_warnings(caught)) == 1
    assert max(model.dart_stats.tree_sizes) <= 3


def test_a_file_replaced_under_a_running_process_never_loses_a_calls_output(tmp_path, monkeypatch):
    model, head, plain = model_and_head(tmp_path, monkeypatch)
    write_learned(model, head)
    attached = dart_hf.enable(model, head)
    out, caught = generate_all(attached)
    assert torch.equal(out, plain) and cache_warnings(caught) == []
    path = learned_path(model, head)
    path.write_text("[" * 100000 + "]" * 100000)
    ctrl = controller_module.existing_controller(attached, head, store=True)
    controller_module.learned_file(ctrl).last_save = -1e9  # the next call's save is due
    out, caught = generate_all(attached)
    assert torch.equal(out, plain) and len(cache_warnings(caught)) == 1
    assert json.loads(path.read_text())["identity"] == identity(model, head)  # replaced by the process's state


# ---- clocks that stall, are coarse or step back ----------------------------------------------------------------

@pytest.mark.parametrize("seconds", [0.0, -0.003, float("nan"), float("inf"), -float("inf")])
def test_a_step_time_that_is_not_positive_and_finite_is_not_learned(tmp_path, seconds):
    path = tmp_path / "x.learned.json"
    learned = kept(path)
    ctrl = learned.controller
    key = regime_key(1, 100)
    ctrl.regime(1, 100)
    for _ in range(4):
        ctrl.observe_plain(key, seconds, cold_ok=True)
        ctrl.observe_step(key, 8, seconds, [[0, 1]], False)
    regime = ctrl.regimes[key]
    assert regime.plain.weight == 0 and regime.scale.weight == 0 and all(m.weight == 0 for m in regime.steps.values())
    assert ctrl.tau_of(False)[8] == pytest.approx(3.0)  # what the steps accepted is still learned
    learned.save(force=True)
    assert load(path)[1] == []  # and the next process reads all of it


def test_a_stalled_clock_never_divides_by_zero():
    ctrl = SpeedController(SIZES, cost(), AcceptanceCurve(tau={1: 1.5, 4: 2.0, 60: 3.0}, steps=9, new_tokens=9,
                                                           prompts=1), 3)
    for attached in (True, False):  # every step of a call timed 0 s, through the policy as the loop runs it
        policy = CallPolicy(lambda: ctrl, may_go_plain=attached)
        policy.begin(False)
        for _ in range(40):
            decision = policy.decide(1, 100)
            assert decision == PLAIN or 1 <= decision.nodes <= ctrl.max_size
            step = types.SimpleNamespace(batch_size=1, context_length=100, seconds=0.0, drafting_seconds=0.0,
                                         one_off=False, ranks=[[0, 1]] if isinstance(decision, TreeStep) else [[]])
            policy.observe(decision, step)
    assert choose_tree_size({1: 1.5, 4: 2.0}, {1: 0.0, 4: 0.01}, 0.0)[0] == 4  # a zero step time is no estimate
    with pytest.raises(ValueError, match="no tree size"):
        choose_tree_size({1: 1.5}, {1: 0.0}, 0.01)


def test_means_ignore_values_that_are_not_finite():
    mean = Mean()
    for value in (float("nan"), float("inf")):
        mean.add(value, 0.9)
        mean.add_robust(value, 0.9)
    assert mean.value is None
    mean.add(2.0, 0.9)
    mean.add_robust(float("nan"), 0.9)
    assert mean.value == 2.0


def marks(clock: PlainClock, times: list[float], monkeypatch, batch: int = 1) -> None:
    """`clock` called once per step at the fake times `times` (as generate() calls a stopping criterion)."""
    feed = iter(times)
    monkeypatch.setattr(controller_module, "now", lambda: next(feed))
    for i in range(len(times)):
        clock(torch.zeros(batch, 20 + i, dtype=torch.long), None)


@pytest.mark.parametrize("times,learned", [
    ([5.0] * 10, None),  # stalled
    ([5.0 - 0.01 * i for i in range(10)], None),  # stepping back at every step
    ([0.0, 0.0, 0.0, 0.016, 0.016, 0.016, 0.032, 0.032, 0.032, 0.048], 0.048 / 9),  # coarser than a step
    ([0.01 * i for i in range(10)], 0.01),
])
def test_plain_calls_timed_by_a_bad_clock_teach_nothing_wrong(monkeypatch, times, learned):
    ctrl = SpeedController(SIZES, cost(), None, 3)
    clock = PlainClock()
    marks(clock, times, monkeypatch)
    clock.report(ctrl)
    plain = ctrl.regimes[regime_key(1, 25)].plain
    assert plain.value is None if learned is None else plain.value == pytest.approx(learned)


def test_a_clock_that_steps_back_mid_call_leaves_a_file_the_next_process_reads_whole(tmp_path):
    path = tmp_path / "x.learned.json"
    learned = kept(path)
    ctrl = learned.controller
    teach(ctrl)
    key = regime_key(1, 100)
    ctrl.observe_step(key, 60, -3600.0, [[0]], False)  # the clock went back an hour during this step
    ctrl.observe_plain(key, -3600.0)
    learned.save(force=True)
    fresh, caught = load(path)
    fresh = fresh.controller
    assert caught == [] and fresh.regimes[key].steps[60].value == pytest.approx(0.004)
    assert fresh.regimes[key].plain.value == pytest.approx(0.010)


def test_a_stalled_loop_clock_never_fails_a_call(tmp_path, monkeypatch):
    model, head, plain = model_and_head(tmp_path, monkeypatch)
    attached = dart_hf.enable(model, head)
    monkeypatch.setattr(sys.modules["dart_hf.loop"], "now", lambda: 7.0)
    monkeypatch.setattr(controller_module, "now", lambda: 7.0)
    for _ in range(3):
        out, _ = generate_all(attached)
        assert torch.equal(out, plain)
    regime = controller_module.existing_controller(attached, head, store=True).regimes[(1, 256)]
    assert regime.plain.weight == 0 and regime.drafting.weight == 0 and all(m.weight == 0 for m in regime.steps.values())


# ---- a head and tree that cannot draft together: refused before any work -------------------------------------------

def small_vocab_head(model, draft_vocab=20):
    return random_head(model, draft_vocab=draft_vocab)


def test_enable_refuses_a_draft_vocabulary_smaller_than_the_trees_topk():
    model = tiny_target()
    head = small_vocab_head(model)
    with pytest.raises(DartInputError, match=r"topk=25.*draft vocabulary of 20|draft vocabulary of 20.*topk=25"):
        dart_hf.enable(model, head)
    assert not hasattr(model, "_dart_attached")  # refused before the model changed
    with pytest.raises(DartInputError, match="topk=30"):
        dart_hf.enable(model, head, tree_config=TreeConfig(topk=30))
    head.tree_config = TreeConfig(topk=21)
    with pytest.raises(DartInputError, match="topk=21"):
        dart_hf.enable(model, head)
    head.tree_config = TreeConfig(topk=20)
    dart_hf.enable(model, head)  # a top-k the vocabulary fills
    dart_hf.enable(tiny_target(), head, tree_config=TreeConfig(topk=5))


def count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_a_call_whose_tree_the_head_cannot_draft_is_refused_before_the_prefill():
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    head = small_vocab_head(model)
    forwards = count_forwards(model)
    with pytest.raises(NotApplicable, match="topk=25"):
        model.generate(PROMPT, max_new_tokens=8, do_sample=False, dart_head=head)
    with pytest.raises(NotApplicable, match="topk=21"):
        model.generate(PROMPT, max_new_tokens=8, do_sample=False, dart_head=head,
                       dart_tree_config=TreeConfig(topk=21))
    assert forwards == []
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, dart_head=head,
                         dart_tree_config=TreeConfig(topk=20))
    assert torch.equal(out, plain)


@pytest.mark.parametrize("how", ["call tree", "head tree changed"])
def test_an_attached_head_whose_tree_it_cannot_draft_runs_plain_with_one_warning(tmp_path, monkeypatch, how):
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    model = tiny_target()
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    head = small_vocab_head(model)
    head.tree_config = TreeConfig(topk=10)
    attached = dart_hf.enable(model, head, tree_config=TreeConfig(topk=10) if how == "call tree" else None)
    kwargs = {}
    if how == "call tree":
        kwargs = dict(dart_tree_config=TreeConfig(topk=25))
    else:
        head.tree_config = TreeConfig(topk=25)
    out, caught = generate_all(attached, **kwargs)
    fallbacks = [w for w in caught if issubclass(w.category, DartFallbackWarning)]
    assert torch.equal(out, plain)
    assert len(fallbacks) == 1 and "topk=25" in str(fallbacks[0].message) and "20" in str(fallbacks[0].message)
    assert attached.dart_stats is None and controller_module.existing_controller(attached, head, store=True) is None


def test_a_drafter_that_takes_at_most_its_vocabulary_is_not_refused():
    model = tiny_target()
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    eagle = Eagle3Head.from_dart_head(random_head(model, draft_vocab=8))  # top-10 branching over 8 draft tokens
    attached = dart_hf.enable(model, eagle, tree_config=eagle.tree_config)
    assert torch.equal(attached.generate(PROMPT, max_new_tokens=8, do_sample=False), plain)
