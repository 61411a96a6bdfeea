"""Official DART head directories and HF target directories for the converter and fault tests: a tiny head's
official-name weights, its directory, and a local target's config."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from dart_core import DartConfig, DartHead

TINY = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, vocab_size=40,
            draft_vocab_size=20, draft_length=3, target_hidden_size=16, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=512)
TARGET_LAYERS = 8  # default taps [2, 4, 5]


def random_state(seed: int, config: dict = TINY) -> dict[str, torch.Tensor]:
    """Official-name weights of a tiny head with random values (d2t maps draft ids into the vocab)."""
    torch.manual_seed(seed)
    head = DartHead(DartConfig(**config))
    state = {}
    for k, v in head.state_dict().items():
        if v.is_floating_point():
            state[k] = torch.randn(v.shape) * 0.3
        else:
            state[k] = v.clone()
    dv, v = config["draft_vocab_size"], config["vocab_size"]
    state["d2t"] = torch.randint(0, v - dv, (dv,))
    state["t2d"] = torch.zeros(v, dtype=torch.bool)
    state["t2d"][torch.arange(dv) + state["d2t"]] = True
    return state


def write_official_head(path, seed=0, state=None, config_overrides=None, drop=(), extra=None, dtype=None):
    """An official DART directory: Llama-style config.json + model.safetensors with the official names."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMDart"], "model_type": "llama", "hidden_act": "silu",
           "num_hidden_layers": 1, "torch_dtype": "float32", "tie_word_embeddings": False, "rope_scaling": None,
           "bos_token_id": 1, "eos_token_id": 2, **TINY}
    cfg.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(cfg))
    state = dict(state if state is not None else random_state(seed))
    for k in drop:
        state.pop(k)
    state.update(extra or {})
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(path / "model.safetensors"))
    return state


def write_target(path, hidden=16, vocab=40, layers=TARGET_LAYERS, eos=7, gen_eos=None, text_config=False):
    """A local HF target directory (config.json, optional generation_config.json)."""
    os.makedirs(path, exist_ok=True)
    fields = {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers, "eos_token_id": eos}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    cfg.update({"text_config": fields} if text_config else fields)
    (path / "config.json").write_text(json.dumps(cfg))
    if gen_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return path
