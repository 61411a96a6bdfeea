"""The tree settings a benchmark decodes with: this machine's choice (`dart_hf.tree_choice`) or a search over
drafter settings (`dart-spec bench`'s calibration)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from dart_core import TreeConfig


def decoding_tree(model, head, remain_total: Optional[int] = None) -> TreeConfig:
    """The tree the controller would choose now for `generate(dart_head=head)` on this machine at batch 1
    (`dart_hf.tree_choice`; while nothing is known of the head's acceptance: its own settings), with `remain_total`
    overriding the size: a fixed tree for a benchmark."""
    from dart_hf.calibration import base_tree_config
    from dart_hf.controller import tree_choice

    choice = tree_choice(model, head)
    tree = choice.tree_config if choice is not None else base_tree_config(model, head)
    return tree if remain_total is None else dataclasses.replace(tree, remain_total=remain_total)


def calibrated_tree(model, tokenizer, drafter, searches: Sequence[dict] = ({},), refresh: bool = False,
                    progress: Optional[bool] = True) -> tuple[TreeConfig, list[dict]]:
    """The fastest tree settings for `drafter` on this machine: for each search setting (TreeConfig overrides, e.g.
    {"topk": 2, "max_depth": 3}) the node count the priors choose (`dart_hf.controller.prior_choice`: the drafter's
    shipped acceptance curve for its own settings, else one measured now; this machine's cost, cached unless
    `refresh`), then the setting with the best expected speedup. Returns (TreeConfig, one row per setting)."""
    from dart_hf.calibration import base_tree_config, machine_cost, measure_acceptance
    from dart_hf.controller import prior_choice

    base = base_tree_config(model, drafter)
    shipped = drafter.acceptance
    rows, best = [], None
    for search in searches:
        drafter.tree_config = dataclasses.replace(base, **search)
        measure = refresh or search or shipped is None
        acceptance = measure_acceptance(model, tokenizer, drafter, progress=progress) if measure else shipped
        choice = prior_choice(acceptance, machine_cost(model, drafter, refresh=refresh, progress=progress),
                              drafter.tree_config)
        rows.append({**search, "remain_total": choice.remain_total, "expected_speedup": choice.expected_speedup,
                     "head_ms": choice.cost.head_ms, "tree_ms": choice.cost.tree_ms})
        if best is None or choice.expected_speedup > best.expected_speedup:
            best = choice
    drafter.tree_config = best.tree_config
    return drafter.tree_config, rows
