"""What the speed rule learned (`dart_core.speed.SpeedController`), kept across processes: `<key>.learned.json` beside
the machine cost in `$DART_SPEC_CACHE/machine/` (`LearnedFile`).

The state is merged entry by entry with what other processes wrote (the newer entry wins, under a file lock) at most
every `SAVE_EVERY_S` seconds and at exit; a cache that cannot be written keeps it in memory, and a save never raises
out of a call. Every value read back is checked (`parse_learned`: a finite number in its range, a tree size among
the controller's, a regime key that is a bucket, a time not ahead of this clock by more than a day): an entry that is
not is ignored with one `DartCacheWarning` per file, the rest kept."""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional

from dart_core.config import MAX_TREE_NODES
from dart_core.errors import DartInputError
from dart_core.speed import (MAX_PROBE_AFTER, MAX_STEP_S, PRIOR_TAU_WEIGHT, SCALE_RANGE, STEP_DECAY, TAU_DECAY, Mean,
                             Mode, Regime, SpeedController, finite, regime_key)
from dart_hf.calibration import NO_FILE, DartCacheWarning, read_cache_file, write_cache_file
from dart_runtime.timing import now

SAVE_EVERY_S = 10.0  # the learned state reaches the disk at most this often (and at exit)
LEARNED_VERSION = 1
# no regime buckets more than 2**40 rows or positions, and no entry was updated more than a day ahead of this clock (it
# would win every merge for ever)
MAX_BUCKET = 2 ** 40
FUTURE_SLACK_S = 86400.0


# ---- reading values back -----------------------------------------------------------------------------------------

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


def mean_from_list(raw, name: str, minimum: float, maximum: float = math.inf, max_weight: float = math.inf) -> Mean:
    """The `Mean` [total, weight] with 0 <= weight <= `max_weight` and, when it is > 0, `minimum` <= mean <=
    `maximum`; DartInputError otherwise."""
    values = [finite(x) for x in raw] if isinstance(raw, list) and len(raw) == 2 else [None]
    if None in values:
        raise DartInputError(f"{name} is {_shown(raw)}, not [total, weight] of two finite numbers")
    mean = Mean(*values)
    if not 0 <= mean.weight <= max_weight or (mean.weight > 0 and not minimum <= mean.value <= maximum):
        raise DartInputError(f"{name} is {_shown(raw)}: the weight must be in 0..{max_weight:g} and the mean in "
                             f"{minimum:g}..{maximum:g}")
    return mean


def regime_to_dict(regime: Regime) -> dict:
    return {"plain": regime.plain.to_list(), "drafting": regime.drafting.to_list(),
            "steps": {str(r): m.to_list() for r, m in sorted(regime.steps.items())},
            "scale": regime.scale.to_list(), "mode": regime.mode.value, "probe_after": regime.probe_after,
            "plain_calls": regime.plain_calls, "updated": regime.updated}


