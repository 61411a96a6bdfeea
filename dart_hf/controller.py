"""One speed controller (`dart_core.speed.SpeedController`) per target, head and machine setting, made at the first
call that needs it from the head's acceptance curve, a machine cost measured on request (`dart_hf.calibrate`,
`dart-spec calibrate`; a call never measures one) and what earlier processes learned (`dart_hf.learned`); and what
plain `generate()` calls teach it (`PlainClock`). The rule itself lives in `dart_core.speed` and
`dart_core.step_policy`.

    choice = dart_hf.tree_choice(model, head)        # the best tree by the estimates at batch 1 (None: none yet)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import statistics
import threading
import weakref
from pathlib import Path
from typing import Optional

import torch
from transformers import StoppingCriteria

from dart_core import AcceptanceCurve, DartHead, TreeConfig
from dart_core.cost import MachineCost
from dart_core.speed import FIRST_ROWS, SpeedController, TreeChoice, regime_key, step_seconds_ok
from dart_hf.calibration import CANDIDATES, base_tree_config, cached_machine_cost, cost_path, identity
from dart_hf.learned import LearnedFile
from dart_hf.target import context_drafting
from dart_runtime.timing import now


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

# per head: {(target id, dtype, device, threads, acceptance id, search settings): the controller's `LearnedFile`,
# which holds the controller}; both live as long as the head
_CONTROLLERS: "weakref.WeakKeyDictionary[DartHead, dict]" = weakref.WeakKeyDictionary()
_CONTROLLERS_LOCK = threading.Lock()
_FILES: "weakref.WeakValueDictionary[int, LearnedFile]" = weakref.WeakValueDictionary()  # id(controller) -> its file


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
        found = _CONTROLLERS.get(head, {}).get(_key(model, head, context, store))
    return None if found is None else found.controller


def controller_for(model, head: DartHead, context: Optional[bool] = None, store: bool = False) -> SpeedController:
    """The controller of `head` on `model` with this machine setting, for calls with context drafting on or off and
    with or without a store of earlier outputs (`context`, `store`: the trees, and so what they accept, differ; None:
    as the head's tree settings say): made at the first call, from the head's acceptance curve, a machine cost that
    `calibrate` measured here (cached; a call never measures one) and what earlier calls learned."""
    key = _key(model, head, context, store)
    with _CONTROLLERS_LOCK:
        found = _CONTROLLERS.get(head, {}).get(key)
        if found is not None:
            return found.controller
        ident = identity(model, head)
        cost = cached_machine_cost(model, head, ident)
        base = base_tree_config(model, head)
        curve = head.acceptance
        largest = max(curve.tau) if curve is not None else base.remain_total
        sizes = [r for r in CANDIDATES if r <= largest] + ([largest] if largest not in CANDIDATES else [])
        controller = SpeedController(sizes, cost, curve, start_size=first_size(head, base, sizes))
        learned = LearnedFile(controller, learned_path(ident, key[-1]), ident)
        learned.load()
        _CONTROLLERS.setdefault(head, {})[key] = _FILES[id(controller)] = learned
        return controller


def first_size(head: DartHead, base: TreeConfig, sizes: list[int]) -> int:
    """The tree a regime's first DART steps verify: for a drafter that fills its trees (`Drafter.fills_tree`: a larger
    tree is a larger forward) the largest of `sizes` within `FIRST_ROWS` rows a sequence, and larger ones only as
    timed steps reach them (`SpeedController.tryable`); for one whose trees hold only what it proposes, its budget
    (`base.remain_total`)."""
    if not head.fills_tree:
        return base.remain_total
    return min(base.remain_total, max([r for r in sizes if r + 1 <= FIRST_ROWS] or [sizes[0]]))


def learned_file(controller: SpeedController) -> Optional[LearnedFile]:
    """Where `controller` keeps what it learns (None: a controller `controller_for` did not make)."""
    found = _FILES.get(id(controller))
    return found if found is not None and found.controller is controller else None


def save_learned(controller: Optional[SpeedController], force: bool = False) -> None:
    """Keep what `controller` learned in its file (`LearnedFile.save`; never raises)."""
    learned = None if controller is None else learned_file(controller)
    if learned is not None:
        learned.save(force)


@atexit.register
def _save_all() -> None:
    for learned in list(_FILES.values()):
        with contextlib.suppress(Exception):  # at exit, a cache that cannot be written has warned already
            learned.save(force=True)


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
