"""Logits processors DART cannot tell apart by class: transformers' own are known (stateless, but the few it refuses
by name); any other runs plain with one warning (attached head) or is refused (`dart_head=`) unless the caller
declares the call's processors stateless with `dart_stateless_processors=True`. And `prefix_allowed_tokens_fn`, a
function of (batch id, prefix), decodes with DART at any batch size."""

import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, NoRepeatNGramLogitsProcessor, TemperatureLogitsWarper

import dart_hf
from dart_core import TreeConfig
from helpers.hf_models import PAD, left_padded, oracle_head, random_head, random_prompts, tiny_target


TREE = TreeConfig(remain_total=8)


class BanArgmaxEveryOtherCall(LogitsProcessor):
    """The issue's processor: on every other call it bans each row's best token (its state: the call count)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls % 2 == 0:
            scores = scores.scatter(1, scores.argmax(-1, keepdim=True), -float("inf"))
        return scores


class BanByRow(LogitsProcessor):
    """Stateless and custom: row r may not emit tokens = r (mod 3)."""

    def __call__(self, input_ids, scores):
        ids = torch.arange(scores.shape[-1])
        for r in range(scores.shape[0]):
            scores[r, ids % 3 == r % 3] = -float("inf")
        return scores


def ban_odd(input_ids, scores):  # a plain function as a processor
    scores[:, 1::2] = -float("inf")
    return scores


class SharperTemperature(TemperatureLogitsWarper):  # a subclass of transformers' own is the caller's code
    pass


def setting(batch=3):
    model = dart_hf.enable(tiny_target(), False)
    ids, mask = left_padded(random_prompts((5, 8, 3, 6)[:batch], seed=4, low=2))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    return model, ids, kwargs


def test_a_processor_that_counts_its_calls_runs_plain_with_one_warning_when_attached():
    model, ids, kwargs = setting()
    plain = model.generate(ids, logits_processor=LogitsProcessorList([BanArgmaxEveryOtherCall()]), **kwargs)
    reference = model.generate(ids, **kwargs)
    attached = dart_hf.enable(tiny_target(), oracle_head(model, reference[1], wrong_every=4), tree_config=TREE)
    with pytest.warns(dart_hf.DartFallbackWarning, match="BanArgmaxEveryOtherCall.*dart_stateless_processors") as w:
        out = attached.generate(ids, logits_processor=LogitsProcessorList([BanArgmaxEveryOtherCall()]), **kwargs)
    assert torch.equal(out, plain)
    assert len(w) == 1


@pytest.mark.parametrize("processor", [BanArgmaxEveryOtherCall(), BanByRow(), ban_odd, SharperTemperature(0.7)],
                         ids=["counting", "row rules", "function", "subclass"])
def test_a_custom_processor_with_dart_head_is_refused_by_name_unless_declared(processor):
    model, ids, kwargs = setting()
    processors = LogitsProcessorList([processor])
    name = getattr(processor, "__qualname__", type(processor).__name__)
    with pytest.raises(dart_hf.NotApplicable, match=f"{name} is not one of transformers' own"):
        model.generate(ids, logits_processor=processors, dart_head=random_head(model), dart_tree_config=TREE,
                       **kwargs)


@pytest.mark.parametrize("processor", [BanByRow, lambda: ban_odd], ids=["row rules", "function"])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_custom_processors_declared_stateless_decode_with_dart_as_plain(processor, batch):
    model, ids, kwargs = setting(batch)
    plain = model.generate(ids, logits_processor=LogitsProcessorList([processor()]), **kwargs)
    head = oracle_head(model, plain[0], wrong_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(ids, logits_processor=LogitsProcessorList([processor()]), dart_head=head,
                             dart_tree_config=TREE, dart_stateless_processors=True, **kwargs)
    assert torch.equal(out, plain)
    assert model.dart_stats.forwards > 0


@pytest.mark.parametrize("settings", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2),
                                      dict(min_new_tokens=4, eos_token_id=5),
                                      dict(logits_processor=LogitsProcessorList([NoRepeatNGramLogitsProcessor(3)]))],
                         ids=["repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "passed in"])
def test_transformers_own_processors_need_no_declaration(settings):
    model, ids, kwargs = setting()
    plain = model.generate(ids, **kwargs, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(ids, dart_head=oracle_head(model, plain[1], wrong_every=4), dart_tree_config=TREE,
                             **kwargs, **settings)
    assert torch.equal(out, plain)


def test_the_declaration_is_true_or_false():
    model, ids, kwargs = setting()
    with pytest.raises(TypeError, match="dart_stateless_processors must be True or False"):
        model.generate(ids, dart_head=random_head(model), dart_stateless_processors="yes", **kwargs)


def test_a_stateful_processor_transformers_builds_stays_refused_even_when_declared():
    model, ids, kwargs = setting(1)
    kwargs.pop("attention_mask")
    with pytest.raises(dart_hf.NotApplicable, match="UnbatchedClassifierFreeGuidanceLogitsProcessor keeps state"):
        model.generate(ids[:, -5:], guidance_scale=1.5, dart_head=random_head(model), dart_stateless_processors=True,
                       **kwargs)


def test_synthid_watermarking_keeps_state_and_runs_plain_with_one_warning():
    from transformers import SynthIDTextWatermarkingConfig

    model, ids, kwargs = setting(1)
    kwargs.pop("attention_mask")
    ids = ids[:, -5:]
    kwargs["watermarking_config"] = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123], ngram_len=3)
    plain = model.generate(ids, **kwargs)
    attached = dart_hf.enable(tiny_target(), oracle_head(model, plain[0]), tree_config=TREE)
    with pytest.warns(dart_hf.DartFallbackWarning, match="SynthIDTextWatermarkLogitsProcessor keeps state") as w:
        assert torch.equal(attached.generate(ids, **kwargs), plain)
    assert len(w) == 1


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [2, 3, 4])
def test_prefix_allowed_tokens_fn_decodes_with_dart_at_batch_sizes_above_one(batch, sample):
    """Each row may emit only its own band of tokens (the function reads the batch id): greedy rows equal plain's;
    sampled rows stay in their band."""
    model, ids, kwargs = setting(batch)
    kwargs.update(do_sample=sample, prefix_allowed_tokens_fn=lambda b, sent: list(range(10 * b + 2, 10 * b + 40)))
    torch.manual_seed(0)
    plain = model.generate(ids, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(0)
        out = model.generate(ids, dart_head=oracle_head(model, plain[1], wrong_every=4), dart_tree_config=TREE,
                             **kwargs)
    assert model.dart_stats.forwards > 0
    new = out[:, ids.shape[1]:]
    assert all(bool(((new[b] >= 10 * b + 2) & (new[b] < 10 * b + 40)).all()) for b in range(batch))
    if not sample:
        assert torch.equal(out, plain)
