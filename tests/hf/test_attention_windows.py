"""Sliding windows as each architecture's own forward decides them: the masks a DART tree forward hands every
attention layer show it what plain decoding's masks show it (`attention_views`), or DART refuses the model by name.

Mistral's family masks every layer with `config.sliding_window` whatever `layer_types` says (the cache reads
`layer_types`); the others mask each layer by its type. transformers' sliding-window cache keeps every position at
a window of 1, so plain decoding's queries look past that window (padding included): refused."""

import warnings

import pytest
import torch

import dart_hf
from dart_core import TreeConfig
from dart_core.errors import DartInputError
from helpers.attention_views import differences, dart_views, padded_prompt, plain_views, PAD
from helpers.hf_models import oracle_head, tiny_causal_lm

# the architectures of issue #46 (all-sliding, hybrid, and Mistral's one-mask family)
ARCHS = ["mistral", "ministral", "mixtral", "gemma2", "gemma3_text", "phi3", "qwen2", "qwen3", "cohere2",
         "starcoder2", "gpt_oss"]
F, S = "full_attention", "sliding_attention"
LAYER_TYPES = {"all full": [F] * 4, "all sliding": [S] * 4, "alternating": [S, F, S, F], "default": None}


def build(model_type, window, layer_types="default"):
    overrides = {"sliding_window": window}
    if LAYER_TYPES[layer_types] is not None:
        overrides["layer_types"] = LAYER_TYPES[layer_types]
    return tiny_causal_lm(model_type, **overrides)


def tokens(n=5):
    return torch.randint(2, 96, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("window, layer_types", [(2, "all full"), (3, "alternating"), (3, "all sliding"),
                                                 (8, "default")])
@pytest.mark.parametrize("model_type", ARCHS)
def test_every_layer_sees_through_a_tree_mask_what_it_sees_in_plain_decoding(model_type, window, layer_types):
    """A padded batch of 2 (10 prompt columns, window shorter than the prompt), then 5 tokens: plain's 5 one-token
    steps against one DART verify forward over them as a chain."""
    ids, mask = padded_prompt()
    try:
        model = build(model_type, window, layer_types)
        plain, plain_logits = plain_views(model, ids, mask, tokens())
    except RuntimeError:  # plain itself cannot run this config (Mistral's one mask over caches of two kinds)
        with pytest.raises(DartInputError, match="one mask"):
            dart_hf.target.attention_layout(_unbuilt(model_type, window, layer_types))
        return
    dart, dart_logits = dart_views(model, ids, mask, tokens())
    assert differences(plain, dart) == []
    torch.testing.assert_close(dart_logits, plain_logits, atol=1e-4, rtol=1e-4)


def _unbuilt(model_type, window, layer_types):
    """The model of a config plain generate() cannot run (tiny_causal_lm checks that it generates)."""
    from helpers.hf_models import _tiny

    return _tiny(model_type, 0, (), {"sliding_window": window, "layer_types": LAYER_TYPES[layer_types]})


@pytest.mark.parametrize("model_type", ARCHS)
def test_a_window_of_one_is_refused_by_name_as_plain_decoding_looks_past_it(model_type):
    model = build(model_type, 1, "alternating")
    ids, mask = padded_prompt()
    plain, _ = plain_views(model, ids, mask, tokens())
    sliding = 0  # a sliding layer (layer 0 under "alternating" layer types; every layer in Mistral's family)
    seen = plain[(sliding, 0, 0)]
    assert len(seen) > 1 and PAD in seen  # the query sees far more than itself, padding included
    with pytest.raises(DartInputError, match="sliding_window=1"):
        dart_views(model, ids, mask, tokens())


@pytest.mark.parametrize("window", [1, 2, 5])
def test_mistral_with_full_layer_types_masks_every_layer_with_its_window(window):
    """transformers accepts the config and only logs a hint; Mistral's forward masks through the window, its cache
    keeps every position. A window of 1 over such a cache is exact too (nothing to keep past it)."""
    model = build("mistral", window, "all full")
    layout = dart_hf.target.attention_layout(model)
    assert (layout.window, layout.by_type) == (window, False)
    ids, mask = padded_prompt()
    plain, _ = plain_views(model, ids, mask, tokens())
    assert differences(plain, dart_views(model, ids, mask, tokens())[0]) == []


PROMPT = torch.tensor([[5, 17, 33, 2, 9, 40, 41, 7, 8]])


def test_the_issue_example_decodes_as_plain_without_a_warning():
    """Mistral, sliding_window=2, layer_types all full: DART departed from plain at the 4th new token."""
    model = build("mistral", 2, "all full")
    plain = model.generate(PROMPT, max_new_tokens=16, do_sample=False)
    dart_hf.enable(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(PROMPT, max_new_tokens=16, do_sample=False, dart_tree_config=TreeConfig(),
                             dart_head=oracle_head(model, plain[0], wrong_every=5))
    assert torch.equal(out, plain)
    assert model.dart_stats.tau > 2.0


def test_a_window_of_one_runs_plain_with_one_warning_with_an_attached_head():
    model = build("gemma2", 1)
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    head = oracle_head(model, plain[0])
    dart_hf.enable(model, head)
    with pytest.warns(dart_hf.DartFallbackWarning, match="sliding_window=1") as caught:
        assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False), plain)
    assert len(caught) == 1
    with pytest.raises(dart_hf.NotApplicable, match="sliding_window=1"):
        model.generate(PROMPT, max_new_tokens=8, do_sample=False, dart_head=head)
