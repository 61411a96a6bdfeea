"""`--threads N`, one rule for every command."""

from __future__ import annotations

from typing import Optional

from dart_cli.errors import UsageError


def set_threads(n: Optional[int]) -> None:
    """Use `n` torch CPU threads (None: torch's choice); UsageError below 1."""
    if n is None:
        return
    if n < 1:
        raise UsageError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)
