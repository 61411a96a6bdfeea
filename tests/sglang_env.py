"""Shared setup of the SGLang tests: SGLang 0.5.23 on this CPU-only machine (DESIGN 4) and the tiny models."""

from __future__ import annotations

import json
import os
import sys

import pytest

CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu")


def import_sglang():
    """Skip (with the install command) when SGLang is missing; put the test-only torchvision stub on the path."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's Triton kernels run in Triton's interpreter on CPU
    if CPU_DIR not in sys.path:
        sys.path.insert(0, CPU_DIR)
    return pytest.importorskip("sglang", reason="SGLang is not installed: see .ci/run for the CPU install")


def write_models(root, draft_length: int = 4, tree: dict | None = None, seed: int = 1) -> tuple[str, str]:
    """A tiny 8-layer Llama target with a word tokenizer, and a random DART head converted for SGLang.
    Returns (target_dir, head_dir)."""
    from conftest import _word_tokenizer
    from dart_converters import convert_sglang
    from hf_models import random_head, tiny_target

    target_dir, raw_dir, head_dir = (os.path.join(root, n) for n in ("target", "head", "head-sglang"))
    target = tiny_target(layers=8)
    target.config.eos_token_id = 2
    target.save_pretrained(target_dir)
    _word_tokenizer().save_pretrained(target_dir)
    head = random_head(target, draft_length=draft_length, seed=seed)
    head.set_input_embeddings(target.get_input_embeddings())
    head.save_pretrained(raw_dir)
    convert_sglang(raw_dir, head_dir, target=target_dir, force=True, progress=False)
    if tree:
        set_tree(head_dir, **tree)
    return target_dir, head_dir


def set_tree(head_dir: str, **settings) -> None:
    file = os.path.join(head_dir, "config.json")
    with open(file) as fh:
        config = json.load(fh)
    config["dart_config"].update(settings)
    with open(file, "w") as fh:
        json.dump(config, fh, indent=1)
