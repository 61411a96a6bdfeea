"""`load_default()`: the offline default, SmolLM2-135M-Instruct plus the DART head shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from dart_core import DartHead

DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-dart"
# x86 CPUs on which the head computes in bfloat16 beside a float32 target (BENCHMARKS.md, "Head dtype on the CPU")
BF16_HEAD_CPU_CAPABILITIES = ("AVX2", "AVX512")


def default_head_dtype(target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype `load_default` gives the head: bfloat16 beside a float32 target on an x86 CPU with AVX2 or newer, else
    the target's. The head's step pushes a few rows through ~10 M weights and is bound by reading them: bfloat16 reads
    half the bytes. Drafts may change slightly; outputs cannot (the target verifies every token)."""
    if (device.type == "cpu" and target_dtype == torch.float32
            and torch.backends.cpu.get_cpu_capability() in BF16_HEAD_CPU_CAPABILITIES):
        return torch.bfloat16
    return target_dtype


def load_default(head_dir: Optional[str | os.PathLike] = None, *, attn_implementation: str = "sdpa",
                 target_dtype: torch.dtype = torch.float32, head_dtype: Optional[torch.dtype] = None):
    """(model, tokenizer, dart_head): SmolLM2-135M-Instruct from `load_smollm2()` in `target_dtype` (enabled for
    `dart_head=`) and the head in `head_dir` (default: the shipped `dart_hf/assets/smollm2-135m-dart/`), offline.

    The head is on the model's device in `head_dtype` (default: `default_head_dtype`) and shares its embedding. Calls
    with `dart_head=head` and no `dart_tree_config` take the tree size chosen for this machine
    (`dart_hf.tree_choice`, measured at the first call). Raises FileNotFoundError naming the directory when the head
    is missing.
    """
    from dart_hf.enable import enable
    from dart_hf.smollm2 import load_smollm2
    from dart_hf.target import plan_for

    directory = Path(head_dir) if head_dir is not None else DEFAULT_HEAD_DIR
    if not (directory / "config.json").is_file():
        what = "the shipped DART head for SmolLM2" if head_dir is None else "the DART head"
        raise FileNotFoundError(f"{what} is missing: no config.json in {directory}")
    model, tokenizer = load_smollm2(attn_implementation=attn_implementation)
    enable(model.to(target_dtype))
    param = next(model.parameters())
    dtype = head_dtype or default_head_dtype(param.dtype, param.device)
    head = DartHead.from_pretrained(directory, dtype=dtype, device=param.device)
    head.eval()
    plan_for(model, head, tokenizer)
    return model, tokenizer, head