def regime_from_dict(raw, name: str, problems: list[str]) -> Regime:
    """The regime a learned-state file holds. DartInputError where its own fields (mode, probe counts, update time) do
    not validate; an estimate that does not (a step time or ratio that is not a finite number in range, a tree size
    outside 1..`MAX_TREE_NODES`) is left out and named in `problems`."""
    if not isinstance(raw, dict):
        raise DartInputError(f"{name} is not an object")
    mode, probe_after, plain_calls = raw.get("mode"), raw.get("probe_after"), raw.get("plain_calls")
    if mode not in (Mode.DART.value, Mode.PLAIN.value):
        raise DartInputError(f"{name}.mode is {_shown(mode)}, not 'dart' or 'plain'")
    for field, value, low, high in (("probe_after", probe_after, 1, MAX_PROBE_AFTER),
                                    ("plain_calls", plain_calls, 0, 10**9)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise DartInputError(f"{name}.{field} is {_shown(value)}, not an integer in {low}..{high}")
    updated = _time_ok(raw.get("updated"))
    if updated is None:
        raise DartInputError(f"{name}.updated is {_shown(raw.get('updated'))}, not a time up to now")
    regime = Regime(mode=Mode(mode), probe_after=probe_after, plain_calls=plain_calls, updated=updated)
    limit = _weight_limit(STEP_DECAY)
    for field, low, high in (("plain", 1e-9, MAX_STEP_S), ("drafting", 0.0, MAX_STEP_S), ("scale", *SCALE_RANGE)):
        if field == "drafting" and field not in raw:  # a file saved before drafting was timed apart
            continue
        try:
            setattr(regime, field, mean_from_list(raw.get(field), f"{name}.{field}", low, high, limit))
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
            regime.steps[size] = mean_from_list(m, f"{name}.steps[{r}]", 1e-9, MAX_STEP_S, limit)
        except DartInputError as err:
            problems.append(str(err))
    return regime


def state_of(controller: SpeedController, ident: dict) -> dict:
    """What a learned-state file holds of `controller` (learned under identity `ident`)."""
    return {"version": LEARNED_VERSION, "identity": ident,
            "tau": {name: {"updated": controller.tau_updated[s],
                           "sizes": {str(r): m.to_list() for r, m in sorted(controller.tau[s].items())}}
                    for name, s in (("greedy", False), ("sampled", True))},
            "regimes": {f"{b}x{c}": regime_to_dict(regime) for (b, c), regime in sorted(controller.regimes.items())}}


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
                table[size] = mean_from_list(m, f"tau.{name}[{r}]", 1.0, (size + 1.0) * (1 + 1e-9),
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
            regimes[(b, c)] = regime_from_dict(regime, f"regimes[{name}]", problems)
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



# ---- one controller's file ---------------------------------------------------------------------------------------

class LearnedFile:
    """Where one controller's learned state is kept (`path`, learned under identity `ident`): `load` at the start,
    `save` after calls and at exit."""

    def __init__(self, controller: SpeedController, path: Path, ident: dict) -> None:
        self.controller, self.path, self.ident = controller, path, ident
        self.last_save = now()
        self.warned = False  # one DartCacheWarning about the file per controller

    def _adopt(self, raw, newer_only: bool) -> list[str]:
        """Take the entries of a saved state that validate (`newer_only`: and are newer than the controller's;
        `parse_learned`: a state that is not this controller's raises DartInputError, whole); what was left out."""
        ctrl = self.controller
        tau, regimes, problems = parse_learned(raw, self.ident, ctrl.sizes)
        for sampled, (updated, table) in tau.items():
            if not newer_only or updated > ctrl.tau_updated[sampled]:
                ctrl.tau[sampled] = {**ctrl.tau[sampled], **table} if not newer_only else table
                ctrl.tau_updated[sampled] = updated
        for key, regime in regimes.items():
            mine = ctrl.regimes.get(key)
            if mine is None or not newer_only or regime.updated > mine.updated:
                if mine is not None:
                    regime.keep_process_state(mine)
                ctrl.regimes[key] = regime
        return problems

    def _warn(self, what: str) -> None:
        """The one `DartCacheWarning` about this file."""
        if not self.warned:
            self.warned = True
            warnings.warn(f"ignoring the learned speed estimates {self.path}{what}", DartCacheWarning, stacklevel=4)

    def _read(self, newer_only: bool) -> None:
        """Adopt what the file holds (`_adopt`), warning once about anything in it left out."""
        try:
            raw = read_cache_file(self.path)
            problems = [] if raw is NO_FILE else self._adopt(raw, newer_only)
        except (ValueError, DartInputError) as err:  # malformed JSON, nested too deeply, another state
            self._warn(f": {err}; " + ("this process's replace them" if newer_only else "they are learned again"))
            return
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            self._warn(f" that do not validate ({'; '.join(problems[:3])}{more}); the rest is kept")

    def load(self) -> None:
        """Give the controller what the file holds."""
        with self.controller.lock:
            self._read(newer_only=False)

    def save(self, force: bool = False) -> None:
        """Merge with what is on disk (newer entries win) and write, when something changed and `SAVE_EVERY_S` has
        passed (`force`: whenever something changed). Never raises: a file that does not validate is replaced by
        this state, one that cannot be written leaves it in memory (`write_cache_file`), and any other failure
        keeps it to be written by a later save (each with one `DartCacheWarning` per controller)."""
        ctrl = self.controller
        with ctrl.lock:
            if not ctrl.dirty or (not force and now() - self.last_save < SAVE_EVERY_S):
                return
            try:
                with _file_lock(self.path):
                    self._read(newer_only=True)
                    write_cache_file(self.path, state_of(ctrl, self.ident))
                ctrl.dirty = False
            except Exception as err:  # noqa: BLE001 -- a call's output is never lost to its save
                self._warn(f" could not be saved ({type(err).__name__}: {err}); they are kept in memory")
            self.last_save = now()
