"""`load_default()`: the offline default, SmolLM2-135M-Instruct plus the DART head shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from dart_core import DartHead
from dart_runtime.matmul import fastest_dtype

DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-dart"


def default_head_dtype(head: DartHead, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype `head` computes in beside a target in `target_dtype` on `device`: on the CPU beside a float32 target,
    float32 or bfloat16, whichever runs the head's weight products over one drafting pass's rows (D + 2: the new
    rows and the mask rows) faster here with the current thread count (`dart_runtime.matmul.fastest_dtype`,
    measured; float32 unless bfloat16 is clearly faster); elsewhere the target's. The head's step is bound by its
    ~10 M weights; whether bfloat16's halved bytes pay depends on the CPU's bfloat16 support. Drafts may change
    slightly; outputs cannot (the target verifies every token)."""
    if device.type != "cpu" or target_dtype != torch.float32:
        return target_dtype
    weights = [p for p in head.parameters() if p.dim() == 2 and p.is_floating_point()]
    return fastest_dtype(weights, head.config.draft_length + 2, (torch.float32, torch.bfloat16))


def load_default(head_dir: Optional[str | os.PathLike] = None, *, attn_implementation: str = "sdpa",
                 target_dtype: torch.dtype = torch.float32, head_dtype: Optional[torch.dtype] = None):
    """(model, tokenizer, dart_head): SmolLM2-135M-Instruct from `load_smollm2()` in `target_dtype` (enabled for
    `dart_head=`) and the head in `head_dir` (default: the shipped `dart_hf/assets/smollm2-135m-dart/`), offline.

    The head is on the model's device in `head_dtype` (default: `default_head_dtype`, measured) and shares its
    embedding. Calls with `dart_head=head` and no `dart_tree_config` choose each step's tree from what DART measures
    (`dart_hf.controller`). Raises FileNotFoundError naming the directory when the head is missing.
    """
    from dart_hf.enable import enable
    from dart_hf.smollm2 import load_smollm2
    from dart_hf.target import plan_for

    directory = Path(head_dir) if head_dir is not None else DEFAULT_HEAD_DIR
    if not (directory / "config.json").is_file():
        what = "the shipped DART head for SmolLM2" if head_dir is None else "the DART head"
        raise FileNotFoundError(f"{what} is missing: no config.json in {directory}")
    model, tokenizer = load_smollm2(attn_implementation=attn_implementation)
    enable(model.to(target_dtype), False)
    param = next(model.parameters())
    head = DartHead.from_pretrained(directory, device=param.device)
    head.to(dtype=head_dtype or default_head_dtype(head, param.dtype, param.device))
    head.eval()
    plan_for(model, head, tokenizer)
    return model, tokenizer, head

