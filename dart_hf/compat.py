"""Every private transformers name dart-spec uses, in one place, each with why (transformers 5.23).

`tests/hf/test_compat.py` exercises each against the installed transformers: a release that renames or changes one fails
there, by name. `DartGenerationMixin` also overrides two private generate() steps (`OVERRIDDEN_METHODS`); the test
checks their signatures.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# generate() steps `dart_hf.enable.DartGenerationMixin` overrides, with the parameters it relies on: generate() calls
# `_get_stopping_criteria` without the call's tokenizer on a custom_generate path (stop strings need it), and
# `_get_candidate_generator` builds the assistant of `assistant_model=` (a DartHead there)
OVERRIDDEN_METHODS = {
    "_get_stopping_criteria": ("generation_config", "stopping_criteria", "tokenizer"),
    "_get_candidate_generator": ("generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
                                 "assistant_model", "target_tokenizer", "assistant_tokenizer"),
}

# the name transformers gives the forward hooks that capture hidden states (closures, which pickle cannot save), and
# the flag it sets on a model once they are installed (it installs them again when the flag is missing)
CAPTURE_HOOK = "output_capturing_hook"
CAPTURE_HOOKS_FLAG = "_output_capturing_hooks_installed"


def synced_gpus(model, asked: Optional[bool]) -> bool:
    """generate()'s `synced_gpus` for a call on `model` (as `asked`, else whether it is sharded over processes that
    must step together), which generate() decides but does not pass to a custom_generate callable: transformers' own
    rule (`_extract_generation_mode_kwargs`)."""
    return bool(model._extract_generation_mode_kwargs(None, {}, asked, None, None)["synced_gpus"])


def generate_pad_token(generation_config) -> Optional[torch.Tensor]:
    """The pad token generate() prepared for the call (`_pad_token_tensor`: the config's pad, else its first EOS), or
    None outside generate(): plain pads finished rows with it, and DART's output must match."""
    return getattr(generation_config, "_pad_token_tensor", None)


def supports_logits_to_keep(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (`_supports_logits_to_keep`): the prefill asks for the last
    position's logits only, as generate() does."""
    supports = getattr(model, "_supports_logits_to_keep", None)
    return bool(supports is not None and supports())


def cache_from_caller(cache) -> bool:
    """Whether a cache generate() hands over was passed in by the caller (`_is_user_defined`), not made for the call:
    DART refuses a caller's cache at batch size > 1, where finished rows leave it."""
    return bool(getattr(cache, "_is_user_defined", False))


def attention_implementation(config) -> str:
    """The attention implementation a model runs (`_attn_implementation`; transformers' default when unset is
    eager): tree masks need one that takes a 4D mask."""
    return getattr(config, "_attn_implementation", None) or "eager"


def registered_attention(name: str) -> Callable:
    """The attention function transformers has registered under `name` (`AttentionInterface._global_mapping`):
    DART wraps the "sdpa" one, and calls it for every forward that is not its own."""
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping[name]
