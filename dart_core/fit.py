"""Whether a head fits a target: the one check that `dart_hf`, the converters and the SGLang plugin all make."""

from __future__ import annotations

import dataclasses

import torch

from dart_core.config import DartConfig
from dart_core.errors import DartInputError
from dart_core.head import OPTIONAL_KEYS, draft_vocab_problem


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """What a head must agree with in a target; `name` says where it came from (a path, a class) for messages."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    name: str = "the target"


def fit_problems(config: DartConfig, d2t: torch.Tensor, target: TargetShape,
                 has_embedding: bool = False) -> list[str]:
    """Every reason the head (`config`, `d2t` [Vd]) cannot run on `target`, each with its numbers; [] if it fits.
    `has_embedding`: the head carries its own token embedding table, so it need not share the target's."""
    problems = []
    if target.hidden_size != config.target_hidden_size:
        problems.append(f"target hidden_size {target.hidden_size} != head target_hidden_size "
                        f"{config.target_hidden_size} (fc reads 3 x {config.target_hidden_size})")
    if target.hidden_size != config.hidden_size and not has_embedding:
        problems.append(f"target hidden_size {target.hidden_size} != head hidden_size {config.hidden_size} (the head "
                        f"embeds tokens with the target's embedding table: the checkpoint has no {OPTIONAL_KEYS[0]})")
    if target.vocab_size != config.vocab_size:
        problems.append(f"target vocab_size {target.vocab_size} != head vocab_size {config.vocab_size}")
    vocab_problem = draft_vocab_problem(d2t, target.vocab_size)
    if vocab_problem:
        problems.append(vocab_problem)
    try:
        config.layer_ids_for(target.num_hidden_layers)
    except ValueError:
        ids = config.target_layer_ids
        need = max(ids) if ids else 4
        shown = f"taps {ids}" if ids else "the default taps [2, L//2, L-3]"
        problems.append(f"target num_hidden_layers {target.num_hidden_layers} is too few for {shown} "
                        f"(need at least {need})")
    return problems


def check_fits(config: DartConfig, d2t: torch.Tensor, target: TargetShape, has_embedding: bool = False) -> list[int]:
    """The taps (HF hidden_states indices) of the head on `target`; ValueError naming every mismatch otherwise."""
    problems = fit_problems(config, d2t, target, has_embedding)
    if problems:
        raise DartInputError(f"head does not fit {target.name}: " + "; ".join(problems))
    return config.layer_ids_for(target.num_hidden_layers)
