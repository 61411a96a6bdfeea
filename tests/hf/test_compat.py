"""Each private transformers name of `dart_hf.compat`, exercised against the installed transformers: a release that
breaks one fails here, by name. And no other module of the project names them."""

import inspect
import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GenerationMixin

import dart_hf
from dart_hf import compat
from helpers.hf_models import random_head, tiny_target

PRIVATE_NAMES = ("_pad_token_tensor", "_supports_logits_to_keep", "_is_user_defined", "_attn_implementation",
                 "_global_mapping", "_output_capturing_hooks_installed", "output_capturing_hook",
                 "_extract_generation_mode_kwargs")
PROMPT = torch.tensor([[5, 17, 33, 2, 9]])


def seen_by_a_decoding_method(**kwargs):
    """What generate() hands a custom_generate callable: (generation_config, model_kwargs)."""
    seen = {}

    def decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        seen.update(config=generation_config, kwargs=model_kwargs)
        return input_ids

    tiny_target().generate(PROMPT, max_new_tokens=2, custom_generate=decoding, **kwargs)
    return seen["config"], seen["kwargs"]


@pytest.mark.parametrize("kwargs,pad", [(dict(pad_token_id=3), 3), (dict(eos_token_id=7), 7), ({}, None)])
def test_generate_pad_token(kwargs, pad):
    config, _ = seen_by_a_decoding_method(**kwargs)
    got = compat.generate_pad_token(config)
    assert (got is None) if pad is None else int(got) == pad


def test_synced_gpus(monkeypatch):
    model = tiny_target()
    assert compat.synced_gpus(model, True) and not compat.synced_gpus(model, False)
    assert not compat.synced_gpus(model, None)  # one process, not sharded
    # sharded with ZeRO-3 over two processes: generate() syncs them
    import transformers.generation.utils as generation

    monkeypatch.setattr(generation, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(generation, "_get_torch_distributed_world_size", lambda: 2)
    assert compat.synced_gpus(model, None) and not compat.synced_gpus(model, False)


def test_cache_from_caller():
    _, made = seen_by_a_decoding_method()
    _, passed = seen_by_a_decoding_method(past_key_values=DynamicCache())
    assert not compat.cache_from_caller(made["past_key_values"])
    assert compat.cache_from_caller(passed["past_key_values"])


def test_supports_logits_to_keep_and_attention_implementation():
    assert compat.supports_logits_to_keep(tiny_target())
    assert compat.attention_implementation(tiny_target(attn="eager").config) == "eager"
    assert compat.attention_implementation(tiny_target(attn="sdpa").config) == "sdpa"


def test_registered_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sdpa = compat.registered_attention("sdpa")
    assert sdpa is sdpa_attention_forward or sdpa.__module__ == "dart_hf.target"  # transformers' own, or DART's wrap


@pytest.mark.parametrize("name", sorted(compat.OVERRIDDEN_METHODS))
def test_overridden_generate_steps_keep_their_parameters(name):
    params = inspect.signature(getattr(GenerationMixin, name)).parameters
    assert set(compat.OVERRIDDEN_METHODS[name]) <= set(params)


def test_hidden_state_capture_hooks():
    model = dart_hf.enable(tiny_target(), False)
    model.generate(PROMPT, max_new_tokens=4, dart_head=random_head(model))
    assert any(getattr(m, compat.CAPTURE_HOOKS_FLAG, False) for m in model.modules())
    hooks = [h for m in model.modules() for h in m._forward_hooks.values()]
    assert any(getattr(h, "__name__", "") == compat.CAPTURE_HOOK for h in hooks)


def test_no_other_module_names_a_private_transformers_name():
    root = Path(__file__).resolve().parents[2]
    found = [f"{path.relative_to(root)}: {name}"
             for package in ("dart_core", "dart_hf", "dart_sglang", "dart_train", "dart_cli", "converters",
                             "dart_bench")
             for path in (root / package).rglob("*.py") if path.name != "compat.py" or package != "dart_hf"
             for name in PRIVATE_NAMES if re.search(rf"(?<!\w){name}", path.read_text())]
    assert not found
