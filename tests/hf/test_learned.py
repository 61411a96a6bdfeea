"""What the speed rule learned, kept across processes (`dart_hf.learned`): saved, loaded, merged newest first, and a
damaged file ignored with one warning. (Hostile values entry by entry: tests/hf/test_controller_state.py.)"""

import json
import time

import pytest

from dart_core.speed import PROCESS_STATE, SpeedController
from dart_hf import DartCacheWarning
from dart_hf.learned import LearnedFile
from helpers.synthetic import SIZES, Machine, prior_from, rate_over_calls, run_call


def kept(path, machine: Machine) -> tuple[SpeedController, LearnedFile]:
    """A controller whose learned state lives in `path` (loaded now)."""
    ctrl = SpeedController(SIZES, prior_from(machine), None, 3)
    learned = LearnedFile(ctrl, path, {"k": 1})
    learned.load()
    return ctrl, learned


def test_the_learned_state_is_saved_loaded_and_merged_newest_first(tmp_path):
    machine = Machine()
    path = tmp_path / "x.learned.json"
    first, first_file = kept(path, machine)
    rate_over_calls(first, machine, 3)
    first_file.save(force=True)
    raw = json.loads(path.read_text())
    assert raw["identity"] == {"k": 1} and "1x256" in raw["regimes"]
    second, second_file = kept(path, machine)
    assert second.tau_of(False) == pytest.approx(first.tau_of(False))
    assert second.regimes[(1, 256)].steps.keys() == first.regimes[(1, 256)].steps.keys()
    # another process learns batch 8 later; this one's batch-1 regime is newer than the disk's: both survive
    other, other_file = kept(path, machine)
    run_call(other, machine, batch=8)
    time.sleep(0.01)
    run_call(second, machine, batch=1)
    other_file.save(force=True)
    second_file.save(force=True)
    merged = json.loads(path.read_text())["regimes"]
    assert set(merged) == {"1x256", "8x256"}
    assert merged["1x256"]["updated"] == second.regimes[(1, 256)].updated


def test_a_regime_another_process_saved_later_keeps_this_process_s_own_state(tmp_path):
    machine = Machine()
    path = tmp_path / "x.learned.json"
    mine, mine_file = kept(path, machine)
    run_call(mine, machine, steps=40)
    regime = mine.regimes[(1, 256)]
    regime.spent_calls, regime.new_size, regime.new_size_at = 1, 6, 33  # as a call may leave them
    own = {name: getattr(regime, name) for name in PROCESS_STATE}
    assert own["count"] == 40
    other, other_file = kept(path, machine)
    time.sleep(0.01)
    run_call(other, machine, steps=8)
    other_file.save(force=True)
    mine.dirty = True
    mine_file.save(force=True)  # reads the newer regime first: it replaces this process's estimates
    adopted = mine.regimes[(1, 256)]
    assert adopted is not regime and adopted.updated == other.regimes[(1, 256)].updated
    assert {name: getattr(adopted, name) for name in PROCESS_STATE} == own


@pytest.mark.parametrize("damage", ["text", "list", "version", "identity", "tau", "mode", "probe", "negative",
                                    "nan"])
def test_a_damaged_learned_state_is_ignored_with_one_warning(tmp_path, damage):
    machine = Machine()
    path = tmp_path / "x.learned.json"
    ctrl, ctrl_file = kept(path, machine)
    rate_over_calls(ctrl, machine, 2)
    ctrl_file.save(force=True)
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
        fresh, fresh_file = kept(path, machine)
    if damage in ("text", "list", "version", "identity"):  # not this controller's state: ignored whole
        assert fresh.regimes == {}
    else:  # the bad entry alone is ignored (tests/hf/test_controller_state.py)
        assert fresh.regimes.get((1, 256)) != ctrl.regimes[(1, 256)] or 3 not in fresh.tau[False]
    fresh.regime(1, 100)
    fresh.dirty = True
    fresh_file.save(force=True)  # a damaged file is replaced
    assert json.loads(path.read_text())["identity"] == {"k": 1}
