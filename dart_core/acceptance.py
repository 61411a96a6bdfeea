"""What verify steps accepted, as tokens per step: the one definition of tau and of what a smaller tree would have
accepted from the same state (used by the decoding statistics, calibration and the speed controller)."""

from __future__ import annotations

from typing import Sequence


def tau_of(accepted: int, steps: int) -> float:
    """Tokens per verify step, the bonus token included: (accepted draft tokens + steps) / steps (0 without steps)."""
    return (accepted + steps) / steps if steps else 0.0


def accepted_within(ranks: Sequence[int], size: int) -> int:
    """Draft tokens a tree of `size` nodes would have accepted (greedy) from the state where a larger tree accepted
    nodes of selection `ranks` along its path: the leading ones of rank < size."""
    n = 0
    while n < len(ranks) and ranks[n] < size:
        n += 1
    return n
